"""A run that stops is noticed: the Watch in a plain loop whose batch function hangs records a
`stall` event whose stack names the hanging frame, alerts once to a local receiver, and records
`resumed` with the stall's length when steps end again; a long checkpoint and an evaluation
inside `watch.paused()` are no stall."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from sqlalchemy.orm import Session

from spikewatch import Watch
from spikewatch.corpus import text_corpus, windows
from spikewatch.observatory import store
from spikewatch.observatory.store.db import make_engine
from spikewatch.trainer.checkpoints.tiers import Tiers

from ..observatory.test_alerts import Receiver
from .conftest import example

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

FAST = {"guard": {"stall": {"min_s": 1.0, "factor": 10.0}}}  # steps of ~10 ms: a 1 s bound


def _run(
    tmp_path,
    hang_at: int | None = None,
    slow_eval_at: int | None = None,
    tick: Callable[[int], None] = lambda i: None,
    steps: int = 30,
) -> list:
    ex = example("plain_loop")
    torch.manual_seed(0)
    model = ex.GPT(32, 2, 4, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    db = f"sqlite:///{tmp_path / 'sw.db'}"
    watch = Watch(model, opt, run_dir=tmp_path / "run", db=db, max_steps=steps, settings=FAST)
    watch.cfg.checkpoint.interval = 10
    train, _ = text_corpus()

    def stuck_in_the_loader(i: int) -> None:
        time.sleep(3.5)  # a loader that does not return for a while

    def batch_at(i: int):
        if i == hang_at:
            stuck_in_the_loader(i)
        tick(i)
        return windows(train, i, 8, 32)

    for x, y in watch.batches(batch_at):
        loss = model(x, y)
        loss.backward()
        watch.step(loss)
        if watch.step_count == slow_eval_at:
            with watch.paused():
                time.sleep(3.5)  # an evaluation
    watch.close()
    with Session(make_engine(db)) as session:
        (run,) = store.list_runs(session)
        return store.events(session, run_id=run.run_id)


def test_a_hung_batch_function_is_a_stall_naming_its_frame_alerted_once(
    tmp_path, monkeypatch
) -> None:
    receiver = Receiver()
    receiver.start()
    monkeypatch.setenv("SPIKEWATCH_ALERT_URLS", receiver.url)
    try:
        events = _run(tmp_path, hang_at=20)
    finally:
        receiver.stop()
    (stall,) = [e for e in events if e.kind == "stall"]
    (resumed,) = [e for e in events if e.kind == "resumed"]
    assert stall.step == 20 and "stuck_in_the_loader" in stall.data["loop_stack"]
    # the bound is min_s (1 s) unless this machine's steps are slower than 0.1 s just now
    assert stall.data["bound_s"] >= 1.0 and stall.data["bound_s"] < stall.data["idle_s"] < 3.5
    assert resumed.step == 21 and resumed.data["stalled_s"] >= 3.5
    assert [b["kind"] for b in receiver.bodies] == ["stall"]
    assert "stall" in receiver.bodies[0]["text"]


def test_a_long_checkpoint_and_a_paused_evaluation_are_no_stall(tmp_path, monkeypatch) -> None:
    save = Tiers.save

    def slow_save(self, step, *args, **kwargs):
        if step == 20:
            time.sleep(3.5)  # slow storage
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(Tiers, "save", slow_save)
    events = _run(tmp_path, slow_eval_at=12)
    assert [e for e in events if e.kind in ("stall", "resumed")] == []


def test_an_hf_evaluation_is_no_stall(tmp_path) -> None:
    """The Trainer evaluates after step 6 for 3.5 s (its prediction step held up), with a 1 s
    bound: the callback leaves the evaluation out; the run records no stall."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from spikewatch.hf import SpikewatchCallback

    from .test_hf import _tiny_llama

    class SlowEvaluation(TrainerCallback):
        def on_prediction_step(self, args, state, control, **kw):  # noqa: ANN001
            time.sleep(3.5 / 2)  # two evaluation batches

    x = torch.randint(0, 256, (64, 16), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": r, "labels": r} for r in x]
    db = f"sqlite:///{tmp_path / 'sw.db'}"
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=10, eval_strategy="steps", eval_steps=6,
        per_device_train_batch_size=4, per_device_eval_batch_size=8, report_to=[],
        use_cpu=True, disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    watch = SpikewatchCallback(db=db, settings=FAST)
    trainer = Trainer(model=_tiny_llama(), args=args, train_dataset=rows, eval_dataset=rows[:16],
                      callbacks=[watch, SlowEvaluation()])  # fmt: skip
    trainer.train()
    with Session(make_engine(db)) as session:
        (run,) = store.list_runs(session)
        events = store.events(session, run_id=run.run_id)
    assert [e.kind for e in events if e.kind in ("stall", "resumed")] == []
    assert watch.summary is not None and watch.summary["steps"] == 10


def test_a_lightning_validation_is_no_stall(tmp_path) -> None:
    """Lightning validates after step 6 for 3.5 s (its validation step held up), with a 1 s
    bound: the callback leaves the validation out; the run records no stall."""
    pl = pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed")

    from spikewatch.lightning import SpikewatchCallback

    from .test_lightning import Bigram

    class SlowValidation(Bigram):
        def validation_step(self, batch: torch.Tensor, idx: int) -> None:
            time.sleep(3.5 / 2)  # two validation batches
            self.log("val_loss", self.training_step(batch, idx))

    g = torch.Generator().manual_seed(0)
    batches = list(torch.randint(0, 256, (80, 17), generator=g).split(8))
    db = f"sqlite:///{tmp_path / 'sw.db'}"
    cb = SpikewatchCallback(db=db, settings=FAST)
    trainer = pl.Trainer(
        max_steps=10, val_check_interval=6, check_val_every_n_epoch=None, limit_val_batches=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path),
        callbacks=[cb],
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    trainer.fit(SlowValidation(), loader, loader)
    with Session(make_engine(db)) as session:
        (run,) = store.list_runs(session)
        events = store.events(session, run_id=run.run_id)
    assert [e.kind for e in events if e.kind in ("stall", "resumed")] == []
    assert cb.summary is not None and cb.summary["steps"] == 10


def test_steps_that_slow_down_are_a_slowdown_alerted_once_and_its_end_said(
    tmp_path, monkeypatch
) -> None:
    """The watchdog on a clock the batch function moves (no timing in the test): 1 s a batch,
    3 s for batches 100-129 (steps 101-130). The median of the last 16 steps passes 1.5x the
    baseline at the 8th slow step (step 108: (1 + 3) / 2 = 2), and that has lasted 30 s at
    the 17th (step 117, the median 3 s): one `slowdown` event and one alert; the pace is back
    within 1.2x at the 9th normal one (step 139), a note says so; no stall (the clock stands
    still between batches)."""
    from spikewatch.trainer.core import step_core, watchdog

    now = [0.0]

    class Clocked(watchdog.Watchdog):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, clock=lambda: now[0], **kwargs)

    def tick(i: int) -> None:
        now[0] += 3.0 if 100 <= i < 130 else 1.0  # a throttled device, a slow filesystem

    monkeypatch.setattr(step_core, "Watchdog", Clocked)
    receiver = Receiver()
    receiver.start()
    monkeypatch.setenv("SPIKEWATCH_ALERT_URLS", receiver.url)
    try:
        events = _run(tmp_path, tick=tick, steps=170)
    finally:
        receiver.stop()
    (slowdown,) = [e for e in events if e.kind == "slowdown"]
    assert slowdown.step == 117 and slowdown.data["ratio"] == 3.0
    assert slowdown.data["since_step"] == 108 and slowdown.data["lasted_s"] == 30.0
    assert "since step 108 (30 s)" in slowdown.message
    (back,) = [e for e in events if e.kind == "note" and e.data.get("kind") == "pace_back"]
    assert back.step == 139 and back.data["since_step"] == 108
    assert [e for e in events if e.kind in ("stall", "resumed")] == []
    assert [b["kind"] for b in receiver.bodies] == ["slowdown"]


