"""Rank faults under `torchrun --nproc_per_node=2` on gloo, apart from test_distributed.py so
that the two test files run side by side: a rank whose loader is slow is named the straggler."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from sqlalchemy.orm import Session

from spikewatch.observatory import store
from spikewatch.observatory.store.db import make_engine

from .conftest import REPO
from .test_distributed import LAUNCH_TIMEOUT_S, TEARDOWN_ABORT

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]


def test_a_rank_whose_loader_is_slow_is_named_the_straggler(tmp_path) -> None:
    """tests/spikewatch/stall_script.py `straggle`: rank 1's batches take 60 ms from batch 10
    on, and the job runs at its pace (rank 0 waits for it in each step's all-reduce). Rank 0
    records one slowdown naming rank 1, with its wait for its batches and rank 0's."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    script = str(REPO / "tests" / "spikewatch" / "stall_script.py")
    done = subprocess.run([*cmd, script, str(tmp_path), "straggle"], env=env,
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)  # fmt: skip
    if done.returncode and TEARDOWN_ABORT in done.stdout + done.stderr:
        pytest.skip("torch's gloo teardown abort (see TEARDOWN_ABORT)")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    with Session(make_engine(f"sqlite:///{tmp_path / 'runs.db'}")) as session:
        (run,) = store.list_runs(session)
        events = store.events(session, run_id=run.run_id, kinds=["slowdown"])
    named = [e for e in events if "straggler" in e.data]
    assert len(named) == 1, [(e.message, e.data) for e in events]
    (event,) = named
    assert event.data["rank"] == 1 and "rank 1 is the straggler" in event.message
    assert event.data["batch_wait_s"] >= 0.05 > event.data["others_batch_wait_s"]
