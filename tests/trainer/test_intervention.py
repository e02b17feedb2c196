"""The intervention record (trainer/core/intervention.py): typed, made when the action is
agreed and, for a rollback, completed once by the restorer; its flat JSON record is the shape
every reader reads (checkpoints, the store, callbacks, `watch.interventions`), and a record read
back from a checkpoint is the same record, keys of an older version included. No training."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from spikewatch.trainer.core.actions import Halt, Rollback, SkipUpdate, Spike
from spikewatch.trainer.core.callbacks import StepState
from spikewatch.trainer.core.intervention import Intervention, RolledBack

STATE = StepState(step=41, batch_index=40, loss=7.5, ce=7.5, grad_norm=3.25, clip_factor=1.0,
                  lr=1e-3, tokens=4096, nonfinite=False)  # fmt: skip
SPIKE = Spike(onset_step=39, detect_step=41, peak_step=41, score=9.0, pre_spike_loss=2.5,
              peak_loss=7.5, replay=((40, 39), (41, 40)), ranks=(1,),
              rank_losses=((41, (2.5, 12.5)),))  # fmt: skip


def test_a_refused_update_and_a_rollback_record_the_step_and_the_spike() -> None:
    """The keys and values the loop has always written, by hand: the step's, and the spike
    guard's when it asked (lists where JSON has them)."""
    skip = Intervention.of(SkipUpdate(reason="same-step tier: loss 3x"), STATE).record()
    assert skip == {
        "step": 41, "batch_index": 40, "kind": "skip_update", "reason": "same-step tier: loss 3x",
        "loss": 7.5, "grad_norm": 3.25,
    }  # fmt: skip
    rb = Intervention.of(Rollback(reason="spike", to_step=30, spike=SPIKE), STATE).record()
    assert rb == {
        **{k: v for k, v in skip.items() if k not in ("kind", "reason")},
        "kind": "rollback", "reason": "spike",
        "onset_step": 39, "detect_step": 41, "peak_step": 41, "score": 9.0, "signal": "loss",
        "repeats": 0, "pre_spike_loss": 2.5, "peak_loss": 7.5, "replay": [[40, 39], [41, 40]],
        "control": [], "ranks": [1], "rank_losses": [[41, [2.5, 12.5]]],
    }  # fmt: skip
    halt = Intervention.of(Halt(reason="non-finite, no checkpoint"), STATE)
    assert halt.kind == "halt" and halt.spike is None


def _rolled() -> Intervention:
    decided = Intervention.of(Rollback(reason="spike", to_step=30, spike=SPIKE), STATE)
    outcome = RolledBack(from_step=41, to_step=30, tier="memory", restore_s=0.004,
                         skip_ranges=[[29, 43]], lr_scale=1.0, lr_scale_after=1.0,
                         dropped_checkpoints=[40], skipped="skipping batches [29, 43)",
                         cause="data_x_state", replay_peak_loss=7.4, replay_steps=2,
                         replay_s=0.01, passed_over=0)  # fmt: skip
    return replace(decided, reason="spike, skipping batches [29, 43)", rolled_back=outcome)


def test_a_rollbacks_outcome_is_in_its_record_what_was_not_told_is_not() -> None:
    rec = _rolled().record()
    assert (
        rec["to_step"] == 30 and rec["skip_ranges"] == [[29, 43]] and rec["cause"] == "data_x_state"
    )
    assert rec["passed_over"] == 0  # told (a zero), not left out
    for untold in ("samples", "device_ranks", "check_s", "suspect_devices", "resumed_at_batch"):
        assert untold not in rec
    assert json.loads(json.dumps(rec)) == rec  # JSON types only


def test_a_record_read_back_is_the_same_record_an_older_versions_keys_kept() -> None:
    """A checkpoint's records come back equal (objects and records), a key this version does
    not know is kept, and a rollback's record that its restore never completed stays a record
    without an outcome, its keys kept."""
    for it in (_rolled(), Intervention.of(SkipUpdate(reason="x"), STATE)):
        back = Intervention.from_record(json.loads(json.dumps(it.record())))
        assert back == it and back.record() == it.record()
    older = {**_rolled().record(), "lr_cut": "it came back"}
    back = Intervention.from_record(older)
    assert back.record() == older and back.extra == {"lr_cut": "it came back"}
    assert back.rolled_back == _rolled().rolled_back
    half = {**Intervention.of(SkipUpdate(reason="x"), STATE).record(), "tier": "disk"}
    back = Intervention.from_record(half)
    assert back.rolled_back is None and back.record() == half


def test_an_outcome_takes_only_its_own_fields() -> None:
    with pytest.raises(TypeError, match="caus"):
        RolledBack(from_step=1, to_step=0, tier="memory", restore_s=0.0, skip_ranges=[],
                   lr_scale=1.0, lr_scale_after=1.0, dropped_checkpoints=[], skipped="",
                   causes="data")  # type: ignore[call-arg]  # fmt: skip
