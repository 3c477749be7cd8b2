"""The scheduler half: request and batch state, admission, the per-stage event loop."""
