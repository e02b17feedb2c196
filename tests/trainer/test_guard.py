"""End to end on CPU: a poisoned region makes a real spike; the guard rolls back and skips."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from spikewatch.trainer.builtin.loop import build_trainer, fit
from spikewatch.trainer.checkpoints import format as ck
from spikewatch.trainer.config import load_config
from spikewatch.trainer.core.guard import regime_steps
from spikewatch.trainer.core.recorder import Recorder

from .conftest import EventSink

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

BASE = [  # the rollback tier (the same-step tier, which acts first, has test_same_step.py)
    "guard.same_step.enabled=false",
    "train.progress=false",
    "checkpoint.interval=10",
    "train.max_steps=220",
    "eval.interval=none",
    "eval.batches=8",
]
FAULT = 'faults=[{kind="shifted_labels", start=150, length=10}]'


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guard")
    guarded = build_trainer(load_config("tiny_cpu", [*BASE, FAULT]), run_dir=tmp / "guarded")
    weights_after: dict = {}
    first_pass: dict[int, dict] = {}  # step -> weights when the run first reached that step
    orig, orig_save = guarded.core.rollback, guarded.core.save

    def spy(action):
        orig(action)
        weights_after.update({k: v.clone() for k, v in guarded.model.state_dict().items()})

    def capture(*args):
        if guarded.step_count not in first_pass:
            first_pass[guarded.step_count] = {
                k: v.clone() for k, v in guarded.model.state_dict().items()
            }
        orig_save(*args)

    guarded.core.rollback, guarded.core.save = spy, capture  # type: ignore[method-assign]
    return {
        "guarded": guarded.fit(),
        "weights_after": weights_after,
        "first_pass": first_pass,
        "ckpt_dir": tmp / "guarded" / "checkpoints",
        "off": fit(
            load_config("tiny_cpu", [*BASE, FAULT, "guard.rollback=false"]), run_dir=tmp / "off"
        ),
        "clean": fit(load_config("tiny_cpu", BASE), run_dir=tmp / "clean"),
        "tmp": tmp,
    }


def test_detector_fires_and_rolls_back_to_before_the_onset(runs) -> None:
    (iv,) = runs["guarded"].interventions
    assert iv["kind"] == "rollback"
    assert iv["onset_step"] == 151  # batch 150 is trained at step 151
    assert iv["to_step"] < iv["onset_step"] <= iv["detect_step"] <= 155
    start, end = iv["skip_ranges"][0]
    assert start <= 150 and end >= 160  # the whole poisoned region is skipped
    (outcome,) = runs["guarded"].extra["outcomes"]  # the guard's, for its rollback
    assert outcome["outcome"] == "recovered" and outcome["detect_step"] == iv["detect_step"]
    kinds = [v["kind"] for v in runs["guarded"].extra["verdicts"]]
    assert "spike" in kinds


def test_weights_after_rollback_equal_the_state_the_run_had_at_the_target(runs) -> None:
    """Compared with the weights held in memory when the run first passed the target step, not
    with the checkpoint file, which the rollback itself rewrites."""
    iv = runs["guarded"].interventions[0]
    before = runs["first_pass"][iv["to_step"]]
    for k, v in before.items():
        assert torch.equal(runs["weights_after"][k], v), k
    path = ck.step_dir(runs["ckpt_dir"], iv["to_step"])
    assert "rollback target" in ck.read_meta(path)["pins"]


def test_continued_losses_equal_a_run_that_skipped_from_the_start(runs) -> None:
    start, end = runs["guarded"].interventions[0]["skip_ranges"][0]
    tr = build_trainer(load_config("tiny_cpu", [*BASE, FAULT]), run_dir=runs["tmp"] / "skip")
    tr.core.run.data.add_skip(start, end)
    skipped = tr.fit()
    assert skipped.train_losses == runs["guarded"].train_losses
    assert skipped.final_val_loss == runs["guarded"].final_val_loss


def test_the_fault_is_real_and_the_rollback_repairs_it(runs) -> None:
    clean, guarded, off = (runs[k].final_val_loss for k in ("clean", "guarded", "off"))
    assert off > clean * 1.02  # without rollback the harm lasts
    assert guarded < clean * 1.02
    assert runs["clean"].interventions == []


@pytest.mark.slow  # its rule is in the fast tier: test_guard_rules.py
def test_repeated_faults_escalate_then_halt(tmp_path) -> None:
    faults = ", ".join(
        f'{{kind="shifted_labels", start={s}, length=12}}' for s in (100, 140, 180, 215)
    )
    cfg = load_config(
        "tiny_cpu",
        [
            *BASE,
            f"faults=[{faults}]",
            "train.max_steps=250",
            "guard.policy.max_rollbacks=2",
            "guard.policy.skip_extra=2",
        ],
    )
    r = fit(cfg, run_dir=tmp_path)
    kinds = [i["kind"] for i in r.interventions]
    assert kinds[:2] == ["rollback", "rollback"] and kinds[-1] == "halt"
    # the replays find the data (the same batches spike again): skipping is the cure, no LR cut
    assert [i["cause"] for i in r.interventions[:2]] == ["data_x_state"] * 2
    assert r.interventions[1]["lr_scale"] == 1.0
    assert r.halted and "rollbacks within" in r.halted and r.steps < 250
    assert r.summary()["halted"] == r.halted


def test_regime_steps_come_from_the_config() -> None:
    cfg = load_config("demo", ["schedule.name=wsd", "schedule.decay_fraction=0.25"])
    assert regime_steps(cfg) == [200, 301]


def test_replay_tells_data_spikes_from_transient_ones(runs, tmp_path) -> None:
    assert runs["guarded"].interventions[0]["cause"] == "data_x_state"
    flaky = 'faults=[{kind="flaky_lr_scale", start=150, length=3}]'
    r = fit(load_config("tiny_cpu", [*BASE, flaky]), run_dir=tmp_path)
    (iv,) = r.interventions
    assert iv["cause"] == "transient"
    assert iv["replay_peak_loss"] < iv["peak_loss"]


def test_detector_state_survives_a_resume(tmp_path) -> None:
    cfg = [*BASE, FAULT]
    straight = fit(load_config("tiny_cpu", cfg), run_dir=tmp_path / "a")
    fit(load_config("tiny_cpu", [*cfg, "train.stop_after=100"]), run_dir=tmp_path / "b")
    resumed = fit(load_config("tiny_cpu", cfg), run_dir=tmp_path / "b", resume=True)
    assert resumed.train_losses == straight.train_losses[100:]
    keys = ("onset_step", "detect_step", "to_step", "skip_ranges")
    assert [{k: i[k] for k in keys} for i in resumed.interventions] == [
        {k: i[k] for k in keys} for i in straight.interventions
    ]


@pytest.mark.slow  # its rule is in the fast tier: test_guard_rules.py
def test_repeated_nonfinite_steps_are_refused_then_rolled_back(tmp_path) -> None:
    nan = 'faults=[{kind="nan_loss", start=100, length=3}]'
    r = fit(load_config("tiny_cpu", [*BASE, nan]), run_dir=tmp_path)
    kinds = [(i["kind"], i["step"]) for i in r.interventions]
    assert kinds[0] == ("skip_update", 101)
    assert kinds[1] == ("rollback", 102)
    start, end = r.interventions[1]["skip_ranges"][0]
    assert start <= 100 and end >= 103  # the non-finite batches are skipped
    assert all(math.isfinite(v) for v in r.train_losses) and r.steps == 220


def test_a_warning_never_cancels_a_rollback(tmp_path) -> None:
    """A high attention logit warns on every step; the spike's rollback must still happen."""
    cfg = [*BASE, FAULT, "guard.detector.attn_warn=0.5"]
    r = fit(load_config("tiny_cpu", cfg), run_dir=tmp_path)
    assert [i["kind"] for i in r.interventions] == ["rollback"]
    warnings = [(v["step"], v["signal"]) for v in r.extra["verdicts"] if v["kind"] == "warning"]
    # one per episode, not one per step: each layer's logits once, the gradient norm before
    # the rollback, and each layer's again on the branch after it
    assert warnings == [
        (20, "layer/0/attn_max"),
        (27, "layer/1/attn_max"),
        (151, "grad_norm"),
        (141, "layer/0/attn_max"),
        (141, "layer/1/attn_max"),
    ]


