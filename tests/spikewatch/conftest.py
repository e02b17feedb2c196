"""Helpers for the integration tests: run the examples (in-process, or killed in a subprocess)
at a tiny size, and compare their results."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

REPO = Path(__file__).parents[2]
# Small enough for seconds per run, big enough that a poisoned region does lasting harm.
SMALL = ("--d-model", "64", "--seq-len", "64", "--batch-size", "8")
POISON = ("--poison-at", "100", "--poison-len", "14")
STEPS = ("--steps", "150")


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", REPO / "examples" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_example(name: str, cwd: Path, *args: str) -> dict[str, Any]:
    """examples/<name>.py in this process, in `cwd`; returns its summary JSON."""
    cwd.mkdir(parents=True, exist_ok=True)
    old = os.getcwd()
    os.chdir(cwd)
    try:
        assert example(name).main([*SMALL, *args, "--summary-json", "summary.json"]) == 0
    finally:
        os.chdir(old)
    return json.loads((cwd / "summary.json").read_text())


def launch(name: str, cwd: Path, *args: str) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(REPO / "examples" / f"{name}.py"), *SMALL, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def kill_when(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float = 120) -> None:
    """SIGKILL `proc` as soon as `ready()`; fails if it ended first or never got there."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"ended before the kill: {proc.stderr.read().decode()[-2000:]}"
        assert time.monotonic() < deadline, "timed out waiting to kill"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights in the newest Watch checkpoint of a run directory."""
    newest = max((run_dir / "checkpoints").glob("step*"), key=lambda p: p.name)
    return torch.load(newest / "model.pt", weights_only=True)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def the_rollback(summary: dict[str, Any]) -> dict[str, Any]:
    rollbacks = [i for i in summary["interventions"] if i["kind"] == "rollback"]
    assert rollbacks, summary["interventions"]
    return rollbacks[0]
