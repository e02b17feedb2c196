"""What `Watch.open` sets up (trainer/watch.py): the world, the run id and directory agreed by
every rank, the store (rank 0), the probes, then the one set-up of the step core
(core/setup.py) with the Watch's guard and its resume: from its own checkpoint, from a
framework's copy of the state, or a fresh start."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spikewatch.observatory.store.sink import BaseSink, DbSink, open_run_sink
from spikewatch.trainer.checkpoints.format import list_checkpoints as ck_list
from spikewatch.trainer.core.callbacks import Callback
from spikewatch.trainer.core.guard import SpikeGuard
from spikewatch.trainer.core.lifecycle import (
    WATCH_RULES,
    Stoppable,
    check_resumable,
    stop_or_interrupt,
)
from spikewatch.trainer.core.probes import Probes, describe_model
from spikewatch.trainer.core.recorder import Recorder
from spikewatch.trainer.core.setup import open_core
from spikewatch.trainer.core.state import RunState, ended
from spikewatch.trainer.core.step_core import StepCore
from spikewatch.trainer.core.world import attach_world, say
from spikewatch.trainer.model.optim.factor import inner_optimizer
from spikewatch.trainer.watch_loader import stream_from_json

log = logging.getLogger(__name__)

__all__ = [
    "UNCAUGHT",
    "build_watch_core",
    "close_at_exit",
    "describe_optimizer",
    "watch_for_uncaught",
]


def build_watch_core(watch: Any) -> StepCore:  # a Watch (trainer/watch.py imports this)
    """Everything `Watch.open` sets up: world, run id and directory (agreed by every rank),
    store (rank 0), checkpoints, guard, probes; then the resume or the framework's state."""
    from spikewatch.trainer.builtin.loop import (
        new_run_id,  # the run id rule of the built-in trainer
    )

    cfg, model, optimizer = watch.cfg, watch.model, watch.optimizer
    world = attach_world(model, optimizer, cfg.distributed_timeout_s)
    if watch.resume_arg not in (True, False, "auto"):
        raise ValueError(f"resume must be True, False or 'auto', not {watch.resume_arg!r}")
    if watch.resume_arg is True and watch.run_dir_arg is None:
        raise ValueError("resume needs the run directory (run_dir=...)")
    saved = watch.saved
    # a fresh start is a new run, whatever its directory is called; a resume takes the id
    # its checkpoint holds (and a framework's state, its own)
    run_id = str(saved["run_id"]) if saved is not None else world.agree(new_run_id(cfg.name))
    run_dir = Path(watch.run_dir_arg) if watch.run_dir_arg else watch.run_root / run_id
    if watch.resume_arg == "auto" and saved is None:
        run_dir = _unfinished(run_dir, world, cfg.max_steps)
    run_dir.mkdir(parents=True, exist_ok=True)
    probes = Probes(model, optimizer, cfg.probes, world, layer_of=watch.layer_of)
    watch.model_info = dict(watch.model_info_arg or describe_model(model))
    if not watch.model_info.get("n_layer"):  # no HF config: count the numbered blocks
        blocks = {la.split("/")[0] for la in probes.layers}
        watch.model_info["n_layer"] = sum(b.isdigit() for b in blocks)
    callbacks: list[Callback] = list(watch.user_callbacks)
    sink: BaseSink | None = None
    if world.is_main:  # one run per job: rank 0 alone opens, migrates and writes the store
        sink = watch.sink_arg if watch.sink_arg is not None else open_run_sink(run_dir, watch.db)
        url = sink.url if isinstance(sink, DbSink) else None
        callbacks.append(Recorder(sink, tags=watch.tags, requests_from=url))
    watch.sink = sink
    world.barrier()
    return open_core(
        model=model,
        optimizer=optimizer,
        world=world,
        run=RunState(run_id=run_id, run_dir=run_dir),
        probes=probes,
        checkpoint=cfg.checkpoint,
        guard=cfg.guard,
        make_guard=lambda retained: _guard(watch, retained),
        callbacks=callbacks,
        config=watch.run_config,
        data_flow="forward",
        resume=lambda core: _resume(watch, core),
        resume_hint="resume=True, or resume='auto'",
        scheduler=watch.scheduler,
        max_steps=cfg.max_steps,
        disk=watch.disk_arg,
    )


