"""Tensors on their way to a checkpoint: copied to reused host buffers, or handed over live.

Shared by the single-process checkpointer and the sharded one; it knows nothing of what the
tensors are (trainer/core/state.py says that).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Live", "Stager", "stage_tensors", "to_host"]


class Stager:
    """Host buffers reused from save to save: an async save copies into memory that is already
    mapped (first-touch page faults cost more than the copy itself). The caller guarantees that
    no earlier write still reads the buffers (one save in flight, joined before the next)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def __call__(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return buf.copy_(t.detach())


class Live(Stager):
    """No copy at all: the live tensors, for a background thread to stage later."""

    def __call__(self, key: str, t: torch.Tensor) -> torch.Tensor:
        return t.detach()


def to_host(obj: Any, stage: Stager | None, key: str = "") -> Any:
    """Tensors to CPU: staged copies with a `stage` (the live ones may change meanwhile), else
    the tensors themselves (a synchronous save writes before training goes on)."""
    if torch.is_tensor(obj):
        return stage(key, obj) if stage is not None else obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_host(v, stage, f"{key}/{k}") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_host(v, stage, f"{key}/{i}") for i, v in enumerate(obj))
    return obj


def stage_tensors(files: dict[str, Any], stage: Stager) -> dict[str, Any]:
    """Every tensor of a snapshot's torch files copied into the stager's host buffers."""
    return {name: to_host(obj, stage, name) for name, obj in files.items()}