SCRIPT = """
import json, sys, time, torch
from spikewatch import Watch
from spikewatch.corpus import text_corpus, windows
sys.path.insert(0, sys.argv[3])
import plain_loop as ex

torch.manual_seed(0)
model = ex.GPT(32, 2, 4, 32)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
train, _ = text_corpus()
settings = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
with Watch(model, opt, run_dir=sys.argv[1], db=sys.argv[2], max_steps=100000,
           settings=settings) as watch:
    for x, y in watch.batches(lambda i: windows(train, i, 8, 32)):
        loss = model(x, y)
        loss.backward()
        watch.step(loss)
        if watch.step_count == 5:
            print("ready", flush=True)
        time.sleep(0.05)
"""


def test_a_watch_loop_stopped_with_sigterm_reads_stopped(tmp_path) -> None:
    """systemd, Kubernetes and schedulers stop a process with SIGTERM: a one-process Watch loop
    ends as with Ctrl-C and its run reads "stopped", not "running" for ever."""
    import os
    import signal
    import subprocess
    import sys

    from .conftest import REPO

    db = f"sqlite:///{tmp_path / 'sw.db'}"
    (tmp_path / "loop.py").write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "loop.py"), str(tmp_path / "run"), db,
         str(REPO / "examples")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert b"KeyboardInterrupt" in err, err.decode()[-2000:]
    with Session(make_engine(db)) as session:
        (run,) = store.list_runs(session)
    assert run.status == "stopped" and run.last_step is not None and run.last_step >= 5


