"""`Watch` in a plain PyTorch loop (examples/plain_loop.py): detection, rollback to a retained
pre-onset checkpoint, skipped batches, refusal of non-finite updates, bit-exact resume after
SIGKILL, and the run in the store as the dashboard reads it."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from sqlalchemy.orm import Session

from observatory import store
from observatory.db import make_engine
from spikewatch import Watch
from spikewatch.corpus import shift_labels, text_corpus, windows

from .conftest import (
    POISON,
    STEPS,
    assert_same_weights,
    example,
    final_weights,
    kill_when,
    launch,
    run_example,
    the_rollback,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("plain")
    db = f"sqlite:///{tmp / 'sw.db'}"
    return {
        "clean": run_example("plain_loop", tmp / "clean", *STEPS, "--db", "none"),
        "guarded": run_example("plain_loop", tmp / "guarded", *STEPS, *POISON, "--db", db),
        "unguarded": run_example(
            "plain_loop", tmp / "unguarded", *STEPS, *POISON, "--no-rollback", "--db", "none"
        ),
        "db": {"url": db},
    }


def test_a_poisoned_region_is_rolled_back_and_the_run_recovers(runs) -> None:
    clean, guarded, unguarded = runs["clean"], runs["guarded"], runs["unguarded"]
    rb = the_rollback(guarded)
    assert 100 < rb["onset_step"] <= 106  # batch 100 is trained as step 101
    assert rb["to_step"] < rb["onset_step"]
    (start, end), *_ = rb["skip_ranges"]
    assert start <= 100 < end
    assert guarded["steps"] == clean["steps"] == 150
    assert not unguarded["interventions"]
    assert guarded["final_val_loss"] <= clean["final_val_loss"] * 1.02
    assert unguarded["final_val_loss"] >= clean["final_val_loss"] * 1.02


def test_probes_are_named_by_the_models_modules(runs) -> None:
    names = set(runs["guarded"]["metric_names"])
    assert {"layer/0/head/3/attn_max", "layer/1/attn_max", "train/loss"} <= names
    assert {"layer/0/attn/grad_norm", "layer/1/mlp/grad_norm", "layer/wte/grad_norm"} <= names
    assert "layer/0/attn/update_ratio" in names and "layer/0/attn/adam_sqrt_v_max" in names


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
        states[watch.step_count] = copy.deepcopy(model.state_dict())
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


def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path) -> None:
    args = ("--steps", "60", "--checkpoint-every", "5", "--db", "none", *POISON[:1], "30")
    whole = tmp_path / "whole"
    ref = run_example("plain_loop", whole, *args, "--run-dir", "run")
    killed = tmp_path / "killed"
    proc = launch("plain_loop", killed, *args, "--run-dir", "run")
    mark = killed / "run" / "checkpoints" / "step00000040" / "meta.json"
    kill_when(proc, mark.exists)
    resumed = run_example("plain_loop", killed, *args, "--resume", "run")
    assert resumed["run_id"] == ref["run_id"] == "run"
    assert resumed["final_train_loss"] == ref["final_train_loss"]
    assert resumed["final_val_loss"] == ref["final_val_loss"]
    assert [i["to_step"] for i in resumed["interventions"]] == [
        i["to_step"] for i in ref["interventions"]
    ]
    assert_same_weights(final_weights(killed / "run"), final_weights(whole / "run"))
