"""Runs we do not control, as `spikewatch watch` and `scan` see them: one tag table for both
(a log written with each tag by torch's own SummaryWriter, and as CSV and JSON lines), a run per
followed directory named by its path (two `tb` directories are two runs, never merged; a
collision is refused), the console line of a spike, and `--once` ending with a summary and
finished runs."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from spikewatch.observatory import metric_names as M
from spikewatch.observatory import store
from spikewatch.observatory.readers.follow import Follower, FollowError
from spikewatch.observatory.readers.scan import scan_path
from spikewatch.observatory.store import db
from spikewatch.observatory.store.sink import DbSink

from .test_follow import SPIKE, SummaryWriter, _loss  # the same curve with its spike


def _tb(logs: Path, tag: str, steps: int = 240, extra: str | None = "lr") -> None:
    writer = SummaryWriter(str(logs))
    for step in range(steps):
        writer.add_scalar(tag, _loss(step), step)
        if extra:
            writer.add_scalar(extra, 1e-3, step)
    writer.close()


def _follow(tmp: Path, *paths: Path, **kw) -> tuple[Follower, str]:
    url = f"sqlite:///{tmp / 'sw.db'}"
    db.upgrade(url)
    sink = DbSink(url, spool_dir=tmp / "spool", linger_s=0.01)
    follower = Follower(list(paths), sink, **kw)
    try:
        follower.poll()
        follower.finish("completed")
    finally:
        sink.close(timeout=30)
    return follower, url


def _loss_steps(url: str, run: str) -> int:
    with store.session_factory(url)() as s:
        (loss,) = store.series(s, run_id=run, metric=M.LOSS, buckets=10_000)
    return sum(b.n for b in loss.buckets)


@pytest.mark.parametrize("tag", M.FOREIGN_LOSS_TAGS)
def test_every_loss_tag_of_the_table_is_the_loss_for_scan_and_watch(tag, tmp_path) -> None:
    logs = tmp_path / "logs" / "version_0"
    _tb(logs, tag)
    scanned = scan_path(tmp_path / "logs")
    assert scanned["metric"] == tag
    assert [s["onset_step"] for s in scanned["spikes"]] == [SPIKE]
    follower, url = _follow(tmp_path, tmp_path / "logs")
    (run,) = follower.runs
    assert _loss_steps(url, run) == 240  # stored under spikewatch's loss name
    rows = "".join(json.dumps({"step": s, tag: _loss(s)}) + "\n" for s in range(240))
    (tmp_path / "log.jsonl").write_text(rows)
    assert scan_path(tmp_path / "log.jsonl")["metric"] == tag


def test_the_table_is_the_one_in_the_docs() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "follow.md").read_text()
    for tag in (*M.FOREIGN_LOSS_TAGS, *M.FOREIGN_GRAD_NORM_TAGS, *M.FOREIGN_STEP_KEYS):
        assert f"`{tag}`" in doc, tag


def test_a_lightning_log_scans(tmp_path) -> None:
    """Lightning's TensorBoardLogger layout and tags: lightning_logs/version_0, `train_loss`
    beside `epoch` and `hp_metric` (and `train_loss_step` with on_epoch=True)."""
    logs = tmp_path / "lightning_logs" / "version_0"
    writer = SummaryWriter(str(logs))
    for step in range(240):
        writer.add_scalar("train_loss", _loss(step), step)
        writer.add_scalar("epoch", step // 100, step)
    writer.add_scalar("hp_metric", -1, 0)
    writer.close()
    result = scan_path(logs)
    assert result["metric"] == "train_loss"
    assert [s["onset_step"] for s in result["spikes"]] == [SPIKE]


def test_two_directories_of_the_same_name_are_two_runs(tmp_path) -> None:
    _tb(tmp_path / "a" / "tb", "train/loss")
    _tb(tmp_path / "b" / "tb", "train/loss", steps=200)
    follower, url = _follow(tmp_path, tmp_path / "a" / "tb", tmp_path / "b" / "tb")
    assert sorted(follower.runs) == ["a-tb", "b-tb"]
    assert (_loss_steps(url, "a-tb"), _loss_steps(url, "b-tb")) == (240, 200)
    with store.session_factory(url)() as s:
        runs = {r.run_id: (r.name, r.status) for r in store.list_runs(s)}
    assert runs == {"a-tb": ("a/tb", "completed"), "b-tb": ("b/tb", "completed")}


def test_lightning_versions_are_runs_of_their_own(tmp_path) -> None:
    for v in range(2):
        _tb(tmp_path / "lightning_logs" / f"version_{v}", "train_loss")
    follower, _ = _follow(tmp_path, tmp_path / "lightning_logs")
    names = sorted(r.name for r in follower.runs.values())
    assert names == ["lightning_logs/version_0", "lightning_logs/version_1"]


def test_a_run_id_that_two_sources_would_share_is_refused(tmp_path) -> None:
    _tb(tmp_path / "x" / "a-tb", "train/loss", steps=30)  # x/a-tb and x/a/tb: both "x-a-tb"
    _tb(tmp_path / "x" / "a" / "tb", "train/loss", steps=30)
    with pytest.raises(FollowError, match="would both be run 'x-a-tb'"):
        _follow(tmp_path, tmp_path / "x")
    with pytest.raises(FollowError, match="--run-name names one run"):
        _follow(tmp_path, tmp_path / "x" / "a", tmp_path / "x" / "a-tb", run_name="mine")


def test_a_spike_is_said_on_the_console_and_summed_up(tmp_path, caplog) -> None:
    _tb(tmp_path / "tb", "train/loss")
    with caplog.at_level(logging.WARNING, logger="spikewatch.observatory"):
        follower, _ = _follow(tmp_path, tmp_path / "tb")
    (line,) = [m for m in caplog.messages if "spike" in m]
    assert line.startswith("watch: tb: loss spike at step") and f"(onset {SPIKE})" in line
    (summary,) = follower.summary()
    assert summary == {
        "run_id": "tb",
        "name": "tb",
        "steps": 240,
        "last_step": 239,
        "spikes": 1,
        "first_onset": SPIKE,
    }


def test_a_restart_goes_on_from_the_saved_offsets(tmp_path) -> None:
    """The second watch reads only what the first had not (its poll stores only the new
    points), continues the detector mid-spike without a second verdict, and the store ends
    with every point and the spike once."""
    url, state = f"sqlite:///{tmp_path / 'sw.db'}", tmp_path / "state.json"
    db.upgrade(url)
    writer = SummaryWriter(str(tmp_path / "tb"))

    def write(steps: range) -> None:
        for step in steps:
            writer.add_scalar("train/loss", _loss(step), step)
            writer.add_scalar("lr", 1e-3, step)
        writer.flush()

    def watch() -> tuple[Follower, int]:
        sink = DbSink(url, spool_dir=tmp_path / "spool", linger_s=0.01)
        follower = Follower([tmp_path / "tb"], sink, state_path=state)
        try:
            return follower, follower.poll()
        finally:
            sink.close(timeout=30)

    write(range(0, 152))  # into the spike (150..155), before its verdict
    first, n1 = watch()
    assert n1 == 2 * 152 and state.is_file()
    write(range(152, 240))
    second, n2 = watch()
    assert n2 == 2 * 88  # only the new points were read
    writer.close()
    assert _loss_steps(url, "tb") == 240
    with store.session_factory(url)() as s:
        spikes = [e for e in store.events(s, run_id="tb") if e.kind == "spike"]
    assert len(spikes) == 1 and spikes[0].data["onset_step"] == SPIKE
    (summary,) = second.summary()
    assert summary["steps"] == 240 and summary["spikes"] == 1  # counts carried over


def test_the_fast_scalar_path_reads_what_the_protobuf_walk_reads(tmp_path) -> None:
    from spikewatch.observatory.readers.tfevents import _frame, scalars, walk_scalars

    writer = SummaryWriter(str(tmp_path / "tb"))
    tags = ["loss", "train/loss", "x" * 130, "ünïcode/täg"]  # a tag too long for one byte
    for step in (0, 1, 127, 128, 300, 16_384, 2**31 - 1):
        for i, tag in enumerate(tags):
            writer.add_scalar(tag, 1.5 + i + step * 1e-3, step)
    writer.add_text("note", "not a scalar", 5)
    writer.close()
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    buf = events.read_bytes()
    starts, size, _, _ = _frame(buf)
    records = [
        buf[a + 12 : a + 12 + n] for a, n in zip(starts.tolist(), size.tolist(), strict=True)
    ]
    got = [x for r in records for x in scalars(r)]
    assert got == [x for r in records for x in walk_scalars(r)]
    assert len(got) == 7 * len(tags)
    assert {s for s, _, _ in got} == {0, 1, 127, 128, 300, 16_384, 2**31 - 1}


def _mlflow_run(uri: str, name: str, monkeypatch) -> None:
    mlflow = pytest.importorskip("mlflow", reason="mlflow-skinny (a dev extra) is not installed")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the file store is in maintenance
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("spikes")
    with mlflow.start_run(run_name=name):
        for step in range(240):
            mlflow.log_metrics({"train_loss": _loss(step), "lr": 1e-3}, step=step)


def test_an_mlflow_file_store_is_followed(tmp_path, monkeypatch) -> None:
    """Written by MLflow's own client into `mlruns/`: each MLflow run is a run, its loss
    found by the tag table, its spike found once."""
    _mlflow_run(f"file:{tmp_path / 'mlruns'}", "first", monkeypatch)
    _mlflow_run(f"file:{tmp_path / 'mlruns'}", "second", monkeypatch)
    follower, url = _follow(tmp_path, tmp_path / "mlruns")
    assert len(follower.runs) == 2
    for run in follower.runs:
        assert _loss_steps(url, run) == 240
    assert [s["spikes"] for s in follower.summary()] == [1, 1]
    assert {s["first_onset"] for s in follower.summary()} == {SPIKE}


def test_an_mlflow_database_is_followed_as_it_grows(tmp_path, monkeypatch) -> None:
    """MLflow's default store since 3.0 (sqlite:///mlflow.db), read by rowid: a second
    poll after more runs reads only the new rows."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _mlflow_run(uri, "first", monkeypatch)
    url = f"sqlite:///{tmp_path / 'sw.db'}"
    db.upgrade(url)
    sink = DbSink(url, spool_dir=tmp_path / "spool", linger_s=0.01)
    follower = Follower([tmp_path / "mlflow.db"], sink)
    try:
        assert follower.poll() == 2 * 240
        _mlflow_run(uri, "second", monkeypatch)
        assert follower.poll() == 2 * 240
    finally:
        sink.close(timeout=30)
    assert sorted(r.name for r in follower.runs.values()) == ["mlflow/first", "mlflow/second"]
    assert [s["spikes"] for s in follower.summary()] == [1, 1]


