"""The GPU check's per-part figures (benchmarks/gpu/gpu_check.py `_per_part`), run on the CPU at
its smoke shape: each part of a watched step is timed around every call of it (on a device,
between CUDA events), and each kind of step is told apart, so a device run says where each
event's cost lies, not only the event's whole."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # trains (and compiles) a model (tests/README.md)

REPO = Path(__file__).resolve().parents[2]


def test_the_mfu_section_times_each_part_of_each_kind_of_step(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks/gpu/gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gpu
    spec.loader.exec_module(gpu)
    out = gpu.mfu_check(smoke=True)
    parts = out["per_part"]
    # 30 steps, the first two left out: a state step every 10, a snapshot every few, the rest
    assert {"plain", "state", "memory"} <= set(parts)
    assert sum(v["steps"] for v in parts.values()) == 28
    for kind, v in parts.items():
        # the smoke GPT's two layers each record their maxima once a step; the core's gate and
        # conclude once each; its checkpoint check twice (at the step's end, and in
        # `watch.batches` before the next batch is drawn)
        calls = {p: v[p]["calls"] for p in ("maxima", "gate", "conclude", "save_if_due")}
        assert calls == {"maxima": 2, "gate": 1, "conclude": 1, "save_if_due": 2}, kind
        assert all(v[p]["host_ms"] > 0 for p in calls), kind
    # and the figures per event of the same run are there beside them
    assert out["per_event"]["plain"]["steps"] == parts["plain"]["steps"]
