"""`Watch`: spikewatch around training it does not own (a plain loop, HF, Lightning); the second
client of the step core (trainer/core/step_core.py), which owns the step, rollback, restore,
checkpoints and resume. The Watch brings only what differs:

- the user's objects: model, optimizer and LR scheduler (their `step()` may be routed through
  the Watch by `route`, so a framework's own `optimizer.step()` goes through the gate);
- the loss, observed from the forward (`observe_loss`), and the clipping (the Watch measures
  the gradient norm before it clips);
- forward-flowing data: the user's (or the framework's) data position keeps going after a
  rollback, so the batches between the restored step and the detection step are never trained
  on again, and the policy's further skip ranges are refused as they come (or, with `batches`,
  never drawn). With `batches(batch_at, loss_fn=...)` the Watch can draw a batch again, so the
  cause of a spike is classified by replaying it, as in the built-in trainer.

One step, whoever runs the loop:
  begin_step(index)  the batch's global index; a due checkpoint of the previous step is saved
  observe_loss(loss) once per forward (micro-batch), on device
  gate()             after backward, before optimizer.step: clip (measuring the norm first),
                     the device step factor, the copy of the values to the host enqueued;
                     `.open` = call the optimizer (with spikewatch's AdamW, always: a refused
                     update is a factor of 0 on the device, and nothing is read on the host)
  apply(step)        the optimizer's step, with the rollback LR scale
  conclude()         the step's one host read, the agreed action, the record; a rollback
                     (in-process restore) or a halt
A plain loop calls `step(loss)`, which does the last three.

Lifetime: `Watch(...)` only assigns; `open()` (or `with Watch(...) as watch:`) opens the store,
the run directory and the checkpoints, and resumes; `close()` ends the run.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch.distributed.tensor import DTensor

from spikewatch.observatory import metric_names as M
from spikewatch.observatory.store.sink import BaseSink, DbSink, open_run_sink
from spikewatch.observatory.strict_json import write_json
from spikewatch.trainer.checkpoints.memory import AUTO_STEPS
from spikewatch.trainer.checkpoints.tiers import Tiers
from spikewatch.trainer.config import WatchSettings
from spikewatch.trainer.core.attribution import (
    leave_out,
    rank_share,
    rows_in,
    tokens_in,
)
from spikewatch.trainer.core.blocklist import Blocklist
from spikewatch.trainer.core.callbacks import Callback
from spikewatch.trainer.core.data_state import DataState
from spikewatch.trainer.core.guard import SpikeGuard
from spikewatch.trainer.core.probes import inner_model, module_layer_of
from spikewatch.trainer.core.recorder import Recorder
from spikewatch.trainer.core.step_core import (
    APPLIED,
    HALTED,
    REFUSED,
    ROLLED_BACK,
    SKIPPED_BATCH,
    Gate,
    StepCore,
)
from spikewatch.trainer.core.transfer import StepTensors, clip_by_global_norm
from spikewatch.trainer.core.watchdog import LastGrad
from spikewatch.trainer.core.world import World, say
from spikewatch.trainer.model.attn_max import AttnMax
from spikewatch.trainer.watch_amp import Scaling
from spikewatch.trainer.watch_clip import LoopClip, see_loop_clips
from spikewatch.trainer.watch_loader import (
    LoaderStream,
    as_stream,
    batch_bytes,
    stream_from_json,
    stream_to_json,
)
from spikewatch.trainer.watch_loss import loss_function
from spikewatch.trainer.watch_open import (
    UNCAUGHT,
    build_watch_core,
    close_at_exit,
    describe_optimizer,
    sigterm_as_ctrl_c,
    watch_for_uncaught,
)
from spikewatch.trainer.watch_replay import Replays

__all__ = ["APPLIED", "HALTED", "REFUSED", "ROLLED_BACK", "SKIPPED_BATCH", "Watch"]

log = logging.getLogger(__name__)


class Watch:
    """Probes, spike guard, retained checkpoints and rollback for the user's own training.

    `with Watch(model, optimizer, scheduler) as watch:` is enough: the run goes to the store
    (`db`, else $SPIKEWATCH_DB_URL, else the default file) and checkpoints to
    `runs/<run id>/`."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        name: str | None = None,
        db: str | None = None,
        run_dir: str | Path | None = None,
        run_root: str | Path = "runs",
        max_steps: int | None = None,
        grad_clip: float | None = None,
        warmup_steps: int | None = None,
        checkpoint_every: int | None = None,
        blocklist: str | Path | None = None,
        settings: WatchSettings | Mapping[str, Any] | None = None,
        resume: bool | Literal["auto"] = False,
        state: Mapping[str, Any] | None = None,
        callbacks: Sequence[Callback] = (),
        tags: Sequence[str] = (),
        sink: BaseSink | None = None,
        layer_of: Callable[[str], str] = module_layer_of,
        framework: str = "loop",
        model_info: Mapping[str, Any] | None = None,
        scaler: Any = None,
        disk: Callable[[World], Any] | None = None,
    ) -> None:
        """`settings`: a `WatchSettings` (or its dict) for everything; the keywords override
        it. `run_dir`: the run's directory; without it `<run_root>/<run id>`. `resume`:
        continue from the newest intact checkpoint in `run_dir`; "auto": do so if it holds
        one, else start there (one command line starts and restarts a preemptible job);
        without `run_dir` a new run starts.
        `state`: a `state_dict()` saved in a framework's own checkpoint (its resume restores
        the rest).
        `callbacks`: the user's own (spikewatch.trainer.core.callbacks.Callback), by priority.
        `scaler`: fp16's `torch.amp.GradScaler` (found on accelerate's optimizer by itself): the
        Watch measures and clips unscaled gradients, an overflow is the scaler's (its update is
        skipped and its scale lowered, no spike), and `step()` steps and updates the scaler -
        do not call `scaler.step`/`scaler.update` yourself. `blocklist`: a quarantine's file; its
        samples are left out of `batches()` (trainer/core/blocklist.py). `disk(world)`: a
        framework's own checkpoints as the disk tier (spikewatch/torchtitan/checkpoints.py)."""
        self.cfg = WatchSettings.build(settings, name, max_steps, grad_clip, warmup_steps,
                                       checkpoint_every, blocklist)  # fmt: skip
        self.blocklist = Blocklist.read(self.cfg.blocklist)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.db, self.run_dir_arg, self.resume_arg, self.saved = db, run_dir, resume, state
        self.run_root = Path(run_root)
        self.user_callbacks, self.tags, self.sink_arg = list(callbacks), list(tags), sink
        self.layer_of, self.framework, self.model_info_arg = layer_of, framework, model_info
        self.disk_arg = disk
        self.attn = AttnMax()  # the user's attention records into it before open()
        self.core: StepCore | None = None
        self.sink: BaseSink | None = None  # rank 0's store, once open
        self.model_info: dict[str, Any] = {}
        self._loss_sum: torch.Tensor | None = None
        self._loss_n = 0
        self._ntok = 0  # the tokens of the batch `batches` yielded last (0: not known)
        self._loss_share: torch.Tensor | None = None
        self.grad_norm: torch.Tensor | None = None  # the step's global norm before clipping
        self._lr_scale = 1.0  # the LR scale of the step being decided
        self._began = self._closed = False
        self._undo_sigterm: Callable[[], None] | None = None  # SIGTERM as Ctrl-C, while open
        self._stop_raised = False  # a signal's agreed stop, raised in the loop once
        self._forward_hook: Any = None  # under torchrun: the forwards timed (the watchdog)
        self._last_grad: LastGrad | None = None  # ... and the backwards, to their last gradient
        self._inner_step: Callable[..., Any] | None = None  # the optimizer's own, once gated
        self._loop_clip: LoopClip | None = None  # the loop's own clip, once routed
        self._undo_clip: Callable[[], None] | None = None
        self.replays = Replays(self)  # a spike's batches again, for its cause and its rows
        self._accumulate = 1
        self._counter_told = self._attn_told = False
        self._loader: LoaderStream | None = None  # the loop's loader, once `batches` has it
        self._held_said = False
        self.amp = Scaling(optimizer, scaler)  # fp16's GradScaler (trainer/watch_amp.py)

    # -- lifetime ---------------------------------------------------------------------------
    def open(self) -> StepCore:
        """Open the run: the store (rank 0 only), the run directory, the checkpoints, the
        guard; resume if asked. Idempotent; the step methods call it if you did not."""
        if self.core is None:
            self.core = build_watch_core(self)
            watch_for_uncaught()
            self._undo_sigterm = sigterm_as_ctrl_c(self.core.world.size, self.core)
            if self.core.world.size > 1:  # a rank slow in its compute: its forwards timed
                # kept out of a compiled graph: a clock read is no part of the model's forward
                ended = torch.compiler.disable(self._forward_ended)
                self._forward_hook = self.model.register_forward_hook(ended)
                params = self.core.probes.params
                if (
                    self.core.stall is not None
                    and self.core.stall.enabled
                    and not any(isinstance(p, DTensor) for p in params)
                ):  # ... and its backwards, to their last gradient (DDP: FSDP2's are its own)
                    self._last_grad = LastGrad(params, self._grads_ready)
            atexit.register(close_at_exit, weakref.ref(self))
            if self.framework == "loop" and self.cfg.probes.attn_max:
                self._attach_attention()
            if self.cfg.probes.attn_max:  # the maxima's table (if reserved) on the model's device
                self.attn.place(self.core.probes.device)
            self._arm_attention()
        return self.core

    def _arm_attention(self) -> None:
        """The next step's forwards record their attention maxima if it is probed: set here
        (at open and after each step) for a loop that never calls `begin_step`, whose step
        begins only at the gate, after its forwards (it recorded none). Evaluation under
        `no_grad` and replays record nothing."""
        core = self._c
        self.attn.arm(core.probes.wants_attn_max(core.step_count + 1))

    def _attach_attention(self) -> None:
        """A Hugging Face model in the user's own loop records its per-head attention maxima
        without being asked (they went missing, silently, unless the user found
        `spikewatch.hf.attach_attention`)."""
        if "transformers" not in sys.modules:  # no Hugging Face model here
            return
        from spikewatch.hf_attention import attach_within

        found = attach_within(inner_model(self.model), self.attn)
        if found is not None and found[1] and self._c.world.is_main:
            say(log, f"per-head attention maxima: recorded in {found[0]}'s attention "
                "(spikewatch's attention function stands in for it)")  # fmt: skip

    def __enter__(self) -> Watch:
        self.open()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is None:
            self.close()
            return
        try:  # the loop's own exception is what the user must see: never mask it
            self.close("failed" if kind is not KeyboardInterrupt else None)
        except Exception as e:
            log.error("closing the run after the loop's %s failed too: %s", kind.__name__, e)

    @property
    def _c(self) -> StepCore:
        return self.core if self.core is not None else self.open()

    # -- what users and adapters read -----------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Updates on the live branch."""
        return self._c.step_count

    @property
    def index(self) -> int:
        return self._c.index

    @property
    def data(self) -> DataState:
        return self._c.run.data

    @property
    def halted(self) -> str | None:
        return self.core.halted if self.core is not None else None

    def _forward_ended(self, *_: Any) -> None:
        watchdog = self.core.watchdog if self.core is not None else None
        if watchdog is not None:
            watchdog.forward_ended()
        if self._last_grad is not None:  # a backward has run: its last gradient is known
            self._last_grad.settle()

    def _grads_ready(self) -> None:
        watchdog = self.core.watchdog if self.core is not None else None
        if watchdog is not None:
            watchdog.grads_ready()

    @property
    def stop_agreed(self) -> bool:
        """A SIGTERM's stop, agreed by every rank: a framework's loop ends after this step."""
        return self.core is not None and self.core.stop_agreed

    @property
    def outcome(self) -> str:
        return self._c.outcome

    @property
    def interventions(self) -> list[dict[str, Any]]:
        """The run's interventions so far (refused updates, rollbacks, halts), each its JSON
        record (trainer/core/intervention.py): a new list each call."""
        return [i.record() for i in self._c.run.interventions]

    @property
    def run_id(self) -> str:
        return self._c.run.run_id

    @property
    def run_dir(self) -> Path:
        return self._c.run.run_dir

    @property
    def checkpointer(self) -> Tiers:
        return self._c.checkpointer

    @property
    def guard(self) -> SpikeGuard | None:
        return next((c for c in self._c.callbacks if isinstance(c, SpikeGuard)), None)

    @property
    def world(self) -> World:
        return self._c.world

    @property
    def should_stop(self) -> bool:
        core = self._c
        return core.stop_requested or (
            self.cfg.max_steps is not None and core.step_count >= self.cfg.max_steps
        )

    # -- batches it can draw again: a spike's replay and its rows (trainer/watch_replay.py) --
    def replay_with(self, run_step: Callable[[int], None]) -> None:
        """For a framework that runs its own micro-batches: `run_step(index)` runs the forwards
        and backwards of the batch at data position `index` again (each loss through
        `observe_loss`), so that a rollback tells a spike's cause by replaying it; it raises
        `NotAtHand` for a batch it no longer holds."""
        self.replays.replay_with(run_step)

    def attribute_with(
        self,
        batch_at: Callable[[int], Any],
        loss_fn: Callable[[Any], torch.Tensor],
        decode: Callable[[list[int]], str] | None = None,
        *,
        drop: bool = False,
    ) -> None:
        """Name the rows behind a spike at each rollback: `loss_fn` on each row of
        `batch_at(index)` on the restored weights. `drop`: the client leaves the named rows out
        of their batches (else the rollback skips whole batches)."""
        self.replays.attribute_with(batch_at, loss_fn, decode, drop=drop)

    # -- the user's loop ------------------------------------------------------------------
    def batches(
        self,
        source: Iterable[Any] | Callable[[int], Any],
        loss_fn: Callable[[Any], Any] | torch.nn.Module | None = None,
        decode: Callable[[list[int]], str] | None = None,
        *,
        shard: bool = True,
        hold: int | None = None,
        epochs: int | None = None,
        accumulate: int = 1,
    ) -> Iterator[Any]:
        """The step's batches, until `max_steps` updates (or a halt), from either
        - the loop's own loader (`for batch in watch.batches(train_dataloader)`): any iterable of
          batches, each rank's own (a DistributedSampler's share), pass after pass with the
          loader's reshuffle (`epochs` passes at most; without `max_steps` one), its position
          kept in the Watch's checkpoints (trainer/watch_loader.py). With `loss_fn` the last
          `hold` batches (default: two memory-snapshot intervals and 16) are kept for a spike's
          replay and row naming. `accumulate=k`: the loop takes one micro-batch an iteration
          and steps every k-th (its own counter, or accelerate's `accumulate`): the micro-batches
          are yielded one by one, k to a step (fewer at a pass's end, where accelerate steps
          too), each loss given to `observe_loss`; the step's loss is their mean; or
        - `batch_at(index)` for each global batch index from the data position on, skipping
        the skip ranges. Under torchrun each rank gets
        its consecutive share of the global batch `batch_at(index)` returns (rank k: rows
        [k * n, (k + 1) * n)); `shard=False`: `batch_at` returns this rank's own rows. With
        `loss_fn(batch) -> loss` the Watch can replay a spike's batches to tell its cause
        (guard.classify_cause) and name the rows that caused it (guard.attribute_samples:
        `loss_fn` on one row at a time; a dict batch's "id" entry names a row's sample,
        `decode(tokens)` shows its text). `loss_fn` may be the model itself, and may return
        `(logits, loss)` or an output with `.loss` (trainer/watch_loss.py)."""
        core = self.open()
        world = core.world
        loss_fn = None if loss_fn is None else loss_function(loss_fn)
        if as_stream(source):
            yield from self._stream(cast(Iterable[Any], source), loss_fn, decode, hold, epochs,
                                    accumulate)  # fmt: skip
            return
        if accumulate != 1:
            raise ValueError("accumulate is for a loader; batch_at(index) gives a whole step")
        batch_at = whole = cast(Callable[[int], Any], source)
        if shard and world.distributed:  # the rank's share, in the replays and the naming too

            def share(index: int) -> Any:
                return rank_share(whole(index), world.rank, world.size)[0]

            batch_at = share

        replays = self.replays
        replays.batch_at, replays.loss_fn, replays.decode = batch_at, loss_fn, decode
        if loss_fn is not None:
            replays.classify(swap=True)
            # one process: the named rows are dropped from their batches (under torchrun a
            # rank could be left with none, so whole batches are skipped there)
            self.attribute_with(batch_at, loss_fn, decode, drop=not core.world.distributed)
        while not self.should_stop:
            index = self.take_index()
            batch = self._fed(index, batch_at(index))
            if batch is not None:
                yield batch

    def _fed(self, index: int, batch: Any, *, saved: bool = False) -> Any | None:
        """Batch `index` as the step gets it (the rows named or blocklisted left out; None when
        none is left), its step begun (`saved`: the due checkpoint was saved already)."""
        core = self._c
        world = core.world
        row0 = world.rank * rows_in(batch) if world.distributed else 0
        left_out = core.run.data.blocked_rows(index) + self.blocklist.rows_of(batch, index, row0)
        if left_out:
            keep = [r for r in range(rows_in(batch)) if r not in left_out]
            if not keep:  # every row of it was named: the next batch
                core.run.data.batch_index = max(core.run.data.batch_index, index + 1)
                return None
            batch = leave_out(batch, keep, index, self)
        self._start(index, save=not saved)
        self._ntok = tokens_in(batch) * world.size  # each rank: its rows of the batch
        return batch

    def _stream(
        self,
        loader: Iterable[Any],
        loss_fn: Callable[[Any], torch.Tensor] | None,
        decode: Callable[[list[int]], str] | None,
        hold: int | None,
        epochs: int | None,
        accumulate: int,
    ) -> Iterator[Any]:
        """`batches(loader)`: the loop's own loader, drawn in order (trainer/watch_loader.py)."""
        core = self._c
        if accumulate > 1 and self.cfg.blocklist:
            raise ValueError(
                "a blocklist leaves rows out of whole batches: with accumulate > 1, leave them "
                "out in the loader (its sampler) instead"
            )
        if hold is None:
            every = self.cfg.checkpoint.memory_interval
            memory = AUTO_STEPS[1] if every == "auto" else every or 0  # at most, when "auto"
            hold = 2 * memory + 16 if loss_fn is not None else 0
        if hold < 0:
            raise ValueError(f"hold must be >= 0 batches, got {hold}")
        if epochs is None and self.cfg.max_steps is None:
            epochs = 1  # no planned end: one pass, as `for batch in loader` would
        stream = self._stream_of(loader, hold if loss_fn else 0, epochs, accumulate)
        if loss_fn is not None:
            self._accumulate = accumulate
            # whole batches are skipped: a skip range reaches past the data position, and the
            # batches there, not drawn yet, cannot be measured for their rows (they would be
            # fed but for their named rows); the rows the rollback names are still recorded
            self.attribute_with(stream.batch_at, loss_fn, decode, drop=False)
            # each rank holds its own batches: a swap gathers them (one batch a step)
            self.replays.classify(swap=accumulate == 1)
        while not self.should_stop:
            core.start()
            core.save_if_due()  # the loader stands at the data position: a checkpoint agrees
            got = stream.draw()
            if got is None:
                return  # the loader ended
            index, batch = got
            if not self._held_said and stream.hold and core.world.is_main:
                self._held_said = True
                size = stream.hold * batch_bytes(batch)
                say(log, f"data: the loop's loader; the last {stream.hold} batches are held "
                    f"for a spike's replay (~{size / 2**20:.1f} MB)")  # fmt: skip
            if accumulate > 1:  # the step's micro-batches, one an iteration
                self._start(index, save=False)
                self._ntok = sum(tokens_in(part) for part in batch) * core.world.size
                yield from batch
                continue
            batch = self._fed(index, batch, saved=True)
            if batch is not None:
                yield batch

    def _stream_of(
        self, loader: Iterable[Any], hold: int, epochs: int | None, accumulate: int
    ) -> LoaderStream:
        """The stream this call draws from. The loop's epoch loop (`for epoch ...: for batch in
        watch.batches(loader)`) calls again each epoch: the same loader goes on where it
        stands (its next pass, `epochs` more of them), a new loader object (one made each
        epoch) starts its first pass at the data position; only the first call after a resume
        takes the saved position (the loader's state, or a fast-forward)."""
        core = self._c
        old = self._loader
        if old is not None and old.loader is loader and old.group == accumulate:
            old.hold = hold
            if old.between_passes() and epochs is not None:
                old.epochs = old.epoch + 1 + epochs  # this call's passes, from the next on
            return old
        stream = LoaderStream(loader, core.run.data, hold=hold, epochs=epochs, group=accumulate)
        if old is None:  # the first call: a resume's saved position, if any
            stream.restore(core.run.stream_saved, core.run.data.batch_index)
        else:  # another loader object: its passes continue the run's index and epoch count
            stream.drawn, stream.epoch = core.run.data.batch_index, old.epoch
            stream.epoch_start = stream.drawn
            if epochs is not None:
                stream.epochs = stream.epoch + 1 + epochs
        core.run.stream_saved, core.run.stream = None, stream.state
        self._loader = stream
        return stream

    def take_index(self) -> int:
        """The next global batch index outside the skip ranges (advances the data position)."""
        return self._c.take_index()

    def step(self, loss: torch.Tensor | None = None) -> str:
        """A plain loop's whole step after `loss.backward()`: measure, decide, apply or refuse,
        advance the scheduler, zero the gradients. Returns 'applied', 'refused', 'rolled_back',
        'halted' or 'skipped_batch' (read late, as on a GPU: 'applied' until it is read)."""
        if loss is not None:
            self.observe_loss(loss)
        if self.gate().open:
            self.apply(self._inner_step or (lambda: self.amp.step(self.optimizer.step)))
        else:
            self.amp.settle()
        outcome = self.conclude()
        if self.scheduler is not None and outcome in (APPLIED, REFUSED):
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._c.save_if_due()
        return outcome

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """`with watch.paused(): evaluate()`: work between steps that is slow by nature (an
        evaluation, a checkpoint of the loop's own). The stall watchdog (settings
        `guard.stall`) counts it neither as a stall nor into the run's pace; the Watch's own
        checkpoints and restores are excluded already."""
        core = self.core
        return core.paused() if core is not None else contextlib.nullcontext()

    def log_eval(self, val_loss: float) -> None:
        """A validation loss of the current step (shown on the run page, kept in the summary),
        during training or after it (the final evaluation, after the `with` block: the run is
        over, its record still takes it)."""
        core = self._c
        if not self._closed:
            core.start()
            core.record_eval(float(val_loss))
            return
        core.run.val_losses.append((core.step_count, float(val_loss)))  # the summary's
        recorder = next((c for c in core.callbacks if isinstance(c, Recorder)), None)
        if recorder is None or self.sink is None:  # another rank, or no store
            return
        late = (
            open_run_sink(core.run.run_dir, self.db) if isinstance(self.sink, DbSink) else self.sink
        )
        try:
            late.know_run(core.run.run_id, range(recorder.branch + 1))  # not started anew
            late.log_metrics(core.run.run_id, recorder.branch, core.step_count,
                             {M.VAL_LOSS: float(val_loss)})  # fmt: skip
        finally:
            if late is not self.sink:
                late.close(timeout=30)

    # -- the step, in phases (frameworks call these from their hooks) ----------------------
    def begin_step(self, index: int | None = None) -> None:
        """Before the step's first forward: `index` is the batch's global index (a framework's
        own data position; None: the Watch's next one); the checkpoint due for the previous
        step is saved first."""
        self._start(index)

    def _start(self, index: int | None, *, save: bool = True) -> None:
        """`begin_step`; `save=False` where the due checkpoint was saved just before (the
        loader's stream saves before it draws, where the loader stands at the position)."""
        self._begin(index, save=save)
        self._forget_losses()

    def _forget_losses(self) -> None:
        """The losses observed so far are no step's (taken, or the step refused unmeasured)."""
        self._loss_sum, self._loss_n, self._loss_share = None, 0, None

    def _begin(self, index: int | None, *, save: bool = True) -> None:
        """The step begun, the losses observed so far kept (the gate begins a step the loop
        did not: its micro-batches' losses are the step's)."""
        core = self._c
        if core.stop_agreed and self.framework == "loop" and not self._stop_raised:
            # a loop of its own (not `batches`, which ends by itself): every rank at this same
            # call, so that none is left in a collective; closed "stopped" by `with` / atexit
            self._stop_raised = True
            raise KeyboardInterrupt(f"SIGTERM: every rank stops after step {core.step_count}")
        core.start()
        if save:
            core.save_if_due()
        # no index: the loop drew its batch itself, the next data position's (the step before's
        # index again put every step of such a loop on one batch index, and a skip range over
        # it refused the rest of the run); one in a skip range is refused, not jumped over:
        # jumping the index over a skip range would train the batches the loop draws there
        core.begin_step(core.next_index() if index is None else index)
        self.grad_norm = None
        # (not cleared here: a loop that never calls begin_step begins its step at the gate,
        # after its forwards recorded; the table was cleared when the step before ended)
        self.attn.active = core.probes.wants_attn_max(core.step_count + 1)
        self._began = True

    def observe_loss(
        self, loss: torch.Tensor | float, *, share: bool = False, tokens: Any = None
    ) -> None:
        """The loss of one forward (one micro-batch); the step's loss is their mean. With
        `share`, the loss was already divided by the whole step's token count (Hugging Face's
        `num_items_in_batch`), so the step's loss is the sum of the shares. `tokens`: the
        micro-batch (its tokens counted as `batches` counts a batch's, on each rank) or a
        count, for a loop that draws its batches itself: the run's token count and tokens a
        second. `loss` may be a number, a loss the loop has read already (`loss.item()`, or
        the sum of its micro-batches' as nano-gpt's `compute_loss` returns it)."""
        if tokens is not None:
            n = int(tokens) if isinstance(tokens, int) else tokens_in(tokens)
            self._ntok += n * self._c.world.size
        if not isinstance(loss, torch.Tensor):
            if isinstance(loss, bool) or not isinstance(loss, int | float):
                raise TypeError(f"observe_loss takes a tensor or a number, not {type(loss)}")
            # on the model's device, as the step's other values (the loop synchronised already)
            loss = torch.tensor(float(loss), dtype=torch.float32, device=self._c.probes.device)
        value = loss.detach().float()
        if share:
            self._loss_share = value if self._loss_share is None else self._loss_share + value
            return
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_n += 1

    def add_tokens(self, n: int) -> None:
        """A framework's tokens of this step, every rank's (the run's token count)."""
        self._ntok += int(n)

    def gate(self) -> Gate:
        """After backward, before the optimizer step: `.open` = apply the update (its step
        factor, if the optimizer takes one, is set on it already)."""
        core = self._c
        if not self._began:
            self._begin(None)
        self._began = False
        if core.refuse_skipped():  # drawn before the rollback that skips it
            self.attn.take()  # its maxima, its clip, its losses and tokens: none the next's
            if self._loop_clip is not None:
                self._loop_clip.take()
            self._forget_losses()
            self._ntok = 0
            return Gate(False)
        self._lr_scale = core.run.lr_scale
        lr = float(self.optimizer.param_groups[0]["lr"]) * self._lr_scale
        tensors = self._tensors()
        self.grad_norm = tensors.grad_norm  # a replay's own norm never lands here
        ntok, self._ntok = self._ntok, 0
        return core.gate(tensors, lr=lr, ntok=ntok)

    def apply(self, optimizer_step: Callable[[], Any]) -> None:
        """Run the optimizer's step with the rollback LR scale (restored after it, so the
        scheduler's own arithmetic is untouched)."""
        if self._lr_scale == 1.0:
            optimizer_step()
            return
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * self._lr_scale
        try:
            optimizer_step()
        finally:
            for g, lr in zip(groups, saved, strict=True):
                g["lr"] = lr

    def conclude(self) -> str:
        """After the optimizer step (or its refusal): record, then roll back or halt."""
        outcome = self._c.conclude()
        self._arm_attention()
        if outcome == ROLLED_BACK and not self._counter_told and self._c.world.is_main:
            self._counter_told = True  # once a run: the loop's own counter now disagrees
            say(log, f"the run's step is now {self._c.step_count} (rolled back): a loop that "
                "counts its own steps (its LR schedule, evaluations, checkpoint names, its end) "
                "takes them from watch.step_count")  # fmt: skip
        return outcome

    def read_in_flight(self) -> str:
        """Read the step in flight now (on a GPU a step is read one step late) and act on it:
        before a framework publishes a checkpoint of its own, which must hold decided steps."""
        return self._c.read_in_flight()

    drain = read_in_flight  # its name before 2026-12-07

    @property
    def scaler(self) -> Any:
        """fp16's GradScaler, if any (the user's, accelerate's or Lightning's)."""
        return self.amp.scaler

    def scaler_skipped(self) -> None:
        """The GradScaler skipped this step's optimizer call (an overflow: with a non-fused
        optimizer, `GradScaler.step` does not call it), so the gate never ran: the step is
        recorded as the scaler's overflow, refused, nothing applied. For frameworks that step
        the scaler themselves (the Lightning callback calls it)."""
        if not self._began:
            return
        self.amp.overflowed = True
        try:
            self.gate()
            self.conclude()
        finally:
            self.amp.overflowed = False

    def route(self, optimizer: Any, scheduler: Any = None) -> None:
        """Route a framework's `optimizer.step()` (with or without a closure, as Lightning
        calls it) and `scheduler.step()` through the Watch: the update goes through the gate,
        and the scheduler follows the Watch's steps."""
        inner = self._inner_step = optimizer.step

        state = getattr(optimizer, "gradient_state", None)  # accelerate's accumulation

        def gated_step(closure: Callable[[], Any] | None = None) -> Any:
            if state is not None and not state.sync_gradients:
                return inner(closure)  # a micro-batch that only accumulates: no update
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if self.gate().open:
                self.apply(inner)
            elif self.amp.in_step:
                self.amp.settle()  # accelerate's step, skipped, would have updated it
            self.conclude()
            return loss

        if hasattr(inner, "_wrapped_by_lr_sched"):  # torch's scheduler checks its own wrapper
            gated_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = gated_step
        if self._loop_clip is None:  # the loop's own clip of the model: measured before it
            self._loop_clip = LoopClip(self._clipped_params)
            self._undo_clip = see_loop_clips(self._loop_clip)
        if scheduler is not None:  # a subclass, not an instance attribute: state_dict() is
            watch = self  # the instance's __dict__, and frameworks save it with torch.save

            cls = type(scheduler)
            unguarded = cls.step

            def sched_step(sched: Any, *args: Any, **kwargs: Any) -> Any:
                if watch.outcome in (APPLIED, REFUSED):
                    return unguarded(sched, *args, **kwargs)
                return None

            scheduler.__class__ = type(f"Gated{cls.__name__}", (cls,), {"step": sched_step})

    def _clipped_params(self) -> list[torch.Tensor] | None:
        """The parameters whose clip by the loop the Watch measures (watch_clip.py): the
        watched trainable ones (the Watch opened, as by any step method, if it was not),
        until it closes, where one process holds them whole."""
        if self._closed:
            return None
        core = self._c
        return None if core.world.clip is not None else core.probes.params

    def _tensors(self, scaled: bool = True) -> StepTensors:
        """Clip (after measuring), and the step's loss and attention maxima, on device.
        `scaled`: the gradients came from a GradScaler's scaled loss (unscaled here). Where
        the loop clipped them itself (routed), its clip measured them first (watch_clip.py)."""
        core = self._c
        amp = self.amp.unscale(core.probes.device) if scaled else None
        clip = core.world.clip or clip_by_global_norm
        seen = None if self._loop_clip is None else self._loop_clip.take()
        if seen is None:
            norm, factor, per_tensor = clip(core.probes.params, self.cfg.grad_clip)
        else:
            norm, factor, per_tensor = seen  # before the loop's clip
            if self.cfg.grad_clip is not None:  # and the Watch's own bound on top of it
                factor = factor * clip(core.probes.params, self.cfg.grad_clip)[1]
        if self._loss_share is not None:
            loss = self._loss_share
        elif self._loss_sum is not None:  # one micro-batch: no division launched
            loss = self._loss_sum if self._loss_n == 1 else self._loss_sum / self._loss_n
        else:
            raise RuntimeError(
                "spikewatch saw no loss this step: call observe_loss(loss) (or step(loss))"
            )
        self._forget_losses()  # taken: the next step's are the next step's
        recording = self.attn.active
        taken = self.attn.take()
        self.attn.active = False  # until the next step: evaluations and replays record nothing
        if recording and taken is None and not self._attn_told and core.world.is_main:
            self._attn_told = True  # once: a model whose attention spikewatch cannot see
            say(log, "no per-head attention maxima: the model's attention does not record them "
                "(call watch.attn.sdpa(layer, q, k, v) in it, or watch.attn.record(layer, "
                "maxima); settings probes.attn_max=false says you do not want them)")  # fmt: skip
        layers, values = taken if taken is not None else (None, None)
        return StepTensors(
            loss=loss,
            grad_norm=norm,
            clip_factor=factor,
            grad_norms=per_tensor,
            attn_max=values,
            attn_layers=layers,
            overflow=None if amp is None else amp[0],
            loss_scale=None if amp is None else amp[1],
        )

    # -- checkpoints and state --------------------------------------------------------------
    def persist(self) -> None:
        """Before a framework publishes its own checkpoint: the waiting update statistics go
        out and every record so far becomes durable, so a resume from that checkpoint, which
        re-sends only the steps after it, leaves each row in the store exactly once."""
        core = self._c
        core.flush_probes()
        recorder = next((c for c in core.callbacks if isinstance(c, Recorder)), None)
        if recorder is not None:
            recorder.persist()

    def state_dict(self) -> dict[str, Any]:
        """Everything but tensors (core/state.py's `trainer.json` schema): counters, data
        position (with the loop's loader's, `batches(loader)`), skips, records, callback
        states, in JSON types. Frameworks keep it in their own checkpoints
        (`accelerator.register_for_checkpointing(watch)`), so their resume resumes it."""
        core = self._c
        out = core.state_dict()
        if core.run.stream is not None:
            out["data_stream"] = stream_to_json(core.run.stream())
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A `state_dict()` back (a framework's resume): the run continues from its step, the
        loop's loader from its position when `batches(loader)` next meets it."""
        core = self._c
        core.load_state_dict(state)
        core.run.stream_saved = stream_from_json(state.get("data_stream"))

    def close(self, status: str | None = None) -> dict[str, Any]:
        """Flush the last update statistics, save the final state, close the run in the store;
        returns the summary (the built-in trainer's keys)."""
        core = self._c
        if self._closed:
            return self.summary()
        self._closed = True
        ended = status in ("failed", "abandoned")  # the others may be gone: no collective
        try:
            if ended:
                core.start(anchor=False)  # failed before its first step: recorded all the same
                core.finish_pending()
                for cb in core.callbacks:
                    cb.on_fit_end(core.fit_state("failed" if status == "failed" else "stopped"))
            else:
                core.finish(status or self._end_status())
        finally:
            if self._undo_sigterm is not None:
                self._undo_sigterm()
                self._undo_sigterm = None
            if self._forward_hook is not None:
                self._forward_hook.remove()
                self._forward_hook = None
            if self._last_grad is not None:
                self._last_grad.remove()
                self._last_grad = None
            if self._undo_clip is not None:
                self._undo_clip()
                self._undo_clip = None
            if self.sink is not None:
                self.sink.close(timeout=30)
            if not ended:
                core.world.barrier()
        return self.summary()

    def _end_status(self) -> str:
        """How a run that did not fail ended: halted by the guard, stopped before its planned
        steps (said), or completed."""
        core = self._c
        if core.halted:
            return "halted"
        planned = self.cfg.max_steps
        if core.stop_requested or (planned is not None and core.step_count < planned):
            if core.world.is_main:
                say(log, f"run {core.run.run_id} stopped at step {core.step_count}"
                    + (f" of {planned}" if planned is not None else ""))  # fmt: skip
            return "stopped"
        return "completed"

    def _close_at_exit(self) -> None:
        """At interpreter exit, a run nobody closed (an exception ended the training, or the
        script forgot `close()`) is closed in the store as failed (or stopped), so that no run
        stays "running" for ever. No checkpoint: the other ranks may be gone."""
        if self.core is not None and not self._closed:
            try:
                crashed = UNCAUGHT and not isinstance(UNCAUGHT[-1], KeyboardInterrupt)
                self.close("failed" if crashed else "abandoned")  # Ctrl-C, SIGTERM: stopped
            except Exception as e:  # at exit: say it, never mask the original error
                log.error("closing the run at exit failed: %s", e)

    def write_summary(self, path: str | Path) -> None:
        """The summary as strict JSON (non-finite numbers as null)."""
        if self._c.world.is_main:
            write_json(path, self.summary())

    def summary(self) -> dict[str, Any]:
        return {**self._c.summary(), "framework": self.framework}

    def run_config(self) -> dict[str, Any]:
        """The run's config as the store and dashboard see it."""
        return {
            **self.cfg.to_dict(),
            "framework": self.framework,
            "model": self.model_info,
            "optim": describe_optimizer(self.optimizer),
            "train": {"max_steps": self.cfg.max_steps},
        }
