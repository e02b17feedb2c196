"""Scale-out under torchrun on PyTorch's own engine (DDP, FSDP2), with every rank agreeing.

A `World` is the run's view of the other processes. In one process (`strategy = None`) every
method is the identity, so the single-process arithmetic stays bitwise what it was. Under
torchrun:

- Data: the global batch of a batch index is the same pure function of (seed, index) as in one
  process; rank r trains rows [r*B/W, (r+1)*B/W) of it. W ranks together train exactly the
  one-process batch, and skip ranges (ranges of batch indices) apply to every rank alike.
- Gradients: DDP averages them across ranks during backward, so every rank holds the full
  gradient, and clipping and the gradient probes (global and per-layer norms) are computed on
  it exactly as in one process. FSDP2 leaves each rank a shard of the averaged gradient:
  clipping and the per-layer norms sum the squares of the local shards over the ranks, then
  take the root; the parameter, update and optimizer-state probes reduce the same way (sums
  summed, maxima maxed), see `sum_shards` and `max_shards`.
- The step's scalars are reduced before its one host transfer: loss, ce and z are means over
  ranks (the global-batch mean: the shards are equal), attention and output-logit maxima are
  maxima over ranks. A NaN or inf on any rank survives the sum, so every rank sees the same
  non-finite verdict; a stop request (SIGTERM) on any rank rides the same all-reduce.
- Decisions: rank 0's callbacks (the spike guard, the recorder, dashboard requests) decide the
  step's action and it is broadcast (`agree`), so every rank carries out the same Continue,
  SkipUpdate, Rollback or Halt at the same step. Objects and barriers go through a gloo group,
  so a decision costs no device transfer under NCCL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from spikewatch.trainer.config import ConfigError, DataConfig, TrainConfig
from spikewatch.trainer.core.norms import norms, scale_
from spikewatch.trainer.core.transfer import Clip, StepTensors

__all__ = ["World", "attach_world", "env_rank", "init_world", "say"]

log = logging.getLogger(__name__)


def env_rank() -> int:
    """This process's rank as torchrun announced it (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


