"""`Watch` in a plain PyTorch loop of the test's own: the weights right after a rollback, the
skipped batches, the refusal of non-finite updates, and a run in the store as the dashboard
reads it (recovery and resume of all three ways in: test_examples.py)."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from sqlalchemy.orm import Session

from spikewatch import Watch
from spikewatch.corpus import shift_labels, text_corpus, windows
from spikewatch.observatory import store
from spikewatch.observatory.store.db import make_engine
from spikewatch.trainer.config import ConfigError
from spikewatch.trainer.core.actions import Action, Continue, Rollback
from spikewatch.trainer.core.callbacks import Callback, StepState

from ..trainer.conftest import EventSink
from .conftest import (
    POISON,
    STEPS,
    assert_same_weights,
    example,
    run_example,
    the_rollback,
)

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("plain")
    db = f"sqlite:///{tmp / 'sw.db'}"
    return {
        "guarded": run_example("plain_loop", tmp / "guarded", *STEPS, *POISON, "--db", db),
        "db": {"url": db},
    }


def test_the_run_is_in_the_store_as_the_dashboard_reads_it(runs) -> None:
    session = Session(make_engine(runs["db"]["url"]))
    run_id = runs["guarded"]["run_id"]
    assert [r.run_id for r in store.list_runs(session)] == [run_id]
    templates = set(store.metric_names(session, run_id=run_id))
    assert {"layer/*/head/*/attn_max", "layer/*/attn/grad_norm", "train/loss"} <= templates
    kinds = [e.kind for e in store.events(session, run_id=run_id)]
    assert "spike" in kinds and "rollback" in kinds
    assert [b.fork_step for b in store.branches(session, run_id=run_id)][1:] == [
        the_rollback(runs["guarded"])["to_step"]
    ]


def _loop(tmp_path, poison: range = range(0), nan_at: int | None = None, steps: int = 130):
    """The example's model in a loop of our own, capturing the weights after every step."""
    ex = example("plain_loop")
    torch.manual_seed(0)
    model = ex.GPT(32, 2, 4, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    watch = Watch(model, opt, run_dir=tmp_path / "run", db="none", max_steps=steps)
    watch.cfg.checkpoint.interval = 10
    model.use_recorder(watch.attn)
    train, _ = text_corpus()
    states = {0: copy.deepcopy(model.state_dict())}
    drawn, events = [], []

    def batch_at(i: int):
        drawn.append(i)
        x, y = windows(train, i, 8, 32)
        return x, shift_labels(y) if i in poison else y

    for x, y in watch.batches(batch_at):
        before = copy.deepcopy(model.state_dict())
        loss = model(x, y)
        if watch.step_count + 1 == nan_at:
            loss = loss * math.nan
        loss.backward()
        outcome = watch.step(loss)
        events.append((watch.step_count, outcome, before, watch.index))
        states.setdefault(watch.step_count, copy.deepcopy(model.state_dict()))
    watch.close()
    return watch, states, drawn, events


def test_after_a_rollback_the_weights_are_those_the_target_step_had(tmp_path) -> None:
    watch, states, drawn, events = _loop(tmp_path, poison=range(100, 112))
    rolled = [(e[0], i) for i, e in enumerate(events) if e[1] == "rolled_back"]
    assert rolled, watch.interventions
    step, at = rolled[0]
    rb = the_rollback(watch.summary())
    assert step == rb["to_step"] < rb["onset_step"]
    # states[step] was captured in memory when the run first passed that step: not a file the
    # rollback could have rewritten
    restored = events[at + 1][2]  # the weights the next step started from
    assert_same_weights(restored, states[step])
    start, end = rb["skip_ranges"][0]
    assert not [e[3] for e in events[at + 1 :] if start <= e[3] < end]
    assert events[at + 1][3] > events[at][3]  # the data goes on: nothing is trained twice


def test_a_nonfinite_update_is_refused_before_the_optimizer_step(tmp_path) -> None:
    watch, states, _, events = _loop(tmp_path, nan_at=40, steps=45)
    step, outcome, before, _ = events[39]
    assert (step, outcome) == (40, "refused")
    for k, v in before.items():
        assert torch.equal(states[40][k], v), k
    assert watch.interventions[0]["reason"] == "non-finite loss or gradient"
    assert not torch.equal(states[41]["lm_head.weight"], states[40]["lm_head.weight"])


class _AskRollback(Callback):
    """A user's own callback: asks for a rollback at one step, and sees every step."""

    priority = 10

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, []

    def pre_update(self, state: StepState) -> Action:
        if state.step == self.at and not any(a == "rollback" for _, a in self.seen):
            return Rollback(to_step=self.at - 15, reason="the user's callback asked")
        return Continue()

    def post_step(self, state: StepState) -> None:
        self.seen.append((state.step, state.action))


def test_a_users_callback_is_heard_and_its_rollback_carried_out(tmp_path) -> None:
    ex = example("plain_loop")
    torch.manual_seed(0)
    model = ex.GPT(32, 2, 4, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cb = _AskRollback(at=40)
    train, _ = text_corpus()
    with Watch(
        model,
        opt,
        run_dir=tmp_path / "run",
        db="none",
        max_steps=50,
        checkpoint_every=10,
        callbacks=[cb],
    ) as watch:
        for x, y in watch.batches(lambda i: windows(train, i, 8, 32)):
            loss = model(x, y)
            loss.backward()
            watch.step(loss)
    (rb,) = watch.interventions
    assert rb["kind"] == "rollback" and rb["reason"] == "the user's callback asked"
    # step 25: in host memory (every 25 steps by default), newer than disk's step 20
    assert (rb["from_step"], rb["to_step"], rb["tier"]) == (40, 25, "memory")
    assert (40, "rollback") in cb.seen and watch.step_count == 50


def _plain(tmp_path, *, resume: bool | str, drawn: list[int] | None = None, **kw):
    ex = example("plain_loop")
    torch.manual_seed(0)
    model = ex.GPT(32, kw.pop("layers", 2), 4, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train, _ = text_corpus()
    sink, drawn = EventSink(), drawn if drawn is not None else []
    with Watch(
        model, opt, run_dir=tmp_path / "run", sink=sink, checkpoint_every=10, resume=resume, **kw
    ) as watch:
        for x, y in watch.batches(lambda i: drawn.append(i) or windows(train, i, 8, 32)):
            loss = model(x, y)
            loss.backward()
            watch.step(loss)
    return watch, sink


def test_a_resume_may_change_what_a_halt_advises_and_nothing_else(tmp_path) -> None:
    _plain(tmp_path, resume=False, max_steps=20, grad_clip=1.0)
    watch, sink = _plain(tmp_path, resume=True, max_steps=30, grad_clip=0.5)
    assert watch.step_count == 30
    (change,) = [d for k, _, d in sink.events if k == "note" and d.get("kind") == "config_change"]
    assert change["changes"]["max_steps"] == [20, 30]
    assert change["changes"]["grad_clip"] == [1.0, 0.5]
    assert sorted(change["changes"]) == ["grad_clip", "max_steps"]  # each once (one name)
    with pytest.raises(ConfigError, match="model.n_layer"):
        _plain(tmp_path, resume=True, max_steps=40, layers=3)


def test_resume_auto_starts_in_an_empty_directory_and_resumes_a_full_one(tmp_path) -> None:
    first, _ = _plain(tmp_path, resume="auto", max_steps=20)
    assert first.step_count == 20 and first.run_dir == tmp_path / "run"
    drawn: list[int] = []
    again, _ = _plain(tmp_path, resume="auto", max_steps=30, drawn=drawn)
    assert again.step_count == 30 and again.run_id == first.run_id
    assert drawn == list(range(20, 30))  # it went on from step 20: no step was trained twice
    with pytest.raises(ValueError, match="'auto'"):
        _plain(tmp_path, resume="yes", max_steps=30)


def test_the_old_watch_section_is_read_as_guard() -> None:
    from spikewatch.trainer.config import WatchSettings, load_config

    assert not WatchSettings.build({"watch": {"rollback": False}}).guard.rollback
    assert not load_config(None, ["watch.rollback=false"]).guard.rollback


def test_the_watch_says_where_its_checkpoints_go_how_many_and_how_big(tmp_path, caplog) -> None:
    ex = example("plain_loop")
    model = ex.GPT(32, 2, 4, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    params = sum(p.numel() * 4 for p in model.parameters())  # fp32
    budget_mb = 2.5 * 3 * params / 2**20  # room for two snapshots of weights + Adam's m and v
    settings = {"checkpoint": {"memory_interval": 5, "memory_budget_mb": budget_mb}}
    with caplog.at_level("INFO", logger="spikewatch.trainer"):
        watch = Watch(
            model, opt, max_steps=100, settings=settings, sink=EventSink(), run_dir=tmp_path
        )
        watch.open()
    (line,) = [m for m in caplog.messages if m.startswith("rollback checkpoints:")]
    size = f"~{3 * params / 2**10:,.1f} KB each"  # Adam's moments counted before they exist
    assert f"host memory every 5 steps, {size}, at most 2 kept" in line
    where = tmp_path / "checkpoints"
    assert f"disk every 100 steps in {where}, written in the background, {size}" in line
    assert line.endswith("at most 1 kept")


def test_at_the_users_info_the_watch_starts_in_two_lines(tmp_path, caplog) -> None:
    """Where its checkpoints go and where the run is recorded; nothing of its internals (the
    read path on a CPU, the store's migrations) in the user's log."""
    ex = example("plain_loop")
    model = ex.GPT(32, 2, 4, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    settings = {"probes": {"attn_max": False}}
    with caplog.at_level("INFO"):
        watch = Watch(model, opt, max_steps=10, settings=settings, run_dir=tmp_path / "run",
                      db=f"sqlite:///{tmp_path / 'sw.db'}")  # fmt: skip
        watch.open()
        watch.close()
    opened = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    opened = [m for m in opened if " stopped at step 0 of 10" not in m]  # (the end's line)
    assert len(opened) == 2, "\n".join(opened)
    assert opened[0].startswith("rollback checkpoints:") and " is recorded in sqlite:" in opened[1]
