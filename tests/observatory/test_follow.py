"""`spikewatch watch` (observatory/readers/follow.py): a real SummaryWriter writing a loss curve
with a spike while the follower polls; a restart mid-way; a truncated and a corrupt record; CSV and
JSON-lines files; an alert to a local receiver."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from spikewatch.observatory import metric_names as M
from spikewatch.observatory import store
from spikewatch.observatory.alerts import Alerter
from spikewatch.observatory.readers.follow import Follower
from spikewatch.observatory.store import db
from spikewatch.observatory.store.sink import DbSink

from .test_alerts import Receiver

pytest.importorskip("tensorboard", reason="torch's SummaryWriter needs the tensorboard package")
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

SPIKE = 150


def _loss(step: int) -> float:
    rng = random.Random(step)
    base = 2.0 + 3.0 * math.exp(-step / 60) + 0.02 * rng.gauss(0, 1)
    return base * (2.5 if SPIKE <= step < SPIKE + 6 else 1.0)


def _write(writer: SummaryWriter, steps: range) -> None:
    for step in steps:
        writer.add_scalar("train/loss", _loss(step), step)
        writer.add_scalar("train/grad_norm", 0.5 + 0.01 * (step % 5), step)
        writer.add_scalar("train/learning_rate", 1e-3, step)
    writer.flush()


def _url(tmp: Path) -> str:
    url = f"sqlite:///{tmp / 'sw.db'}"
    db.upgrade(url)
    return url


def _follower(url: str, tmp: Path, logs: Path) -> tuple[Follower, DbSink]:
    sink = DbSink(url, spool_dir=tmp / "spool", linger_s=0.01)
    return Follower([logs], sink), sink


def _counts(url: str, run: str, metric: str = "train/loss") -> tuple[dict[str, list[int]], list]:
    with store.session_factory(url)() as s:
        (loss,) = store.series(s, run_id=run, metric=metric, buckets=10_000)
        steps = [b.start for b in loss.buckets for _ in range(b.n)]
        events = store.events(s, run_id=run)
    return {metric: steps}, events


def test_a_summary_writer_with_a_spike_is_followed_live(tmp_path: Path) -> None:
    """Written in chunks while the follower polls: every point once, the spike with its
    onset, the grad norm under its spikewatch name, and an alert about the spike."""
    url, logs = _url(tmp_path), tmp_path / "tb" / "run-a"
    receiver = Receiver()
    receiver.start()
    try:
        follower, sink = _follower(url, tmp_path, tmp_path / "tb")
        sink.alerts = Alerter([receiver.url])
        writer = SummaryWriter(str(logs))
        for lo in range(0, 240, 40):
            _write(writer, range(lo, lo + 40))
            follower.poll()
        writer.close()
        follower.poll()
        assert sink.alerts.wait(30)
        sink.close(timeout=30)
    finally:
        receiver.stop()
    (run,) = follower.runs
    assert run == "tb-run-a"
    steps, events = _counts(url, run)
    assert steps["train/loss"] == list(range(240))  # every step once
    spikes = [e for e in events if e.kind == "spike"]
    assert len(spikes) == 1 and abs(spikes[0].data["onset_step"] - SPIKE) <= 5
    with store.session_factory(url)() as s:
        names = store.metric_names(s, run_id=run)
    assert {M.LOSS, M.GRAD_NORM, "train/learning_rate"} <= set(names)  # ours for the known
    assert any(b["kind"] == "spike" and "spike" in b["text"] for b in receiver.bodies)
    from fastapi.testclient import TestClient

    from spikewatch.web.app import create_app
    from spikewatch.web.settings import Settings

    with TestClient(create_app(Settings(db_url=url))) as api:  # the dashboard sees it
        assert [r["run_id"] for r in api.get("/api/runs").json()] == [run]
        shown = api.get(f"/api/runs/{run}/events", params={"kind": "spike"}).json()
        assert [e["kind"] for e in shown] == ["spike"]
        assert abs(shown[0]["data"]["onset_step"] - SPIKE) <= 5


def test_a_restart_of_watch_leaves_every_point_and_event_once(tmp_path: Path) -> None:
    url, logs = _url(tmp_path), tmp_path / "tb"
    writer = SummaryWriter(str(logs / "r"))
    _write(writer, range(0, 160))  # the spike starts inside the first half
    first, sink = _follower(url, tmp_path, logs)
    first.poll()
    sink.close(timeout=30)  # watch stopped
    _write(writer, range(160, 240))
    writer.close()
    second, sink = _follower(url, tmp_path, logs)  # and started again: reads from the start
    second.poll()
    sink.close(timeout=30)
    steps, events = _counts(url, "tb-r")
    assert steps["train/loss"] == list(range(240))
    assert [e.kind for e in events].count("spike") == 1


def _event_file(tmp: Path) -> Path:
    writer = SummaryWriter(str(tmp / "src"))
    _write(writer, range(0, 50))
    writer.close()
    (f,) = (tmp / "src").glob("events.out.tfevents.*")
    return f


def test_a_truncated_record_waits_and_a_corrupt_one_is_skipped_and_reported(
    tmp_path: Path,
) -> None:
    data = _event_file(tmp_path).read_bytes()
    logs = tmp_path / "tb" / "r"
    logs.mkdir(parents=True)
    target = logs / "events.out.tfevents.1.host"
    url = _url(tmp_path)
    follower, sink = _follower(url, tmp_path, tmp_path / "tb")
    lr = "train/learning_rate"  # the file's last record: step 49's learning rate
    target.write_bytes(data[:-7])  # the last record is still being written
    follower.poll()
    assert sink.flush(30)
    assert _counts(url, "tb-r", lr)[0][lr] == list(range(49))  # step 49 waits ...
    with open(target, "ab") as f:
        f.write(data[-7:])
    follower.poll()
    assert sink.flush(30)
    assert _counts(url, "tb-r", lr)[0][lr] == list(range(50))  # ... and is read whole
    # a second file with one record's data damaged: that record is skipped and reported
    damaged = bytearray(data)
    at = data.index(b"train/loss", len(data) // 2)
    damaged[at + 2] ^= 0xFF
    (logs / "events.out.tfevents.2.host").write_bytes(bytes(damaged))
    follower.poll()
    sink.close(timeout=30)
    _, events = _counts(url, "tb-r")
    (note,) = [e for e in events if e.data.get("kind") == "corrupt_record"]
    assert "events.out.tfevents.2.host" in note.message and "checksum" in note.message


def test_csv_and_json_lines_files_are_followed(tmp_path: Path) -> None:
    url = _url(tmp_path)
    csv_path, jsonl_path = tmp_path / "metrics.csv", tmp_path / "log.jsonl"
    csv_path.write_text("step,loss,lr\n1,2.5,0.001\n2,2.4,0.001\n3,2.3")  # row 3 unfinished
    rows = [{"step": s, "train": {"loss": 3.0 - s / 100}, "note": "x"} for s in range(1, 4)]
    jsonl_path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    sink = DbSink(url, spool_dir=tmp_path / "spool", linger_s=0.01)
    follower = Follower([csv_path, jsonl_path], sink)
    follower.poll()
    with open(csv_path, "a") as f:
        f.write(",0.001\n4,2.2,0.001\n")
    follower.poll()
    sink.close(timeout=30)
    with store.session_factory(url)() as s:
        (loss,) = store.series(s, run_id="metrics", metric="train/loss", buckets=100)
        assert [(b.start, b.max_value) for b in loss.buckets] == [
            (1, 2.5), (2, 2.4), (3, 2.3), (4, 2.2)
        ]  # fmt: skip
        (jl,) = store.series(s, run_id="log", metric="train/loss", buckets=100)
        assert [b.start for b in jl.buckets] == [1, 2, 3]  # "train/loss" from {"train": ...}
        notes = [e for e in store.events(s, run_id="log") if e.data.get("kind")]
    assert [n.data["kind"] for n in notes] == ["corrupt_record"] and "not a row" in notes[0].message


def test_the_follow_command_imports_a_log_directory(tmp_path: Path, capsys) -> None:
    from spikewatch.trainer.cli import main

    _event_file(tmp_path)  # tmp_path/src holds a 50-step log
    url = _url(tmp_path)
    args = ["follow", str(tmp_path / "src"), "--once", "--db", url, "--spool", str(tmp_path / "s")]
    assert main(args) == 0
    assert _counts(url, "src")[0]["train/loss"] == list(range(50))
    assert main(["follow", str(tmp_path / "nope"), "--once", "--db", url]) == 2
    capsys.readouterr()
    # the old name still follows, and says it is the old name
    assert main(["watch", *args[1:]]) == 0
    assert "`spikewatch watch` is the old name of `spikewatch follow`" in capsys.readouterr().err


def test_a_follower_stopped_with_sigterm_marks_its_run_stopped(tmp_path: Path) -> None:
    """systemd and Kubernetes stop a process with SIGTERM: the run it followed reads
    "stopped", as after Ctrl-C, not "running" for ever."""
    import os
    import signal
    import subprocess
    import sys
    import time

    url = _url(tmp_path)
    log = tmp_path / "metrics.csv"
    log.write_text("step,loss\n" + "".join(f"{s},{3.0 - s / 100}\n" for s in range(1, 21)))
    cmd = [sys.executable, "-m", "spikewatch.trainer.cli", "follow", str(log), "--db", url,
           "--spool", str(tmp_path / "spool"), "--interval", "0.2"]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            with store.session_factory(url)() as s:
                runs = store.list_runs(s)
            if runs and _counts(url, "metrics")[0]["train/loss"]:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()[-2000:]
    with store.session_factory(url)() as s:
        (run,) = store.list_runs(s)
    assert run.status == "stopped"


def test_a_log_that_stops_growing_is_a_stalled_run_until_it_grows_again(tmp_path: Path) -> None:
    """The follower's own pace rule: a log that grew every second and then not for longer than
    max(stall_min_s, 10x that) reads "stalled" (a `stall` event, as the Watch's watchdog
    records); its next growth records `resumed` and the run reads live again."""
    url = _url(tmp_path)
    sink = DbSink(url, spool_dir=tmp_path / "spool", linger_s=0.01)
    now = [1000.0]
    log_path = tmp_path / "metrics.csv"
    log_path.write_text("step,loss\n")
    follower = Follower([log_path], sink, stall_min_s=5.0, clock=lambda: now[0])
    step = 0

    def grow() -> None:
        nonlocal step
        step += 1
        with open(log_path, "a") as f:
            f.write(f"{step},{3.0 - step / 100}\n")

    for _ in range(6):  # a row a second
        grow()
        follower.poll()
        now[0] += 1.0
    now[0] += 4.0  # 5 s without a row: within max(5, 10 x 1 s)
    follower.poll()
    now[0] += 7.0  # 11 s: past it
    follower.poll()
    follower.poll()  # said once
    assert sink.flush(timeout=30)
    with store.session_factory(url)() as s:
        (run,) = store.list_runs(s)
    assert run.state == "stalled"
    grow()
    follower.poll()
    sink.close(timeout=30)
    with store.session_factory(url)() as s:
        (run,) = store.list_runs(s)
        events = store.events(s, run_id=run.run_id, kinds=["stall", "resumed"])
    assert [(e.kind, e.step) for e in events] == [("stall", 6), ("resumed", 7)]
    assert events[0].data["bound_s"] == 10.0 and events[1].data["stalled_s"] == 12.0
    assert run.state == "live"
