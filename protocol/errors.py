"""The one error type the wire protocol raises."""

from __future__ import annotations


class ProtocolError(ValueError):
    """A message could not be encoded or decoded; the text is one sentence naming why.

    Decoding code catches every lower-level failure (msgpack, torch, type checks) and re-raises
    it as this type, so a receiver needs exactly one `except` to survive any bytes a peer sends.
    """
