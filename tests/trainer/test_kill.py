"""SIGKILL at random moments, during steps and during checkpoint writes: every checkpoint on disk
is intact or absent, and resuming reproduces the uninterrupted run bitwise."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from spikewatch.trainer.builtin.loop import build_trainer
from spikewatch.trainer.checkpoints import format as ck

from .conftest import tiny_config

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

ARGS = ("checkpoint.interval=1", "train.max_steps=40", "eval.interval=none")
REPO = Path(__file__).parents[2]


def _launch(run_dir: Path, *extra: str) -> subprocess.Popen:
    """The CLI in a subprocess, training exactly tiny_config(*ARGS, *extra) (as JSON)."""
    cfg_file = run_dir.parent / f"{run_dir.name}.json"
    cfg_file.write_text(json.dumps(tiny_config(*ARGS, *extra).to_dict()))
    cmd = [
        sys.executable,
        "-m",
        "spikewatch.trainer.cli",
        "train",
        str(cfg_file),
        "--run-dir",
        str(run_dir),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        cmd, cwd=run_dir.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def _final_weights(run_dir: Path, resume: bool, *extra: str) -> dict[str, torch.Tensor]:
    tr = build_trainer(tiny_config(*ARGS, *extra), run_dir=run_dir, resume=resume)
    tr.fit()
    return tr.model.state_dict()


def _trial(tmp: Path, rng: random.Random, reference: dict, window: float, *extra: str) -> str:
    proc = _launch(tmp, *extra)
    first = tmp / "checkpoints" / "step00000000" / "meta.json"
    deadline = time.monotonic() + 60
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(rng.uniform(0, window))
    finished = proc.poll() is not None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for path in ck.list_checkpoints(tmp / "checkpoints").values():
        ck.verify_checkpoint(path)  # raises if a torn checkpoint was ever published
    has_any = ck.find_intact(tmp / "checkpoints") is not None
    weights = _final_weights(tmp, has_any, *extra)
    for k, v in reference.items():
        assert torch.equal(weights[k], v), k
    return "finished" if finished else "killed"


def _run_trials(tmp_path: Path, n: int, seed: int, *extra: str) -> list[str]:
    reference = _final_weights(tmp_path / "reference", False, *extra)
    took = []
    for k in range(2):  # the shorter of two: a burst of load in one must not stretch the window
        t0 = time.perf_counter()
        _final_weights(tmp_path / f"timing{k}", False, *extra)
        took.append(time.perf_counter() - t0)
    window = 1.2 * min(took)  # the kill lands anywhere in a run's lifetime
    rng = random.Random(seed)
    return [_trial(tmp_path / f"t{i}", rng, reference, window, *extra) for i in range(n)]


# slow: test_sigkill_many_trials is its long form; make test kills and resumes in
# test_sigkill_during_async_saves (4 kills), tests/spikewatch/test_examples.py (each client),
# test_exactly_once.py and test_rollback_crash.py
@pytest.mark.slow
def test_sigkill_always_resumes_from_an_intact_checkpoint(tmp_path) -> None:
    # seed 12 puts the kills at 0.57, 0.79, 0.80 and 0.17 of a run's lifetime (60 trials: slow)
    outcomes = _run_trials(tmp_path, n=4, seed=12)
    assert outcomes.count("killed") >= 3


def test_sigkill_during_async_saves(tmp_path) -> None:
    """With a save every step in a background thread, most kills land while one is writing."""
    outcomes = _run_trials(tmp_path, 4, 21, "checkpoint.async_save=true")  # 0.20 to 0.83
    assert outcomes.count("killed") >= 3


@pytest.mark.slow
def test_sigkill_many_trials(tmp_path) -> None:
    outcomes = _run_trials(tmp_path, n=60, seed=1)
    assert outcomes.count("killed") >= 30


def test_sigterm_stops_cleanly_with_a_checkpoint(tmp_path) -> None:
    reference = _final_weights(tmp_path / "reference", resume=False)
    run = tmp_path / "run"
    proc = _launch(run)
    first = run / "checkpoints" / "step00000003" / "meta.json"
    deadline = time.monotonic() + 60
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    step, path = ck.find_intact(run / "checkpoints")
    assert 3 <= step <= 40
    if step < 40:
        assert b"stopping at step" in err
    weights = _final_weights(run, resume=True)
    for k, v in reference.items():
        assert torch.equal(weights[k], v), k
