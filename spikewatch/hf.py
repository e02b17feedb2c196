"""Hugging Face `transformers.Trainer`: one callback gives a run the whole loop.

    trainer = Trainer(..., callbacks=[SpikewatchCallback(db="sqlite:///runs/spikewatch.db")])

A callback cannot refuse an update, so the callback routes the Trainer's optimizer and
scheduler through the `Watch`, which owns the rest; it translates the Trainer's events and
keeps its step counts meaning what the user set. What it does, hook by hook:
docs/integrations.md, "What the callback does".
"""

from __future__ import annotations

import inspect
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from spikewatch._adapter import Adapter
from spikewatch._optional import require
from spikewatch.hf_attention import ATTN_IMPLEMENTATION, attach_attention, register_attention
from spikewatch.trainer.core.attribution import FED_STEPS, ID_KEYS, MicroBatches, tokens_in

if TYPE_CHECKING:
    from transformers import TrainerCallback
else:
    TrainerCallback = require("transformers", "hf").TrainerCallback

__all__ = ["ATTN_IMPLEMENTATION", "SpikewatchCallback", "attach_attention", "register_attention"]

log = logging.getLogger(__name__)

STATE_FILE = "spikewatch.json"


def _spare_updates(args: Any, state: Any, loader: Any) -> int | None:
    """Updates the Trainer's epochs hold beyond `state.max_steps` (None: no length, so the
    Trainer loops over an iterable until max_steps). HF fixes the epoch count at start."""
    try:
        n = len(loader)
    except TypeError:
        return None
    ga = max(1, args.gradient_accumulation_steps)
    per_epoch = max(n // ga + int(n % ga > 0), 1)
    if args.max_steps > 0:
        epochs = args.max_steps // per_epoch + int(args.max_steps % per_epoch > 0)
    else:
        epochs = math.ceil(args.num_train_epochs)
    return max(0, epochs * per_epoch - state.max_steps)


def _calling_trainer() -> Any:
    """The Trainer whose `train()` is running this callback (callbacks are not given it)."""
    from transformers import Trainer

    frame = inspect.currentframe()
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
        frame = frame.f_back
    return None


def _resumed_from() -> Path | None:
    """The checkpoint folder the running `Trainer.train` resumed from (its folder's name is the
    step; its `global_step`, the data position)."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name in ("_inner_training_loop", "train"):
            where = frame.f_locals.get("resume_from_checkpoint")
            if isinstance(where, str | Path):
                return Path(where)
        frame = frame.f_back
    return None


def _replace(path: Path, text: str) -> None:
    """Write `path` whole or not at all (a kill mid-write leaves the old file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


class SpikewatchCallback(Adapter, TrainerCallback):
    """spikewatch for a Hugging Face Trainer; options as `Adapter`'s."""

    _hook: Any = None
    _ids_hook: Any = None
    _ids: Any = None  # the rows' own ids of the forward in progress
    _id_keys: tuple[str, ...] = ()  # the id entries the model's forward does not take
    _clip: float | None = None
    _spare: int | None = None  # updates the Trainer's data holds beyond max_steps
    _grad_norm: torch.Tensor | None = None  # what the Trainer logs as grad_norm (see below)
    _trainer: Any = None
    _position = 0  # the Trainer's steps taken (batches / accumulation): the data position
    _fed: dict[int, list[dict[str, Any]]]  # position -> the micro-batches the model was fed
    _measuring = False  # the attribution's own forwards: not the step's

    # -- start and end ----------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):  # noqa: ANN001
        if self._clip is None:  # the first train() of these args: what the user asked for
            self._clip = args.max_grad_norm if args.max_grad_norm > 0 else 0.0
        args.max_grad_norm = 0.0  # the Watch clips, after measuring the norm (on_step_begin)
        self._target = state.max_steps
        saved = self._saved_state(args, state)
        self._position = state.global_step  # trainer_state.json's: the data position
        if saved is not None:
            saved = dict(saved)
            self._position = int(saved.pop("framework_position", state.global_step))
        watch = self._open(
            model,
            optimizer,
            kw.get("lr_scheduler"),
            framework="hf",
            output_dir=args.output_dir,
            default_name=Path(args.output_dir).name or "hf",
            max_steps=state.max_steps,
            saved=saved,
            clip=self._clip,
            warmup_steps=args.get_warmup_steps(state.max_steps),
        )
        self._hook = model.register_forward_hook(self._loss_hook, with_kwargs=True)
        takes = inspect.signature(model.forward).parameters  # a model's own `ids` stays its own
        self._id_keys = tuple(k for k in ID_KEYS if k not in takes)
        self._ids_hook = model.register_forward_pre_hook(self._take_ids, with_kwargs=True)
        self._fed = {}
        if watch.cfg.guard.attribute_samples:  # the batches it fed are at hand: name rows
            tokenizer = kw.get("processing_class") or kw.get("tokenizer")
            watch.attribute_with(
                self._fed_at,
                lambda row: self._row_loss(model, row),
                getattr(tokenizer, "decode", None),
            )
        self._share_grad_norm(model)
        if self.attn_max and watch.cfg.probes.attn_max:
            attach_attention(model, watch.attn)
        state.global_step = watch.step_count  # a resume's data position is ours
        self._spare = _spare_updates(args, state, kw.get("train_dataloader"))
        if self._spare == 0 and watch.cfg.guard.rollback and watch.cfg.checkpoint.any_tier:
            log.warning(
                "the Trainer's data holds exactly its %d planned updates (%s): updates a "
                "rollback discards cannot be made up, so such a run ends short of its plan. "
                "To keep them, give it data to spare: max_steps with a longer dataset, or an "
                "IterableDataset",
                state.max_steps,
                "num_train_epochs, no max_steps" if args.max_steps <= 0 else "max_steps",
            )

    def on_train_end(self, args, state, control, **kw):  # noqa: ANN001
        if self._hook is not None:
            self._hook.remove()
            self._ids_hook.remove()
        if self._trainer is not None:  # its own _get_grad_norm again
            self._trainer.__dict__.pop("_get_grad_norm", None)
            self._trainer = None
        args.max_grad_norm = self._clip  # the user's arguments are theirs again
        watch = self._w
        if watch.step_count < self._target and watch.halted is None and not watch.should_stop:
            log.warning(
                "made %d of %d planned updates: rollbacks discarded %d and the Trainer's data "
                "ran out (it fixes its epochs when training starts), so the LR schedule did "
                "not finish; give it data to spare (see the warning at start)",
                watch.step_count,
                self._target,
                self._position - watch.step_count,
            )
        self._close()
        if self.summary is not None:
            self.summary["planned_steps"] = self._target
            self.summary["framework_step"] = state.global_step

    # -- the step ---------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
        self._slow_work_ends()
        args.max_grad_norm = 0.0  # back after the step: saved training_args keep the user's
        self._w.begin_step(self._position)

    def _take_ids(self, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        """A batch's own "id" entry (kept with remove_unused_columns=False) names its rows in
        the attribution; the model never sees it."""
        key = next((k for k in self._id_keys if k in kwargs), None)
        self._ids = None if key is None else kwargs.pop(key)
        return args, kwargs

    def _loss_hook(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._measuring or not (module.training and torch.is_grad_enabled()):
            return
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if loss is None:
            raise RuntimeError(
                "spikewatch sees no loss: the model's output has none (pass labels to the "
                "model, or call the Watch's observe_loss(loss) from your compute_loss)"
            )
        # With num_items_in_batch the model divides by the whole step's tokens: a share.
        self._w.observe_loss(loss, share=kwargs.get("num_items_in_batch") is not None)
        self._w.add_tokens(tokens_in(kwargs) * self._w.world.size)  # shapes: no device read
        if self._w.cfg.guard.attribute_samples:  # kept, not copied: the attribution's rows
            fed = {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}
            if self._ids is not None:
                fed["id"] = self._ids
            self._fed.setdefault(self._position, []).append(fed)
            while len(self._fed) > FED_STEPS:
                del self._fed[next(iter(self._fed))]

    def _fed_at(self, index: int) -> MicroBatches | None:
        """The micro-batches the model was fed at data position `index`, while kept."""
        fed = self._fed.get(index)
        return None if fed is None else MicroBatches(fed)

    def _row_loss(self, model: torch.nn.Module, row: dict[str, Any]) -> torch.Tensor:
        """One row's own loss (the model's mean over its tokens), for the attribution."""
        self._measuring = True
        try:
            return model(**row).loss
        finally:
            self._measuring = False

    def on_optimizer_step(self, args, state, control, **kw):  # noqa: ANN001
        if self._grad_norm is not None:  # the step's norm before clipping, for HF's log
            norm = self._w.grad_norm  # None: a skipped batch, not measured
            if norm is None:
                self._grad_norm.fill_(math.nan)
            else:
                self._grad_norm.copy_(norm)

    def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
        args.max_grad_norm = self._clip  # checkpoints, logs and evals see the user's value
        self._position += 1
        taken, updates = state.global_step, self._w.step_count
        if taken != updates:  # rolled back or refused: the Trainer counted an update not made
            state.global_step = updates
            # the Trainer's flow callback decided on `taken`: the update it would log, save
            # or evaluate is not there, and it comes again at `taken`
            control.should_log = control.should_save = control.should_evaluate = False
            if taken >= state.max_steps > updates:
                control.should_training_stop = False
        if self._w.halted is not None or self._w.stop_agreed:
            control.should_training_stop = True
        if control.should_evaluate or control.should_save:  # the Trainer does it next
            self._slow_work_begins()
        return control

    def on_evaluate(self, args, state, control, metrics=None, **kw):  # noqa: ANN001
        loss = (metrics or {}).get("eval_loss")
        if loss is not None and math.isfinite(loss):
            self._eval(loss)

    def on_save(self, args, state, control, **kw):  # noqa: ANN001
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if self.watch is not None and folder.is_dir():  # NaN kept: a state, not a report
            self.watch.persist()
            trainer_state = folder / "trainer_state.json"
            if trainer_state.is_file() and self._position != state.global_step:
                # the Trainer's resume skips `global_step` steps of data: the data position
                written = json.loads(trainer_state.read_text())
                written["global_step"] = self._position
                _replace(trainer_state, json.dumps(written, indent=2, sort_keys=True) + "\n")
            # last: its presence says the checkpoint is whole (a kill between the two writes
            # once left a checkpoint whose resume skipped the Trainer's count of data)
            saved = {**self.watch.state_dict(), "framework_position": self._position}
            _replace(folder / STATE_FILE, json.dumps(saved, allow_nan=True))

    # -- helpers ----------------------------------------------------------------------------
    def _share_grad_norm(self, model: torch.nn.Module) -> None:
        """With `max_grad_norm` at 0 (the Watch clips, after measuring), the Trainer computes
        the gradient norm once more for its log (`_get_grad_norm`: a norm and a multiply by 1
        over every gradient, ~2% of a small model's step). The Trainer that called
        `on_train_begin` gets, instead, the norm the Watch measured before clipping: a tensor
        it logs as before, filled on device at `on_optimizer_step`, before the Trainer reads
        it. A Trainer that cannot be found (or a subclass with its own `_get_grad_norm`)
        keeps its own."""
        trainer = _calling_trainer()
        if trainer is None or "_get_grad_norm" in trainer.__dict__:
            return
        from transformers import Trainer

        if type(trainer)._get_grad_norm is not Trainer._get_grad_norm:
            return
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        shared = self._grad_norm = torch.full((), math.nan, device=device)

        def get_grad_norm(model: Any, grad_norm: Any = None) -> Any:
            return shared if grad_norm is None else grad_norm

        trainer._get_grad_norm = get_grad_norm
        self._trainer = trainer

    @staticmethod
    def _saved_state(args: Any, state: Any) -> dict[str, Any] | None:
        """The Watch's state in the checkpoint the Trainer resumed from, if it did."""
        if state.global_step == 0:
            return None
        folder = _resumed_from() or Path(args.output_dir) / f"checkpoint-{state.global_step}"
        path = folder / STATE_FILE
        if not path.is_file():
            log.warning("resuming without %s: the guard starts afresh", path)
            return None
        return json.loads(path.read_text())
