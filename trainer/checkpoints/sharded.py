"""Sharded checkpoints under torchrun: torch.distributed.checkpoint (DCP) inside the same
per-step layout, meta.json, checksums, retention and pins as a single process.

`step{N:08d}/` holds DCP's `.metadata` and `__<rank>_<i>.distcp` files (model and optimizer
state keyed by parameter name, so DCP reshards them for another world size), one
`rng.rank<r>.pt` per rank, `trainer.json`, `config.json`, and `meta.json`, written last by
rank 0 with the CRC-32 of every file: each rank checksums the files it wrote and rank 0
gathers them. Every rank writes into one temporary directory that rank 0 renames into place.
Rank 0 alone deletes (retention, abandoned branches) and writes pins; the others wait at a
barrier or for its broadcast. The run directory must be one that every rank sees (across
nodes, a shared filesystem).

An optimizer with no state yet (the step-0 anchor) is saved without it: asking DCP's
`get_optimizer_state_dict` for it would initialise it with a zero-LR step, which changes
Adam's step count and so the run.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from spikewatch.trainer.checkpoints import format as ck
from spikewatch.trainer.checkpoints.disk import Checkpointer
from spikewatch.trainer.checkpoints.memory import Lent
from spikewatch.trainer.checkpoints.staging import Stager
from spikewatch.trainer.config import CheckpointConfig
from spikewatch.trainer.core.world import World

__all__ = ["ShardedCheckpointer", "load_sharded", "write_sharded"]

log = logging.getLogger(__name__)


def write_sharded(
    root: Path,
    snap: ck.Snapshot,
    world: World,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    fsync: bool,
) -> Path:
    """Every rank: its DCP shards and RNG file; rank 0: the JSON files, meta.json, the rename."""
    final = ck.step_dir(root, snap.step)
    tmp = root / f".tmp-{final.name}-sharded"
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    world.barrier()
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer.state:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    writer = dcp.FileSystemWriter(tmp, sync_files=fsync)
    # Plan caching: a save whose layout has not changed skips re-planning (~30% of a save).
    planner = dcp.DefaultSavePlanner(enable_plan_caching=True)
    dcp.save(state, storage_writer=writer, planner=planner, process_group=world.group)
    for name, obj in snap.torch_files.items():
        torch.save(obj, tmp / name)
    mine = [p.name for p in tmp.glob(f"__{world.rank}_*.distcp")] + list(snap.torch_files)
    gathered = world.gather({name: ck.digest(tmp / name, fsync) for name in mine})
    if world.is_main:
        assert gathered is not None
        files = {name: d for part in gathered for name, d in part.items()}
        for name, obj in snap.json_files.items():
            (tmp / name).write_bytes(ck.json_bytes(obj))
            files[name] = ck.digest(tmp / name, fsync)
        files[".metadata"] = ck.digest(tmp / ".metadata", fsync)
        snap.meta.update(
            sharded=True,
            strategy=world.strategy,
            world_size=world.size,
            optimizer_state="optim" in state,
        )
        ck.publish(root, tmp, snap, files, fsync=fsync)
    world.barrier()
    return final


def load_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path, world: World
) -> None:
    """Load a sharded checkpoint into the live model and optimizer, in place, on every rank
    (DCP reads each rank's part, resharding if the world size changed)."""
    with_optim = bool(ck.read_meta(path).get("optimizer_state", True))
    state: dict[str, Any] = {}
    if with_optim:  # first: an empty optimizer is initialised by a zero-LR step, then overwritten
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    state["model"] = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path, process_group=world.group)
    set_model_state_dict(model, state["model"])
    if with_optim:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    else:
        optimizer.state.clear()


