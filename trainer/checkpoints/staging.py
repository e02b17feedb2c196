"""Tensors on their way to a checkpoint: copied to reused host buffers, or handed over live.

Shared by the single-process checkpointer and the sharded one; it knows nothing of what the
tensors are (trainer/core/state.py says that).
"""

from __future__ import annotations

from typing import Any

import torch

from spikewatch.trainer.checkpoints.pinned import Events, HostBlock, SideCopies

__all__ = ["Live", "NoTensors", "Queued", "Stager", "has_cuda", "stage_tensors", "to_host"]


class Stager:
    """Host buffers reused from save to save: an async save copies into memory that is already
    mapped (first-touch page faults cost more than the copy itself). The caller guarantees that
    no earlier write still reads the buffers (one save in flight, joined before the next)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self._blocks: dict[str, HostBlock] = {}

    def buffer(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """The reused host buffer for `key`, shaped like `t` (pinned when `t` is on CUDA)."""
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            block = self._blocks[key] = HostBlock({key: t}, pin=t.is_cuda)
            buf = self.buffers[key] = block.tensors[key]
        return buf

    def __call__(self, key: str, t: torch.Tensor) -> torch.Tensor:
        return self.buffer(key, t).copy_(t.detach())


class Queued(Stager):
    """Device tensors staged on side streams (trainer/checkpoints/pinned.py): their pinned
    buffers are handed out at once and the copies queued by `start` (nothing waits); host
    tensors are copied at once, as `Stager` does."""

    def __init__(self, stager: Stager) -> None:
        super().__init__()
        self.stager = stager
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, key: str, t: torch.Tensor) -> torch.Tensor:
        if not t.is_cuda:
            return self.stager(key, t)
        buf = self.stager.buffer(key, t)
        self.pairs.append((buf, t.detach()))
        return buf

    def start(self, copies: SideCopies) -> Events:
        """Queue every copy collected so far (one side stream and one event per device)."""
        pairs, self.pairs = self.pairs, []
        return copies.start(pairs)


class Live(Stager):
    """No copy at all: the live tensors, for a background thread to stage later."""

    def __call__(self, key: str, t: torch.Tensor) -> torch.Tensor:
        return t.detach() if t.requires_grad else t  # (state dicts' tensors are detached)


class NoTensors(Live):
    """The weights and optimizer state are not wanted: a host-memory snapshot copies them from
    the live tensors itself (memory.py), so the snapshot skips building their state dicts (a
    walk of every module and state tensor on the loop thread)."""


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


def has_cuda(obj: Any) -> bool:
    """Whether any tensor in `obj` (dicts, lists, tuples) lives on a CUDA device."""
    if torch.is_tensor(obj):
        return obj.is_cuda
    if isinstance(obj, dict):
        return any(has_cuda(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(has_cuda(v) for v in obj)
    return False
