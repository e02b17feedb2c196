"""Run lifecycle helpers: what a resume may change, and clean stops on SIGTERM / SIGINT."""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from spikewatch.trainer.checkpoints.format import read_meta
from spikewatch.trainer.config import ConfigError, TrainConfig, WatchSettings
from spikewatch.trainer.config.legacy import rename_legacy


class Stoppable(Protocol):
    """What a signal handler needs of the loop (the step core, trainer/core/step_core.py)."""

    stop_requested: bool
    stop_asked: bool

    def request_stop(self) -> None: ...


__all__ = [
    "TRAIN_RULES",
    "WATCH_RULES",
    "ResumeRules",
    "check_resumable",
    "check_resume",
    "stop_on_signals",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumeRules:
    """Which settings a resume may change (dotted keys, or prefixes ending in '.').

    `resumable`: they do not touch the arithmetic of the run (probes never change training,
    evaluation only reads). `changeable`: they do change the run from its resumed step on, as a
    halt advises (a lower peak LR, a tighter clip, more steps) and how the run is guarded and
    saved; each is recorded in the run's store as an event (kind "note", data.kind
    "config_change"). Everything else must match the checkpoint's config. A key the saved config
    lacks (a setting added by a newer spikewatch) counts as its default."""

    resumable: frozenset[str]
    changeable: frozenset[str]
    defaults: Callable[[], dict[str, Any]]

    def allows(self, keys: frozenset[str], key: str) -> bool:
        return key in keys or any(p.endswith(".") and key.startswith(p) for p in keys)

    def shown(self) -> str:
        return ", ".join(sorted(k + ("*" if k.endswith(".") else "") for k in self.all()))

    def all(self) -> frozenset[str]:
        return self.resumable | self.changeable


_CHECKPOINT = {"checkpoint.interval", "checkpoint.keep_last", "checkpoint.mtbf_hours"}
_CHECKPOINT |= {"checkpoint.fsync", "checkpoint.memory_interval", "checkpoint.memory_budget_mb"}
TRAIN_RULES = ResumeRules(
    resumable=frozenset(
        {"train.stop_after", "train.progress", "checkpoint.async_save", "distributed.backend"}
        | {"distributed.timeout_s", "probes.", "eval."}
    ),
    changeable=frozenset(
        {"optim.lr", "optim.grad_clip", "train.max_steps", "train.compile", "guard."} | _CHECKPOINT
    ),
    defaults=lambda: TrainConfig().to_dict(),
)
# The Watch's run config: its WatchSettings, plus what the dashboard shows (framework, model).
WATCH_RULES = ResumeRules(
    resumable=frozenset(
        {"checkpoint.async_save", "probes.", "distributed_timeout_s", "name", "framework"}
        # descriptions for the logbook, read off the objects (n_layer and the rest still count)
        | {"model.d_model", "model.model_type", "optim."}
    ),
    changeable=frozenset({"max_steps", "train.max_steps", "grad_clip", "warmup_steps", "guard."})
    | _CHECKPOINT,
    defaults=lambda: WatchSettings().to_dict(),
)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and not (k == "weights"):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resume(cfg: TrainConfig, path: Path, world_size: int) -> dict[str, list[Any]]:
    """Refuse, before any weight is loaded, a resume that cannot continue the run: another
    config (`check_resumable`), or another checkpoint format (one process vs torchrun). A
    different world size, or ddp <-> fsdp2, is fine: the data position is a global batch
    index, the global batch is the same (init_world refuses a world size it does not divide
    evenly over) and DCP reshards weights and optimizer state on load. Returns the changes of
    `CHANGEABLE_KEYS` settings, {key: [then, now]}."""
    saved = json.loads((path / "config.json").read_text())
    then = saved.get("distributed", {}).get("strategy")
    now = cfg.distributed.strategy
    if then != now and None in (then, now):
        what = "one process (torch.save files)" if then is None else f"'{then}' under torchrun"
        how = "in one process" if then is None else "under torchrun"
        raise ConfigError(
            f"cannot resume {path}: its checkpoints were written by {what}; resume it {how} "
            f"with distributed.strategy={then or 'none'}"
        )
    if then != now:  # ddp <-> fsdp2: the same DCP format, resharded on load
        log.info("resuming a '%s' checkpoint with distributed.strategy=%s", then, now)
        saved = {**saved, "distributed": {**saved["distributed"], "strategy": now}}
    changes = check_resumable(cfg.to_dict(), saved, path, TRAIN_RULES)
    ranks = read_meta(path).get("world_size", 1)
    if ranks != world_size:
        log.info("resuming a %d-rank checkpoint on %d ranks (resharded)", ranks, world_size)
    return changes


def check_resumable(
    now: dict[str, Any], saved: dict[str, Any], path: Path, rules: ResumeRules
) -> dict[str, list[Any]]:
    """Refuse a config that differs in a setting a resume may not change; return the changes
    of the settings it may change that matter, {key: [then, now]}."""
    now, then = _flatten(now), _flatten(rename_legacy(saved))
    for key, default in _flatten(rules.defaults()).items():
        then.setdefault(key, default)  # a checkpoint from before the setting existed
    differ = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))
    changes = {k: [then.get(k), now.get(k)] for k in differ if rules.allows(rules.changeable, k)}
    refused = [k for k in differ if k not in changes and not rules.allows(rules.resumable, k)]
    if refused:
        shown = ", ".join(f"{k}: {then.get(k)!r} -> {now.get(k)!r}" for k in refused[:8])
        raise ConfigError(
            f"cannot resume {path}: the config differs in {shown}. A resume may change "
            f"{rules.shown()}"
        )
    for k in [k for k in changes if "." in k]:  # one setting under two names: its short one
        short = k.rsplit(".", 1)[1]
        if changes.get(short) == changes[k]:
            del changes[k]
    return changes


def stop_or_interrupt(loop: Stoppable) -> None:
    """A stop signal's rule, in a handler: the first asks for a stop after the current step
    (under torchrun, after the step every rank agrees on); a second interrupts at once."""
    if loop.stop_requested or loop.stop_asked:
        raise KeyboardInterrupt
    loop.request_stop()


class stop_on_signals:
    """SIGTERM / SIGINT end the run cleanly after the current step, with a checkpoint."""

    def __init__(self, trainer: Stoppable) -> None:
        self.trainer = trainer
        self.saved: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        stop_or_interrupt(self.trainer)

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.saved[sig] = signal.signal(sig, self._handler)

    def __exit__(self, *exc: object) -> None:
        for sig, old in self.saved.items():
            signal.signal(sig, old)
