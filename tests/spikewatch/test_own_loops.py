"""The Watch in loops we did not write, shaped like nanoGPT's train.py: a random-window sampler
on torch's global RNG that ignores the batch index, the loop's own schedule."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from spikewatch import AdamW, Watch
from spikewatch.corpus import text_corpus
from spikewatch.observatory.store.sink import NullSink
from spikewatch.trainer.core.actions import Action, Continue, Rollback
from spikewatch.trainer.core.callbacks import Callback, StepState

from .conftest import example

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


class _RollbackAt(Callback):
    def __init__(self, at: int, to: int) -> None:
        self.at, self.to, self.done = at, to, False

    def on_step(self, state: StepState) -> Action:
        if state.step == self.at and not self.done:
            self.done = True
            return Rollback(to_step=self.to, reason="test")
        return Continue()


def _random_windows(data: torch.Tensor, rows: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's get_batch: offsets from torch's global RNG, whatever the step."""
    ix = torch.randint(len(data) - t - 1, (rows,))
    x = torch.stack([data[i : i + t] for i in ix]).long()
    y = torch.stack([data[i + 1 : i + 1 + t] for i in ix]).long()
    return x, y


def test_a_rollback_does_not_draw_again_what_a_global_rng_sampler_drew(tmp_path) -> None:
    """A rollback restores weights and optimizer, not the data's randomness: the windows a
    random sampler drew for the discarded steps are not drawn again after it (before, the
    restored RNG re-drew exactly the windows of the steps after the target)."""
    ex = example("plain_loop")
    torch.manual_seed(0)
    model = ex.GPT(32, 2, 4, 32)
    opt = AdamW(model.parameters(), lr=1e-3)
    train, _ = text_corpus()
    settings = {"checkpoint": {"memory_interval": 10, "interval": None}}
    watch = Watch(model, opt, run_dir=tmp_path, db="none", max_steps=40, settings=settings,
                  callbacks=[_RollbackAt(25, 20)])  # fmt: skip
    drawn: list[tuple[int, torch.Tensor]] = []
    with watch:
        while not watch.should_stop:
            x, y = _random_windows(train, 4, 32)
            drawn.append((watch.step_count, x))
            watch.begin_step()
            watch.step(model(x, y))
    (rb,) = [i for i in watch.interventions if i["kind"] == "rollback"]
    assert (rb["from_step"], rb["to_step"]) == (25, 20)
    before = [x for s, x in drawn[:25] if s >= 20]  # drawn for steps 21..25, then discarded
    after = [x for _, x in drawn[25:]]
    assert len(before) == 5 and after
    assert not any(torch.equal(a, b) for a in after for b in before)


def _draws(run_dir: Any, steps: int, kill_at: int | None) -> list[torch.Tensor]:
    ex = example("plain_loop")
    torch.manual_seed(0)
    model = ex.GPT(32, 2, 4, 32)
    opt = AdamW(model.parameters(), lr=1e-3)
    train, _ = text_corpus()
    settings = {"checkpoint": {"memory_interval": None, "interval": 10}}
    watch = Watch(model, opt, run_dir=run_dir, db="none", max_steps=steps, settings=settings,
                  resume="auto")  # fmt: skip
    out = []
    with watch:
        while not watch.should_stop:
            if kill_at is not None and watch.step_count == kill_at:
                break
            x, y = _random_windows(train, 4, 32)
            out.append(x)
            watch.begin_step()
            watch.step(model(x, y))
    return out


def test_a_resume_after_a_kill_still_draws_what_the_uninterrupted_run_drew(tmp_path) -> None:
    """A resume takes the RNGs back: the same random windows as the uninterrupted run."""
    whole = _draws(tmp_path / "a", 30, None)
    _draws(tmp_path / "b", 30, kill_at=20)  # stopped at 20, checkpoint at 20
    again = _draws(tmp_path / "b", 30, None)
    assert len(again) == 10
    assert all(torch.equal(a, b) for a, b in zip(again, whole[20:], strict=True))