class ShardedCheckpointer(Checkpointer):
    """The Checkpointer's timing, retention and pins, for sharded checkpoints; every method
    that the loop calls on all ranks is collective, and agrees on rank 0's view of the disk."""

    def __init__(
        self,
        root: Path,
        cfg: CheckpointConfig,
        world: World,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        before_commit: Callable[[], object] | None = None,
    ) -> None:
        super().__init__(root, cfg, before_commit=before_commit)
        self.world = world
        self.model = model
        self.optimizer = optimizer

    def open(self) -> None:
        if self.world.is_main:
            super().open()
        self.world.barrier()

    def due(self, step: int, seconds_per_step: float) -> bool:
        """With interval='auto' the timing is measured per rank: rank 0's answer holds."""
        due = super().due(step, seconds_per_step)
        return bool(self.world.agree(due)) if self.cfg.interval == "auto" else due

    @property
    def in_background(self) -> bool:
        return False  # every rank writes its shard before the save returns

    @property
    def awaits(self) -> bool:
        return False  # a step in flight is drained first (every rank writes before returning)

    def prepare(self, build: Callable[[Stager | None], ck.Snapshot]) -> None:
        """Nothing to make ahead: each rank writes its shards synchronously."""

    @property
    def takes_lent(self) -> bool:
        return False  # every rank writes its own shards through torch.distributed.checkpoint

    def save(
        self,
        step: int,
        build: Callable[[Stager | None], ck.Snapshot],
        awaiting: bool = False,
        lent: Lent | None = None,
    ) -> float:
        if lent is not None:
            raise ValueError("a sharded save writes the live tensors: nothing is lent")
        if awaiting:
            raise ValueError("a sharded save cannot take a step still in flight")
        t0 = time.perf_counter()
        pins = {s: set(p) for s, p in self.pins.items()}
        snap = build(None)
        snap.meta["pins"] = sorted(pins.get(step, ()))
        if self.before_commit is not None and self.world.is_main:
            self.before_commit()
        fsync = self.cfg.fsync
        path = write_sharded(self.root, snap, self.world, self.model, self.optimizer, fsync=fsync)
        if self.world.is_main:
            self._changed(step, "ok", path)
            self._prune(step, pins)
        self.world.barrier()
        log.debug("saved %s", path)
        self.save_seconds = time.perf_counter() - t0
        self.last_saved = step
        return self.save_seconds

    def pin(self, step: int, reason: str) -> None:
        if self.world.is_main:
            super().pin(step, reason)
        else:
            self.pins.setdefault(step, set()).add(reason)

    def unpin(self, step: int, reason: str) -> None:
        if self.world.is_main:
            super().unpin(step, reason)
        else:
            held = self.pins.get(step)
            if held is not None:
                held.discard(reason)
                if not held:
                    del self.pins[step]

    def drop_after(self, step: int, background: bool = False) -> list[int]:
        """Rank 0 deletes, every rank waits for it (never in the background)."""
        dropped = super().drop_after(step) if self.world.is_main else []
        dropped = self.world.agree(dropped)  # also: nobody reads on before rank 0 deleted
        for s in dropped:
            self.pins.pop(s, None)
        return dropped

    def latest(
        self, at_most: int | None = None, above: int | None = None
    ) -> tuple[int, Path] | None:
        """Rank 0 finds the newest checkpoint that verifies; every rank takes that one."""
        found = super().latest(at_most, above) if self.world.is_main else None
        step = self.world.agree(None if found is None else found[0])
        return None if step is None else (step, ck.step_dir(self.root, step))

    def read(self, path: Path) -> dict[str, Any]:
        """The JSON files and this rank's RNG states (rank 0's when the checkpoint had fewer
        ranks); the weights load in place later, from `loaded['sharded']`. Rank 0 verified
        every checksum when it chose the checkpoint."""
        own = path / f"rng.rank{self.world.rank}.pt"
        rng = torch.load(
            own if own.exists() else path / "rng.rank0.pt", map_location="cpu", weights_only=True
        )
        state = json.loads((path / "trainer.json").read_text())
        state["rng"] = rng.pop("json")
        scheduler = rng.pop("scheduler", None)  # a client's LR scheduler (the Watch's)
        data = rng.pop("data", None)
        out = {
            "meta": ck.read_meta(path),
            "trainer.json": state,
            "config.json": json.loads((path / "config.json").read_text()),
            "rng.pt": rng,
            "sharded": path,
        }
        if scheduler is not None:
            out["scheduler.pt"] = scheduler
        if data is not None:  # the Watch's loader position, this rank's
            out["data.pt"] = data
        return out
