"""The checkpoint error, apart from the tiers (which import torch): the CLI catches it without
importing torch for commands that never touch one (`simulate`, `advise`, `serve`)."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupted; the message names it."""
