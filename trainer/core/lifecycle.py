"""Run lifecycle helpers: what a resume may change, and clean stops on SIGTERM / SIGINT."""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path
from typing import Any, Protocol

from trainer.checkpoints.format import read_meta
from trainer.config import ConfigError, DistributedConfig, TrainConfig


class Stoppable(Protocol):
    """What a signal handler needs of the loop (trainer/builtin/loop.py's Trainer)."""

    stop_requested: bool
    stop_asked: bool

    def request_stop(self) -> None: ...


__all__ = [
    "CHANGEABLE_KEYS",
    "RESUMABLE_KEYS",
    "check_resumable",
    "check_resume",
    "stop_on_signals",
]

log = logging.getLogger(__name__)

# Settings a resume may change: they do not touch the arithmetic of the run (probes never
# change training; evaluation only reads).
RESUMABLE_KEYS = {
    "train.stop_after",
    "train.progress",
    "checkpoint.async_save",
    "distributed.backend",
    "distributed.timeout_s",
}
RESUMABLE_PREFIXES = ("probes.", "eval.")
# Settings a resume may change that do change the run from its resumed step on: what a halt
# advises (a lower peak LR, a tighter clip, more steps) and how the run is watched and saved.
# Each is recorded in the run's store as an event (kind "note", data.kind "config_change").
CHANGEABLE_KEYS = {
    "optim.lr",
    "optim.grad_clip",
    "train.max_steps",
    "checkpoint.interval",
    "checkpoint.keep_last",
    "checkpoint.mtbf_hours",
    "checkpoint.fsync",
}
CHANGEABLE_PREFIXES = ("watch.",)


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
    changes = check_resumable(cfg, saved, path)
    ranks = read_meta(path).get("world_size", 1)
    if ranks != world_size:
        log.info("resuming a %d-rank checkpoint on %d ranks (resharded)", ranks, world_size)
    return changes


def check_resumable(cfg: TrainConfig, saved: dict[str, Any], path: Path) -> dict[str, list[Any]]:
    """Refuse a config that differs in a setting a resume may not change; return the changes
    of the settings it may change that matter (`CHANGEABLE_KEYS`), {key: [then, now]}."""
    now, then = _flatten(cfg.to_dict()), _flatten(saved)
    for key, default in _flatten({"distributed": DistributedConfig().model_dump()}).items():
        then.setdefault(key, default)  # a checkpoint from before the section existed
    differ = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))
    changes = {
        k: [then.get(k), now.get(k)]
        for k in differ
        if k in CHANGEABLE_KEYS or k.startswith(CHANGEABLE_PREFIXES)
    }
    refused = [
        k
        for k in differ
        if k not in changes and k not in RESUMABLE_KEYS and not k.startswith(RESUMABLE_PREFIXES)
    ]
    if refused:
        shown = ", ".join(f"{k}: {then.get(k)!r} -> {now.get(k)!r}" for k in refused[:8])
        allowed = ", ".join(sorted(CHANGEABLE_KEYS | RESUMABLE_KEYS))
        raise ConfigError(
            f"cannot resume {path}: the config differs in {shown}. A resume may change "
            f"{allowed}, watch.*, probes.* and eval.*"
        )
    return changes


class stop_on_signals:
    """SIGTERM / SIGINT end the run cleanly after the current step, with a checkpoint."""

    def __init__(self, trainer: Stoppable) -> None:
        self.trainer = trainer
        self.saved: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.trainer.stop_requested or self.trainer.stop_asked:  # a second signal: stop now
            raise KeyboardInterrupt
        self.trainer.request_stop()

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.saved[sig] = signal.signal(sig, self._handler)

    def __exit__(self, *exc: object) -> None:
        for sig, old in self.saved.items():
            signal.signal(sig, old)