def test_a_killed_run_reads_gone_on_the_api(tmp_path) -> None:
    """SIGKILL (as the out-of-memory killer does): no end record, no more heartbeats. Two
    heartbeat periods after the last one the API and the runs page say "gone"; before, live."""
    import datetime as dt
    import json
    import os
    import signal
    import subprocess
    import sys

    from fastapi.testclient import TestClient

    from spikewatch.web.app import create_app
    from spikewatch.web.settings import Settings

    from .conftest import REPO

    db = f"sqlite:///{tmp_path / 'sw.db'}"
    (tmp_path / "loop.py").write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    beat = {"guard": {"stall": {"heartbeat_s": 0.5}}}
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "loop.py"), str(tmp_path / "run"), db,
         str(REPO / "examples"), json.dumps(beat)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(1.5)  # a few heartbeats into the store
        with TestClient(create_app(Settings(db_url=db))) as client:
            (live,) = client.get("/api/runs").json()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert live["state"] == "live" and live["heartbeat_s"] == 0.5
    with Session(make_engine(db)) as session:
        (run,) = store.list_runs(session)
    assert run.status == "running" and run.heartbeat_at is not None  # nothing said it ended
    assert store.run_state(run, run.heartbeat_at + dt.timedelta(seconds=0.9)) == "live"
    time.sleep(max(0.0, (run.heartbeat_at - dt.datetime.now(dt.UTC)).total_seconds() + 1.1))
    with TestClient(create_app(Settings(db_url=db))) as client:
        (gone,) = client.get("/api/runs").json()
        page = client.get("/").text
    assert gone["state"] == "gone"
    assert 'class="state state-gone">gone' in page


@pytest.mark.slow  # ~30 s, two launches: `make test-slow`, keeping `make test` in budget
def test_a_hang_ends_the_process_and_torchrun_restarts_it_from_the_newest_checkpoint(
    tmp_path,
) -> None:
    """The whole loop the stall's hard bound is for: a loader hangs at batch 25, the stall is
    recorded, the process exits with EXIT_STALLED (75) two seconds on, `torchrun
    --max-restarts=1` starts it again and `resume="auto"` takes the newest checkpoint (step 25):
    the job ends with code 0 and the run completed, all 40 steps, the stall in its record."""
    import os
    import subprocess
    import sys

    from spikewatch.trainer.core.watchdog import EXIT_STALLED

    from .conftest import REPO

    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts=1",
              "--nproc_per_node=1"]  # fmt: skip
    cmd = [*launch, str(REPO / "tests/spikewatch/restart_script.py"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert f"exitcode: {EXIT_STALLED}" in log and "finished at step 40" in log, log[-3000:]
    assert "resumed run" in log and "at step 25 from its disk checkpoint" in log, log[-3000:]
    with Session(make_engine(f"sqlite:///{tmp_path}/runs.db")) as session:
        (run,) = store.list_runs(session)
        events = store.events(session, run_id=run.run_id)
    assert run.status == "completed" and run.last_step == 40
    (stall,) = [e for e in events if e.kind == "stall"]
    assert stall.step == 25 and "batch_at" in stall.data["loop_stack"]
