"""A long run's loop does not grow (trainer/checkpoints/tiers.py `MAX_ANCHORS`, memory.py
`_pack`): over 10,000 steps the Python work a step costs the loop thread, the snapshots held and
the objects the garbage collector walks stay where they were at step 1,000, so no pause grows
with the run (a full collection walks what the process holds; a step walks what the run holds).

A tiny model on the CPU, so that the Watch's own work is most of a step (meta at a tiny shape
runs the Watch the same, ~25x slower a step). The work is counted, not timed: Python calls on
the loop thread (`sys.setprofile`), per step, over steps 901-1,000 and 9,901-10,000 (the same
phase of every cadence)."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import sys

import pytest
import torch

from spikewatch import AdamW, Watch
from spikewatch.trainer.checkpoints.tiers import MAX_ANCHORS

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

STEPS, EVERY = 10_000, 5


# slow tier (a soak, ~26 s): make test keeps the anchors' release
# (tests/trainer/test_memory_tier.py)
@pytest.mark.slow
def test_ten_thousand_steps_keep_a_steps_work_and_what_the_run_holds_flat(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = AdamW(model.parameters(), lr=1e-3)
    # the pace's slowdowns are judged by the clock: off, so that the run is the same every time
    settings = {"probes": {"read": "next_step"}, "guard": {"stall": {"slowdown": None}},
                "checkpoint": {"memory_interval": EVERY, "interval": None}}  # fmt: skip
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 8, generator=g) for _ in range(64)]
    windows = {"early": range(901, 1001), "late": range(STEPS - 99, STEPS + 1)}
    calls = dict.fromkeys(windows, 0)
    held: dict[int, tuple[int, int]] = {}
    count = [0]

    def profile(frame, event, arg) -> None:  # noqa: ANN001
        if event in ("call", "c_call"):
            count[0] += 1

    watch = Watch(model, opt, run_dir=tmp_path, db="none", max_steps=STEPS, settings=settings)
    # a line logged in one window and not the other (this toy run warns now and then) would
    # count its handler's work, which is the line's, not the run's length
    logging.disable(logging.CRITICAL)
    with contextlib.ExitStack() as undo, watch:
        undo.callback(logging.disable, logging.NOTSET)
        for x in watch.batches(lambda i: data[i % 64]):
            window = next((w for w, r in windows.items() if watch.step_count + 1 in r), None)
            if window is not None:
                count[0] = 0
                sys.setprofile(profile)
            loss = model(x).pow(2).mean()
            loss.backward()
            watch.step(loss)
            if window is not None:
                sys.setprofile(None)
                calls[window] += count[0]
            if watch.step_count in (1000, STEPS):
                gc.collect()
                objs = gc.get_objects()
                containers = len(objs) - sum(1 for o in objs if issubclass(type(o), torch.Tensor))
                held[watch.step_count] = (containers, len(watch.checkpointer.memory.slots))
    (before, slots_before), (after, slots_after) = held[1000], held[STEPS]
    # retention's own bound (observatory/retention.py): the newest two, one per power-of-two
    # age, and the pre-spike anchors of the newest warnings (this toy run warns often)
    assert slots_after <= 2 + int(math.log2(STEPS // EVERY)) + 1 + MAX_ANCHORS, held
    assert after - before <= 200 * max(slots_after - slots_before, 1), held
    assert calls["late"] <= 1.1 * calls["early"], calls