class _Kept(NullSink):
    """A sink that keeps the events and statuses it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []
        self.statuses: list[str] = []

    def log_event(self, run_id: str, kind: str, **kw: Any) -> None:  # type: ignore[override]
        self.events.append((kind, str(kw.get("message", ""))))
        super().log_event(run_id, kind, **kw)

    def set_status(self, run_id: str, status: str) -> None:
        self.statuses.append(status)
        super().set_status(run_id, status)


def _run(run_dir: Any, steps: int, stop_at: int | None = None, sink: Any = None) -> Watch:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = AdamW(model.parameters(), lr=1e-3)
    settings = {"checkpoint": {"memory_interval": None, "interval": 5}}
    watch = Watch(model, opt, run_dir=run_dir, db="none", max_steps=steps, settings=settings,
                  resume="auto", sink=sink)  # fmt: skip
    with watch:
        while not watch.should_stop and watch.step_count != stop_at:
            watch.begin_step()
            watch.step(model(torch.ones(2, 4)).square().mean())
    return watch


def test_a_fresh_start_is_a_new_run_whatever_its_directory_is_called(tmp_path) -> None:
    """Runs are not named by their directory's last folder (nanoGPT's out_dir + "/spikewatch"
    named every run "spikewatch", and a fault run merged into the clean run's record)."""
    a = _run(tmp_path / "clean" / "spikewatch", 5)
    b = _run(tmp_path / "fault" / "spikewatch", 5)
    assert a.run_id != b.run_id and a.run_id.startswith("run-")


@pytest.fixture
def said(caplog, monkeypatch):  # noqa: ANN001, ANN201
    """What spikewatch says at INFO, whatever an earlier test (the CLI's) set up for its logger."""
    pkg = logging.getLogger("spikewatch")
    monkeypatch.setattr(pkg, "propagate", True)
    monkeypatch.setattr(pkg, "handlers", [])
    caplog.set_level(logging.INFO, logger="spikewatch")
    return caplog


def test_running_again_after_a_finished_run_starts_a_new_run_beside_it(tmp_path, said) -> None:
    caplog = said
    first = _run(tmp_path / "out", 10)
    again = _run(tmp_path / "out", 10)
    text = caplog.text
    assert again.run_dir == tmp_path / "out-2" and again.step_count == 10
    assert again.run_id != first.run_id
    assert f"run {first.run_id} in {tmp_path / 'out'} ended (completed) at step 10" in text
    assert f"a new run starts in {tmp_path / 'out-2'}" in text


def test_an_early_end_is_said_and_a_resume_is_said_and_logged(tmp_path, said) -> None:
    caplog = said
    sink = _Kept()
    stopped = _run(tmp_path / "out", 20, stop_at=10, sink=sink)
    assert sink.statuses == ["stopped"]
    assert f"run {stopped.run_id} stopped at step 10 of 20" in caplog.text
    caplog.clear()
    sink = _Kept()
    resumed = _run(tmp_path / "out", 20, sink=sink)  # a stopped run resumes where it was
    text = caplog.text
    assert resumed.run_id == stopped.run_id and resumed.step_count == 20
    assert text.count("resumed run") == 1
    assert f"resumed run {stopped.run_id} at step 10 from its disk checkpoint" in text
    assert (
        "note",
        f"resumed at step 10 from {tmp_path / 'out' / 'checkpoints' / 'step00000010'}",
    ) in sink.events
    assert sink.statuses == ["completed"]


