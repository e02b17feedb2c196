"""The loop's own loader as the Watch's batches: `watch.batches(train_dataloader)`.

Any iterable of batches: a map-style `DataLoader` (shuffled, with a `DistributedSampler`, or
accelerate-prepared), an `IterableDataset` stream, a generator. The Watch's data position is the
count of batches drawn from it, across epochs: batch index i is the i-th batch the loader gave.

- **Epochs** go on until `max_steps` with the loader's own reshuffle: before each pass
  `set_epoch(epoch)` is called where the loader (accelerate's), its sampler or its batch
  sampler's sampler (a `DistributedSampler`) has one. Without `max_steps` (or with `epochs`) the
  stream ends after that many passes. An iterator (a generator) is one pass.
- **Skips**: a batch whose index lies in a skip range is drawn and dropped; the Watch's data
  flows forward, so after a rollback the batches between the restored step and the detection are
  not fed again (the rollback's line counts the clean ones among them).
- **Held**: with `loss_fn` (a spike's cause told by replaying it, its rows named) the last
  `hold` batches are kept, as the loader gave them, to be drawn again by index; an older one is
  not at hand (the cause is then not told, and said). Without `loss_fn` nothing is kept.
- **Resume** after a kill: the Watch's disk checkpoints hold the stream's position (epoch, the
  index its pass began at, torch's RNG state when that pass began: an unseeded shuffle draws its
  seed from it) and, where the loader has `state_dict`/`load_state_dict` (torchdata's
  `StatefulDataLoader`, accelerate's with `use_stateful_dataloader`), the loader's own state: it
  is loaded, so the data continues exactly. Otherwise the pass is begun again as it was begun
  then and fast-forwarded past the batches it had given (accelerate's `skip_first_batches`,
  which costs drawing them). Either way one line says which.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from spikewatch.trainer.core.attribution import MicroBatches
from spikewatch.trainer.core.cause import NotAtHand
from spikewatch.trainer.core.data_state import DataState
from spikewatch.trainer.core.world import say

__all__ = ["LoaderStream", "as_stream", "batch_bytes", "stream_from_json", "stream_to_json"]

log = logging.getLogger(__name__)


def as_stream(source: Any) -> bool:
    """True for a loader the Watch iterates (any iterable), False for `batch_at(index)`; a
    clear error for anything else."""
    if isinstance(source, (str, bytes, dict)) or not (
        hasattr(source, "__iter__") or callable(source)
    ):
        raise TypeError(
            "watch.batches takes the loop's loader (a DataLoader, an IterableDataset, a "
            "generator: any iterable of batches) or batch_at(index) -> batch; got "
            f"{type(source).__name__}"
        )
    return hasattr(source, "__iter__")


def batch_bytes(batch: Any) -> int:
    """The bytes of a batch's tensors (nested in tuples, lists, dicts, or HF's BatchEncoding)."""
    if torch.is_tensor(batch):
        return batch.numel() * batch.element_size()
    if isinstance(batch, (list, tuple)):
        return sum(batch_bytes(b) for b in batch)
    if hasattr(batch, "values") and callable(batch.values):
        return sum(batch_bytes(b) for b in batch.values())
    return 0


def stream_to_json(state: dict[str, Any]) -> dict[str, Any]:
    """A stream's position (`LoaderStream.state`) in JSON types, for `Watch.state_dict()` (a
    framework's own checkpoint): the RNG state as its bytes; a loader state that is not JSON
    is left out (a resume then fast-forwards), said."""
    out = {k: v for k, v in state.items() if k not in ("epoch_rng", "loader")}
    if state.get("epoch_rng") is not None:
        out["epoch_rng"] = state["epoch_rng"].tolist()
    if "loader" in state:
        try:
            json.dumps(state["loader"])
        except (TypeError, ValueError):
            log.warning("data: the loader's state_dict() is not JSON; a resume from the "
                        "Watch's state_dict() fast-forwards the loader instead")  # fmt: skip
        else:
            out["loader"] = state["loader"]
    return out


def stream_from_json(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """`stream_to_json`'s inverse."""
    if not state:
        return None
    out = dict(state)
    if out.get("epoch_rng") is not None:
        out["epoch_rng"] = torch.tensor(out["epoch_rng"], dtype=torch.uint8)
    return out


