from __future__ import annotations

from spikewatch.observatory.detect import Verdict
from spikewatch.observatory.policy import Plan, Policy, PolicyConfig


def _spike(step: int, onset: int) -> Verdict:
    return Verdict("spike", step, onset, onset + 1, 30.0)


BATCH_OF = {s: s - 1 for s in range(1, 2000)}  # no skips yet: batch index = step - 1


def test_rollback_targets_the_newest_checkpoint_before_onset_minus_margin() -> None:
    p = Policy(PolicyConfig(margin=1, skip_extra=10))
    plan = p.plan(_spike(153, 151), checkpoints=[0, 100, 140, 150, 152], batch_of=BATCH_OF)
    assert plan.action == "rollback" and plan.to_step == 140
    assert plan.skip_ranges == ((149, 163),)  # from step 150's batch through 153's, plus 10
    assert plan.lr_scale == 1.0 and plan.info["onset_step"] == 151


def test_a_warning_before_the_onset_moves_the_target_earlier() -> None:
    assert PolicyConfig().warning_horizon == 100  # on by default (docs/spikes.md)
    ck = [0, 100, 120, 140, 150]
    warned = [20, 125, 160]  # too early, within 50 steps before the onset, after it
    off = Policy(PolicyConfig(warning_horizon=None)).plan(
        _spike(153, 151), checkpoints=ck, batch_of=BATCH_OF, warned_at=warned
    )
    assert off.to_step == 140 and "warning_step" not in off.info
    on = Policy(PolicyConfig(warning_horizon=50))
    plan = on.plan(_spike(153, 151), checkpoints=ck, batch_of=BATCH_OF, warned_at=warned)
    assert plan.to_step == 120 and plan.skip_ranges == ((123, 163),)  # from step 124's batch
    assert plan.info["onset_step"] == 151 and plan.info["warning_step"] == 125
    assert "before the warning at step 125" in plan.reason
    none = on.plan(_spike(453, 451), checkpoints=ck + [440], batch_of=BATCH_OF, warned_at=[])
    assert none.to_step == 440


def test_repeats_escalate_then_halt() -> None:
    p = Policy(PolicyConfig(max_rollbacks=2, repeat_window=500, skip_extra=10))
    ck = list(range(0, 2000, 10))
    first = p.plan(_spike(200, 198), checkpoints=ck, batch_of=BATCH_OF)
    second = p.plan(_spike(300, 297), checkpoints=ck, batch_of=BATCH_OF)
    assert second.lr_scale == 0.5 and second.skip_ranges[0][1] - 300 == 20  # 10 * 2
    assert first.lr_scale == 1.0
    third = p.plan(_spike(400, 396), checkpoints=ck, batch_of=BATCH_OF)
    assert third.action == "halt" and "2 rollbacks within 500 steps" in third.reason
    far = Policy(PolicyConfig(max_rollbacks=1, repeat_window=50))
    far.plan(_spike(200, 198), checkpoints=ck, batch_of=BATCH_OF)
    assert far.plan(_spike(900, 898), checkpoints=ck, batch_of=BATCH_OF).action == "rollback"


def test_no_checkpoint_before_onset_halts_with_a_reason() -> None:
    plan = Policy().plan(_spike(30, 25), checkpoints=[30], batch_of=BATCH_OF)
    assert plan.action == "halt" and "no retained checkpoint" in plan.reason


def test_nonfinite_is_skipped_then_rolled_back_when_it_repeats() -> None:
    p = Policy(PolicyConfig(nonfinite_tolerance=2))
    nf = [Verdict("nonfinite", s, s, s, float("inf")) for s in (50, 51)]
    assert p.plan(nf[0], checkpoints=[40], batch_of=BATCH_OF).action == "skip"
    plan = p.plan(nf[1], checkpoints=[40], batch_of=BATCH_OF)
    assert plan.action == "rollback" and plan.to_step == 40 and plan.info["onset_step"] == 50
    p.finite()
    assert p.plan(nf[0], checkpoints=[40], batch_of=BATCH_OF).action == "skip"


