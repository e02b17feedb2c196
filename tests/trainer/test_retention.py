from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spikewatch.observatory.retention import keep


@settings(max_examples=300, deadline=None)
@given(
    steps=st.sets(st.integers(0, 5000), min_size=1, max_size=200),
    pins=st.sets(st.integers(0, 5000), max_size=10),
    k=st.integers(1, 5),
    extra=st.integers(0, 100),
)
def test_pins_and_newest_k_always_survive(steps, pins, k, extra) -> None:
    now = max(steps) + extra
    kept = keep(steps, now, pins=pins, keep_last=k)
    assert kept <= steps
    assert pins & steps <= kept
    assert set(sorted(steps)[-k:]) <= kept


@settings(max_examples=300, deadline=None)
@given(steps=st.sets(st.integers(0, 10**6), min_size=1, max_size=300), k=st.integers(1, 4))
def test_at_most_one_per_power_of_two_age_bucket(steps, k) -> None:
    now = max(steps)
    kept = keep(steps, now, keep_last=k)
    older = sorted(kept - set(sorted(steps)[-k:]))
    buckets = [max(now - s, 1).bit_length() for s in older]
    assert len(buckets) == len(set(buckets))
    assert len(kept) <= k + math.floor(math.log2(max(now, 1))) + 1


@pytest.mark.parametrize("n", [50, 200, 1000])
def test_checkpoint_every_step_leaves_log_n(n: int) -> None:
    """Run retention as the trainer does (a save, then a prune) for n steps."""
    on_disk: set[int] = set()
    for step in range(n + 1):
        on_disk.add(step)
        on_disk = keep(on_disk, step, pins={7}, keep_last=2)
    assert 7 in on_disk and {n, n - 1} <= on_disk and 0 in on_disk
    assert len(on_disk) <= 2 + math.floor(math.log2(n)) + 1 + 1  # K + buckets + the pin
    assert len(on_disk) <= 2 * math.log2(n) + 2


@settings(max_examples=50, deadline=None)
@given(n=st.integers(10, 3000), gap=st.integers(1, 50))
def test_old_checkpoints_remain_for_rollback(n: int, gap: int) -> None:
    """Sequential pruning keeps the oldest anchor, and consecutive kept ages grow at most ~8x:
    each octave keeps its oldest member, and an octave is empty for a while once its member
    aged into an octave that holds an older one (found by this test at n=427, gap=7: ages 91
    then 427). A rollback target ~100 steps back exists."""
    on_disk: set[int] = set()
    for step in range(0, n + 1, gap):
        on_disk = keep(on_disk | {step}, step, keep_last=2)
    now = max(on_disk)
    assert 0 in on_disk
    ages = sorted(now - s for s in on_disk)
    for a, b in zip(ages, ages[1:], strict=False):
        assert b <= 8 * a + 8 * gap, (ages, gap)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        keep([1, 2], 2, keep_last=0)
    with pytest.raises(ValueError, match="newer than now_step"):
        keep([1, 5], 3)
