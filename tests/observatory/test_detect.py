from __future__ import annotations

import math
import random

import pytest

from spikewatch.observatory.detect import Detector, DetectorConfig


def _curve(n: int, seed: int = 0, noise: float = 0.03):
    rng = random.Random(seed)
    return [2 + 3 * math.exp(-s / 300) + noise * rng.gauss(0, 1) for s in range(1, n + 1)]


def _run(det: Detector, losses, start: int = 1):
    out = []
    for i, loss in enumerate(losses):
        out += [v for v in det.update(start + i, loss) if v.kind != "warning"]
    return out


def test_a_clean_noisy_run_never_fires() -> None:
    assert _run(Detector(DetectorConfig(ignore_before=30)), _curve(20000)) == []


def test_a_spike_is_found_with_its_onset() -> None:
    losses = _curve(1000)
    for s in range(600, 610):
        losses[s - 1] *= 2.2
    v = _run(Detector(DetectorConfig(ignore_before=30)), losses)
    assert [x.kind for x in v] == ["spike"]
    assert v[0].onset_step == 600 and v[0].step == 602


def test_onset_walks_back_over_a_gradual_rise() -> None:
    """Steps 500 and 501 rise by 6-7% (about 5 sigmas: rising, not yet an excursion), the
    excursion starts at 502 and is a spike at 504: the onset is 500, found by walking back."""
    losses = _curve(800)
    for s, factor in zip(range(500, 512), [1.06, 1.07, 1.3, 1.5, 1.8, *[2.0] * 7], strict=True):
        losses[s - 1] *= factor
    v = _run(Detector(DetectorConfig(ignore_before=30)), losses)
    assert v and v[0].kind == "spike"
    assert (v[0].onset_step, v[0].step) == (500, 504)


def test_one_noisy_step_is_not_a_spike() -> None:
    losses = _curve(600)
    losses[400] *= 3.0
    losses[450] *= 3.0
    assert _run(Detector(DetectorConfig(ignore_before=30)), losses) == []


def test_warmup_and_known_regime_changes_do_not_fire() -> None:
    rng = random.Random(3)  # warmup: a fast, noisy fall that joins the curve
    losses = [9.0 - 0.04 * s + 0.3 * rng.gauss(0, 1) for s in range(100)] + _curve(400)
    det = Detector(DetectorConfig(ignore_before=100))
    out = _run(det, losses[:300])
    det.rebase(301)  # e.g. a data-mixture stage switch: the level jumps up by 30%
    out += _run(det, [x * 1.3 for x in losses[300:]], start=301)
    assert out == []


def test_an_unannounced_level_shift_is_accepted_not_repeated() -> None:
    losses = _curve(1000)
    shifted = losses[:500] + [x * 1.5 for x in losses[500:]]
    v = _run(Detector(DetectorConfig(ignore_before=30)), shifted)
    assert [x.kind for x in v] == ["spike"]  # one verdict, then the new level becomes normal


def test_slow_divergence_is_a_trend_not_a_spike() -> None:
    rng = random.Random(1)
    losses = [
        2.0 * math.exp(0.0004 * max(0, s - 300)) + 0.02 * rng.gauss(0, 1) for s in range(1, 1500)
    ]
    v = _run(Detector(DetectorConfig(ignore_before=30)), losses)
    assert [x.kind for x in v] == ["divergence"]


def test_nonfinite_is_reported_at_once() -> None:
    det = Detector()
    assert det.update(1, 3.0) == []
    (v,) = det.update(2, float("nan"))
    assert v.kind == "nonfinite" and v.onset_step == 2
    assert det.update(3, 3.0, grad_norm=float("inf"))[0].kind == "nonfinite"


def test_leading_signals_warn() -> None:
    det = Detector(DetectorConfig(min_history=5))
    for s in range(1, 30):
        assert det.observe(s, {"layer/0/attn/update_norm": 1.0 + 0.01 * (s % 3)}) == []
    (w,) = det.observe(30, {"layer/0/attn/update_norm": 5.0})
    assert w.kind == "warning" and "update_norm" in w.signal
    (a,) = det.observe(31, {"layer/1/attn_max": 250.0, "layer/1/head/0/attn_max": 250.0})
    assert a.signal == "layer/1/attn_max"
    grads = [det.update(s, 2.0, grad_norm=1.0 + 0.02 * (s % 5)) for s in range(40, 80)]
    assert not any(grads)
    assert det.update(80, 2.0, grad_norm=50.0)[0].signal == "grad_norm"


def test_state_round_trips_and_continues_identically() -> None:
    """A spike right after the hand-over: only a detector with the state (its level and noise
    scale) can see it; a fresh one is not armed yet."""
    losses = _curve(700)
    for s in range(405, 411):
        losses[s - 1] *= 2.5
    a = Detector(DetectorConfig(ignore_before=30))
    _run(a, losses[:400])
    b, fresh = Detector(), Detector(DetectorConfig(ignore_before=30))
    b.load_state_dict(a.state_dict())
    went_on = _run(a, losses[400:], start=401)
    assert went_on and went_on[0].onset_step == 405
    assert _run(b, losses[400:], start=401) == went_on
    assert _run(fresh, losses[400:], start=401) != went_on


def test_bad_input() -> None:
    det = Detector()
    det.update(5, 1.0)
    with pytest.raises(ValueError, match="steps must increase"):
        det.update(5, 1.0)
    assert det.update(6, 0.0) == []  # not usable in log space: skipped, not fatal


def test_blips_separated_by_calm_steps_are_not_a_spike() -> None:
    """Spike, calm, spike, calm, spike: three one-step blips (each would need `persistence`
    consecutive excursion steps), not a spike; three in a row are one."""
    losses = _curve(800)
    for s in (500, 502, 504, 506, 508):
        losses[s - 1] *= 2.5
    assert _run(Detector(DetectorConfig(ignore_before=30)), losses) == []
    for s in (700, 701, 702):
        losses[s - 1] *= 2.5
    (v,) = _run(Detector(DetectorConfig(ignore_before=30)), losses)
    assert (v.kind, v.onset_step, v.step) == ("spike", 700, 702)
