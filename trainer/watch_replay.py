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
from typing import TYPE_CHECKING, Any, Protocol

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

__all__ = ["Replayed", "Replays"]


class Replayed(Protocol):
    """What the replays read and write of the Watch that holds them (checked where the Watch
    makes its `Replays`; named here as an interface, since watch.py imports this): a replay is
    the Watch's own step again."""

    cfg: WatchSettings
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    attn: AttnMax
    amp: Scaling
    _accumulate: int  # micro-batches a step of `batches(loader, accumulate=k)`, whose
    # backward the loop divides by k (accelerate's does)
    _inner_step: Callable[..., Any] | None
    _loss_sum: torch.Tensor | None
    _loss_n: int
    _loss_share: torch.Tensor | None
    _lr_scale: float

    @property
    def _c(self) -> StepCore: ...
    @property
    def guard(self) -> SpikeGuard | None: ...
    def observe_loss(self, loss: torch.Tensor | float, *, share: bool = False) -> None: ...
    def _tensors(self, scaled: bool = True) -> StepTensors: ...
    def apply(self, optimizer_step: Callable[[], Any]) -> None: ...


class Replays:
    """The Watch's replays and row attribution: an object the Watch holds (`watch.replays`),
    with the batches it was given; the step it replays is the Watch's own (its losses, its
    tensors, its update)."""

    def __init__(self, watch: Replayed) -> None:
        self.watch = watch
        self.batch_at: Callable[[int], Any] | None = None
        self.loss_fn: Callable[[Any], torch.Tensor] | None = None
        self.decode: Callable[[list[int]], str] | None = None
        self.run_step: Callable[[int], None] | None = None
        self.row_backward = True

    def replay_with(self, run_step: Callable[[int], None]) -> None:
        """For a framework that runs its own micro-batches: `run_step(index)` runs the forwards
        and backwards of the batch at data position `index` again (each loss through
        `observe_loss`, as in training), so that a rollback tells a spike's cause by replaying
        it (guard.classify_cause); it raises `NotAtHand` for a batch it no longer holds."""
        self.run_step = run_step
        self.classify(swap=False)

    def classify(self, *, swap: bool) -> None:
        w = self.watch
        core = w._c
        if not w.cfg.guard.classify_cause:
            return
        core.replay = self._replay  # on every rank: a replay's collectives need them all
        core.swap = self._swap if swap and core.world.distributed else None
        guard = w.guard  # rank 0's
        if guard is not None:
            guard.classify = True

    def _replay(self, step: int, index: int) -> tuple[StepTensors, Callable[[bool], None]]:
        """For the cause of a spike (the core's replay): batch `index` again, through the
        client's `run_step` or the user's `loss_fn`, its update applied only if the core finds
        it finite."""
        w = self.watch
        w._loss_sum, w._loss_n, w._loss_share = None, 0, None
        w.attn.active = False
        with w._c.world.replay_sync(w.model):
            if self.run_step is not None:
                self.run_step(index)
            else:
                assert self.batch_at is not None and self.loss_fn is not None
                batch = self.batch_at(index)  # a step's micro-batches, or its batch
                parts = batch if isinstance(batch, MicroBatches) else [batch]
                for part in parts:
                    loss = self.loss_fn(part)
                    # unscaled under fp16 too: a replay leaves the GradScaler alone
                    (loss / w._accumulate if w._accumulate > 1 else loss).backward()
                    w.observe_loss(loss)
        t = w._tensors(scaled=False)
        w._lr_scale = w._c.run.lr_scale
        # the optimizer's own step (not accelerate's, which would step the scaler)
        raw = w.amp.optimizer.step if w.amp.in_step else w._inner_step or w.optimizer.step

        def update(applied: bool) -> None:  # the scheduler steps on a refused step too, as
            if applied:  # it did in the run (`Watch.step`, a routed scheduler)
                w.apply(raw)
            if w.scheduler is not None:
                w.scheduler.step()

        return t, update

    def _swap(self, step: int, index: int) -> torch.Tensor:
        """For the device check of a spike (core/cause.py): the next rank's batch `index`
        through the user's `loss_fn` here, forward only (the batches travel on the host)."""
        w = self.watch
        assert self.batch_at is not None and self.loss_fn is not None
        world = w._c.world
        everyone = world.all_objects(to_host(self.batch_at(index), None))
        theirs = moved(everyone[(world.rank + 1) % world.size], w._c.probes.device)
        w.attn.active = False
        with torch.no_grad():
            loss = self.loss_fn(theirs).detach().float()
        world.reshard(w.model)
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
        w = self.watch
        core = w._c
        self.batch_at, self.loss_fn, self.decode = batch_at, loss_fn, decode
        self.row_backward = core.world.strategy != "fsdp2"  # shards: the rows' losses only
        if w.cfg.guard.attribute_samples:
            core.measure_rows = self._measure_rows
            core.skip_samples = w.cfg.guard.skip_samples and drop

    def _measure_rows(self, index: int) -> list[RowStat]:
        """For the attribution of a spike (the core's): this rank's rows of batch `index`."""
        w = self.watch
        assert self.batch_at is not None and self.loss_fn is not None
        core = w._c
        try:
            fed = self.batch_at(index)
        except NotAtHand:  # a loader's batch no longer held: its rows are not measured
            fed = None
        return measure_rows(
            index,
            fed,
            self.loss_fn,
            core.probes.params if self.row_backward else None,
            core.world.rank,
            self.decode,
        )