def test_a_lasting_warning_does_not_pin_every_checkpoint(tmp_path) -> None:
    from spikewatch.trainer.checkpoints import format as ck

    cfg = [
        "train.progress=false",
        "checkpoint.interval=1",
        "train.max_steps=60",
        "eval.interval=none",
        "guard.detector.attn_warn=0.01",
    ]
    fit(load_config("tiny_cpu", cfg), run_dir=tmp_path)
    # the exponential retention schedule's own checkpoints: none kept for a warning (a pin)
    assert sorted(ck.list_checkpoints(tmp_path / "checkpoints")) == [0, 32, 48, 56, 58, 59, 60]


# its rule is in the fast tier: test_guard_rules.py (a spike that comes back is taken for a new
# level), test_policy.py (a level that returns where the skip ends is accepted)
@pytest.mark.slow
@pytest.mark.parametrize("tier", ["true", "false"])
def test_an_unannounced_new_level_is_accepted_after_it_persists(tmp_path, tier) -> None:
    """From batch 150 on the data changes for good (random bytes: a new, higher plateau the
    trainer was not told about). The guard rolls back, meets the same level where the skipped
    batches end, rolls back again (no LR cut: the replay finds the data), meets it again: a new
    level, not a spike. The run goes on to its last step at its LR, and says so in the store.
    With the same-step tier on, the first updates at the new level are refused as well."""
    fault = 'faults=[{kind="random_bytes", start=150, length=100000}]'
    sink = EventSink()
    cfg = load_config("tiny_cpu", [*BASE, fault, f"guard.same_step.enabled={tier}"])
    tr = build_trainer(cfg, run_dir=tmp_path, callbacks=[Recorder(sink)])
    r = tr.fit()
    rollbacks = [i for i in r.interventions if i["kind"] == "rollback"]
    assert len(rollbacks) == 2 and rollbacks[1]["lr_scale"] == 1.0, r.interventions
    assert not [i for i in r.interventions if i["kind"] == "halt"]
    assert r.halted is None and r.steps == 220
    assert tr.core.run.lr_scale == 1.0
    (shift,) = [d for k, _, d in sink.events if k == "note" and d.get("kind") == "level_shift"]
    assert shift["rollbacks"] == sorted(i["detect_step"] for i in rollbacks)
    assert r.train_losses[-1] > 4.0  # training on at the new level, not rolled back forever