def _env_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a tensor: the local shard of a DTensor, else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class World:
    strategy: str | None = None  # "ddp" | "fsdp2"; None = one process
    rank: int = 0
    size: int = 1
    group: Any = None  # gloo group for objects and barriers; None = the default group
    owns_group: bool = False  # init_world created the process group (and destroys it)
    fwd: torch.nn.Module | None = None  # what the step calls forward on (set by wrap)

    @property
    def distributed(self) -> bool:
        return self.strategy is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- data ------------------------------------------------------------------------------
    def rows(self, batch_size: int, rank: int | None = None) -> slice | None:
        """This rank's (or `rank`'s) rows of a global batch; None in one process (all)."""
        if not self.distributed:
            return None
        n, r = batch_size // self.size, self.rank if rank is None else rank
        return slice(r * n, (r + 1) * n)

    def shard(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of an evaluation batch (all of them when they do not divide)."""
        if not self.distributed or x.size(0) % self.size:
            return x, y
        rows = self.rows(x.size(0))
        return x[rows], y[rows]

    def micro_batch(self, data: DataConfig) -> int:
        return data.micro_batch_size or data.batch_size // self.size

    # -- the model -------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """DDP wraps the model; FSDP2 shards each block and the root in place (build the
        optimizer after this: it must hold the sharded parameters)."""
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [device.index] if device.type == "cuda" else None
            # The only buffers are the RoPE tables, equal everywhere: no per-step broadcast.
            self.fwd = DDP(model, device_ids=ids, forward_sync_buffers=False)
        elif self.strategy == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (self.size,))
            for block in model.blocks:  # type: ignore[union-attr]
                fully_shard(block, mesh=mesh, reshard_after_forward=True)
            fully_shard(model, mesh=mesh, reshard_after_forward=True)
            self.fwd = model
        else:
            self.fwd = model
        return self.fwd

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Around the micro-batches before the last: no gradient reduction yet."""
        if self.strategy == "ddp":
            return self.fwd.no_sync()  # type: ignore[union-attr,operator]
        if self.strategy == "fsdp2":
            return _fsdp_no_sync(self.fwd)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def replay_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Around a replayed step's forward and backward (core/cause.py) under DDP: when the
        user's `loss_fn` calls the module inside the DDP wrapper the Watch was given, and not
        the wrapper, no gradient is averaged and the replay trains another update than the
        step did (a data spike then reads as the device's). The gradients are averaged here
        then, on every rank alike (all ranks replay together)."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        if self.strategy != "ddp" or not isinstance(model, DDP):
            yield
            return
        calls = [0]
        hook = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            yield
        finally:
            hook.remove()
        if calls[0] == 0:  # the wrapper was passed by: average as its reducer would have
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(self.size)

    @property
    def clip(self) -> Clip | None:
        """The clipping of sharded gradients (fsdp2); None = step.py's own."""
        return _sharded_clip if self.strategy == "fsdp2" else None

    # -- reductions ------------------------------------------------------------------------
    def reduce(self, t: StepTensors, stop: bool) -> StepTensors:
        """The step's scalars over all ranks: means of loss, ce and z; maxima of the logit
        maxima; the number of ranks asked to stop; and each rank's own loss (gathered, so a
        verdict can name the rank whose data departed). Two collectives, no host sync."""
        if not self.distributed:
            return t
        means = [m for m in (t.loss, t.ce, t.z_mean) if m is not None]
        flag = torch.full((), float(stop), device=t.loss.device)
        tail = [flag] if t.overflow is None else [flag, t.overflow.float().reshape(())]
        mine = torch.stack([*(m.float() for m in means), *tail])  # (k+1,) or (k+2,)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine)
        every = torch.stack(parts)  # (W, k+1): every rank's own values, in rank order
        summed = every.sum(dim=0)
        mean = summed[: len(means)] / self.size
        out = replace(t, loss=mean[0], stop=summed[len(means)], rank_losses=every[:, 0])
        if t.overflow is not None:  # a GradScaler's overflow on any rank (FSDP2 shards)
            out = replace(out, overflow=summed[len(means) + 1])
        rest = iter(mean[1:])
        if t.ce is not None:
            out = replace(out, ce=next(rest))
        if t.z_mean is not None:
            out = replace(out, z_mean=next(rest))
        maxima = [m for m in (t.logit_max, t.attn_max) if m is not None]
        if maxima:
            flat = torch.cat([m.float().reshape(-1) for m in maxima])
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)
            if t.logit_max is not None:
                out, flat = replace(out, logit_max=flat[0]), flat[1:]
            if t.attn_max is not None:
                out = replace(out, attn_max=flat.view(t.attn_max.shape))
        return out

    def reshard(self, model: torch.nn.Module) -> None:
        """After a forward with no backward (fsdp2): the root keeps its parameters gathered
        until a backward; give them back their shards (the optimizer holds those)."""
        if self.strategy != "fsdp2":
            return
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def every(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's scalar `x`, in rank order: (W,) on every rank."""
        if not self.distributed:
            return x.reshape(1)
        parts = [torch.empty_like(x.reshape(1)) for _ in range(self.size)]
        dist.all_gather(parts, x.reshape(1).contiguous())
        return torch.cat(parts)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """The mean of a tensor over ranks (gloo has no AVG: a sum, divided)."""
        if not self.distributed:
            return x
        x = x.clone()
        dist.all_reduce(x)
        return x / self.size

    def sum_shards(self, x: torch.Tensor) -> torch.Tensor:
        """A per-layer sum over parameter shards (fsdp2); the identity where ranks hold whole
        parameters (one process, DDP: replicas are equal, summing them would be wrong)."""
        if self.strategy != "fsdp2":
            return x
        x = x.clone()
        dist.all_reduce(x)
        return x

    def max_shards(self, x: torch.Tensor) -> torch.Tensor:
        if self.strategy != "fsdp2":
            return x
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x

    # -- agreement -------------------------------------------------------------------------
    def agree(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (rank 0 keeps its very object)."""
        if not self.distributed:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return obj if self.is_main else box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.is_main else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def all_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (host objects: tensors on the CPU), in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def min_int(self, x: int) -> int:
        """The smallest of every rank's `x` (a host number, through the gloo group)."""
        if not self.distributed:
            return x
        t = torch.tensor([x], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


@contextlib.contextmanager
def _fsdp_no_sync(module: Any) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


@torch.no_grad()
def _sharded_clip(
    params: list[torch.Tensor], max_norm: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """step.clip_by_global_norm for gradients sharded over ranks: per-tensor sums of squares of
    the local shards, summed over ranks, then the root; the factor scales the local shards."""
    grads = [None if p.grad is None else local(p.grad) for p in params]
    shards = [g for g in grads if g is not None]
    squares = norms(grads, local(params[0]).device).square()  # (P,) this rank's part
    dist.all_reduce(squares)
    per_tensor = squares.sqrt()
    total = torch.linalg.vector_norm(per_tensor)
    if max_norm is None:
        return total, torch.ones_like(total), per_tensor
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    scale_(shards, factor)
    return total, factor, per_tensor


def check_shape(cfg: TrainConfig, size: int) -> None:
    """The global batch must split evenly over the ranks (and each shard into micro-batches):
    the data position is a global batch index, so this is all a new world size must meet."""
    batch, micro = cfg.data.batch_size, cfg.data.micro_batch_size
    if batch % size:
        raise ConfigError(
            f"data.batch_size={batch} is the global batch and must divide evenly over the "
            f"{size} ranks"
        )
    if micro is not None and (batch // size) % micro:
        raise ConfigError(
            f"each of the {size} ranks trains {batch // size} sequences per step, not a "
            f"multiple of data.micro_batch_size={micro}"
        )


def init_world(cfg: TrainConfig, device: torch.device) -> tuple[World, torch.device]:
    """The world this process belongs to, and its device (cuda:LOCAL_RANK under torchrun).
    Creates the process group unless one exists already (a test harness may own it)."""
    strategy, size = cfg.distributed.strategy, _env_size()
    if strategy is None:
        if size > 1:
            raise ConfigError(
                f"launched as {size} processes but distributed.strategy is none: set "
                "distributed.strategy=ddp or fsdp2 (or launch one process)"
            )
        return World(), device
    if not dist.is_initialized() and "RANK" not in os.environ:
        raise ConfigError(
            f"distributed.strategy='{strategy}' needs torchrun: torchrun --nproc_per_node=N "
            "-m spikewatch train ... (or leave distributed.strategy unset: one process)"
        )
    check_shape(cfg, size)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns:
        backend = cfg.distributed.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=cfg.distributed.timeout_s)
        dist.init_process_group(backend, timeout=timeout)
    group = None
    if dist.get_backend() != "gloo":
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.distributed.timeout_s))
    world = World(strategy, dist.get_rank(), dist.get_world_size(), group, owns)
    quiet_other_ranks(world.rank)
    log.info("rank %d of %d (%s on %s)", world.rank, world.size, strategy, device)
    return world, device


_PACKAGES = ("spikewatch",)  # every module of ours logs under it


def say(logger: logging.Logger, message: str) -> None:
    """A line the user must see (where the run is recorded, where its checkpoints go): through
    spikewatch's logger where logging shows INFO, else on stderr, so that a script with no
    logging set up still sees it. Other ranks stay quiet (quiet_other_ranks)."""
    if logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
        logger.info(message)
    elif logger.isEnabledFor(logging.WARNING):  # the default: WARNING, no handler
        print(f"spikewatch: {message}", file=sys.stderr)  # noqa: T201 - the one fallback


def quiet_other_ranks(rank: int) -> None:
    """Rank 0 talks; the others log only errors, each tagged with its rank ('[rank 1] ...'),
    for spikewatch's own loggers only (the root logger stays the user's)."""
    if rank == 0:
        return
    for name in _PACKAGES:
        logging.getLogger(name).setLevel(logging.ERROR)
    previous = logging.getLogRecordFactory()
    if getattr(previous, "spikewatch_rank", None) is not None:
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if record.name.split(".")[0] in _PACKAGES:
            record.msg = f"[rank {rank}] {record.msg}"
        return record

    factory.spikewatch_rank = rank  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


def attach_world(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, timeout_s: float
) -> World:
    """The world of a process group the user (torchrun, accelerate, Lightning) created, for the
    Watch: one process without one; DDP when every rank holds whole parameters (DDP, or any
    replica data parallelism that averages gradients); FSDP2 when they are DTensor shards on a
    1-D mesh. What spikewatch cannot agree a step over fails here, with one line. Objects and
    barriers go through a gloo group of its own with `timeout_s`, so the decision's broadcast
    costs no device transfer under NCCL and a dead rank fails the job instead of hanging it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return World()
    refuse_unsupported(model, optimizer)
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    strategy = "fsdp2" if sharded else "ddp"
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    world = World(strategy, dist.get_rank(), dist.get_world_size(), group, False, model)
    quiet_other_ranks(world.rank)
    log.info("rank %d of %d (%s)", world.rank, world.size, strategy)
    return world


def refuse_unsupported(model: torch.nn.Module, optimizer: Any) -> None:
    """DeepSpeed, FSDP (v1) and multi-dimensional meshes (tensor or pipeline parallelism,
    HSDP): a step's gradient norm and state are not what spikewatch can measure and restore."""
    kinds = {type(m).__name__ for m in model.modules()} | {type(model).__name__}
    opt = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
    if "DeepSpeedEngine" in kinds or opt.startswith("deepspeed") or "DeepSpeed" in opt:
        raise ConfigError(
            "spikewatch does not support DeepSpeed: use DDP or FSDP2 (fully_shard) under torchrun"
        )
    if "FullyShardedDataParallel" in kinds:
        raise ConfigError(
            "spikewatch does not support FSDP (v1) FullyShardedDataParallel: use FSDP2 "
            "(torch.distributed.fsdp.fully_shard), or DDP"
        )
    meshes = {p.device_mesh.ndim for p in model.parameters() if isinstance(p, DTensor)}
    if any(n > 1 for n in meshes):
        raise ConfigError(
            "spikewatch supports data parallelism only (DDP, FSDP2 on a 1-D mesh): this model "
            "is sharded over a multi-dimensional mesh (tensor/pipeline parallelism or HSDP)"
        )
