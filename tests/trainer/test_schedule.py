from __future__ import annotations

import pytest

from spikewatch.trainer.builtin.schedule import lr_multiplier
from spikewatch.trainer.config import ScheduleConfig


def test_warmup_is_linear_from_zero() -> None:
    cfg = ScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert [lr_multiplier(cfg, s, 100) for s in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])


def test_cosine_reaches_the_floor_at_the_last_step() -> None:
    cfg = ScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_multiplier(cfg, s, 100) for s in range(1, 101)]
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))


def test_wsd_is_flat_then_decays_linearly_to_the_floor() -> None:
    cfg = ScheduleConfig(name="wsd", warmup_steps=10, min_lr_ratio=0.0, decay_fraction=0.2)
    lrs = [lr_multiplier(cfg, s, 100) for s in range(1, 101)]
    assert all(v == 1.0 for v in lrs[10:80])
    assert lrs[80] < 1.0 and lrs[-1] == pytest.approx(0.0)
    steps = [a - b for a, b in zip(lrs[80:], lrs[81:], strict=False)]
    assert max(steps) - min(steps) < 1e-9


def test_constant_and_no_warmup() -> None:
    cfg = ScheduleConfig(name="constant", warmup_steps=0)
    assert {lr_multiplier(cfg, s, 50) for s in range(1, 51)} == {1.0}
