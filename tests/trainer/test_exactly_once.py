"""After a SIGKILL at any moment and a resume, the store holds every step's metrics and every
event of the live history exactly once: the same rows as an uninterrupted run of the same
config, in its own store; what the killed process did past the checkpoint it resumed from
stays, as an abandoned branch (the run page draws it as a rollback's). The run rolls back once
(a shifted-labels fault), so branches and rollback events are part of what must survive."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from spikewatch.observatory import metric_names as M
from spikewatch.observatory.store.chunks import decode
from spikewatch.trainer.config import load_config

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

REPO = Path(__file__).parents[2]
ARGS = [
    "train.progress=false",
    "checkpoint.interval=10",
    "train.max_steps=120",
    "eval.interval=40",
    "eval.batches=2",
    "guard.classify_cause=false",
    'faults=[{kind="shifted_labels", start=70, length=8}]',
]
TIMING = {M.TOKENS_PER_S}  # wall-clock metrics: the same steps, not the same values
PACE = {"slowdown", "stall", "resumed"}  # wall-clock events: on a loaded machine, not in another
# A save's stall is known only once the save is published, after the record was made durable
# for it: a SIGKILL right then loses that one value (the checkpoint itself is intact).
AFTER_COMMIT = {M.checkpoint_stall("disk"), M.checkpoint_stall("memory"), M.CKPT_MEMORY_BYTES}


def _train(run_dir: Path, *, resume: bool = False) -> subprocess.Popen:
    cfg_file = run_dir.parent / "config.json"
    cfg_file.write_text(json.dumps(load_config("tiny_cpu", ARGS).to_dict()))
    cmd = [sys.executable, "-m", "spikewatch", "train", str(cfg_file)]
    cmd += ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("SPIKEWATCH_DB_URL", None)  # the default store: runs/spikewatch.db where it runs
    return subprocess.Popen(
        cmd, cwd=run_dir.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def _finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]


def _store(run_dir: Path) -> dict[str, Counter]:
    """Every point (with its value unless it measures time), branch and event of the live
    history (`_live`): what a run's record holds once, killed or not."""
    engine = create_engine(f"sqlite:///{run_dir.parent / 'runs' / 'spikewatch.db'}")
    with engine.connect() as conn:
        windows = conn.execute(
            text(
                "SELECT m.name, s.branch, s.layer, s.head, c.win, c.first_step, c.last_step, c.n, "
                "c.steps, c.vals FROM point_windows c JOIN series s ON s.id = c.series_id "
                "JOIN metric_names m ON m.id = s.metric_id"
            )
        ).all()
        points = [
            (name, b, layer, head, step, None if math.isnan(value) else value)
            for name, b, layer, head, *packed in windows
            for step, value in zip(*(a.tolist() for a in decode(*packed)), strict=True)
        ]
        events = [  # not the watchdog's: a slowdown and its end are the wall clock's
            e
            for e in conn.execute(text("SELECT kind, branch, step, message FROM events")).all()
            if e[0] not in PACE and not (e[0] == "note" and "the pace is back" in e[3])
        ]
        branches = conn.execute(
            text("SELECT number, parent, fork_step, reason FROM branches")
        ).all()
    engine.dispose()
    live, logical, resumes = _live(branches)
    keyed = Counter(
        (name, logical[b], layer, head, step, None if name in TIMING else value)
        for name, b, layer, head, step, value in points
        if name not in AFTER_COMMIT and live(b, step)
    )
    return {
        "points": keyed,
        "events": Counter((k, logical[b], st, m) for k, b, st, m in events if live(b, st)),
        "branches": Counter(
            (logical[n], None if p is None else logical[p], f)
            for n, p, f, _ in branches
            if n in logical and n not in resumes
        ),
        "resumes": Counter(  # (the abandoned branch's points past its fork, the fork step)
            (sum(1 for _, b, *_r, st, _v in points if b == p and st > f), f)
            for n, p, f, _ in branches
            if n in resumes
        ),
    }