def _unfinished(run_dir: Path, world: Any, max_steps: int | None) -> Path:
    """`resume="auto"` resumes only a run that did not end: a directory whose run completed
    its steps (or was halted by the guard) is left as it is and a new run starts beside it, in
    the first free `<dir>-2`, `<dir>-3`, ...; said in one line. A run stopped early resumes,
    and so does a completed one given more steps than it ended at (training on)."""
    end = ended(run_dir)
    status = None if end is None else end.get("status")
    more = max_steps is not None and end is not None and int(end.get("step", 0)) < max_steps
    if end is None or status not in ("completed", "halted") or (status == "completed" and more):
        return run_dir
    k = 2
    while (run_dir.parent / f"{run_dir.name}-{k}").exists():
        k += 1
    fresh = run_dir.parent / f"{run_dir.name}-{k}"
    if world.is_main:
        say(
            log,
            f"run {end.get('run_id')} in {run_dir} ended ({end.get('status')}) at step "
            f"{end.get('step')}: a new run starts in {fresh}",
        )
    return fresh


def _guard(watch: Any, retained: Callable[[], list[int]]) -> SpikeGuard:
    cfg = watch.cfg
    guard = SpikeGuard(
        cfg.guard,
        retained,
        warmup_steps=cfg.warmup_steps,
        can_roll_back=cfg.checkpoint.any_tier or watch.disk_arg is not None,
    )
    guard.classify = False  # until `batches(..., loss_fn)` makes a replay possible
    return guard


def _resume(watch: Any, core: StepCore) -> bool:
    """From the Watch's own checkpoint (`resume=True`, or "auto" where there is one), or from a
    framework's copy of the state (`state=`); False: a fresh start."""
    resume = watch.resume_arg
    if resume == "auto":
        resume = bool(ck_list(core.checkpointer.root))
    given = None if watch.saved is None else int(watch.saved.get("step", 0))
    if resume and given is not None:  # two saved states: the newer is where the run got to
        own = max(ck_list(core.checkpointer.root), default=-1)
        if own >= 0 and core.world.is_main:
            newer = "its own checkpoint" if own >= given else "the state given"
            say(log, f"two saved states: the Watch's own checkpoint at step {own} and the state "
                f"given (state=) at step {given}; resuming from {newer}, the newer")  # fmt: skip
        resume = own >= given
    if resume:
        config = watch.run_config()
        core.resume(lambda path: check_resumable(config, _saved_config(path), path, WATCH_RULES))
        return True
    if watch.saved is not None:
        core.load_state_dict(watch.saved)
        core.run.stream_saved = stream_from_json(watch.saved.get("data_stream"))
        core.checkpointer.drop_after(core.step_count)  # the future of an abandoned timeline
        return True
    return False


def _saved_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def describe_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's class and peak LR, for the logbook (a scheduler may have moved `lr`)."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    lr = group.get("initial_lr", group.get("lr"))
    name = type(inner_optimizer(optimizer)).__name__  # inside accelerate's / Lightning's
    return {"name": name, "lr": float(lr) if isinstance(lr, (int, float)) else None}


def close_at_exit(ref: weakref.ref[Any]) -> None:
    watch = ref()
    if watch is not None:
        watch._close_at_exit()


UNCAUGHT: list[BaseException] = []  # an exception that ended the program (sys.excepthook)


def watch_for_uncaught() -> None:
    """Chain sys.excepthook once, so that the exit handler can tell a crash from an exit."""
    previous = sys.excepthook
    if getattr(previous, "spikewatch", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        UNCAUGHT.append(value)
        previous(kind, value, tb)

    hook.spikewatch = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def sigterm_as_ctrl_c(world_size: int, loop: Stoppable | None) -> Callable[[], None] | None:
    """SIGTERM (how systemd, Kubernetes, job schedulers and torchrun's own shutdown stop a
    process) ends a Watch loop as Ctrl-C does, and the run is closed "stopped" rather than left
    "running" for ever. In one process: a KeyboardInterrupt in the loop. Under torchrun, where
    the launcher forwards its SIGTERM to every rank: the built-in trainer's rule
    (`stop_or_interrupt`), the first asking `loop` for a stop that rides the next step's
    all-reduce, so that every rank stops after the same step. A rank inside a collective when
    the signal comes runs the handler when the collective returns, its peers still there; none
    leaves alone. A second SIGTERM interrupts at once. Only where SIGTERM still has its default
    action (a framework's or the user's own handler is theirs) and in the main thread. Returns
    the undo, or None when nothing was installed."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None

    def interrupt(signum: int, frame: Any) -> None:
        if world_size == 1 or loop is None:
            raise KeyboardInterrupt("SIGTERM")
        if not (loop.stop_requested or loop.stop_asked):
            log.warning("SIGTERM: every rank stops after the step they agree on (again: at once)")
        stop_or_interrupt(loop)

    signal.signal(signal.SIGTERM, interrupt)

    def undo() -> None:
        if signal.getsignal(signal.SIGTERM) is interrupt:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    return undo
