"""A step's device tensors and their one host transfer, for every client of the step core.

The client (the built-in trainer, the Watch) hands the core a `StepTensors` after backward; the
core reduces it over ranks (core/world.py), adds the probes' values and the step factor, and
reads everything in one `HostTransfer`: `start()` enqueues one non-blocking copy into pinned
host memory (on CUDA) before the update, `fetch()` waits for that copy alone, after the update
has been enqueued. Nothing between backward and the update makes the host wait.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from spikewatch.observatory import metric_names as M
from spikewatch.trainer.core import streams
from spikewatch.trainer.core.norms import norms, scale_

__all__ = [
    "Clip",
    "HostTransfer",
    "Reduce",
    "StepTensors",
    "as32",
    "attn_names",
    "clip_by_global_norm",
    "flat32",
]


@dataclass
class StepTensors:
    """Device tensors of one step, before the host transfer."""

    loss: torch.Tensor  # () mean over micro-batches (ce + z-loss term in the built-in GPT)
    grad_norm: torch.Tensor  # () global, before clipping
    clip_factor: torch.Tensor  # () min(1, max_norm / norm)
    grad_norms: torch.Tensor  # (P,) per parameter, in the probes' parameter order, pre-clip
    ce: torch.Tensor | None = None  # () None: the loss is the cross-entropy
    z_mean: torch.Tensor | None = None  # ()
    logit_max: torch.Tensor | None = None  # ()
    attn_max: torch.Tensor | None = None  # (L, nh) over the whole global batch
    attn_layers: tuple[int, ...] | None = None  # the layers of attn_max's rows; None = 0..L-1
    stop: torch.Tensor | None = None  # () ranks asked to stop (torchrun only), agreed by all
    rank_losses: torch.Tensor | None = None  # (W,) each rank's own loss (torchrun only)
    overflow: torch.Tensor | None = None  # () > 0: a GradScaler found inf/nan gradients (fp16)
    loss_scale: torch.Tensor | None = None  # () the GradScaler's scale this step


# host values -> metrics by name (`HostTransfer.add_reduced`)
Reduce = Callable[[list[float]], dict[str, float]]

# (parameters, max norm) -> (total norm, clip factor, per-tensor norms), clipping in place
Clip = Callable[[list[torch.Tensor], float | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def clip_by_global_norm(
    params: Sequence[torch.Tensor], max_norm: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.nn.utils.clip_grad_norm_'s arithmetic, keeping the per-tensor norms it computes
    (the per-layer grad-norm probe then costs nothing). Returns (total, factor, per-tensor)."""
    if not params:
        raise ValueError("clip_by_global_norm: no parameters")
    # one process with DTensor parameters on a mesh of one (torchtitan's SPMD types): each
    # local tensor is the whole one (sharded meshes take World.clip, the sharded clip)
    grads = [_whole(p.grad) for p in params]
    per_tensor = norms(grads, params[0].device)  # (P,) on the first parameter's device
    total = torch.linalg.vector_norm(per_tensor)
    if max_norm is None:
        return total, torch.ones_like(total), per_tensor
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    scale_([g for g in grads if g is not None], factor)
    return total, factor, per_tensor


def _whole(g: torch.Tensor | None) -> torch.Tensor | None:
    if isinstance(g, DTensor):
        if g.device_mesh.size() != 1:
            raise ValueError("a sharded gradient outside FSDP2's world (the sharded clip)")
        return g.to_local()
    return g


@functools.lru_cache(maxsize=16)
def attn_names(layers: tuple[int, ...], n_head: int) -> tuple[list[str], list[str]]:
    """Per-head and per-layer max-logit names, built once per shape rather than every step."""
    heads = [M.attn_max(i, h) for i in layers for h in range(n_head)]
    return heads, [M.layer_attn_max(i) for i in layers]


NOT_RECORDED = float("-inf")


def as32(x: torch.Tensor) -> torch.Tensor:
    """`x.detach().float()` with only the ops it needs: each op is a dispatch on the loop
    thread, and most of a step's values are fp32 and need no detaching already."""
    if x.requires_grad:
        x = x.detach()
    return x if x.dtype == torch.float32 else x.float()


def flat32(x: torch.Tensor) -> torch.Tensor:
    """`as32(x).reshape(-1)`, the reshape only where x is not 1-D."""
    x = as32(x)
    return x if x.dim() == 1 else x.reshape(-1)


class _LayerNorms:
    """Per-layer 2-norms from per-tensor ones on the host (`HostTransfer.add_by_layer`), summed
    in float64: `owner[j]` is the layer of value j."""

    def __init__(self, names: list[str], owner: list[int]) -> None:
        self.names, self.owner = names, owner

    def __call__(self, values: list[float]) -> dict[str, float]:
        squares = [0.0] * len(self.names)
        for j, layer in enumerate(self.owner):
            squares[layer] += values[j] ** 2
        return dict(zip(self.names, map(math.sqrt, squares), strict=True))


