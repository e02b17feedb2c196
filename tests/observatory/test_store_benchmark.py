"""benchmarks/store.py and benchmarks/store_scale.py at tiny sizes (their smoke runs): they go
through public interfaces only, so a renamed private field cannot break them unseen (both once
failed on DbSink._q)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

REPO = Path(__file__).resolve().parents[2]


def test_the_store_benchmark_runs_at_tiny_sizes() -> None:
    url = os.environ.get("SPIKEWATCH_TEST_PG_URL")
    if not url:
        pytest.skip("needs $SPIKEWATCH_TEST_PG_URL (set by .ci/run): the benchmark uses PostgreSQL")
    cmd = [sys.executable, str(REPO / "benchmarks/store.py"), "--pg-url", url,
           "--ingest-values", "2000", "--reps", "1"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["sqlite_ingest_values_per_s"] > 0 and figures["pg_ingest_values_per_s"] > 0


@pytest.mark.parametrize("backend", ["sqlite", "pg"])
def test_the_store_scale_benchmark_runs_at_tiny_sizes(backend: str) -> None:
    """benchmarks/store_scale.py (the 70B-shape store figures the README quotes) at 20 steps of
    2 layers and 2 heads: the same code path, through public interfaces."""
    url = os.environ.get("SPIKEWATCH_TEST_PG_URL")
    if backend == "pg" and not url:
        pytest.skip("needs $SPIKEWATCH_TEST_PG_URL (set by .ci/run)")
    cmd = [sys.executable, str(REPO / "benchmarks/store_scale.py"), "--steps", "20",
           "--layers", "2", "--heads", "2", "--reps", "1", "--backends", backend]  # fmt: skip
    if url:
        cmd += ["--pg-url", url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["steps"] == 20 and figures[f"{backend}_ingest_values_per_s"] > 0
    assert figures["heatmap_p95_ms"] > 0 and figures["series_p95_ms"] > 0
