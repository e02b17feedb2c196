"""The guard's rules on synthetic steps, no training (the fast tier): a loss curve made by hand
is fed to `SpikeGuard.on_step` as a trainer would feed it, and every action the guard returns
is compared with the one the rules call for. test_guard.py shows the same rules on real runs."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable

from spikewatch.observatory.detect import Verdict
from spikewatch.observatory.policy import PolicyConfig
from spikewatch.trainer.config import GuardConfig
from spikewatch.trainer.core.actions import Action, Continue, Halt, Rollback, SkipUpdate
from spikewatch.trainer.core.callbacks import StepState
from spikewatch.trainer.core.guard import SpikeGuard

EVERY_10 = list(range(0, 40_000, 10))  # the steps of the retained checkpoints


def curve(n: int, seed: int = 0) -> list[float]:
    """A falling loss with a little noise: 5.0 at the start, about 2.0 late."""
    rng = random.Random(seed)
    return [2.0 + 3.0 * math.exp(-s / 40) + rng.gauss(0, 0.02) for s in range(1, n + 1)]


BASE = curve(400)


def guard(**policy) -> SpikeGuard:
    cfg = GuardConfig(policy=PolicyConfig(**policy))
    return SpikeGuard(cfg, retained=lambda: EVERY_10, warmup_steps=20)


def state(step: int, loss: float, batch: int | None = None) -> StepState:
    return StepState(
        step=step,
        batch_index=step - 1 if batch is None else batch,
        loss=loss,
        ce=loss,
        grad_norm=1.0,
        clip_factor=1.0,
        lr=1e-3,
        tokens=1024 * step,
        nonfinite=not math.isfinite(loss),
    )


def drive(g: SpikeGuard, loss_at: Callable[[int], float], steps: range) -> list[tuple]:
    """Every step fed in order; the steps whose action is not a plain Continue, until the
    first rollback or halt."""
    acted: list[tuple[int, Action]] = []
    for s in steps:
        action = g.on_step(state(s, loss_at(s)))
        if not isinstance(action, Continue) or action.lr_scale != 1.0:
            acted.append((s, action))
            if isinstance(action, Rollback | Halt):
                break
    return acted


def spiky(s: int) -> float:
    return BASE[s - 1] * (3.0 if 150 <= s < 160 else 1.0)


def test_a_spike_rolls_back_to_a_checkpoint_before_its_onset_and_skips_its_batches() -> None:
    ((step, rb),) = drive(guard(), spiky, range(1, 300))
    assert step == 152 and isinstance(rb, Rollback)
    # onset 150 (batch 149): the newest checkpoint before onset - margin; the batches from
    # the onset's minus the margin to the detection's plus skip_extra (10)
    assert (rb.spike.onset_step, rb.spike.detect_step, rb.spike.peak_step) == (150, 152, 150)
    assert rb.to_step == 140 and rb.skip_ranges == ((148, 162),) and rb.lr_scale == 1.0
    assert rb.spike.peak_loss == spiky(150) and rb.spike.pre_spike_loss is not None
    # the replay feeds the rolled-back steps' own batches, the control as many earlier ones
    assert rb.spike.replay == tuple((s, s - 1) for s in range(141, 153))
    assert rb.spike.control == tuple((s, s - 13) for s in range(141, 153))


def test_the_restored_branch_is_calm_and_the_outcome_is_recorded() -> None:
    g = guard()
    ((_, rb),) = drive(g, spiky, range(1, 300))
    g.on_rollback(rb.to_step, {"kind": "rollback"})
    after = [
        g.on_step(state(s, BASE[s - 1], batch=s - 1 + 14))  # 14 batches skipped
        for s in range(rb.to_step + 1, 300)
    ]
    assert all(a == Continue() for a in after)
    (outcome,) = g.outcomes
    assert outcome["outcome"] == "recovered" and outcome["recovered_at_step"] == 153


def test_inside_warmup_a_jump_is_no_spike() -> None:
    assert drive(guard(), lambda s: BASE[s - 1] * (3.0 if s == 15 else 1.0), range(1, 100)) == []


def test_a_clean_curve_of_20000_steps_gives_no_verdict() -> None:
    long = curve(20_000, seed=5)
    g = guard()
    assert drive(g, lambda s: long[s - 1], range(1, 20_001)) == [] and g.verdicts == []


def test_non_finite_steps_are_refused_then_rolled_back() -> None:
    """policy.nonfinite_tolerance = 2: the first refused, the second rolls back."""
    acted = drive(guard(), lambda s: math.nan if s in (100, 101) else BASE[s - 1], range(1, 300))
    (s1, skip), (s2, rb) = acted
    assert (s1, s2) == (100, 101) and isinstance(skip, SkipUpdate)
    assert isinstance(rb, Rollback) and rb.to_step == 90 and rb.skip_ranges == ((98, 111),)


def test_a_spike_that_comes_back_cuts_the_lr_then_is_taken_for_a_new_level() -> None:
    """Batches 149-199 poisoned: the first rollback skips 148-161, the spike returns at the
    skip's end (a repeat: the skip grows, the LR halves), returns again where that skip ends
    at the same level: after accept_level_after = 2 rollbacks it is a new level, accepted,
    and the LR cuts are given back."""
    g = guard()
    skips: list[tuple[int, int]] = []
    seen: list[tuple] = []
    step, batch = 1, 0
    while step < 400:
        while any(a <= batch < b for a, b in skips):
            batch += 1
        loss = BASE[step - 1] * (3.0 if 149 <= batch < 200 else 1.0)
        action = g.on_step(state(step, loss, batch))
        if isinstance(action, Rollback):
            seen.append((step, batch, "rollback", action.to_step, action.skip_ranges))
            seen.append(action.lr_scale)
            g.on_rollback(action.to_step, {"kind": "rollback"})
            skips += action.skip_ranges
            step, batch = action.to_step + 1, g.batch_of[action.to_step] + 1
            continue
        if action != Continue():
            seen.append((step, batch, type(action).__name__, action.lr_scale))
        step, batch = step + 1, batch + 1
    assert seen == [
        (152, 151, "rollback", 140, ((148, 162),)),
        1.0,
        (151, 164, "rollback", 140, ((147, 185),)),
        0.5,
        (150, 187, "Continue", 2.0),
    ]


def test_repeats_past_the_limit_halt_the_run() -> None:
    """A spike at every fresh start from the checkpoint: max_rollbacks = 2, then a halt."""
    g = guard(max_rollbacks=2, accept_level_after=10)
    kinds, start = [], 1
    for _ in range(3):
        (*_, (_, action)) = drive(g, spiky, range(start, 300))
        kinds.append(type(action).__name__)
        if isinstance(action, Rollback):
            g.on_rollback(action.to_step, {"kind": "rollback"})
            start = action.to_step + 1
    assert kinds == ["Rollback", "Rollback", "Halt"]


def test_a_guard_saved_and_loaded_decides_as_the_uninterrupted_one() -> None:
    straight = drive(guard(), spiky, range(1, 300))
    first = guard()
    assert drive(first, spiky, range(1, 146)) == []
    resumed = guard()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint has it
    assert drive(resumed, spiky, range(146, 300)) == straight


def test_record_only_records_the_spike_and_acts_on_nothing() -> None:
    g = SpikeGuard(GuardConfig(rollback=False), retained=lambda: EVERY_10, warmup_steps=20)
    assert drive(g, spiky, range(1, 300)) == []
    assert [(v["kind"], v["onset_step"], v["step"]) for v in g.verdicts] == [("spike", 150, 152)]


def _warn(step: int) -> Verdict:
    return Verdict("warning", step, step, step, 20.0, "grad_norm", "grad norm jumped")


def test_a_rollback_resets_the_warning_memory() -> None:
    """A warning episode of the abandoned branch does not silence the same warning on the
    restored branch: there it is a new episode (recorded, and it pins an anchor)."""
    g = SpikeGuard(GuardConfig(), retained=list)
    assert g._new_episode(_warn(100)) and not g._new_episode(_warn(101))
    g.on_rollback(90, {})
    assert g._new_episode(_warn(92))  # the same signal, one branch later
    assert not g._new_episode(_warn(93))


def test_warning_episodes_reach_the_policy_and_a_rollback_forgets_later_ones() -> None:
    """With policy.warning_horizon the guard's warning episodes move the rollback target to
    before the earliest one within the horizon; episodes of an abandoned branch are gone."""
    watch = GuardConfig(policy=PolicyConfig(warning_horizon=50, margin=1))
    g = SpikeGuard(watch, retained=lambda: [0, 100, 120, 140])
    g.batch_of = {s: s - 1 for s in range(1, 200)}
    for step in (125, 126, 130, 131, 170):  # episodes begin at 125 and 130 (130 > 126 + 1)
        g._new_episode(_warn(step))
    g.on_rollback(160, {})  # the episode at 170 was on the abandoned branch
    action = g._act(Verdict("spike", 153, 151, 152, 30.0), level=None)
    assert action.to_step == 120 and action.skip_ranges == ((123, 163),)  # from step 124
    assert g.state_dict()["episodes"] == [125, 130]


def test_after_a_rollback_the_refused_rest_of_a_bad_stretch_is_no_second_spike() -> None:
    """A spike rolled back to step 140; the stream then gives the rest of the bad stretch
    (losses 3x) on the restored weights, and the same-step tier refuses each (`refused_by`).
    Those steps are the data's, not the model spiking again: no second rollback and no LR cut
    while they last. The first step learnt ends that: a spike after it is acted on as ever."""
    g = guard()
    ((at, rb),) = drive(g, spiky, range(1, 300))
    assert at == 152 and isinstance(rb, Rollback) and rb.to_step == 140
    g.on_rollback(140, {"kind": "rollback", "cause": None})
    for s in range(141, 151):  # the bad stretch goes on: each refused by the tier
        why = "same-step tier, right after a rollback: ..."
        refused = dataclasses.replace(state(s, 3.0 * BASE[s - 1]), refused_by=why)
        assert g.on_step(refused) == Continue()
    for s in range(151, 200):  # clean again
        assert g.on_step(state(s, BASE[s - 1])) == Continue()
    ((again, rb2),) = drive(g, lambda s: BASE[s - 1] * (3.0 if 200 <= s < 210 else 1.0),
                            range(200, 300))  # fmt: skip
    assert again == 202 and isinstance(rb2, Rollback)