def test_state_round_trips() -> None:
    p = Policy()
    p.plan(_spike(200, 198), checkpoints=[100], batch_of=BATCH_OF)
    q = Policy()
    q.load_state_dict(p.state_dict())
    assert q.rollback_steps == [200]


def test_an_lr_cut_is_given_back_after_calm_windows() -> None:
    p = Policy(PolicyConfig(max_rollbacks=5, repeat_window=100, lr_decay=0.5))
    ck = list(range(0, 2000, 10))
    p.plan(_spike(200, 198), checkpoints=ck, batch_of=BATCH_OF)
    assert p.plan(_spike(250, 248), checkpoints=ck, batch_of=BATCH_OF).lr_scale == 0.5
    assert p.plan(_spike(280, 278), checkpoints=ck, batch_of=BATCH_OF).lr_scale == 0.5
    assert [p.recover(s) for s in (300, 379)] == [1.0, 1.0]  # not yet 100 calm steps
    assert p.recover(380) == 2.0  # one cut back ...
    assert [p.recover(s) for s in (381, 479)] == [1.0, 1.0]
    assert p.recover(480) == 2.0  # ... and the next one a window later
    assert p.recover(2000) == 1.0  # nothing left to give back
    q = Policy(p.cfg)
    q.load_state_dict(p.state_dict())
    assert q.lr_cuts == [] and q.restored_at == 480


def test_a_level_that_returns_where_the_skip_ends_is_accepted() -> None:
    """The loss rises to the same level right where each rollback's skipped batches end: after
    `accept_level_after` rollbacks it is a new level, with the LR cuts given back. A spike at
    another level, or elsewhere, is a spike."""
    cfg = PolicyConfig(accept_level_after=2, skip_extra=10, lr_decay=0.5)
    p = Policy(cfg)
    ck = list(range(0, 2000, 10))
    level = {s: 2.0 for s in range(1, 2000)}
    first = p.plan(
        _spike(153, 151),
        checkpoints=ck,
        batch_of=BATCH_OF,
        loss_of={**level, 151: 6.0, 152: 6.1, 153: 5.9},
    )
    assert first.action == "rollback" and first.skip_ranges == ((149, 163),)
    # the new branch from step 140: batches 139..147 on steps 140..148, then 163 on
    batch_of = {s: s - 1 for s in range(1, 149)} | {s: s + 14 for s in range(149, 200)}
    losses = {**level, 149: 6.2, 150: 6.0, 151: 6.1}
    second = p.plan(_spike(151, 149), checkpoints=ck, batch_of=batch_of, loss_of=losses)
    assert second.action == "rollback" and second.lr_scale == 0.5
    end = second.skip_ranges[0][1]
    batch_of = {s: s - 1 for s in range(1, 149)} | {s: end + s - 149 for s in range(149, 200)}
    third = p.plan(_spike(151, 149), checkpoints=ck, batch_of=batch_of, loss_of=losses)
    assert third.action == "accept" and third.lr_scale == 2.0
    assert third.info["rollbacks"] == [151, 153] and p.rollback_steps == [] and not p.lr_cuts
    other = Policy(cfg)  # the same returns, but at a level 40% higher each time: spikes
    other.plan(
        _spike(153, 151),
        checkpoints=ck,
        batch_of=BATCH_OF,
        loss_of={**level, 151: 6.0, 152: 6.1, 153: 5.9},
    )
    batch_of = {s: s - 1 for s in range(1, 149)} | {s: s + 14 for s in range(149, 200)}
    higher = {**level, 149: 8.4, 150: 8.5, 151: 8.6}
    assert (
        other.plan(_spike(151, 149), checkpoints=ck, batch_of=batch_of, loss_of=higher).action
        == "rollback"
    )
    assert other.shift is not None and other.shift["count"] == 0