class HostTransfer:
    """Named device tensors gathered into one host copy (the loop's one sync per step)."""

    def __init__(self) -> None:
        # the values' runs, in order: [start, end), their names, late, sparse (-inf there
        # means "not recorded": left out). Read at `fetch` a run at a time, not a value at a
        # time (a step's ~300 values: most of the read's Python was per value)
        self._runs: list[tuple[int, int, list[str], bool, bool]] = []
        self._n = 0  # values added
        # per-layer maxima taken on the host from their heads' values at `fetch` (no device
        # reduction, no extra values moved): (the layers' names, the first head's index, heads)
        self._layer_max: list[tuple[list[str], int, int]] = []
        # metrics made on the host at `fetch` from values that are none themselves:
        # (the values' [start, end), the function that makes them, late)
        self._reduced: list[tuple[int, int, Reduce, bool]] = []
        self.parts: list[torch.Tensor] = []
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    @property
    def names(self) -> list[str]:
        """The names of the values added (not those only `reduce` functions make)."""
        return [name for _, _, names, _, _ in self._runs for name in names]

    def add(
        self, names: list[str], values: torch.Tensor, late: bool = False, sparse: bool = False
    ) -> None:
        """`sparse`: maxima where -inf stands for nothing recorded (a layer of the attention
        maxima's table that did not record this step): such values are left out at `fetch`."""
        if names:
            start = self._n
            self._n += len(names)
            self._runs.append((start, self._n, names, late, sparse))
            self.parts.append(flat32(values))

    def add_by_layer(self, names: list[str], norms: torch.Tensor, owner: list[int]) -> None:
        """Per-layer 2-norms `names` from per-tensor ones, `owner[j]` the layer of tensor j:
        the (P,) norms go to the host as they are and are summed there, at `fetch`."""
        if names:
            self.add_reduced(norms, _LayerNorms(names, owner))

    def add_reduced(self, values: torch.Tensor, reduce: Reduce, late: bool = False) -> None:
        """Metrics that `reduce` makes on the host at `fetch` from `values` (which are no
        metrics themselves): a reduction that would be a chain of small device ops per step
        (per-layer statistics from per-tensor sums) is a loop over a few hundred floats."""
        n = values.numel()
        start = self._n
        self._n += n
        self._reduced.append((start, self._n, reduce, late))
        if n:
            self.parts.append(flat32(values))

    def add_step(self, t: StepTensors) -> None:
        """Everything a `StepTensors` carries, under its metric names."""
        self.add([M.LOSS], t.loss)  # 0-dim values as they are: `start`'s one cat takes them
        self.add([M.GRAD_NORM], t.grad_norm)
        self.add([M.CLIP_FACTOR], t.clip_factor)
        if t.ce is not None:
            self.add([M.CE], t.ce)
        if t.z_mean is not None:
            self.add([M.Z_MEAN], t.z_mean)
        if t.logit_max is not None:
            self.add([M.LOGIT_MAX], t.logit_max)
        if t.attn_max is not None:
            layers = t.attn_layers or tuple(range(t.attn_max.size(0)))
            heads, per_layer = attn_names(layers, t.attn_max.size(1))
            self._layer_max.append((per_layer, self._n, t.attn_max.size(1)))
            self.add(heads, t.attn_max, sparse=True)
        if t.rank_losses is not None:
            self.add([M.rank_loss(r) for r in range(t.rank_losses.numel())], t.rank_losses)
        if t.loss_scale is not None:
            self.add([M.LOSS_SCALE], t.loss_scale)

    def start(self) -> None:
        """Enqueue the copy to the host (no wait): one pinned buffer and an event on CUDA; on
        a CPU the values are host memory already."""
        flat = torch.cat(self.parts)
        if streams.is_cuda(flat):  # the copy and its event on the tensor's own device
            self._host = streams.host_buffer(flat.shape, flat.dtype)
            self._host.copy_(flat, non_blocking=True)
            self._copied = streams.record_event(flat.device)
        else:
            self._host = flat

    def fetch(self) -> tuple[dict[str, float], dict[str, float]]:
        """The values by name, (now, late): waits for the copy `start` enqueued (started here
        if it was not), and for nothing else."""
        if self._host is None:
            self.start()
        if self._copied is not None:
            self._copied.synchronize()
        assert self._host is not None
        values = self._host.tolist()
        if len(values) != self._n:
            raise ValueError(f"{len(values)} values read for {self._n} added")
        now: dict[str, float] = {}
        late: dict[str, float] = {}
        for start, end, names, is_late, sparse in self._runs:
            out = late if is_late else now
            if sparse:
                row = values[start:end]
                out.update((k, v) for k, v in zip(names, row, strict=True) if v != NOT_RECORDED)
            elif end - start == 1:
                out[names[0]] = values[start]
            else:
                out.update(zip(names, values[start:end], strict=True))
        for first, end, reduce, is_late in self._reduced:
            (late if is_late else now).update(reduce(values[first:end]))
        for per_layer, first, n in self._layer_max:
            for j, name in enumerate(per_layer):
                row = [v for v in values[first + j * n : first + (j + 1) * n] if v != NOT_RECORDED]
                if row:  # the layer's maximum over its heads (NaN if any head's is NaN)
                    now[name] = math.nan if any(v != v for v in row) else max(row)
        return now, late
