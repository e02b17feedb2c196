"""PyTorch Lightning: one callback gives a run the whole loop.

    from spikewatch.lightning import SpikewatchCallback

    trainer = L.Trainer(max_steps=1000, callbacks=[SpikewatchCallback(db="sqlite:///...")])

The callback only translates Lightning hooks into the `Watch` (trainer/watch.py):
- on_fit_start builds the Watch around the module, its (first) optimizer and LR scheduler
  and routes their `step()` through it (`Watch.route`; Lightning calls the optimizer with a
  closure, which the gate runs first). It takes over `gradient_clip_val` (norm clipping, the
  same arithmetic) so that it measures the norm before clipping.
- on_before_backward gives the loss; on_train_batch_start the batch's global index: the index
  that `dataset()` drew, or else the trainer's global step (its data position).
- `dataset(batch_at)` is the skip-aware data stream: batch `batch_at(i)` for each global index
  i from the data position on, skipping the skip ranges without computing them, and resuming
  where the run stopped (Lightning restores the callback's state from its checkpoint).
- After a rollback the Watch's steps are behind the trainer's; `max_steps` is raised by that
  lag so the run still makes `max_steps` updates. An epoch-based run (`max_epochs`, no
  `max_steps`) makes the updates its epochs planned: it gets the epochs the lag needs.
- With your own DataLoader (not `dataset()`) a resume is not bit-exact: said at start.
- `val_metric` (default "val_loss") names the logged validation loss.
- The batches it was fed are kept (the newest `FED_STEPS` = 16 steps, references, no copies): a
  rollback names the rows behind the spike, each through `training_step` alone (its `log`
  muted), on the restored weights; the data flows on, so whole batches are skipped.
- The Watch's state is the callback's `state_dict`, so Lightning checkpoints carry it.
Per-head attention maxima: a Hugging Face model inside the module gets the recording attention
of `spikewatch.hf` when transformers is installed; otherwise call `watch.attn.record(...)` or
`watch.attn.sdpa(...)` from your attention.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from spikewatch._adapter import Adapter
from spikewatch._optional import require
from spikewatch.trainer.core.attribution import FED_STEPS, MicroBatches, rank_share, tokens_in

L = require("lightning.pytorch", "lightning")

__all__ = ["SpikewatchCallback"]

log = logging.getLogger(__name__)


class _Stream(torch.utils.data.IterableDataset):
    """Batches by global index from the Watch's data position; see `SpikewatchCallback.dataset`."""

    def __init__(
        self, owner: SpikewatchCallback, batch_at: Callable[[int], Any], shard: bool
    ) -> None:
        self.owner, self.batch_at, self.shard = owner, batch_at, shard

    def __iter__(self) -> Iterator[Any]:
        watch = self.owner.watch
        if watch is None:
            raise RuntimeError("spikewatch: the stream is read before the fit started")
        index = watch.data.batch_index  # a copy of the cursor: the loader reads ahead
        self.owner.drawn.clear()
        world = watch.world
        size = world.size if self.shard else 1
        while True:
            while (end := watch.data.skip_end(index)) is not None:
                index = end
            self.owner.drawn.append(index)
            yield rank_share(self.batch_at(index), world.rank, size)[0]
            index += 1


