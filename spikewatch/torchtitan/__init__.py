"""torchtitan (0.3): `SpikewatchTrainer`, a torchtitan `Trainer` whose every step goes through
the `Watch` (trainer/watch.py).

torchtitan has no callback API; its extension route is a `Trainer` subclass with its own
nested `Config`, which a config function returns:

    torchrun --nproc_per_node=8 -m torchtitan.train --module spikewatch.torchtitan \
        --config llama3_8b --spikewatch.db postgresql+psycopg://...

What the subclass does, and what it refuses: docs/torchtitan.md, "What the subclass does".
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from spikewatch._adapter import Adapter
from spikewatch._optional import require
from spikewatch.trainer.checkpoints.memory import AUTO_STEPS
from spikewatch.trainer.core.attribution import ID_KEYS, MicroBatches
from spikewatch.trainer.core.cause import NotAtHand
from spikewatch.trainer.core.world import World
from spikewatch.trainer.watch import Watch

require("torchtitan", "torchtitan")
try:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.trainer import Trainer
except ImportError as e:  # torchtitan 0.3 imports triton, which torch's CUDA builds bring
    raise ImportError(f"spikewatch.torchtitan: torchtitan's trainer does not import: {e}") from e

from spikewatch.torchtitan.checkpoints import TitanCheckpointManager, TitanDisk  # noqa: E402
from spikewatch.torchtitan.maxima import attach_inner_attention  # noqa: E402

Batches = list[tuple[dict[str, torch.Tensor], torch.Tensor]]  # a step's micro-batches

__all__ = ["SpikewatchOptions", "SpikewatchTrainer", "with_spikewatch"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class SpikewatchOptions:
    """`--spikewatch.*` on torchtitan's command line."""

    db: str | None = None
    """The store's URL (default: $SPIKEWATCH_DB_URL, else runs/spikewatch.db here)."""
    name: str | None = None
    """The run's name (default: the model's name and flavor)."""
    settings: str = ""
    """WatchSettings overrides as a JSON object, e.g. '{"guard": {"rollback": false}}'."""
    attn_max: bool = True
    """Record the per-head attention maxima of the inner attention modules."""
    summary_json: str = ""
    """Write the run's summary here at the end (rank 0)."""
    replay_steps: int = -1
    """Steps of batches kept on the host to replay a spike (its cause) and name its rows: -1,
    twice the host-memory interval plus 32; 0, none (no cause, no rows named)."""


class SpikewatchTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        spikewatch: SpikewatchOptions = field(default_factory=SpikewatchOptions)

    def __init__(self, config: Config) -> None:
        _refuse_unsupported(config)
        settings = watch_settings(config.spikewatch)
        config.checkpoint = titan_checkpoints(config.checkpoint)
        self.spikewatch_state: dict[str, Any] | None = None  # the Watch's, from a checkpoint
        super().__init__(config)
        opts = config.spikewatch
        self._adapter = Adapter(
            db=opts.db, name=opts.name, settings=settings, attn_max=opts.attn_max
        )
        self._position = 0  # batches drawn: the data position (the loader flows on)
        every = settings["checkpoint"].get("memory_interval")
        memory = AUTO_STEPS[1] if every == "auto" else every or 0  # at most, when "auto"
        keep = opts.replay_steps if opts.replay_steps >= 0 else 2 * memory + 32
        self._keep_steps = keep
        self._fed: dict[int, tuple[Batches, torch.Tensor]] = {}  # data position -> its batches
        if len(self.model_parts) != 1 or len(self.optimizers.optimizers) != 1:
            raise ValueError(
                "spikewatch.torchtitan: one model part with one optimizer is supported "
                f"(this job has {len(self.model_parts)} and {len(self.optimizers.optimizers)})"
            )

    # -- the Watch ------------------------------------------------------------------------
    @property
    def watch(self) -> Watch:
        """The run's Watch, opened at the first step (after torchtitan's checkpoint load)."""
        if self._adapter.watch is None:
            cfg = self.config
            spec = cfg.model_spec
            saved = self.spikewatch_state
            manager = self.checkpointer
            disk = None
            if isinstance(manager, TitanCheckpointManager) and manager.enable:

                def disk(world: World) -> TitanDisk:
                    manager.disk = TitanDisk(
                        manager, world, train_state=self, before_save=self._before_save
                    )
                    return manager.disk

            watch = self._adapter._open(
                self.model_parts[0],
                self.optimizers.optimizers[0],
                self.lr_schedulers.schedulers[0],
                framework="torchtitan",
                output_dir=cfg.dump_folder,
                default_name=f"{spec.name}-{spec.flavor}" if spec is not None else "torchtitan",
                max_steps=cfg.training.steps,
                saved=saved,
                clip=cfg.training.max_norm if cfg.training.max_norm > 0 else None,
                warmup_steps=cfg.lr_scheduler.warmup_steps,
                disk=disk,
            )
            if saved:
                self._position = int(saved.get("torchtitan_position", self._position))
            if self._adapter.attn_max and watch.cfg.probes.attn_max:
                attach_inner_attention(self.model_parts[0], watch.attn)
            if self._keep_steps:  # the batches are at hand: replay a spike, name its rows
                watch.replay_with(self._replay_step)
                tokenizer = getattr(self, "tokenizer", None)
                watch.attribute_with(
                    self._fed_at, self._row_loss, getattr(tokenizer, "decode", None)
                )
        return self._adapter._w

    def train_step(
        self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]
    ) -> None:
        """torchtitan's step (no pipeline parallelism) with the Watch's phases."""
        watch = self.watch
        watch.begin_step(self._position)
        self.optimizers.zero_grad(set_to_none=True)
        step: int = self.step  # type: ignore[has-type]  # counted by torchtitan's loop already
        should_log = self.metrics_processor.should_log(step)
        lr_metrics = self.lr_schedulers.get_metrics()
        batches: Batches = []
        local_tokens = torch.tensor(0, dtype=torch.int64)
        for _ in range(self.gradient_accumulation_steps):
            input_dict, labels = next(data_iterator)
            local_tokens += (labels != IGNORE_INDEX).sum()
            batches.append((input_dict, labels))
        dims = self.parallel_dims
        if dims.dp_enabled:
            tokens = dist_utils.dist_sum_tensor(
                local_tokens.to(self.device), dims.get_mesh("batch")
            )
        else:
            tokens = local_tokens.to(self.device)
        if self._keep_steps:  # as drawn, on the host, for a replay and the rows' names
            self._fed[self._position] = (batches, tokens)  # _forward_backward changes none
            while len(self._fed) > self._keep_steps:
                del self._fed[next(iter(self._fed))]
        self._position += 1
        watch.add_tokens(int(local_tokens) * watch.world.size)  # on the host: no device read
        total = self._forward_backward(batches, tokens)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()  # routed: measure, clip, gate, apply or refuse, decide
        self.lr_schedulers.step()  # held unless the step was applied or refused
        self.step = watch.step_count  # a rollback sets the run back
        if should_log:
            self._log(total, tokens, lr_metrics)

    def _forward_backward(self, batches: Batches, tokens: torch.Tensor) -> torch.Tensor:
        """torchtitan's forward and backward of each micro-batch, each loss to the Watch: this
        rank's token sum over the job's tokens, x world (a rank's own mean loss; the ranks'
        mean is then the job's loss, as the Watch reduces it). Returns the rank's loss."""
        world = self.watch.world.size
        total: torch.Tensor | None = None
        for input_dict, labels in batches:
            inputs = {k: v for k, v in input_dict.items() if k not in ID_KEYS}  # a row's id
            for key, value in inputs.items():
                if isinstance(value, torch.Tensor):
                    inputs[key] = value.to(self.device)
            loss = self.forward_backward_step(
                input_dict=inputs, labels=labels.to(self.device), global_valid_tokens=tokens
            )
            self.watch.observe_loss(loss.detach() * world, share=True)
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None  # at least one micro-batch
        return total

    # -- a spike's batches again: its cause (replay) and its rows (attribution) ---------------
    def _replay_step(self, index: int) -> None:
        kept = self._fed.get(index)
        if kept is None:
            raise NotAtHand(
                f"batch {index} is no longer kept (the last {self._keep_steps} steps are: "
                "--spikewatch.replay_steps)"
            )
        self._forward_backward(*kept)

    def _fed_at(self, index: int) -> MicroBatches | None:
        """The rows of the batch at data position `index` as dicts (input, labels, id)."""
        kept = self._fed.get(index)
        if kept is None:
            return None
        return MicroBatches([{**d, "labels": y} for d, y in kept[0]])

    def _row_loss(self, row: dict[str, torch.Tensor]) -> torch.Tensor:
        """One row's own loss (its mean over its tokens) through torchtitan's model and loss."""
        device = self.device
        input_dict = {k: v.to(device) for k, v in row.items() if k not in (*ID_KEYS, "labels")}
        labels = row["labels"].to(device)
        inputs, labels, extra = self.post_dataloading_process(input_dict, labels)
        with self.train_context():
            pred = self.model_parts[0](inputs, **extra)
            n = (labels != IGNORE_INDEX).sum().clamp(min=1)
            loss, _ = self.loss_fn(pred, labels, n)
        return loss

    def _before_save(self, step: int) -> bool:
        """Before torchtitan saves `step`: the step in flight is read and acted on (a
        checkpoint holds only decided steps); a rollback there moved the run: no save."""
        watch = self._adapter.watch
        if watch is None:
            return True
        watch.read_in_flight()
        return watch.step_count == step

    def _log(self, total: torch.Tensor, tokens: torch.Tensor, lr_metrics: dict) -> None:
        """torchtitan's metrics line (no crash on a non-finite loss: the Watch refused it)."""
        mesh = self.parallel_dims.get_optional_mesh("loss")
        loss = dist_utils.dist_sum(total, mesh) if mesh is not None else float(total)
        norm = self.watch.grad_norm
        self.metrics_processor.log(
            self.step,
            loss,
            loss,
            float(norm) if norm is not None else math.nan,
            extra_metrics={"n_tokens_seen": self.ntokens_seen, **lr_metrics},
        )

    def should_continue_training(self) -> bool:
        adapter = self._adapter
        halted = adapter.watch is not None and adapter.watch.halted is not None
        return not halted and super().should_continue_training()

    def train(self) -> None:
        try:
            super().train()
        finally:
            self._adapter._close()
            summary = self._adapter.summary
            if summary is not None:
                summary["framework_step"] = self.step
                if self.config.spikewatch.summary_json:
                    self._adapter.write_summary(self.config.spikewatch.summary_json)

    @property
    def summary(self) -> dict[str, Any] | None:
        """The run's summary once training has ended (rank 0 writes it: `write_summary`)."""
        return self._adapter.summary

    def write_summary(self, path: str) -> None:
        self._adapter.write_summary(path)

    # -- torchtitan's checkpoints carry the Watch ---------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        watch = self._adapter.watch
        state: dict[str, Any] = {}
        if watch is not None:
            watch.persist()
            state = {**watch.state_dict(), "torchtitan_position": self._position}
        out["spikewatch"] = json.dumps(state)  # one opaque entry: DCP stores it as bytes
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        saved = json.loads(state_dict.get("spikewatch") or "{}")
        self.spikewatch_state = saved or None