def _live(branches: list) -> tuple:
    """The live history of a record: a resume after a kill forks a branch of its own at the
    step it restored, and what the killed process did past it stays as it was, abandoned
    (its branch's tail, the branches it forked). Leave those out, and take each resume's
    branch as the one it continued: then a killed and resumed run's record is the
    uninterrupted run's. Returns (is (branch, step) live, logical branch numbers, the
    resumes' branches)."""
    tree = {n: (p, f) for n, p, f, _ in branches}
    resumes = {n for n, _, _, reason in branches if (reason or "").startswith("resumed at step")}
    lineage, cur = [], max(tree, default=0)
    while cur is not None:
        lineage.append(cur)
        cur = tree.get(cur, (None, None))[0]
    cut = {tree[n][0]: tree[n][1] for n in resumes if n in lineage}  # parent -> resumed at
    logical: dict[int, int] = {}
    for n in sorted(lineage):
        parent = tree.get(n, (None, None))[0]
        logical[n] = logical[parent] if n in resumes else len(set(logical.values()))

    def live(branch: int, step: int | None) -> bool:
        return branch in logical and (step is None or step <= cut.get(branch, step))

    return live, logical, resumes


def _diff(a: Counter, b: Counter) -> str:
    return f"missing {list((a - b).items())[:5]}, extra {list((b - a).items())[:5]}"


def test_sigkill_and_resume_store_every_row_exactly_once(tmp_path) -> None:
    ref = tmp_path / "ref" / "run"
    ref.parent.mkdir()
    t0 = time.monotonic()
    _finish(_train(ref))
    lifetime = time.monotonic() - t0
    want = _store(ref)
    assert sum(1 for e in want["events"] if e[0] == "rollback") == 1
    rng = random.Random(3)
    for trial in range(2):
        run = tmp_path / f"t{trial}" / "run"
        run.parent.mkdir()
        proc = _train(run)
        kill_at = time.monotonic() + rng.uniform(0.4, 0.95) * lifetime
        # never before the first checkpoint (a run under load can be slower than the reference
        # was): a resume needs one, and the kill is for what happens after it
        while not any((run / "checkpoints").glob("step*")) and proc.poll() is None:
            time.sleep(0.02)
        time.sleep(max(0.0, kill_at - time.monotonic()))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _finish(_train(run, resume=True))
        got = _store(run)
        # the resume is in the logbook, once; the rest as the uninterrupted run has it
        resumed = [e for e in got["events"] if e[0] == "note" and e[3].startswith("resumed at")]
        assert sum(got["events"][e] for e in resumed) == 1, resumed
        for e in resumed:
            del got["events"][e]
        for what in ("branches", "events", "points"):
            assert got[what] == want[what], f"trial {trial}, {what}: {_diff(want[what], got[what])}"
        # the killed process's steps past the restored checkpoint are kept, abandoned
        assert sum(got["resumes"].values()) <= 1 and all(n > 0 for n, _ in got["resumes"])


def test_a_rollback_taken_again_after_a_resume_is_stored_once(tmp_path) -> None:
    """Killed after the rollback was recorded, resumed from before it: the same decision comes
    again from another tier in another time, and the store keeps one event (the SIGKILL test
    above meets this only when the kill falls in that window)."""
    from spikewatch.observatory import store
    from spikewatch.observatory.store import db
    from spikewatch.observatory.store.sink import DbSink
    from spikewatch.trainer.core.recorder import Recorder

    url = f"sqlite:///{tmp_path / 'sw.db'}"
    db.upgrade(url)
    why = "loss spike at step 73, onset 71: back to step 60"
    with DbSink(url, spool_dir=tmp_path / "spool", linger_s=0.01) as sink:
        for tier, seconds in (("memory", 0.01), ("disk", 0.4)):  # the run, then its resume
            rec = Recorder(sink)
            rec.run_id = "r"
            sink.start_run("r")
            rec.on_rollback(60, {"step": 73, "reason": why, "tier": tier, "restore_s": seconds})
        sink.flush(timeout=10)
    with store.session_factory(url)() as s:
        rollbacks = store.events(s, run_id="r", kinds=["rollback"])
    assert len(rollbacks) == 1 and rollbacks[0].data["tier"] == "memory"
