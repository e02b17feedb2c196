"""Which checkpoints to keep: the newest K, then one per power-of-two age bucket, plus pins.

Keep-last-K (torchtitan's default) deletes exactly the checkpoints a rollback needs: PaLM
restarted ~100 steps before a spike, i.e. from a checkpoint older than the newest few. Here the
age `now - step` of every older checkpoint falls in a bucket [2^b, 2^(b+1)); each bucket keeps its
oldest member, which is the next to age into the bucket above, so a kept checkpoint stays kept
until an older one holds its bucket. With a checkpoint every step, after N steps at most
K + floor(log2 N) + 1 unpinned checkpoints remain. Pinned ones (rollback targets, pre-spike
anchors) are never dropped. Pure: no disk, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["keep"]


def keep(
    checkpoints: Iterable[int], now_step: int, pins: Iterable[int] = (), keep_last: int = 2
) -> set[int]:
    """Steps to keep among `checkpoints` (steps <= now_step) at `now_step`."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    steps = sorted(set(checkpoints))
    if steps and steps[-1] > now_step:
        raise ValueError(f"checkpoint step {steps[-1]} is newer than now_step={now_step}")
    kept = set(steps[-keep_last:]) | (set(pins) & set(steps))
    oldest_in_bucket: dict[int, int] = {}
    for s in steps[:-keep_last]:
        bucket = max(now_step - s, 1).bit_length()  # age in [2^(b-1), 2^b)
        oldest_in_bucket.setdefault(bucket, s)  # ascending steps: the first seen is the oldest
    return kept | set(oldest_in_bucket.values())
