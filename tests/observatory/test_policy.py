from __future__ import annotations

from observatory.detect import Verdict
from observatory.policy import Policy, PolicyConfig


def _spike(step: int, onset: int) -> Verdict:
    return Verdict("spike", step, onset, onset + 1, 30.0)


BATCH_OF = {s: s - 1 for s in range(1, 2000)}  # no skips yet: batch index = step - 1


def test_rollback_targets_the_newest_checkpoint_before_onset_minus_margin() -> None:
    p = Policy(PolicyConfig(margin=1, skip_extra=10))
    plan = p.decide(_spike(153, 151), checkpoints=[0, 100, 140, 150, 152], batch_of=BATCH_OF)
    assert plan.action == "rollback" and plan.to_step == 140
    assert plan.skip_ranges == ((149, 163),)  # from step 150's batch through 153's, plus 10
    assert plan.lr_scale == 1.0 and plan.info["onset_step"] == 151


def test_repeats_escalate_then_halt() -> None:
    p = Policy(PolicyConfig(max_rollbacks=2, repeat_window=500, skip_extra=10))
    ck = list(range(0, 2000, 10))
    first = p.decide(_spike(200, 198), checkpoints=ck, batch_of=BATCH_OF)
    second = p.decide(_spike(300, 297), checkpoints=ck, batch_of=BATCH_OF)
    assert second.lr_scale == 0.5 and second.skip_ranges[0][1] - 300 == 20  # 10 * 2
    assert first.lr_scale == 1.0
    third = p.decide(_spike(400, 396), checkpoints=ck, batch_of=BATCH_OF)
    assert third.action == "halt" and "2 rollbacks within 500 steps" in third.reason
    far = Policy(PolicyConfig(max_rollbacks=1, repeat_window=50))
    far.decide(_spike(200, 198), checkpoints=ck, batch_of=BATCH_OF)
    assert far.decide(_spike(900, 898), checkpoints=ck, batch_of=BATCH_OF).action == "rollback"


def test_no_checkpoint_before_onset_halts_with_a_reason() -> None:
    plan = Policy().decide(_spike(30, 25), checkpoints=[30], batch_of=BATCH_OF)
    assert plan.action == "halt" and "no retained checkpoint" in plan.reason


def test_nonfinite_is_skipped_then_rolled_back_when_it_repeats() -> None:
    p = Policy(PolicyConfig(nonfinite_tolerance=2))
    nf = [Verdict("nonfinite", s, s, s, float("inf")) for s in (50, 51)]
    assert p.decide(nf[0], checkpoints=[40], batch_of=BATCH_OF).action == "skip"
    plan = p.decide(nf[1], checkpoints=[40], batch_of=BATCH_OF)
    assert plan.action == "rollback" and plan.to_step == 40 and plan.info["onset_step"] == 50
    p.finite()
    assert p.decide(nf[0], checkpoints=[40], batch_of=BATCH_OF).action == "skip"


def test_state_round_trips() -> None:
    p = Policy()
    p.decide(_spike(200, 198), checkpoints=[100], batch_of=BATCH_OF)
    q = Policy()
    q.load_state_dict(p.state_dict())
    assert q.rollback_steps == [200]
