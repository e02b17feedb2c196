"""Run lifecycle helpers: what a resume may change, and clean stops on SIGTERM / SIGINT."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.config import ConfigError, TrainConfig

if TYPE_CHECKING:
    from trainer.loop import Trainer

__all__ = ["RESUMABLE_KEYS", "check_resumable", "stop_on_signals"]

# Settings a resume may change: they do not touch the arithmetic of the run (probes never
# change training; evaluation only reads).
RESUMABLE_KEYS = {"train.stop_after", "train.progress", "checkpoint.async_save"}
RESUMABLE_PREFIXES = ("probes.", "eval.")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and not (k == "weights"):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resumable(cfg: TrainConfig, saved: dict[str, Any], path: Path) -> None:
    now, then = _flatten(cfg.to_dict()), _flatten(saved)
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

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.saved: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.trainer.stop_requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.trainer.stop_requested = True

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.saved[sig] = signal.signal(sig, self._handler)

    def __exit__(self, *exc: object) -> None:
        for sig, old in self.saved.items():
            signal.signal(sig, old)
