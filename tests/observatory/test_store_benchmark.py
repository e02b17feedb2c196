"""benchmarks/store.py at tiny sizes (its smoke run): it goes through public interfaces only, so a
renamed private field cannot break it unseen (it once failed on DbSink._q)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
