"""Pauses that grow with a run: Python's full (generation-2) collections over a long Watch run.

A full collection walks every live container; its pause grows with what the run keeps alive.
This runs the plain-loop example's GPT through the Watch for `--steps` steps (host-memory
snapshots every 5 steps so that retention keeps one more as the run doubles, read one step
late as on a GPU), times every collection of generation 2 with `gc.callbacks`, and counts the
objects the collector tracks at the end of the first tenth and at the end.

    python benchmarks/gc_pauses.py [--steps 10000]

Prints one JSON line: the longest full-collection pause over the first tenth of the run and
over all of it, how many full collections ran, and the tracked objects at both points (with
the snapshots held then). Host times move with the machine; the counts do not.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from spikewatch import AdamW, Watch
from spikewatch.corpus import text_corpus, windows

REPO = Path(__file__).resolve().parents[1]


def example_module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(steps: int) -> dict[str, Any]:
    ex = example_module("plain_loop")
    torch.manual_seed(0)
    model = ex.GPT(32, 2, 4, 32)
    opt = AdamW(model.parameters(), lr=3e-3)
    settings = {"probes": {"read": "next_step"},
                "checkpoint": {"memory_interval": 5, "interval": None}}  # fmt: skip
    pauses: list[tuple[int, float]] = []  # (step, seconds) of each full collection
    started: list[float] = []
    at: dict[str, Any] = {}

    def timed(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((watch.step_count, time.perf_counter() - started.pop()))

    with tempfile.TemporaryDirectory() as tmp:
        watch = Watch(model, opt, run_dir=tmp, db="none", max_steps=steps, settings=settings)
        model.use_recorder(watch.attn)
        train, _ = text_corpus()
        gc.callbacks.append(timed)
        try:
            with watch:
                for x, y in watch.batches(lambda i: windows(train, i, 8, 32)):
                    loss = model(x, y)
                    loss.backward()
                    watch.step(loss)
                    if watch.step_count in (steps // 10, steps):
                        slots = len(watch.checkpointer.memory.slots)
                        at[str(watch.step_count)] = {
                            "tracked_objects": len(gc.get_objects()),
                            "snapshots_held": slots,
                        }
        finally:
            gc.callbacks.remove(timed)
    first = [s for step, s in pauses if step <= steps // 10]
    return {
        "steps": steps,
        "full_collections": len(pauses),
        "longest_pause_ms_first_tenth": round(1e3 * max(first, default=0.0), 2),
        "longest_pause_ms_all": round(1e3 * max((s for _, s in pauses), default=0.0), 2),
        "tracked": at,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    args = ap.parse_args(argv)
    out = run(args.steps)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
