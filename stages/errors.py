"""The one error type a user can meet while a stage is being set up."""

from __future__ import annotations


class ConfigError(ValueError):
    """A model folder, partition or option cannot be used; the text is one sentence naming the fix.

    Raised before any request is served (loading the config, the weights, partitioning layers),
    so the launcher can print it and exit instead of showing a stack trace.
    """
