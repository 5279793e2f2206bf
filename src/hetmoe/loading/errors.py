"""The one error type of checkpoint loading: raised with what was expected, found, and where."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory that cannot become the model: a bad file, tensor, or config field."""