def _set_epoch(loader: Any, epoch: int) -> None:
    """The loader's reshuffle for pass `epoch`: accelerate's loader, a sampler or a batch
    sampler's sampler (DistributedSampler), whichever has `set_epoch`."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (
        loader,
        getattr(loader, "sampler", None),
        getattr(batch_sampler, "sampler", None),
    ):
        if owner is not None and callable(getattr(owner, "set_epoch", None)):
            owner.set_epoch(epoch)
            return


class LoaderStream:
    """Batches drawn in order from `loader`, each with its global index (see the module)."""

    def __init__(
        self,
        loader: Iterable[Any],
        data: DataState,
        *,
        hold: int,
        epochs: int | None,
        group: int = 1,
    ) -> None:
        """`group`: micro-batches a step (gradient accumulation); a step's batch is then their
        `MicroBatches`, and a pass's end closes its last step (accelerate syncs there too)."""
        if group < 1:
            raise ValueError(f"accumulate must be >= 1 micro-batches a step, got {group}")
        self.loader, self.data, self.hold, self.epochs = loader, data, hold, epochs
        self.group = group
        self._empty = False  # a pass gave nothing: no more will come
        self.stateful = callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None)
        )
        if getattr(loader, "use_stateful_dataloader", None) is False:
            self.stateful = False  # accelerate's loader has the methods, not the state
        self.once = isinstance(loader, Iterator)  # a generator: one pass, no going back
        self.epoch = -1
        self.epoch_start = 0  # the global index of the current pass's first batch
        self.epoch_rng: torch.Tensor | None = None
        self.drawn = 0  # batches given so far: the next batch's index
        self.held: OrderedDict[int, Any] = OrderedDict()
        self.bytes_held = 0
        self._it: Iterator[Any] | None = None
        self._given = 0  # batches the current pass gave

    # -- the position -------------------------------------------------------------------------
    def _begin_pass(self, epoch: int) -> None:
        self.epoch, self.epoch_start, self._given = epoch, self.drawn, 0
        _set_epoch(self.loader, epoch)
        self.epoch_rng = torch.get_rng_state()  # an unseeded shuffle draws its seed from it
        self._it = iter(self.loader)

    def state(self) -> dict[str, Any]:
        """What a disk checkpoint keeps of the stream (`data.pt`)."""
        out: dict[str, Any] = {
            "drawn": self.drawn,
            "epoch": max(self.epoch, 0),
            "epoch_start": self.epoch_start,
        }
        if self.epoch_rng is not None:
            out["epoch_rng"] = self.epoch_rng
        if self.stateful:
            try:
                out["loader"] = self.loader.state_dict()  # type: ignore[attr-defined]
            except Exception as e:  # its methods without a state: the position will do
                self.stateful = False
                log.warning("data: the loader's state_dict() failed (%s: %s); a resume will "
                            "fast-forward it instead", type(e).__name__, e)  # fmt: skip
        return out

    def restore(self, saved: dict[str, Any] | None, position: int) -> None:
        """Continue at batch `position` (a resume): from the loader's own state where the
        checkpoint holds it, else by beginning the saved pass again as it began and drawing
        the batches it had given. Says which."""
        if position == 0:
            return
        saved = saved or {}
        if int(saved.get("drawn", -1)) != position:
            saved = {}  # an older checkpoint, or another loader's: the position alone
        epoch, start = int(saved.get("epoch", 0)), int(saved.get("epoch_start", 0))
        if self.stateful and "loader" in saved:
            _set_epoch(self.loader, epoch)
            self.loader.load_state_dict(saved["loader"])  # type: ignore[attr-defined]
            self.epoch, self.epoch_start, self.drawn = epoch, start, position
            self.epoch_rng = saved.get("epoch_rng")
            self._it, self._given = iter(self.loader), position - start
            say(log, f"data: the loader's own state restored at batch {position} (epoch {epoch})")
            return
        if self.once and position:
            say(log, f"data: skipping the first {position} batches the stream gives "
                "(a generator keeps no position; they were trained before the resume)")  # fmt: skip
        live = torch.get_rng_state()
        rng = saved.get("epoch_rng")
        self.drawn = start
        if rng is not None:
            torch.set_rng_state(rng)
        try:  # the pass begun and its first batch drawn as then (a sampler draws its seed
            self._begin_pass(epoch)  # when the loader's iterator is made and when it first
            first = self._next() if position > start else None  # asks it for indices)
        finally:
            torch.set_rng_state(live)  # the resumed run's own RNG, as the checkpoint had it
        skipped = 0 if first is None else 1
        while self.drawn < position:
            if self._next() is None:
                break
            skipped += 1
        if not self.once:
            what = f"{skipped} batches" if self.group == 1 else f"{skipped} steps' micro-batches"
            say(log, f"data: fast-forwarded past {what} of epoch {epoch} to batch {position} "
                "(the loader keeps no state_dict: they were drawn again)")  # fmt: skip

    # -- drawing ------------------------------------------------------------------------------
    def between_passes(self) -> bool:
        """No pass under way (before the first, or the last one ended)."""
        return self._it is None

    def _more(self) -> bool:
        """Whether another pass may begin."""
        if self._empty or (self.once and self.epoch >= 0):
            return False
        return self.epochs is None or self.epoch + 1 < self.epochs

    def _next(self) -> Any | None:
        """The next step's batch of the stream (a new pass when one ends; `group` micro-batches
        as `MicroBatches`, fewer at a pass's end), or None at its end."""
        parts: list[Any] = []
        while len(parts) < self.group:
            if self._it is None:
                if parts or not self._more():  # a pass's end closes its last step
                    break
                self._begin_pass(self.epoch + 1)
            assert self._it is not None
            try:
                parts.append(next(self._it))
            except StopIteration:
                self._it = None
                self._empty = self._given == 0
                continue
            self._given += 1
        if not parts:
            return None
        self.drawn += 1
        return parts[0] if self.group == 1 else MicroBatches(parts)

    def draw(self) -> tuple[int, Any] | None:
        """(index, batch) of the next batch outside the skip ranges (those are drawn and
        dropped), or None when the stream ends. Keeps it if batches are held."""
        while True:
            index = self.drawn
            batch = self._next()
            if batch is None:
                return None
            if self.data.skip_end(index) is None:
                break
        if self.hold:
            self.held[index] = batch
            self.bytes_held += batch_bytes(batch)
            while len(self.held) > self.hold:
                _, old = self.held.popitem(last=False)
                self.bytes_held -= batch_bytes(old)
        return index, batch

    def batch_at(self, index: int) -> Any:
        """A held batch, for a replay; `NotAtHand` for one no longer held."""
        if index not in self.held:
            raise NotAtHand(
                f"batch {index} is no longer held (the loader's stream keeps the last {self.hold}"
                f": watch.batches(loader, hold=...))"
            )
        return self.held[index]
