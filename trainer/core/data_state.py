"""The data position: the next global batch index, the ranges of indices to skip, and the
single samples to leave out.

A client maps a global batch index to a batch (the built-in sampler does it as a pure function
of the seed and the index; the Watch's `batches(batch_at)` asks the user's function), so the
data position is one integer and skipping the batches that caused a spike is a list of ranges.
When a rollback's attribution named the rows that caused it, only those rows are left out
(`blocked`, (batch index, global row) pairs): the built-in sampler refills them with fresh
samples, the Watch drops them from the batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DataState"]


@dataclass
class DataState:
    """The data position: the next global batch index and the half-open ranges to skip."""

    batch_index: int = 0
    skip_ranges: list[tuple[int, int]] = field(default_factory=list)
    blocked: set[tuple[int, int]] = field(default_factory=set)  # (batch index, global row)

    def take(self) -> int:
        """Return the next batch index not inside a skip range, and advance past it."""
        i = self.batch_index
        moved = True
        while moved:
            moved = False
            for start, end in self.skip_ranges:
                if start <= i < end:
                    i, moved = end, True
        self.batch_index = i + 1
        return i

    def advance(self) -> int:
        """Return the next batch index and advance past it, skip range or not: for a loop that
        draws its own batches, whose next batch is the next one whatever the index says (one
        in a skip range is refused when it comes, not jumped over)."""
        i = self.batch_index
        self.batch_index = i + 1
        return i

    def skip_end(self, index: int) -> int | None:
        """The end of the skip range holding `index`, or None when it is not skipped."""
        return next((end for start, end in self.skip_ranges if start <= index < end), None)

    def add_skip(self, start: int, end: int) -> None:
        if end <= start or start < 0:
            raise ValueError(f"skip range [{start}, {end}) is empty or negative")
        self.skip_ranges = sorted([*self.skip_ranges, (start, end)])

    def block(self, rows: Iterable[tuple[int, int]]) -> None:
        """Leave out these (batch index, global row) samples from now on."""
        self.blocked |= {(int(b), int(r)) for b, r in rows}

    def blocked_rows(self, index: int) -> list[int]:
        """The global rows of batch `index` to leave out, ascending."""
        return sorted(r for b, r in self.blocked if b == index)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "batch_index": self.batch_index,
            "skip_ranges": [list(r) for r in self.skip_ranges],
        }
        if self.blocked:
            out["blocked"] = [list(p) for p in sorted(self.blocked)]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataState:
        return cls(
            int(d["batch_index"]),
            [(int(a), int(b)) for a, b in d["skip_ranges"]],
            {(int(b), int(r)) for b, r in d.get("blocked", ())},
        )
