"""The one set-up of a run's step core, for both clients (the built-in trainer, the Watch).

What each client knows (its model and optimizer, its config sections, its data flow, how it
resumes) goes in; what is the same for both comes out of here once: the checkpointer (one
process, or sharded under torchrun) with the record made durable before each commit, the
checkpoint tiers and the line that tells where they go, rank 0's spike guard, the `StepCore`,
the resume or the refusal of a directory that holds another run, and `config.json`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from spikewatch.trainer.checkpoints.disk import Checkpointer
from spikewatch.trainer.checkpoints.format import list_checkpoints
from spikewatch.trainer.checkpoints.tiers import build_tiers, describe, estimated_snapshot_bytes
from spikewatch.trainer.config import CheckpointConfig, ConfigError, GuardConfig
from spikewatch.trainer.core.callbacks import Callback
from spikewatch.trainer.core.probes import Probes
from spikewatch.trainer.core.recorder import Recorder
from spikewatch.trainer.core.same_step import SameStepGate
from spikewatch.trainer.core.state import RunState
from spikewatch.trainer.core.step_core import StepCore
from spikewatch.trainer.core.world import World, say

__all__ = ["open_checkpointer", "open_core"]

log = logging.getLogger(__name__)


def open_core(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    world: World,
    run: RunState,
    probes: Probes,
    checkpoint: CheckpointConfig,
    guard: GuardConfig,
    make_guard: Callable[[Callable[[], list[int]]], Callback],
    callbacks: Sequence[Callback],
    config: Callable[[], dict[str, Any]],
    data_flow: Literal["rewind", "forward"],
    resume: Callable[[StepCore], bool],
    resume_hint: str,
    scheduler: Any = None,
    max_steps: int | None = None,
    disk: Callable[[World], Any] | None = None,
) -> StepCore:
    """The run's core, resumed if `resume(core)` says it did (True), else a fresh start in a
    directory that must hold no checkpoints. `make_guard(retained)` builds rank 0's spike guard
    (when `guard.enabled`); `resume_hint` says how to resume, for the refusal; `disk(world)`:
    a framework's own checkpoints as the disk tier, opened (else spikewatch's own)."""
    durable = next((c.persist for c in callbacks if isinstance(c, Recorder)), None)
    if disk is not None:
        ondisk = disk(world)
        ondisk.open()
    else:
        ondisk = open_checkpointer(
            run.run_dir / "checkpoints", checkpoint, world, model, optimizer, durable
        )
    tiers = build_tiers(checkpoint, ondisk, model, optimizer, world)
    if world.is_main:
        say(log, describe(tiers, estimated_snapshot_bytes(model, optimizer), max_steps))
    everyone = list(callbacks)
    if world.is_main and guard.enabled:  # rank 0 decides for all
        everyone.append(make_guard(tiers.retained))
    tier = guard.same_step
    core = StepCore(
        model=model,
        optimizer=optimizer,
        probes=probes,
        checkpointer=tiers,
        world=world,
        run=run,
        callbacks=everyone,
        config=config,
        data_flow=data_flow,
        scheduler=scheduler,
        same_step=SameStepGate(tier) if guard.enabled and tier.enabled else None,
        max_steps=max_steps,
        stall=guard.stall,
    )
    if not resume(core) and list_checkpoints(tiers.root):
        raise ConfigError(
            f"{run.run_dir} already holds checkpoints of a run: resume it ({resume_hint}) or "
            "choose another run directory"
        )
    if world.is_main:
        (run.run_dir / "config.json").write_text(json.dumps(config(), indent=2))
    core.restart_clock()
    return core


def open_checkpointer(
    root: Path,
    cfg: CheckpointConfig,
    world: World,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    durable: Callable[[], object] | None,
) -> Checkpointer:
    """One process: torch.save files; under torchrun: sharded (DCP) checkpoints. `durable`
    makes the run's record durable before each checkpoint commits."""
    checkpointer = Checkpointer(root, cfg, before_commit=durable)
    if world.distributed:
        from spikewatch.trainer.checkpoints.sharded import ShardedCheckpointer

        checkpointer = ShardedCheckpointer(
            root, cfg, world, model, optimizer, before_commit=durable
        )
    checkpointer.open()
    return checkpointer