def _scaler_of(trainer: Any) -> Any:
    """The GradScaler of Lightning's "16-mixed" precision (MixedPrecision), if any: Lightning
    unscales before its optimizer step and updates the scaler after it."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


def _row_loss(module: Any, row: Any) -> torch.Tensor:
    """One row's loss through the module's own `training_step`, its logging muted."""
    own = "log" in vars(module)
    saved = vars(module).get("log")
    module.log = module.log_dict = lambda *a, **k: None
    try:
        out = module.training_step(row, 0)
    finally:
        del module.log, module.log_dict
        if own:
            module.log = saved
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not torch.is_tensor(loss):
        raise RuntimeError("spikewatch: training_step returned no loss to attribute rows by")
    return loss


class SpikewatchCallback(Adapter, L.Callback):  # type: ignore[name-defined]
    """spikewatch for a Lightning run; options as `Adapter`'s."""

    def __init__(self, *, val_metric: str = "val_loss", **options: Any) -> None:
        """`val_metric`: the logged metric (`self.log(name, ...)` in validation_step) that
        is the run's validation loss on the dashboard and in the summary."""
        super().__init__(**options)
        self.val_metric = val_metric
        self.drawn: collections.deque[int] = collections.deque()  # indices the stream gave
        self._saved: dict[str, Any] | None = None
        self._epochs: tuple[int, float] | None = None  # max_epochs asked, updates per epoch
        self._fed: dict[int, list[Any]] = {}  # a step's batch index -> its micro-batches

    def dataset(
        self, batch_at: Callable[[int], Any], *, shard: bool = True
    ) -> torch.utils.data.IterableDataset:
        """The skip-aware, resumable data stream: use it as the train dataloader's dataset,
        `DataLoader(cb.dataset(fn), batch_size=None)`, where `fn(i)` returns global batch i.
        Under torchrun each rank trains its consecutive share of it (rank k: rows [k * n,
        (k + 1) * n)); `shard=False`: `fn(i)` returns this rank's own rows."""
        return _Stream(self, batch_at, shard)

    # -- start and end ----------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        clip = trainer.gradient_clip_val
        if clip and trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError("spikewatch clips by norm: use gradient_clip_algorithm='norm'")
        trainer.gradient_clip_val = None  # the Watch clips, after measuring the norm
        configs = trainer.lr_scheduler_configs
        self._target = self._planned(trainer)
        watch = self._open(
            pl_module,
            trainer.optimizers[0],
            configs[0].scheduler if configs else None,
            framework="lightning",
            output_dir=trainer.default_root_dir,
            default_name=type(pl_module).__name__,
            max_steps=self._target if self._target > 0 else None,
            saved=self._saved,
            clip=clip,
            scaler=_scaler_of(trainer),
        )
        if self.attn_max and watch.cfg.probes.attn_max:
            self._attach_attention(pl_module)
        self._fed = {}
        if watch.cfg.guard.attribute_samples:  # the batches it fed are at hand: name rows
            watch.attribute_with(
                lambda i: MicroBatches(self._fed[i]) if i in self._fed else None,
                lambda row: _row_loss(pl_module, row),
            )
        self._extend(trainer)
        self._check_loader(trainer)

    def _planned(self, trainer: Any) -> int:
        """The updates the run is to make: max_steps, or for an epoch-based run the updates of
        its max_epochs (Lightning's estimate), which a rollback's lag then adds epochs for."""
        if trainer.max_steps > 0:
            return int(trainer.max_steps)
        planned = trainer.estimated_stepping_batches
        if not math.isfinite(planned) or not trainer.max_epochs or trainer.max_epochs < 0:
            return -1  # neither max_steps nor max_epochs: nothing to keep
        self._epochs = (int(trainer.max_epochs), planned / trainer.max_epochs)
        return int(planned)

    def _check_loader(self, trainer: Any) -> None:
        """The user's own DataLoader: Lightning resumes it at the start of its epoch (a
        sampler's and workers' positions are not saved), so a resume is not bit-exact."""
        loader = trainer.train_dataloader
        dataset = getattr(loader, "dataset", None)
        if loader is not None and not isinstance(dataset, _Stream):
            log.warning(
                "your own train DataLoader: a resume from a Lightning checkpoint continues, "
                "but not bit-exactly (Lightning restarts the loader's epoch, its sampler's "
                "and workers' positions are not saved). For an exact resume, and skips that "
                "cost no compute, serve batches by index: DataLoader(callback.dataset("
                "batch_at), batch_size=None)"
            )

    def _attach_attention(self, pl_module: Any) -> None:
        from spikewatch.hf_attention import attach_within

        attach_within(pl_module, self._w.attn)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    # -- the step ---------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        index = self.drawn.popleft() if self.drawn else trainer.global_step
        if idx % max(1, trainer.accumulate_grad_batches) == 0:  # a step's first micro-batch
            self._w.begin_step(index)
        else:  # a later micro-batch of the same step: only the data position moves
            self._w.data.batch_index = index + 1
        self._w.add_tokens(tokens_in(batch) * self._w.world.size)  # shapes: no device read
        if self._w.cfg.guard.attribute_samples:  # kept, not copied: the attribution's rows
            self._fed.setdefault(self._w.index, []).append(batch)
            while len(self._fed) > FED_STEPS:
                del self._fed[next(iter(self._fed))]

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        loss = loss * trainer.accumulate_grad_batches  # Lightning divided it
        scaler = self._w.scaler
        if scaler is not None and scaler.is_enabled():  # "16-mixed": the scaler scaled it
            loss = loss / scaler._scale
        self._w.observe_loss(loss)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        watch = self._w
        if watch._began and watch.scaler is not None and self._stepped(trainer, *args):
            watch.scaler_skipped()  # "16-mixed": GradScaler skipped the optimizer (overflow)
        self._extend(trainer)
        if self._w.halted is not None or self._w.stop_agreed:
            trainer.should_stop = True

    @staticmethod
    def _stepped(trainer: Any, outputs: Any = None, batch: Any = None, idx: int = 0) -> bool:
        """Whether this batch ended an optimizer step (its last micro-batch)."""
        return (idx + 1) % max(1, trainer.accumulate_grad_batches) == 0

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._slow_work_begins()  # the stall watchdog leaves a validation out

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._slow_work_ends()
        val = trainer.callback_metrics.get(self.val_metric)
        if val is not None and not trainer.sanity_checking:
            self._eval(float(val))

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Called as Lightning writes a checkpoint: the records so far are made durable first."""
        if self.watch is None:
            return {}
        self.watch.persist()
        return self.watch.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = dict(state_dict) or None

    def _extend(self, trainer: Any) -> None:
        """Raise `max_steps` by the steps a rollback set the run back (never lower it); an
        epoch-based run also gets the epochs those steps need (Lightning reads both live)."""
        if self._target > 0:
            lag = max(0, trainer.global_step - self._w.step_count)
            trainer.fit_loop.epoch_loop.max_steps = self._target + lag
            if self._epochs is not None:
                epochs, per_epoch = self._epochs
                trainer.fit_loop.max_epochs = epochs + math.ceil(lag / max(per_epoch, 1.0))
