"""Run lifecycle helpers: what a resume may change, and clean stops on SIGTERM / SIGINT."""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path
from typing import Any, Protocol

from trainer.checkpoint import read_meta
from trainer.config import ConfigError, DistributedConfig, TrainConfig


class Stoppable(Protocol):
    """What a signal handler needs of the loop (trainer/loop.py's Trainer)."""

    stop_requested: bool
    stop_asked: bool

    def request_stop(self) -> None: ...


__all__ = ["RESUMABLE_KEYS", "check_resumable", "check_resume", "stop_on_signals"]

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


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and not (k == "weights"):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resume(cfg: TrainConfig, path: Path, world_size: int) -> None:
    """Refuse, before any weight is loaded, a resume that cannot continue the run: another
    config (`check_resumable`), or another checkpoint format (one process vs torchrun). A
    different world size, or ddp <-> fsdp2, is fine: the data position is a global batch
    index, the global batch is the same (init_world refuses a world size it does not divide
    evenly over) and DCP reshards weights and optimizer state on load."""
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
    check_resumable(cfg, saved, path)
    ranks = read_meta(path).get("world_size", 1)
    if ranks != world_size:
        log.info("resuming a %d-rank checkpoint on %d ranks (resharded)", ranks, world_size)


def check_resumable(cfg: TrainConfig, saved: dict[str, Any], path: Path) -> None:
    now, then = _flatten(cfg.to_dict()), _flatten(saved)
    for key, default in _flatten({"distributed": DistributedConfig().model_dump()}).items():
        then.setdefault(key, default)  # a checkpoint from before the section existed
    diff = sorted(
        k
        for k in now.keys() | then.keys()
        if k not in RESUMABLE_KEYS
        and not k.startswith(RESUMABLE_PREFIXES)
        and now.get(k) != then.get(k)
    )
    if diff:
        shown = ", ".join(f"{k}: {then.get(k)!r} -> {now.get(k)!r}" for k in diff[:8])
        raise ConfigError(f"cannot resume {path}: the config differs in {shown}")


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
