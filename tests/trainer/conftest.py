from __future__ import annotations

from spikewatch.observatory.store.sink import NullSink
from spikewatch.trainer.config import TrainConfig, load_config

TINY = (
    "model.n_layer=2",
    "model.n_head=4",
    "model.d_model=32",
    "model.max_seq_len=64",
    "data.seq_len=32",
    "data.batch_size=8",
    "schedule.warmup_steps=2",
    "train.max_steps=12",
    "train.progress=false",
    "eval.interval=6",
    "eval.batches=2",
)


def tiny_config(*overrides: str) -> TrainConfig:
    """2 layers, d=32, T=32, B=8: a model small enough for many tests on 2 cores."""
    return load_config(None, [*TINY, *overrides])


class EventSink(NullSink):
    """A store that keeps the events it is sent, as (kind, step, data)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int | None, dict]] = []

    def log_event(self, run_id, kind, **kw):  # noqa: ANN001, ANN003
        self.events.append((kind, kw.get("step"), kw.get("data") or {}))
        return super().log_event(run_id, kind, **kw)