WANDB_WRITER = """
import json, sys, wandb
rows = json.load(open(sys.argv[1]))
run = wandb.init(project="spikes", name=sys.argv[2], dir=sys.argv[3], mode="offline")
for step, row in enumerate(rows):
    wandb.log(row, step=step)
run.finish()
"""


def _wandb_run(tmp: Path, name: str, rows: list[dict]) -> Path:
    """A run written by W&B's own client in offline mode (in a process of its own: the client
    starts a service); its run file."""
    pytest.importorskip("wandb", reason="wandb (a dev extra) is not installed")
    import subprocess
    import sys

    (tmp / f"{name}.json").write_text(json.dumps(rows))
    (tmp / "writer.py").write_text(WANDB_WRITER)
    env = {**__import__("os").environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    subprocess.run(
        [sys.executable, str(tmp / "writer.py"), str(tmp / f"{name}.json"), name, str(tmp)],
        check=True,
        env=env,
        timeout=300,
    )
    (path,) = [p for p in (tmp / "wandb").rglob("run-*.wandb") if name in _wandb_names(p)]
    return path


def _wandb_names(path: Path) -> str:
    return path.read_bytes()[:4096].decode("latin-1")


def test_a_wandb_offline_run_is_followed(tmp_path) -> None:
    """Written by W&B's own client: the loss by the tag table, nested keys as a/b, media and
    text skipped, W&B's own `_` keys left out; a history row longer than a 32 KiB block (its
    record in several chunks) read whole; the spike found once."""
    rows = [
        {"train/loss": _loss(s), "lr": 1e-3, "eval": {"acc": s / 240}}
        | ({"note": "x" * 70_000} if s == 50 else {})
        for s in range(240)
    ]
    _wandb_run(tmp_path, "spiky", rows)
    follower, url = _follow(tmp_path, tmp_path / "wandb")
    (summary,) = follower.summary()
    assert summary["name"].startswith("wandb/offline-run-")
    assert summary["steps"] == 240 and summary["spikes"] == 1 and summary["first_onset"] == SPIKE
    with store.session_factory(url)() as s:
        names = set(store.metric_names(s, run_id=summary["run_id"]))
    assert names == {M.LOSS, "lr", "eval/acc"}
    state = tmp_path / "state.json"  # a restart from saved offsets reads nothing again
    for expected in (3 * 240, 0):
        sink = DbSink(url, spool_dir=tmp_path / "spool", linger_s=0.01)
        try:
            assert Follower([tmp_path / "wandb"], sink, state_path=state).poll() == expected
        finally:
            sink.close(timeout=30)


def test_a_wandb_file_read_as_it_grows_and_a_corrupt_chunk_reported(tmp_path) -> None:
    from spikewatch.observatory.readers.wandb_log import BLOCK, WandbLog

    rows = [{"loss": 2.0 + s * 1e-3} | ({"blob": "y" * 40_000} if s % 60 == 7 else {})
            for s in range(400)]  # fmt: skip
    whole = _wandb_run(tmp_path, "grows", rows).read_bytes()
    grown = tmp_path / "grown.wandb"
    log = WandbLog(grown)
    got: list[float] = []
    with open(grown, "wb") as f:
        for cut in [*range(3, len(whole), 9_001), len(whole)]:  # inside headers, chunks, blocks
            f.write(whole[f.tell() : cut])
            f.flush()
            columns, problems = log.read_scalars()
            assert problems == []
            got += columns["loss"][1].tolist() if "loss" in columns else []
    assert got == [r["loss"] for r in rows]
    bad = bytearray(whole)
    bad[BLOCK + 2000] ^= 0xFF  # inside block 1
    (tmp_path / "bad.wandb").write_bytes(bytes(bad))
    columns, problems = WandbLog(tmp_path / "bad.wandb").read_scalars()
    assert len(problems) == 1 and "checksum" in problems[0][1]
    steps = columns["loss"][0].tolist()
    assert steps[0] == 0 and steps[-1] == 399 and 300 < len(steps) < 400  # only block 1 lost
