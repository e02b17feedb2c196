"""Code that runs in child processes (imported by name under the spawn start method)."""

from __future__ import annotations

import time
from pathlib import Path

from spikewatch.observatory.store.sink import DbSink

STEPS_PER_WORKER = 400
METRICS = ("train/loss", "optim/grad_norm", "layer/0/grad_norm", "layer/1/grad_norm")


def value(worker: int, step: int, metric: int) -> float:
    return worker * 1e6 + step * 10.0 + metric


def write_steps(url: str, spool_dir: str, worker: int, start_at: float) -> dict[str, int]:
    """One of several processes writing disjoint steps of the same run and series.

    All start at `start_at` and commit every 10 steps, so their transactions interleave and
    they write into the same stored windows (512 steps: every window spans two workers' steps).
    """
    sink = DbSink(url, spool_dir=Path(spool_dir) / f"w{worker}", linger_s=0.001)
    time.sleep(max(0.0, start_at - time.time()))
    sink.start_run("shared", name="concurrent")
    first = worker * STEPS_PER_WORKER
    for step in range(first, first + STEPS_PER_WORKER):
        sink.log_metrics(
            "shared", 0, step, {m: value(worker, step, i) for i, m in enumerate(METRICS)}
        )
        if step % 100 == 0:
            sink.log_event("shared", "note", step=step, message=f"worker {worker}")
        if step % 10 == 0:
            sink.flush(60)
    ok = sink.flush(120)
    sink.close()
    return {"flushed": int(ok), **sink.stats}
