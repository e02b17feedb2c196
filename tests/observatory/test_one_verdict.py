"""One verdict per spike in detection-only mode (scan, watch, a Watch that cannot roll back):
a spike whose decay wavers around the threshold (noise, occasional outliers) used to get a
second verdict with the same onset when the excursion rose again after a calm step or two."""

from __future__ import annotations

import numpy as np
import pytest

from spikewatch.observatory.detect import Detector
from spikewatch.observatory.readers.scan import scan


def spiky_curve(seed: int, steps: int = 3000, at: int = 1500) -> list[tuple[int, float]]:
    """A power-law loss, a spike at `at` rising by 1.0 over 3 steps and decaying with time
    constant 45, Gaussian noise of 1.2% of the loss with 2% of draws multiplied by 2 to 3.5."""
    rng = np.random.default_rng(seed)
    s = np.arange(steps)
    base = 2.2 + 1.5 * (1 + s / 100) ** -0.5
    k = s - at
    bump = np.where(k < 0, 0.0, np.where(k < 3, (k + 1) / 3, np.exp(-(k - 2) / 45)))
    loss = base + bump
    noise = rng.normal(0, 0.012, steps) * loss
    noise *= np.where(rng.random(steps) < 0.02, rng.uniform(2, 3.5, steps), 1.0)
    return [(int(i), float(v)) for i, v in zip(s, loss + noise, strict=True)]


@pytest.mark.parametrize("seed", range(16))
def test_a_wavering_spike_gets_exactly_one_verdict(seed: int) -> None:
    (spike,) = scan(spiky_curve(seed))["spikes"]
    assert spike["onset_step"] == 1500
    assert 1500 <= spike["peak_step"] <= 1510
    assert 1530 < spike["end_step"] < 1600


def test_the_verdict_is_remembered_across_a_checkpoint() -> None:
    """A detector restored mid-excursion (a resumed run) does not give the spike again."""
    points = spiky_curve(0)
    det = Detector()
    verdicts = [v for s, x in points[:1510] for v in det.update(s, x) if v.kind == "spike"]
    assert len(verdicts) == 1
    again = Detector()
    again.load_state_dict(det.state_dict())
    later = [v for s, x in points[1510:] for v in again.update(s, x) if v.kind == "spike"]
    assert later == []
