"""A quarantine's samples kept out of a run, in any loop.

`spikewatch quarantine RUN --out bad.jsonl` (and `spikewatch data-check --out`) write a
JSON-lines blocklist: each line a sample, by the data's own `id` and, for the samples a
rollback named, by its (`batch`, `row`). A second run keeps them out:

- `Watch(..., blocklist="bad.jsonl")` leaves them out of the batches `watch.batches(batch_at)`
  yields: rows whose (batch index, row) a rollback named, when `batch_at` draws the same batch
  for the same index, and rows whose id (a dict batch's "id" / "ids" entry) is listed;
- `spikewatch.without_blocked(dataset, "bad.jsonl")` for a dataset a framework or a DataLoader
  reads (Hugging Face's `train_dataset`, a LightningDataModule's, your own): the items whose id
  is listed are gone before any batch is made, so batches keep their shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset, Subset

from spikewatch.trainer.core.attribution import id_of, rows_in

__all__ = ["Blocklist", "without_blocked"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Blocklist:
    ids: frozenset[str] = frozenset()
    rows: frozenset[tuple[int, int]] = frozenset()  # (batch index, global row)

    @classmethod
    def read(cls, path: str | None) -> Blocklist:
        """The file's ids and (batch, row) pairs (an empty blocklist for None)."""
        if path is None:
            return cls()
        from spikewatch.observatory.reports.quarantine import read_blocklist

        ids, rows = set(), set()
        for entry in read_blocklist(str(path)):
            if entry.get("id") is not None:
                ids.add(str(entry["id"]))
            batch, row = entry.get("batch"), entry.get("row")
            if isinstance(batch, int) and isinstance(row, int):
                rows.add((batch, row))
        if not ids and not rows:
            raise ValueError(f"{path}: no sample in it has an id or a (batch, row)")
        log.info("blocklist %s: %d ids, %d (batch, row) pairs kept out", path, len(ids), len(rows))
        return cls(frozenset(ids), frozenset(rows))

    def __bool__(self) -> bool:
        return bool(self.ids or self.rows)

    def rows_of(self, batch: Any, index: int, row0: int = 0) -> list[int]:
        """The rows of `batch` (global batch `index`, its first row global row `row0`) to
        leave out."""
        if not self:
            return []
        out = []
        for r in range(rows_in(batch)):
            if (index, row0 + r) in self.rows or (self.ids and id_of(batch, r) in self.ids):
                out.append(r)
        return out


def without_blocked(
    dataset: Any,
    path: str,
    id_of_item: Callable[[Any], Any] | None = None,
    position: Callable[[int, int], int] | None = None,
) -> Any:
    """`dataset` without the items the blocklist at `path` lists: by id (an item's "id" entry,
    a dict item's, unless `id_of_item(item)` says otherwise), and, with `position(batch, row)
    -> item index` (the index a framework's in-order sampler fed as that batch's row: `batch *
    batch_size + row` for a global batch read in order), by the (batch, row) a rollback named.
    A map-style dataset (`__getitem__` and `__len__`) gives a `Subset` (one pass over it to read
    ids); an iterable one is filtered as it is read (by id only)."""
    listed = Blocklist.read(path)
    ids = listed.ids
    at = {position(b, r) for b, r in listed.rows} if position is not None else set()
    if not ids and not at:
        raise ValueError(f"{path}: no sample in it has an id to match items by (or give position)")
    get = id_of_item or _item_id

    def kept(item: Any) -> bool:
        if not ids:
            return True
        value = get(item)
        return value is None or str(value.item() if torch.is_tensor(value) else value) not in ids

    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        return _Filtered(dataset, kept)
    keep = [i for i in range(len(dataset)) if i not in at and kept(dataset[i])]
    log.info("%s: %d of %d items kept out", path, len(dataset) - len(keep), len(dataset))
    return Subset(dataset, keep)


def _item_id(item: Any) -> Any:
    return item.get("id") if isinstance(item, dict) else None


class _Filtered(IterableDataset):
    def __init__(self, source: Iterable[Any], kept: Callable[[Any], bool]) -> None:
        self.source, self.kept = source, kept

    def __iter__(self) -> Iterator[Any]:
        return (item for item in self.source if self.kept(item))
