"""The CLI's run lands in the store: metrics per branch, verdicts, the rollback, the logbook."""

from __future__ import annotations

import json

import pytest

from spikewatch.observatory import store
from spikewatch.observatory.store.queries import session_factory
from spikewatch.trainer.cli import main

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

FAULT = 'faults=[{kind="shifted_labels", start=150, length=10}]'


def _first_rollback(summary: dict) -> dict:
    """The rollback among the interventions (the same-step tier's refusals come first)."""
    return next(i for i in summary["interventions"] if i["kind"] == "rollback")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rec")
    db = f"sqlite:///{tmp / 'sw.db'}"
    args = [
        "train",
        "tiny_cpu",
        "--set",
        "train.progress=false",
        "--set",
        "train.max_steps=200",
        "--set",
        "checkpoint.interval=10",
        "--set",
        FAULT,
        "--run-dir",
        str(tmp / "runs" / "r1"),
        "--db",
        db,
        "--tag",
        "test",
        "--summary-json",
        str(tmp / "s.json"),
    ]
    assert main(args) == 0
    return {"db": db, "tmp": tmp, "summary": json.loads((tmp / "s.json").read_text())}


def test_run_branches_and_events_are_stored(run) -> None:
    with session_factory(run["db"])() as s:
        summary = store.get_run(s, run_id="r1")
        assert summary.status == "completed" and summary.tags == ["test"]
        assert summary.spikes == 1 and summary.rollbacks == 1 and summary.branches == 2
        (b0, b1) = store.branches(s, run_id="r1")
        iv = _first_rollback(run["summary"])
        assert b1.parent == 0 and b1.fork_step == iv["to_step"]
        kinds = [e.kind for e in store.events(s, run_id="r1")]
        assert "spike" in kinds and "rollback" in kinds
        assert len(store.checkpoints(s, run_id="r1")) >= 10


def test_both_branches_keep_their_history(run) -> None:
    iv = _first_rollback(run["summary"])
    with session_factory(run["db"])() as s:
        data = store.series(s, run_id="r1", metric="train/loss", branch="all", buckets=4000)
        by_branch = {d.branch: d for d in data}
        assert set(by_branch) == {0, 1}
        steps0 = [b.end for b in by_branch[0].buckets]
        # the abandoned branch ends where the rollback happened: the detection, or (read a step
        # late, the GPU default) the step after it
        assert max(steps0) == iv["from_step"] >= iv["detect_step"]
        names = set(store.metric_names(s, run_id="r1"))
        assert {
            "train/loss",
            "val/loss",
            "layer/*/attn/grad_norm",  # per-layer series, stored under their template
            "layer/*/head/*/attn_max",
            "layer/embed/update_ratio",
        } <= names, names


def test_logbook_tells_the_story(run, capsys) -> None:
    assert main(["logbook", "r1", "--db", run["db"]]) == 0
    out = capsys.readouterr().out
    iv = _first_rollback(run["summary"])
    assert out.startswith("# Logbook of run `r1`")
    assert f"**Spike** detected at step {iv['detect_step']}" in out
    assert f"to the checkpoint of step {iv['to_step']}" in out
    assert "Outcome of the rollback" in out and "recovered" in out
    assert out.rstrip().endswith("2 branch(es).")


def test_logbook_of_an_unknown_run(run, capsys) -> None:
    assert main(["logbook", "nope", "--db", run["db"]]) == 2
    assert "no run 'nope'" in capsys.readouterr().err


def test_nonfinite_steps_are_recorded_without_breaking_the_run(tmp_path) -> None:
    db = f"sqlite:///{tmp_path / 'nan.db'}"
    nan = 'faults=[{kind="nan_loss", start=100, length=3}]'
    args = [
        "train",
        "tiny_cpu",
        "--set",
        "train.progress=false",
        "--set",
        "train.max_steps=130",
        "--set",
        "checkpoint.interval=10",
        "--set",
        nan,
        "--run-dir",
        str(tmp_path / "n1"),
        "--db",
        db,
    ]
    assert main(args) == 0
    with session_factory(db)() as s:
        events = store.events(s, run_id="n1")
        kinds = [e.kind for e in events]
        assert "nonfinite" in kinds and "skip" in kinds and "rollback" in kinds
        rollback = next(e for e in events if e.kind == "rollback")
        assert rollback.data["loss"] == "nan"  # non-finite values travel as strings


def _strict(text: str) -> dict:
    def no(value: str) -> None:
        raise ValueError(f"not strict JSON: {value}")

    return json.loads(text, parse_constant=no)


def test_a_resume_keeps_the_rollback_history_and_a_finished_resume_its_loss(tmp_path) -> None:
    """Killed (here: stopped) after a rollback and resumed, branch 1 still forks at the rollback
    target; a finished run resumed writes strict JSON that repeats its final loss."""
    db = f"sqlite:///{tmp_path / 'sw.db'}"
    common = ["--set", "train.progress=false", "--set", "train.max_steps=200", "--db", db]
    common += ["--set", "checkpoint.interval=10", "--set", FAULT, "--summary-json"]
    run = tmp_path / "r2"
    first = [*common, str(tmp_path / "a.json"), "--set", "train.stop_after=180"]
    assert main(["train", "tiny_cpu", *first, "--run-dir", str(run)]) == 0
    to_step = _first_rollback(_strict((tmp_path / "a.json").read_text()))["to_step"]
    assert main(["train", "--resume", str(run), *common, str(tmp_path / "b.json")]) == 0
    with session_factory(db)() as s:
        (_, b1) = store.branches(s, run_id="r2")
        assert (b1.fork_step, b1.parent) == (to_step, 0) and "resume" not in b1.reason
    done = _strict((tmp_path / "b.json").read_text())
    assert main(["train", "--resume", str(run), *common, str(tmp_path / "c.json")]) == 0
    again = _strict((tmp_path / "c.json").read_text())
    assert again["steps"] == 200 and again["final_train_loss"] == done["final_train_loss"]
    assert again["tokens_per_s"] is None  # no token was trained by that call


@pytest.mark.parametrize("async_save", [False, True])
def test_the_store_lists_the_checkpoints_on_disk(tmp_path, async_save: bool) -> None:
    """Every checkpoint ever written has a row; those on disk now are 'ok' (an async save is
    'writing' until it landed), those deleted by retention or the rollback are 'deleted'."""
    from spikewatch.trainer.checkpoints import format as ck

    db = f"sqlite:///{tmp_path / 'sw.db'}"
    run = tmp_path / "r3"
    args = ["train", "tiny_cpu", "--set", "train.progress=false", "--set", "train.max_steps=200"]
    args += ["--set", "checkpoint.interval=5", "--set", "checkpoint.keep_last=2", "--set", FAULT]
    args += ["--set", f"checkpoint.async_save={str(async_save).lower()}", "--db", db]
    assert main([*args, "--run-dir", str(run)]) == 0
    on_disk = {str(p) for p in ck.list_checkpoints(run / "checkpoints").values()}
    with session_factory(db)() as s:
        rows = store.checkpoints(s, run_id="r3")
    status = {r.path: r.checksum_status for r in rows}
    assert {p for p, st in status.items() if st == "ok"} == on_disk
    assert set(status.values()) == {"ok", "deleted"}  # nothing left 'writing'
    assert len(status) >= 40  # one row per step directory ever written (every 5 of 200)
    pinned = {r.step for r in rows if r.pinned and r.checksum_status == "ok"}
    assert pinned  # the rollback target (and pre-spike anchors) stay, pinned