def test_spikes_in_the_optimizer_state_may_repeat_while_the_lr_cuts_cure_them() -> None:
    """Adam's own spikes (cause "state": the replay found them again on batches that trained
    well) come back after every rollback until the LR is low enough: they halt only after
    `max_state_rollbacks`, each repeat cutting the LR; data spikes still halt after
    `max_rollbacks`, and so do state spikes when the LR is never cut."""
    ck = list(range(0, 2000, 10))

    def repeats(cause: str | None, **cfg) -> list[Plan]:
        p = Policy(PolicyConfig(max_rollbacks=3, max_state_rollbacks=5, **cfg))
        plans = []
        for k in range(7):
            plans.append(
                p.plan(_spike(200 + 40 * k, 198 + 40 * k), checkpoints=ck, batch_of=BATCH_OF)
            )
            if plans[-1].action != "rollback":
                break
            p.caused(cause)
        return plans

    state = repeats("state")
    assert [pl.action for pl in state] == ["rollback"] * 5 + ["halt"]
    assert [pl.lr_scale for pl in state[:5]] == [1.0, 0.5, 0.5, 0.5, 0.5]  # each repeat cuts
    extra = [pl.skip_ranges[0][1] - (200 + 40 * k) for k, pl in enumerate(state[:5])]
    assert extra == [10] * 5  # the skip does not grow: skipping cannot help these
    assert "optimizer state" in state[-1].reason and "beta2" in state[-1].reason
    assert state[-1].info["state"] is True
    for cause in ("data_x_state", "transient", None):
        data = repeats(cause)
        assert [pl.action for pl in data] == ["rollback"] * 3 + ["halt"]
        assert "check the data near batch" in data[-1].reason
    never_cut = repeats("state", lr_decay=1.0)
    assert [pl.action for pl in never_cut] == ["rollback"] * 3 + ["halt"]


def test_the_causes_travel_with_the_state() -> None:
    ck = list(range(0, 2000, 10))
    p = Policy(PolicyConfig(max_rollbacks=1, max_state_rollbacks=3))
    p.plan(_spike(200, 198), checkpoints=ck, batch_of=BATCH_OF)
    p.caused("state")
    q = Policy(PolicyConfig(max_rollbacks=1, max_state_rollbacks=3))
    q.load_state_dict(p.state_dict())
    assert q.plan(_spike(240, 238), checkpoints=ck, batch_of=BATCH_OF).action == "rollback"
    fresh = Policy(PolicyConfig(max_rollbacks=1, max_state_rollbacks=3))
    fresh.load_state_dict({**p.state_dict(), "causes": []})  # a state from before the causes
    assert fresh.plan(_spike(240, 238), checkpoints=ck, batch_of=BATCH_OF).action == "halt"


def test_an_lr_cut_follows_the_cause() -> None:
    """The response follows the cause. A repeat after a spike of the optimizer state cuts the
    LR, and the cut stays (giving it back brought Adam's own spikes straight back:
    docs/spikes.md); a repeat whose cause is not known cuts it, given back after calm steps;
    a repeat after spikes of the data (the same batches make it again), of a device, or
    transient, cuts nothing: the skip is the cure (nanoGPT's 40 bad batches lost ~530 steps at
    half the LR to a data spike's cut)."""
    ck = list(range(0, 2000, 10))
    for cause, cuts, given in (
        ("state", [250], 1.0),
        (None, [250], 2.0),
        ("data_x_state", [], 1.0),
        ("transient", [], 1.0),
        ("device", [], 1.0),
    ):
        p = Policy(PolicyConfig(repeat_window=100))
        plans = []
        for step in (200, 250):
            plans.append(p.plan(_spike(step, step - 2), checkpoints=ck, batch_of=BATCH_OF))
            p.caused(cause)
        assert p.lr_cuts == cuts, cause
        assert [q.lr_scale for q in plans] == [1.0, 0.5 if cuts else 1.0], cause
        assert ("the LR x0.5 from now on" in plans[1].reason) == bool(cuts), plans[1].reason
        assert p.recover(400) == given, cause