def test_spikewatch_runs_lists_the_runs_and_logbook_takes_a_run_directory(tmp_path, capsys) -> None:
    """`spikewatch runs`: name, status, steps, spikes, rollbacks, where; `spikewatch logbook
    DIR` finds the run a directory holds (a directory is no longer named after its run)."""
    import json

    from spikewatch.trainer.cli import main

    db = f"sqlite:///{tmp_path / 'store.db'}"
    torch.manual_seed(0)
    runs = []
    for stop in (None, 4):
        model = torch.nn.Linear(4, 1)
        w = Watch(model, AdamW(model.parameters(), lr=1e-3), db=db, max_steps=8,
                  run_dir=tmp_path / f"r{stop}", name="lin")  # fmt: skip
        with w:
            while not w.should_stop and w.step_count != stop:
                w.begin_step()
                w.step(model(torch.ones(2, 4)).square().mean())
        runs.append(w)
    capsys.readouterr()
    assert main(["runs", "--db", db, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    got = {r["run_id"]: (r["status"], r["state"], r["steps"], r["run_dir"]) for r in listed["runs"]}
    assert got == {
        runs[0].run_id: ("completed", "completed", 8, str(tmp_path / "rNone")),
        runs[1].run_id: ("stopped", "stopped", 4, str(tmp_path / "r4")),
    }
    assert main(["runs", "--db", db]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("2 runs in sqlite:///") and table[1].split()[:3] == [
        "run",
        "state",
        "steps",
    ]
    assert main(["logbook", str(tmp_path / "r4"), "--db", db]) == 0
    assert runs[1].run_id in capsys.readouterr().out


def test_the_final_evaluation_after_the_block_is_recorded(tmp_path) -> None:
    """An accelerate loop evaluates after training: `log_eval` after the `with` block raised
    "sink is closed" and the script crashed before saving its model."""
    from sqlalchemy import create_engine, text

    db = f"sqlite:///{tmp_path / 'store.db'}"
    model = torch.nn.Linear(4, 1)
    with Watch(model, AdamW(model.parameters(), lr=1e-3), db=db, max_steps=5,
               run_dir=tmp_path / "run") as watch:  # fmt: skip
        while not watch.should_stop:
            watch.begin_step()
            watch.step(model(torch.ones(2, 4)).square().mean())
    watch.log_eval(1.25)
    assert watch.summary()["final_val_loss"] == 1.25
    engine = create_engine(db)
    with engine.connect() as conn:
        names = conn.execute(text("SELECT name FROM metric_names")).scalars().all()
    engine.dispose()
    assert "val/loss" in names


def test_an_exception_before_the_first_step_surfaces_as_itself_and_fails_the_run(
    tmp_path,
) -> None:
    """The loop's own error (here a DataLoader given where `batches` wants a function) is what
    the user sees, not the Watch's exit's "run id must be a printable str" on top of it."""
    sink = _Kept()
    model = torch.nn.Linear(4, 1)
    with pytest.raises(ValueError, match="the loop's own"):
        with Watch(model, AdamW(model.parameters(), lr=1e-3), run_dir=tmp_path, sink=sink):
            raise ValueError("the loop's own")
    assert sink.statuses == ["failed"]


def test_at_the_users_info_spikewatch_starts_in_its_own_lines(tmp_path, caplog) -> None:
    """A user's log at INFO: a new store's migrations (Alembic's ~15 lines) stay below it."""
    caplog.set_level(logging.INFO)
    alembic = logging.getLogger("alembic")
    before = alembic.level
    alembic.setLevel(logging.NOTSET)  # as a program that never set it (an earlier test may have)
    model = torch.nn.Linear(4, 1)
    watch = Watch(model, AdamW(model.parameters(), lr=1e-3), run_dir=tmp_path / "run",
                  db=f"sqlite:///{tmp_path / 'new.db'}", max_steps=2)  # fmt: skip
    with watch:
        while not watch.should_stop:
            watch.begin_step()
            watch.step(model(torch.ones(2, 4)).square().mean())
    try:
        assert not [r for r in caplog.records if r.name.startswith("alembic")]
        assert alembic.level == logging.NOTSET  # the user's to set, as it was
    finally:
        alembic.setLevel(before)


@pytest.mark.parametrize("read", ["same_step", "next_step"])  # next_step: a GPU's default
def test_the_guard_is_armed_right_after_a_rollback_that_reached_far_back(
    tmp_path, said, read: str
) -> None:
    """A rollback further back than the detector's window used to leave it with too few
    points to judge (blind for its first steps, and taking them into its level): now its
    statistics are the restored checkpoint's. Bad data right after the rollback is detected
    as it would be anywhere else."""
    ex = example("plain_loop")
    torch.manual_seed(0)
    model = ex.GPT(32, 2, 4, 32)
    opt = AdamW(model.parameters(), lr=3e-3)
    train, _ = text_corpus()
    settings = {"checkpoint": {"memory_interval": 10, "interval": None},
                "guard": {"same_step": {"enabled": False}}, "probes": {"read": read}}  # fmt: skip
    forced = _RollbackAt(150, 80)  # the window (64 points) then holds steps 87..150
    watch = Watch(model, opt, run_dir=tmp_path, db="none", max_steps=170, settings=settings,
                  callbacks=[forced])  # fmt: skip
    spoil = 4  # the first batches after it
    with watch:
        while not watch.should_stop:
            x, y = _random_windows(train, 8, 32)
            if forced.done and spoil:
                y, spoil = (y + 1) % 256, spoil - 1  # spoilt labels
            watch.begin_step()
            loss = model(x, y)
            loss.backward()
            watch.step(loss)
    to = [i["to_step"] for i in watch.interventions if i["kind"] == "rollback"][0]
    assert to <= 80
    spikes = [v for v in watch.guard.verdicts if v["kind"] == "spike" and v["onset_step"] > to]
    assert spikes and spikes[0]["onset_step"] <= to + 2, watch.guard.verdicts
    # the loop's own counter is told once, at the first rollback, where the step now is
    told = [r.message for r in said.records if "takes them from watch.step_count" in r.message]
    assert told == [f"the run's step is now {to} (rolled back): a loop that counts its own steps "
                    "(its LR schedule, evaluations, checkpoint names, its end) takes them from "
                    "watch.step_count"]  # fmt: skip


def test_two_saved_states_the_newer_wins_and_it_is_said(tmp_path, said) -> None:
    """The Watch's own checkpoints in its directory and a framework's copy of its state
    (`state=`): it resumes from the newer and says which and why."""
    _run(tmp_path / "a", 30, stop_at=10)  # its own checkpoints, up to step 10
    given = _run(tmp_path / "b", 30, stop_at=20).state_dict()  # a framework's, at step 20
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    watch = Watch(model, AdamW(model.parameters(), lr=1e-3), run_dir=tmp_path / "a", db="none",
                  max_steps=30, resume="auto", state=given,
                  settings={"checkpoint": {"memory_interval": None, "interval": 5}})  # fmt: skip
    watch.open()
    assert watch.step_count == 20
    line = ("two saved states: the Watch's own checkpoint at step 10 and the state given "
            "(state=) at step 20; resuming from the state given, the newer")  # fmt: skip
    assert line in said.text
    watch.close()


def test_a_resume_keeps_what_the_process_before_did_past_its_checkpoint_as_a_branch(
    tmp_path, said
) -> None:
    """A process that ends between two checkpoints (killed, or crashed as here) leaves steps
    in the record that the resume trains again: they stay as they were, an abandoned branch
    forked at the restored step, as a rollback's; the resume goes on in a branch of its own,
    and its one line says how far the process before got."""
    from sqlalchemy.orm import Session

    from spikewatch.observatory import store
    from spikewatch.observatory.store.db import make_engine

    db = f"sqlite:///{tmp_path / 'sw.db'}"
    settings = {"checkpoint": {"memory_interval": None, "interval": 5}}

    def loop(crash_at: int | None) -> Watch:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = AdamW(model.parameters(), lr=1e-3)
        watch = Watch(model, opt, run_dir=tmp_path / "out", db=db, max_steps=20,
                      settings=settings, resume="auto")  # fmt: skip
        with watch:
            while not watch.should_stop:
                if watch.step_count == crash_at:
                    raise RuntimeError("the node went away")
                watch.begin_step()
                watch.step(model(torch.ones(2, 4)).square().mean())
        return watch

    with pytest.raises(RuntimeError, match="node went away"):
        loop(crash_at=13)  # checkpoints at 5 and 10; steps 11-13 recorded past the last
    said.clear()
    resumed = loop(crash_at=None)
    assert resumed.step_count == 20
    (line,) = [m for m in said.messages if m.startswith("resumed run")]
    assert line.endswith(
        "the process before recorded steps up to 13: 3 steps at least trained again (its points "
        "stay in the record as an abandoned branch)"
    )
    with Session(make_engine(db)) as s:
        run = resumed.core.run.run_id
        forks = [(b.number, b.parent, b.fork_step) for b in store.branches(s, run_id=run)]
        own = {
            d.branch: [b.start for b in d.buckets]
            for d in store.series(s, run_id=run, metric="train/loss", branch="all")
        }
        notes = [e.message for e in store.events(s, run_id=run, kinds=["note"])]
    assert forks == [(0, None, None), (1, 0, 10)]
    assert own == {0: list(range(1, 14)), 1: list(range(11, 21))}  # the crashed process's kept
    assert any("the process before recorded steps up to 13" in n for n in notes)


def test_a_bad_batch_in_a_new_runs_first_descent_is_refused(tmp_path) -> None:
    """A new user's first run: 90 steps of a small GPT whose loss is still falling fast, two
    batches of garbage labels at steps 60 and 61 (as a new user's Qwen2 on two ranks met them
    at step 76, 2.8x its loss, and trained on both). Each is refused on its own step; the
    window's deviation, widened by the descent, let them through."""
    ex = example("plain_loop")
    torch.manual_seed(0)
    model = ex.GPT(32, 2, 4, 32)
    opt = AdamW(model.parameters(), lr=3e-3)
    train, _ = text_corpus()
    settings = {"checkpoint": {"memory_interval": 25, "interval": None}}
    watch = Watch(model, opt, run_dir=tmp_path, db="none", max_steps=90, settings=settings)
    g = torch.Generator().manual_seed(1)
    with watch:
        while not watch.should_stop:
            x, y = _random_windows(train, 8, 32)
            if watch.step_count + 1 in (60, 61):
                y = torch.randint(0, 256, y.shape, generator=g)  # garbage labels
            watch.begin_step()
            loss = model(x, y)
            loss.backward()
            watch.step(loss)
    refused = [(i["kind"], i["step"]) for i in watch.interventions]
    assert refused == [("skip_update", 60), ("skip_update", 61)], watch.interventions
