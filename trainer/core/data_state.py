"""The data position: the next global batch index, and the ranges of indices to skip.

A client maps a global batch index to a batch (the built-in sampler does it as a pure function
of the seed and the index; the Watch's `batches(batch_at)` asks the user's function), so the
data position is one integer and skipping the batches that caused a spike is a list of ranges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["DataState"]


@dataclass
class DataState:
    """The data position: the next global batch index and the half-open ranges to skip."""

    batch_index: int = 0
    skip_ranges: list[tuple[int, int]] = field(default_factory=list)

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

    def skip_end(self, index: int) -> int | None:
        """The end of the skip range holding `index`, or None when it is not skipped."""
        return next((end for start, end in self.skip_ranges if start <= index < end), None)

    def add_skip(self, start: int, end: int) -> None:
        if end <= start or start < 0:
            raise ValueError(f"skip range [{start}, {end}) is empty or negative")
        self.skip_ranges = sorted([*self.skip_ranges, (start, end)])

    def to_dict(self) -> dict[str, Any]:
        return {"batch_index": self.batch_index, "skip_ranges": [list(r) for r in self.skip_ranges]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataState:
        return cls(int(d["batch_index"]), [(int(a), int(b)) for a, b in d["skip_ranges"]])
