"""What the Watch (trainer/watch.py) does with batches it can draw again: replay a spike's steps
for its cause (core/cause.py), check a rank's rows on another rank's device, and name the rows
behind a spike (core/attribution.py). The core calls these at a rollback, on every rank.

A client gives the batches one of two ways:
- `batches(batch_at, loss_fn)` (a plain loop) or `attribute_with(batch_at, loss_fn)`: one batch,
  one loss, one backward;
- `replay_with(run_step)` (a framework that runs its own micro-batches, torchtitan): the
  client's own forwards and backwards of a step again, its losses through `observe_loss`. A
  client that no longer holds a batch raises `NotAtHand`: the cause is then not told.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from spikewatch.trainer.checkpoints.staging import to_host
from spikewatch.trainer.core.attribution import MicroBatches, RowStat, measure_rows, moved
from spikewatch.trainer.core.cause import NotAtHand
from spikewatch.trainer.core.transfer import StepTensors

if TYPE_CHECKING:
    from spikewatch.trainer.config import WatchSettings
    from spikewatch.trainer.core.guard import SpikeGuard
    from spikewatch.trainer.core.step_core import StepCore
    from spikewatch.trainer.model.attn_max import AttnMax
    from spikewatch.trainer.watch_amp import Scaling

__all__ = ["Replaying"]


class Replaying:
    """The Watch's replays and row attribution (a mixin: the Watch holds the state)."""

    cfg: WatchSettings
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    attn: AttnMax
    amp: Scaling
    _batch_at: Callable[[int], Any] | None
    _loss_fn: Callable[[Any], torch.Tensor] | None
    _decode: Callable[[list[int]], str] | None
    _run_step: Callable[[int], None] | None
    _row_backward: bool
    _accumulate: int  # micro-batches a step of `batches(loader, accumulate=k)`, whose
    # backward the loop divides by k (accelerate's does)
    _inner_step: Callable[..., Any] | None
    _loss_sum: torch.Tensor | None
    _loss_n: int
    _loss_share: torch.Tensor | None
    _lr_scale: float

    if TYPE_CHECKING:

        @property
        def _c(self) -> StepCore: ...
        @property
        def guard(self) -> SpikeGuard | None: ...
        def observe_loss(self, loss: torch.Tensor, *, share: bool = False) -> None: ...
        def _tensors(self, scaled: bool = True) -> StepTensors: ...
        def apply(self, optimizer_step: Callable[[], Any]) -> None: ...

    def replay_with(self, run_step: Callable[[int], None]) -> None:
        """For a framework that runs its own micro-batches: `run_step(index)` runs the forwards
        and backwards of the batch at data position `index` again (each loss through
        `observe_loss`, as in training), so that a rollback tells a spike's cause by replaying
        it (guard.classify_cause); it raises `NotAtHand` for a batch it no longer holds."""
        self._run_step = run_step
        self._classify(swap=False)

    def _classify(self, *, swap: bool) -> None:
        core = self._c
        if not self.cfg.guard.classify_cause:
            return
        core.replay = self._replay  # on every rank: a replay's collectives need them all
        core.swap = self._swap if swap and core.world.distributed else None
        guard = self.guard  # rank 0's
        if guard is not None:
            guard.classify = True

    def _replay(self, step: int, index: int) -> tuple[StepTensors, Callable[[], None]]:
        """For the cause of a spike (the core's replay): batch `index` again, through the
        client's `run_step` or the user's `loss_fn`, its update applied only if the core finds
        it finite."""
        self._loss_sum, self._loss_n, self._loss_share = None, 0, None
        self.attn.active = False
        with self._c.world.replay_sync(self.model):
            if self._run_step is not None:
                self._run_step(index)
            else:
                assert self._batch_at is not None and self._loss_fn is not None
                batch = self._batch_at(index)  # a step's micro-batches, or its batch
                parts = batch if isinstance(batch, MicroBatches) else [batch]
                for part in parts:
                    loss = self._loss_fn(part)
                    # unscaled under fp16 too: a replay leaves the GradScaler alone
                    (loss / self._accumulate if self._accumulate > 1 else loss).backward()
                    self.observe_loss(loss)
        t = self._tensors(scaled=False)
        self._lr_scale = self._c.run.lr_scale
        # the optimizer's own step (not accelerate's, which would step the scaler)
        raw = (
            self.amp.optimizer.step if self.amp.in_step else self._inner_step or self.optimizer.step
        )

        def update() -> None:
            self.apply(raw)
            if self.scheduler is not None:
                self.scheduler.step()

        return t, update

    def _swap(self, step: int, index: int) -> torch.Tensor:
        """For the device check of a spike (core/cause.py): the next rank's batch `index`
        through the user's `loss_fn` here, forward only (the batches travel on the host)."""
        assert self._batch_at is not None and self._loss_fn is not None
        world = self._c.world
        everyone = world.all_objects(to_host(self._batch_at(index), None))
        theirs = moved(everyone[(world.rank + 1) % world.size], self._c.probes.device)
        self.attn.active = False
        with torch.no_grad():
            loss = self._loss_fn(theirs).detach().float()
        world.reshard(self.model)
        return loss

    def attribute_with(
        self,
        batch_at: Callable[[int], Any],
        loss_fn: Callable[[Any], torch.Tensor],
        decode: Callable[[list[int]], str] | None = None,
        *,
        drop: bool = False,
    ) -> None:
        """Name the rows behind a spike at each rollback (guard.attribute_samples): `loss_fn`
        on each row of `batch_at(index)` (a batch, `MicroBatches`, or None: not at hand) on
        the restored weights. `drop`: the client leaves the named rows out of their batches
        (else the rollback skips whole batches)."""
        core = self._c
        self._batch_at, self._loss_fn, self._decode = batch_at, loss_fn, decode
        self._row_backward = core.world.strategy != "fsdp2"  # shards: the rows' losses only
        if self.cfg.guard.attribute_samples:
            core.measure_rows = self._measure_rows
            core.skip_samples = self.cfg.guard.skip_samples and drop

    def _measure_rows(self, index: int) -> list[RowStat]:
        """For the attribution of a spike (the core's): this rank's rows of batch `index`."""
        assert self._batch_at is not None and self._loss_fn is not None
        core = self._c
        try:
            fed = self._batch_at(index)
        except NotAtHand:  # a loader's batch no longer held: its rows are not measured
            fed = None
        return measure_rows(
            index,
            fed,
            self._loss_fn,
            core.probes.params if self._row_backward else None,
            core.world.rank,
            self._decode,
        )
