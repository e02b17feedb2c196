"""Tensors on their way to a checkpoint: copied to reused host buffers, or handed over live.

Shared by the single-process checkpointer and the sharded one; it knows nothing of what the
tensors are (trainer/core/state.py says that).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from spikewatch.trainer.checkpoints.pinned import BlockLayout, Events, HostBlock, SideCopies
from spikewatch.trainer.core import streams

__all__ = [
    "FromMemory",
    "Live",
    "NoTensors",
    "Queued",
    "Stager",
    "has_cuda",
    "leaves_of",
    "stage_tensors",
    "to_host",
]


class Stager:
    """Host buffers reused from save to save: an async save copies into memory that is already
    mapped (first-touch page faults cost more than the copy itself). The caller guarantees that
    no earlier write still reads the buffers (one save in flight, joined before the next).

    A snapshot's tensors are staged together (`stage`) into one `HostBlock` a file, pinned once
    when they live on CUDA (a block a tensor was ~450 registrations at 124M, on the loop thread
    at the first save), made ahead in a thread where the caller can (`prepare`)."""

    def __init__(self) -> None:
        self.blocks: dict[str, HostBlock] = {}  # `stage`'s, a file's each
        self._ahead: dict[str, Future[HostBlock]] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """A snapshot being built (`to_host`) holds the live tensors: `stage` copies them
        together afterwards."""
        return t.detach() if t.requires_grad else t

    def block_for(
        self, leaves: dict[str, torch.Tensor], wait: bool = True
    ) -> dict[str, torch.Tensor]:
        """Host tensors for `leaves` ({key: tensor}, keys under their file's name): one block
        per file (torch.save writes the whole storage of any view it holds, so files must not
        share one), the last one if its layout fits, else the one made ahead if it fits, else
        a new one (made here). `wait` False (the writer thread, which makes the blocks ahead
        itself: one still queued behind it would never come): a block made ahead is taken
        only if it is made."""
        out: dict[str, torch.Tensor] = {}
        for name, part in _by_file(leaves).items():
            if self._stale(name, part):
                ahead = self._ahead.pop(name, None)
                ready = ahead is not None and (wait or ahead.done())
                block = ahead.result() if ready and ahead is not None else None
                if block is None or not _fits(block, part):
                    pin = any(map(streams.is_cuda, part.values()))
                    block = HostBlock(part, pin, separate=True)
                self.blocks[name] = block
            out.update(self.blocks[name].tensors)
        return out

    def prepare(
        self,
        leaves: dict[str, torch.Tensor],
        submit: Callable[..., Future[HostBlock]],
    ) -> None:
        """Make the blocks for `leaves`' layout ahead with `submit` (a thread's), where the
        ones held do not fit."""
        for name, part in _by_file(leaves).items():
            if self._stale(name, part):
                pin = any(map(streams.is_cuda, part.values()))
                self._ahead[name] = submit(HostBlock.with_views, BlockLayout(part), pin, True)

    def _stale(self, name: str, part: dict[str, torch.Tensor]) -> bool:
        """No block is held for file `name`, or the one held is not laid out for `part`."""
        block = self.blocks.get(name)
        return block is None or not _fits(block, part)

    def stage(self, leaves: dict[str, torch.Tensor], wait: bool = True) -> dict[str, torch.Tensor]:
        """`leaves` copied into the blocks' tensors (one multi-tensor copy), which it returns
        (`wait`: as `block_for`'s)."""
        views = self.block_for(leaves, wait)
        with torch.no_grad():  # (the live tensors: parameters need no detach)
            torch._foreach_copy_([views[k] for k in leaves], list(leaves.values()))
        return views


def _fits(block: HostBlock, part: dict[str, torch.Tensor]) -> bool:
    """Whether `block` is laid out for `part`'s keys, shapes and dtypes (no layout made)."""
    keys, shapes = block.layout.signature
    return keys == tuple(part) and shapes == tuple((t.shape, t.dtype) for t in part.values())


def _by_file(leaves: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """`leaves` grouped by their file (a key's first part)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in leaves.items():
        out.setdefault(key.split("/", 1)[0], {})[key] = t
    return out


class Queued(Stager):
    """Device tensors staged on side streams (trainer/checkpoints/pinned.py): the block's
    pinned tensors are handed out at once and the copies queued by `start` (nothing waits);
    host tensors are copied by `start` at once."""

    def __init__(self, stager: Stager) -> None:
        super().__init__()
        self.stager = stager
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def stage(self, leaves: dict[str, torch.Tensor], wait: bool = True) -> dict[str, torch.Tensor]:
        views = self.stager.block_for(leaves, wait)
        self.pairs = [(views[k], t) for k, t in leaves.items()]
        return views

    def start(self, copies: SideCopies) -> Events:
        """Queue every copy staged (one multi-tensor copy and one event per device)."""
        pairs, self.pairs = self.pairs, []
        return copies.start(pairs)


class Live(Stager):
    """No copy at all: the live tensors, for a background thread to stage later."""


class NoTensors(Live):
    """The weights and optimizer state are not wanted: a host-memory snapshot copies them from
    the live tensors itself (memory.py), so the snapshot skips building their state dicts (a
    walk of every module and state tensor on the loop thread)."""

    wants_stream = False  # the loader's position: a resume's, which host memory never serves


class FromMemory(NoTensors):
    """A disk checkpoint taken with the host-memory snapshot of the same step: its weights and
    optimizer state are that snapshot's (memory.py `Lent`, written by the disk's writer
    thread), so they are neither walked nor copied here; the rest, the loader's position
    included, is built as for any file."""

    wants_stream = True


def to_host(obj: Any, stage: Stager | None) -> Any:
    """With a `stage`: the tensors as the stager hands them over (the live ones, copied
    together by `stage_tensors` later, by their paths); without: copies on the CPU (a
    synchronous save writes before training goes on)."""
    if torch.is_tensor(obj):
        return stage(obj) if stage is not None else obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_host(v, stage) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_host(v, stage) for v in obj)
    return obj


def stage_tensors(files: dict[str, Any], stage: Stager, wait: bool = True) -> dict[str, Any]:
    """Every tensor of a snapshot's torch files copied into the stager's host block (one walk
    to find them, one copy, one walk to put the block's tensors in their places). `wait`
    False: on the thread that makes the blocks ahead (`Stager.block_for`)."""
    leaves = leaves_of(files)
    host = stage.stage(leaves, wait) if leaves else {}
    return {name: _put(obj, host, name) for name, obj in files.items()}


def leaves_of(files: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a snapshot's torch files, by `to_host`'s keys."""
    leaves: dict[str, torch.Tensor] = {}
    for name, obj in files.items():
        _leaves(obj, name, leaves)
    return leaves


def _leaves(obj: Any, key: str, out: dict[str, torch.Tensor]) -> None:
    """`obj`'s tensors by `to_host`'s keys."""
    if torch.is_tensor(obj):
        out[key] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _leaves(v, f"{key}/{k}", out)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _leaves(v, f"{key}/{i}", out)


def _put(obj: Any, host: dict[str, torch.Tensor], key: str) -> Any:
    """`obj` with each tensor replaced by `host`'s of its key."""
    if torch.is_tensor(obj):
        return host[key]
    if isinstance(obj, dict):
        return {k: _put(v, host, f"{key}/{k}") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_put(v, host, f"{key}/{i}") for i, v in enumerate(obj))
    return obj


def has_cuda(obj: Any) -> bool:
    """Whether any tensor in `obj` (dicts, lists, tuples) lives on a CUDA device."""
    if torch.is_tensor(obj):
        return streams.is_cuda(obj)
    if isinstance(obj, dict):
        return any(has_cuda(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(has_cuda(v) for v in obj)
    return False