def titan_checkpoints(config: Any) -> Any:
    """torchtitan's checkpoint config as `TitanCheckpointManager`'s (the same fields): its DCP
    checkpoints become the Watch's disk tier, kept on spikewatch's schedule."""
    if isinstance(config, TitanCheckpointManager.Config):
        return config
    if type(config) is not CheckpointManager.Config:
        log.warning("a checkpoint manager of its own (%s): not a rollback tier", type(config))
        return config
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return TitanCheckpointManager.Config(**fields)


def watch_settings(opts: SpikewatchOptions) -> dict[str, Any]:
    """`--spikewatch.settings` as the Watch's settings. The Watch's own disk tier is refused:
    torchtitan's checkpoints are the disk tier here (rollback targets, and their resume
    carries spikewatch), and torch's DCP state dict cannot name the parameters of torchtitan's
    fused modules."""
    try:
        settings = json.loads(opts.settings) if opts.settings else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--spikewatch.settings is not JSON: {e}") from e
    if not isinstance(settings, dict):
        raise ValueError("--spikewatch.settings must be a JSON object")
    checkpoint = settings.setdefault("checkpoint", {})
    if checkpoint.get("interval"):
        raise ValueError(
            "spikewatch.torchtitan: the Watch's disk checkpoints (checkpoint.interval) are not "
            "for torchtitan: its own --checkpoint.* are the disk tier (rollback targets, and "
            "spikewatch resumes with them)"
        )
    checkpoint.setdefault("interval", None)
    checkpoint.setdefault("memory_interval", "auto")
    return settings


def with_spikewatch(config: Trainer.Config, **options: Any) -> SpikewatchTrainer.Config:
    """`config` (any torchtitan `Trainer.Config`) with spikewatch on: the same fields in
    `SpikewatchTrainer.Config`, `options` (SpikewatchOptions' fields) its `spikewatch`."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return SpikewatchTrainer.Config(**fields, spikewatch=SpikewatchOptions(**options))


_REGISTRIES = ("llama3", "llama4", "qwen3", "qwen3_5", "deepseek_v3", "gpt_oss", "kimi_k2_7")


def __getattr__(name: str) -> Callable[[], SpikewatchTrainer.Config]:
    """`--module spikewatch.torchtitan --config NAME`: torchtitan's config function NAME (from
    its model registries) with spikewatch on."""
    for model in _REGISTRIES:
        try:
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except ImportError:
            continue
        fn = getattr(registry, name, None)
        if callable(fn) and not name.startswith("_"):
            return lambda: with_spikewatch(fn())
    raise AttributeError(f"module 'spikewatch.torchtitan' has no attribute {name!r}")


def _refuse_unsupported(config: Trainer.Config) -> None:
    if config.parallelism.pipeline_parallel_degree > 1:
        raise ValueError("spikewatch.torchtitan: pipeline parallelism is not supported")
    if torch.cuda.is_available() and not config.training.disable_cuda_graphs:
        raise ValueError(
            "spikewatch.torchtitan: CUDA graphs replay the forward without Python, so the "
            "probes would see the capture only: pass --training.disable_cuda_graphs"
        )
