"""The same-step tier: its arithmetic against numpy, what it refuses and lets through, and the
refusal in the loop (a skip on the very step, no rollback, nothing applied)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from spikewatch.trainer.builtin.loop import build_trainer
from spikewatch.trainer.config import load_config
from spikewatch.trainer.core.callbacks import Callback, StepState
from spikewatch.trainer.core.recorder import Recorder
from spikewatch.trainer.core.same_step import SameStepConfig, SameStepGate

from .conftest import EventSink

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

CFG = SameStepConfig(window=16, min_history=8, sigma=6.0, max_refusals=2)


def _check(gate: SameStepGate, loss: float, gnorm: float = 1.0) -> tuple[bool, float, float]:
    return gate.check(loss, gnorm)


def test_z_scores_are_those_of_the_window_in_numpy() -> None:
    """The deviations of each step, computed again in numpy from the accepted steps before it:
    above the mean of the last `level_window` of them, in units of the deviation that their
    successive differences give (mean square over two), on a falling loss with noise."""
    cfg = SameStepConfig(window=32, level_window=8, min_history=8, floor=1e-6, grad_floor=1e-6,
                         min_loss_excess=0.0)  # fmt: skip
    rng = np.random.default_rng(0)
    steps = np.arange(80)
    losses = (2.0 + 3.0 * np.exp(-steps / 20)) * np.exp(0.02 * rng.standard_normal(80))
    gnorms = 0.5 * np.exp(0.05 * rng.standard_normal(80))
    gate = SameStepGate(cfg)
    for i, (loss, g) in enumerate(zip(losses, gnorms, strict=True)):
        refuse, z_loss, z_grad = _check(gate, float(loss), float(g))
        window = slice(max(0, i - cfg.window), i)  # the accepted steps before this one
        for z, series in ((z_loss, losses), (z_grad, gnorms)):
            hist = np.log(series[window])
            if len(hist) >= 2:
                spread = math.sqrt(np.sum(np.diff(hist) ** 2) / (2 * (len(hist) - 1)))
                want = (math.log(series[i]) - hist[-8:].mean()) / spread
                assert z == pytest.approx(want, rel=1e-4, abs=1e-4), i
        assert not refuse


def test_a_new_runs_first_descent_does_not_hide_a_bad_batch() -> None:
    """A new user's first run (the defaults): the loss falls from 5.5 to 3.0 over 75 steps with
    a batch's noise, then a batch of garbage labels gives 2.8x the loss (as Qwen2 at d=64 did on
    two ranks). It is refused: the window's own mean (3.4) and deviation (0.19, the descent's)
    put the bar at 10.8 and let it through; the level of the last 16 steps (3.0) and the
    deviation of successive differences (0.07) put it at 5.2. A clean step goes on."""
    rng = np.random.default_rng(3)
    steps = np.arange(75)
    losses = (2.9 + 2.6 * np.exp(-steps / 25)) * np.exp(0.07 * rng.standard_normal(75))
    gate = SameStepGate(SameStepConfig())
    for v in losses:
        assert not _check(gate, float(v))[0]
    level = float(np.exp(np.log(losses[-16:]).mean()))
    assert _check(gate, 2.8 * level)[0] and _check(gate, 2.7 * level)[0]
    assert not _check(gate, 1.1 * level)[0]


def test_an_isolated_extreme_step_is_refused_and_not_learnt() -> None:
    gate = SameStepGate(CFG)
    rng = np.random.default_rng(1)
    for v in 2.0 * np.exp(0.02 * rng.standard_normal(7)):
        assert not _check(gate, float(v))[0]
    assert not _check(gate, 9.0)[0]  # 7 steps of history: not armed yet (min_history 8)
    gate.reset()
    for v in 2.0 * np.exp(0.02 * rng.standard_normal(12)):
        assert not _check(gate, float(v))[0]
    before = gate.state_dict()
    refuse, z_loss, _ = _check(gate, 9.0)
    assert refuse and z_loss > 6
    assert gate.state_dict()["values"] == before["values"]  # the refused value is not learnt
    assert not _check(gate, 2.0)[0]  # and the next normal step goes on
    assert _check(gate, 2.0, gnorm=1e4)[0]  # an extreme gradient alone is refused too


def test_a_persisting_excursion_is_let_through_after_max_refusals() -> None:
    """Two refusals in a row, then the third extreme update goes through (the detector sees
    three excursions in a row: a spike for the rollback tier), and is learnt."""
    gate = SameStepGate(CFG)
    for v in 2.0 * np.exp(0.02 * np.random.default_rng(2).standard_normal(16)):
        _check(gate, float(v))
    # refused, refused, let through (and learnt: in a 16-step window one such value widens
    # the deviation enough that the same level is no longer 6 deviations away)
    assert [_check(gate, 9.0)[0] for _ in range(4)] == [True, True, False, False]
    count = gate.state_dict()["count"]
    assert count == CFG.window  # full, and the let-through value replaced the oldest
    assert any(math.isclose(v, math.log(9.0), rel_tol=1e-6) for v in gate.state_dict()["values"][0])


def test_non_finite_values_never_enter_and_state_round_trips() -> None:
    gate = SameStepGate(CFG)
    for v in (2.0, 2.1, 1.9):
        _check(gate, v)
    refuse, *_ = _check(gate, math.nan)
    assert not refuse  # the loop refuses non-finite updates itself
    assert gate.state_dict()["count"] == 3
    other = SameStepGate(CFG)
    other.load_state_dict(gate.state_dict())
    assert other.state_dict() == gate.state_dict()


class _Applied(Callback):
    def __init__(self) -> None:
        self.steps: list[StepState] = []

    def post_step(self, state: StepState) -> None:
        self.steps.append(state)


@pytest.mark.parametrize("tier", [True, False])
def test_one_bad_batch_is_refused_on_its_step_without_a_rollback(tmp_path, tier) -> None:
    """Batch 150 has shifted labels (one batch): with the tier its update is refused on step
    151 itself, recorded as a skip, and nothing else happens; without it the bad update is
    applied (and the rollback tier, which needs a spike that persists, does nothing)."""
    over = [
        "train.progress=false",
        "checkpoint.interval=10",
        "train.max_steps=170",
        "eval.interval=none",
        'faults=[{kind="shifted_labels", start=150, length=1}]',
        f"guard.same_step.enabled={str(tier).lower()}",
    ]
    seen, sink = _Applied(), EventSink()
    tr = build_trainer(
        load_config("tiny_cpu", over), run_dir=tmp_path, callbacks=[seen, Recorder(sink)]
    )
    r = tr.fit()
    step151 = next(s for s in seen.steps if s.step == 151)
    if tier:
        assert [(i["kind"], i["step"]) for i in r.interventions] == [("skip_update", 151)]
        assert r.interventions[0]["reason"].startswith("same-step tier: loss")
        assert not step151.applied and ("skip", 151, {}) in sink.events
    else:
        assert r.interventions == [] and step151.applied
    assert all(s.applied for s in seen.steps if s.step != 151)


def test_thresholds_with_the_step_before_on_the_device_are_those_after_observing_it() -> None:
    """Read one step late (the GPU default), step t + 1's thresholds are set while step t's
    values are still on the device: `limits_after` must give what `limits()` gives once
    `observe` has learnt step t, whatever step t was (learnt, refused by the tier, non-finite,
    a GradScaler's overflow), through the window's filling, its evictions, the refusals in
    a row that disarm it and the stretches after a rollback (a loss held to its floor)."""
    import random

    from spikewatch.trainer.core.same_step import SameStepConfig, SameStepGate

    rng = random.Random(0)
    cfg = SameStepConfig(window=16, min_history=8, max_refusals=2, sigma=2.0)
    gate = SameStepGate(cfg)
    kinds = {"learnt": 0, "refused": 0, "nonfinite": 0, "overflow": 0, "armed": 0, "after": 0}
    for _ in range(400):
        if rng.random() < 0.05:
            gate.after_restore()  # a rollback restored the window
        kinds["after"] += gate.refused < 0
        loss, gnorm = rng.lognormvariate(0, 0.3), rng.lognormvariate(0, 0.5)
        kind = rng.choices(["learnt", "refused", "nonfinite", "overflow"], [8, 2, 1, 1])[0]
        if kind == "nonfinite":
            gnorm = math.inf if rng.random() < 0.5 else math.nan
        if kind == "overflow":
            gnorm = math.inf
        factor = 0.0 if kind in ("refused", "nonfinite", "overflow") else 1.0
        t = [torch.tensor(v) for v in (loss, gnorm, factor)]  # float32, as on the device
        loss, gnorm = float(t[0]), float(t[1])  # the host reads those same values
        ov = torch.tensor(1.0 if kind == "overflow" else 0.0)
        lim, armed = gate.limits_after(*t, ov)
        if kind != "overflow":  # as the core: the scaler's overflow is not the tier's to learn
            gate.observe(loss, gnorm, kind == "refused")
        want = gate.limits()
        kinds[kind] += 1
        assert bool(armed) == (want is not None)
        if want is not None:
            kinds["armed"] += 1
            assert lim.tolist() == pytest.approx(list(want), rel=1e-12, abs=1e-12)
    assert min(kinds.values()) > 20, kinds


def _late_cases(n: int = 400):  # noqa: ANN202
    """(gate before the step, the step before's device values, this step's loss and norm)
    through a window's filling, evictions, refusals, non-finite steps and overflows."""
    import random

    from spikewatch.trainer.core.same_step import SameStepConfig, SameStepGate

    rng = random.Random(1)
    gate = SameStepGate(SameStepConfig(window=16, min_history=8, max_refusals=2, sigma=2.0))
    for _ in range(n):
        if rng.random() < 0.05:
            gate.after_restore()  # a rollback restored the window: a loss held to its floor
        loss, gnorm = rng.lognormvariate(0, 0.3), rng.lognormvariate(0, 0.5)
        kind = rng.choices(["learnt", "refused", "nonfinite", "overflow"], [8, 2, 1, 1])[0]
        if kind in ("nonfinite", "overflow"):
            gnorm = math.inf if rng.random() < 0.5 else math.nan
        factor = 0.0 if kind != "learnt" else 1.0
        ahead = tuple(torch.tensor(v) for v in (loss, gnorm, factor))
        over = torch.tensor(1.0 if kind == "overflow" else 0.0) if rng.random() < 0.7 else None
        now = [rng.lognormvariate(0, 0.6), rng.lognormvariate(0, 0.9)]
        if rng.random() < 0.05:
            now[rng.randrange(2)] = rng.choice([math.nan, math.inf, 0.0])
        yield gate, (*ahead, over), torch.tensor(now[0]), torch.tensor(now[1])
        if not (kind == "overflow" and over is not None):
            gate.observe(float(ahead[0]), float(ahead[1]), kind == "refused")


def test_the_late_factor_in_one_op_is_the_reference_to_the_bit() -> None:
    """Read late, a step's factor is one device op (`spikewatch::late_factor`): the same
    decision as `step_factor` over `limits_after`'s thresholds in every case, refusals too."""
    from spikewatch.trainer.core.same_step import step_factor

    refused = applied = 0
    for gate, ahead, loss, gnorm in _late_cases():
        want = step_factor(loss, gnorm, gate.limits_after(*ahead))
        got = gate.factor_after(loss, gnorm, ahead)
        assert got.dtype == torch.float32 and got.shape == (2,)
        assert got[0].item() == want.item()
        assert got[1].item() == (want == 0).float().item()  # the refusal flag, a fused AdamW's
        refused += want.item() == 0.0
        applied += want.item() == 1.0
    assert refused > 40 and applied > 200, (refused, applied)


def test_the_late_factor_compiled_as_on_cuda_equals_the_eager_op() -> None:
    """On CUDA the op runs `late_factor` compiled (one kernel, no Python per scalar op); the
    same compilation on a CPU gives the eager decisions."""
    import functools

    from spikewatch.trainer.core.same_step import GRAD_FLOOR, late_factor

    kw = dict(sigma=2.0, floor=0.01, grad_floor=GRAD_FLOOR, min_history=8, refusals=2)
    compiled = torch.compile(functools.partial(late_factor, **kw), dynamic=False, fullgraph=True)
    seen = set()
    for gate, ahead, loss, gnorm in _late_cases(150):
        eager = gate.factor_after(loss, gnorm, ahead)
        got = compiled(*gate.late_inputs(loss, gnorm, ahead))
        assert got.tolist() == eager.tolist()
        seen.add(tuple(got.tolist()))
    assert seen == {(0.0, 1.0), (1.0, 0.0)}


def test_the_floors_refuse_a_loss_at_1_75x_and_a_gradient_norm_alone_at_16x_their_means() -> None:
    """Late in a run the series' spreads narrow, and 6 deviations came down to ~1.3x the
    gradient norm's mean (26 refusals in 9,000 clean steps of tiny_cpu); a small model's own
    instabilities then reached a loss of 1.2-1.44x with gradient norms of 7.7-12x (4 refusals
    in 9,000 steps), where a bad batch's own loss was 2.1x (shifted labels) to 4x (random
    bytes). With the floors ln 1.75 / 6 and ln 16 / 6 in log units, a flat history refuses a
    loss at 1.75x its rolling mean and a gradient norm alone at 16x, no nearer. The host rule
    and the device op agree."""
    rng = np.random.default_rng(3)
    cases = ((12.0, 2.0, False), (17.0, 2.0, True), (1.0, 2.0 * 1.7, False), (1.0, 2.0 * 1.8, True),
             (12.0, 2.0 * 1.45, False))  # fmt: skip
    for g, loss, want in cases:
        gate = SameStepGate(CFG)
        for v, n in zip(2.0 * np.exp(0.002 * rng.standard_normal(12)),
                        0.5 * np.exp(0.002 * rng.standard_normal(12)), strict=True):  # fmt: skip
            assert not _check(gate, float(v), float(n))[0]
        limits = gate.limits()
        x = torch.tensor(loss), torch.tensor(0.5 * g)
        ahead = (torch.tensor(2.0), torch.tensor(0.5), torch.tensor(1.0), None)
        twin = SameStepGate(CFG)
        twin.load_state_dict(gate.state_dict())
        twin.count, twin.pos = twin.count - 1, twin.pos - 1  # the last step still "in flight"
        late = twin.factor_after(*x, ahead)[0]  # the device's rule, read late
        refused, _, z_grad = _check(gate, loss, 0.5 * g)
        assert refused == want, (g, loss, z_grad, limits)
        assert (late.item() == 0.0) == want


def test_a_loss_near_zero_is_refused_only_nats_above_its_mean() -> None:
    """Near zero a loss's ratios are noise: accelerate's own checkpointing loop (a small BERT
    that learns its task, benchmarks/accelerate_public.py) had a clean step refused at 0.006
    nats against a rolling mean of 0.0001 (63x, 11 deviations). A refusal by the loss needs it
    `min_loss_excess` (0.05) nats above its geometric mean too, where a bad batch's is nats
    above. The host rule, the device's rule read late and `limits_after` agree."""
    rng = np.random.default_rng(5)
    history = 1e-4 * np.exp(0.3 * rng.standard_normal(40))
    for loss, want in ((0.006, False), (0.04, False), (0.2, True), (3.0, True)):
        gate = SameStepGate(CFG)
        for v in history:
            assert not _check(gate, float(v), 0.5)[0]
        x = torch.tensor(loss), torch.tensor(0.5)
        ahead = (torch.tensor(float(history[-1])), torch.tensor(0.5), torch.tensor(1.0), None)
        twin = SameStepGate(CFG)
        twin.load_state_dict(gate.state_dict())
        twin.count, twin.pos = twin.count - 1, twin.pos - 1  # the last step still "in flight"
        late = twin.factor_after(*x, ahead)[0]  # the device's op, read late
        lim, armed = twin.limits_after(*ahead)  # the same thresholds, op by op
        refused = _check(gate, loss, 0.5)[0]
        assert refused == want, loss
        assert (late.item() == 0.0) == want
        assert bool(armed) and (math.log(loss) > float(lim[0])) == want


def test_right_after_a_rollback_a_bad_stretch_is_refused_to_its_end() -> None:
    """A stretch of bad batches at 4x the loss: the usual rule refuses `max_refusals` (2) in a
    row and lets the third through (a new level is learnt rather than refused for ever: the
    rollback tier judges it). Right after a rollback (`after_restore`) the weights are known
    good, so a loss past the rollback's bar is the data's: all 40 are refused (up to
    `after_rollback`), and the first clean batch is learnt and the usual rule is back."""
    descent = [2.6 + 3.1 * math.exp(-s / 6) for s in range(16)]
    for restored in (False, True):
        gate = SameStepGate(CFG)
        for v in descent:
            assert not _check(gate, v)[0]
        if restored:
            gate.after_restore()
        refused = [_check(gate, 4.0 * 2.6)[0] for _ in range(40)]
        if not restored:  # the rule without a rollback
            assert refused[:3] == [True, True, False]
            continue
        assert all(refused)
        assert gate.observe(2.6, 1.0, False) == "" and gate.refused == 0  # learnt: back
        assert _check(gate, 4.0 * 2.6)[0] and _check(gate, 4.0 * 2.6)[0]
        assert not _check(gate, 4.0 * 2.6)[0]


def test_after_a_rollback_its_bar_holds_for_after_rollback_whatever_max_refusals() -> None:
    """`after_rollback` 3 below `max_refusals` 4: right after a rollback a loss at 1.6x its
    rolling mean (past the rollback's 1.5x bar, under the usual 1.75x floor) is refused three
    times, at the rollback's bar, then goes through (the usual rule would not refuse it)."""
    cfg = CFG.model_copy(update={"max_refusals": 4, "after_rollback": 3})
    gate, twin = SameStepGate(cfg), SameStepGate(cfg)
    for _ in range(40):
        assert not _check(gate, 2.6)[0] and not _check(twin, 2.6)[0]
    assert not _check(twin, 1.6 * 2.6)[0]  # without a rollback: let through
    gate.after_restore()
    assert [_check(gate, 1.6 * 2.6)[0] for _ in range(4)] == [True, True, True, False]
