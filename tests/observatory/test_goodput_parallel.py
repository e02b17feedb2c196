"""Lanes split over processes (goodput/parallel.py) give the outputs of one process to the bit:
through helper processes (a process with threads), through children forked per share (one
thread), and when a helper dies (its share runs here); a helper never runs the program's main
module."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from spikewatch.observatory.goodput import parallel, simulate

from .test_goodput import _small
from .test_goodput_engines import _outputs

PLANS = [_small(), _small(steps=4000, straggler=0.1)]
SEEDS = [parallel.MIN_SHARE, parallel.MIN_SHARE + 5]  # two shares of ~100 lanes


def _helpers_ready(n: int) -> list[parallel._Helper]:
    parallel.warm(n)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        idle = parallel._idle_helpers(n)
        for h in idle:
            h.lock.release()
        if len(idle) >= n:
            return idle
        time.sleep(0.05)
    raise AssertionError("the helper processes did not start within 60 s")


@pytest.fixture
def threaded(monkeypatch):  # noqa: ANN201
    """As in a web server: no forking, helper processes."""
    monkeypatch.setattr(parallel, "_forking", lambda: False)


def test_shares_in_helper_processes_equal_one_process(threaded) -> None:
    alone = _outputs(simulate(PLANS, SEEDS, seed=3, workers=1))
    helper = _helpers_ready(1)[0]
    sent = []
    real = parallel._Helper.send

    def counted(self, args):  # noqa: ANN001, ANN202
        sent.append(args[1].sum())
        return real(self, args)

    try:
        parallel._Helper.send = counted  # type: ignore[method-assign]
        split = _outputs(simulate(PLANS, SEEDS, seed=3, workers=2))
    finally:
        parallel._Helper.send = real  # type: ignore[method-assign]
    assert sent and 0 < sent[0] < sum(SEEDS)  # a share went to the helper
    for k, want in alone.items():
        np.testing.assert_array_equal(split[k], want, err_msg=k)
    assert helper.proc.poll() is None  # kept for the next question


def test_a_helper_that_dies_leaves_its_share_to_this_process(threaded, caplog) -> None:
    alone = _outputs(simulate(PLANS, SEEDS, seed=5, workers=1))
    helper = _helpers_ready(1)[0]
    real = parallel._Helper.send

    def send_then_die(self, args):  # noqa: ANN001, ANN202
        out = real(self, args)
        self.proc.kill()
        return out

    try:
        parallel._Helper.send = send_then_die  # type: ignore[method-assign]
        split = _outputs(simulate(PLANS, SEEDS, seed=5, workers=2))
    finally:
        parallel._Helper.send = real  # type: ignore[method-assign]
    for k, want in alone.items():
        np.testing.assert_array_equal(split[k], want, err_msg=k)
    assert "running its share here" in caplog.text
    helper.proc.wait(timeout=10)
    _helpers_ready(1)  # a new one replaces it


def test_forked_shares_in_a_one_thread_program_equal_one_process(tmp_path) -> None:
    """The CLI's case, in a fresh interpreter (pytest's own process runs threads): a script
    with no main guard, whose top level must run once only."""
    marker = tmp_path / "ran"
    script = textwrap.dedent(
        f"""
        import numpy as np, threading
        from spikewatch.observatory.goodput import simulate
        from tests.observatory.test_goodput_parallel import PLANS, SEEDS
        from tests.observatory.test_goodput_engines import _outputs
        with open({str(marker)!r}, "a") as f:
            f.write("x")
        assert threading.active_count() == 1
        a = _outputs(simulate(PLANS, SEEDS, seed=7, workers=1))
        b = _outputs(simulate(PLANS, SEEDS, seed=7, workers=2))
        assert all(np.array_equal(a[k], b[k]) for k in a), "forked shares differ"
        print("equal")
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "equal"
    assert marker.read_text() == "x"  # the children never ran the script again


@pytest.mark.parametrize("text", ["0", "two"])
def test_a_bad_worker_count_is_one_clear_line(text, monkeypatch) -> None:
    monkeypatch.setenv(parallel.ENV, text)
    if text == "0":
        assert parallel.workers_default() == 1
    else:
        with pytest.raises(ValueError, match="SPIKEWATCH_SIMULATE_WORKERS"):
            parallel.workers_default()