@pytest.mark.slow  # its rule is in the fast tier: test_policy.py (an LR cut given back)
def test_the_lr_cut_of_a_repeat_is_given_back_after_calm_steps(tmp_path, caplog) -> None:
    two = ", ".join(f'{{kind="shifted_labels", start={s}, length=6}}' for s in (100, 125))
    faults = f"faults=[{two}]"
    sink = EventSink()
    over = [*BASE, faults, "guard.policy.repeat_window=40", "guard.classify_cause=false"]
    tr = build_trainer(load_config("tiny_cpu", over), run_dir=tmp_path, callbacks=[Recorder(sink)])
    with caplog.at_level(logging.WARNING):
        r = tr.fit()
    said = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING]
    # the console says the cut and its give-back (issue 58: only a table column and the chart)
    assert any("the learning rate cut x0.5 from now on" in m for m in said), said
    assert any("one LR cut given back (x2)" in m for m in said), said
    assert [i["lr_scale"] for i in r.interventions] == [1.0, 0.5]
    (back,) = [(s, d) for k, s, d in sink.events if d.get("kind") == "lr_restore"]
    assert back[0] == r.interventions[1]["detect_step"] + 40 and back[1]["lr_factor"] == 2.0
    assert tr.core.run.lr_scale == 1.0 and r.steps == 220
