"""Rank faults under `torchrun --nproc_per_node=2` on gloo, apart from test_distributed.py so
that the two test files run side by side: a rank whose loader is slow is named the straggler;
a SIGTERM to the launcher stops every rank after one agreed step."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

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
    assert event.data["slow_in"] == "batches"
    assert event.data["batch_wait_s"] >= 0.05 > event.data["others_batch_wait_s"]


@pytest.mark.parametrize("part", ["forward", "backward"])
def test_a_rank_slow_in_its_compute_is_named_the_straggler(tmp_path, part: str) -> None:
    """`stall_script.py OUT slow_forward`: rank 1's forward takes 60 ms more from step 10 on (a
    slow device). Its batches come as fast as rank 0's and the ranks' steps take as long (rank
    0 waits in backward's all-reduce): rank 0 records one slowdown naming rank 1 by its
    forward, from the forwards' times each rank publishes. `slow_backward`: its backward takes
    the 60 ms, its forward as fast as rank 0's; each rank times its backward to its last
    gradient (before the all-reduce's wait, where rank 0's backward waits for rank 1's), and
    rank 1 is named by its backward."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    script = str(REPO / "tests" / "spikewatch" / "stall_script.py")
    done = subprocess.run([*cmd, script, str(tmp_path), f"slow_{part}"], env=env,
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
    assert event.data["rank"] == 1 and event.data["slow_in"] == part
    assert f"rank 1 is the straggler, its {part} taking" in event.message
    assert event.data[f"{part}_s"] >= 0.06 > event.data[f"others_{part}_s"]


def test_a_rank_slow_under_fsdp2_is_named_by_its_arrivals_at_the_collectives(tmp_path) -> None:
    """`stall_script.py OUT fsdp_slow`: the model sharded with FSDP2, rank 1's forward 60 ms
    longer from step 10 on. Every rank waits inside the all-gathers and reduce-scatters for
    it, so its batches, forwards and backwards take as long as rank 0's; each rank sums when
    it reached blocks of the same collectives (torch's flight recorder), and rank 0 records one
    slowdown naming rank 1 by its lateness there. On the way: a parameter with fewer rows than
    ranks (the last layer's bias) has an empty shard on rank 1, which the optimizer state's
    maxima refused (`_foreach_max` of an empty tensor) and now count as 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    script = str(REPO / "tests" / "spikewatch" / "stall_script.py")
    done = subprocess.run([*cmd, script, str(tmp_path), "fsdp_slow"], env=env,
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
    assert event.data["rank"] == 1 and event.data["slow_in"] == "arrival"
    assert "rank 1 is the straggler, reaching the collectives" in event.message
    assert 0.03 <= event.data["late_s"] <= 0.09 and event.data["others_late_s"] < 0.01


@pytest.mark.parametrize("mode", ["own", pytest.param("batches", marks=pytest.mark.slow)])
def test_a_sigterm_to_torchrun_stops_every_rank_after_one_step_and_reads_stopped(
    tmp_path, mode: str
) -> None:
    """torchrun forwards its SIGTERM (a scheduler's stop) to every rank. Rank 0 is inside the
    step's all-reduce most of the time (rank 1's batches are slow), where the signal's handler
    waits for the collective to return; no rank may leave while the other waits there for it.
    Each rank ends its loop after the same step (a loop of its own with a KeyboardInterrupt at
    its next step; `watch.batches` by itself), the run reads "stopped" at that step, with its
    final checkpoint there, not "running" until its heartbeats lapse."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    script = str(REPO / "tests" / "spikewatch" / "sigterm_script.py")
    log = tmp_path / "log.txt"
    mark = tmp_path / "run" / "checkpoints" / "step00000010" / "meta.json"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*cmd, script, str(tmp_path), mode], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not mark.exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "never reached step 10"
            time.sleep(0.05)
        assert mark.exists(), log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)  # to torchrun alone, as a scheduler stops the job
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    if TEARDOWN_ABORT in text:
        pytest.skip("torch's gloo teardown abort (see TEARDOWN_ABORT)")
    ends = dict(re.findall(r"rank (\d) (?:ended|interrupted \(SIGTERM[^)]*\)) at step (\d+)", text))
    assert sorted(ends) == ["0", "1"], text[-3000:]  # both ended their loops; neither was killed
    assert ends["0"] == ends["1"], ends
    step = int(ends["0"])
    with Session(make_engine(f"sqlite:///{tmp_path / 'runs.db'}")) as session:
        (run,) = store.list_runs(session)
    assert (run.status, run.last_step) == ("stopped", step), text[-3000:]
    assert (tmp_path / "run" / "checkpoints" / f"step{step:08d}" / "meta.json").exists()
    assert json.loads((tmp_path / "run" / "ended.json").read_text())["status"] == "stopped"
