"""`AttnMax`: the per-layer, per-head max attention logits of a step, from the user's attention.

A probe inside a model that users compile must not change the compiled graph from step to
step (ARCHITECTURE.md: no Python state that changes per step inside the compiled forward).
`AttnMax.active` changes (probed steps, a replay, evaluation), and so does its dict of maxima
(one entry per layer, combined over micro-batches): read inside a compiled forward, each is a
guard, and a guard that fails is a recompile (a probed and an unprobed graph, a graph for the
first micro-batch and one for the others).

So under `torch.compile` the recording goes through two custom operators that the compiler
sees as opaque calls with a side effect (`EffectType.ORDERED`: kept, in order, never
eliminated): `spikewatch::record_attn_max(mx, ...)` and `spikewatch::record_max_logits(q, k,
...)`, which computes the maxima itself. They run at the compiled graph's run time, eagerly,
and read `active` and the dict there, where no guard can see them. The training forward is then
one graph, probed or not; evaluation under `torch.no_grad()` is the grad-mode graph every
compiled model has. Eager code calls the same methods and records directly.
"""

from __future__ import annotations

import itertools
import logging
import weakref

import torch
import torch.nn.functional as F

from spikewatch.trainer.model import attention
from spikewatch.trainer.model.attention import RECORD_CHUNK, max_logits

__all__ = ["AttnMax"]

log = logging.getLogger(__name__)

_RECORDERS: weakref.WeakValueDictionary[int, AttnMax] = weakref.WeakValueDictionary()
_UNPLANNED = object()
_KEYS = itertools.count()


def _recomputing() -> bool:
    """Inside a backward pass: activation checkpointing running a forward again (torchtitan's
    selective AC, Hugging Face's gradient checkpointing). The maxima are the first forward's;
    its recomputation records nothing (under selective AC it must not: an op that was not in
    the first forward fails the recomputation's check)."""
    return torch._C._current_graph_task_id() != -1


class AttnMax:
    """Per-layer, per-head max pre-softmax attention logits of one step, kept on device.

    Filled by an attention function (spikewatch.hf registers one), by `sdpa` in the user's
    attention, or by the user's own maxima through `record`; maxima of the step's micro-batches
    are combined. Only probed steps (`active`, which the Watch sets for each step and clears
    once it has taken the step's maxima) record; `sdpa` and `record_logits` compute the maxima
    only for training forwards (grad enabled)."""

    def __init__(self) -> None:
        self.active = False  # set per step: only probed steps pay for the maxima
        self._by_layer: dict[int, torch.Tensor] = {}
        # the step's (layers, heads) maxima on the model's device, -inf until recorded, once its
        # shape is known (`reserve`): one tensor for the whole run, written in place
        self.table: torch.Tensor | None = None
        self._shape: tuple[int, int] | None = None
        self._wrote = False  # the table holds a value since it was last cleared
        self._device: torch.device | None = None  # the model's, once the Watch opens
        # eager launches into the table, one per q and k signature (None: the table refused it)
        self._launches: dict[tuple, object] = {}
        self.key = next(_KEYS)  # how the compiled graph's operators find this recorder
        _RECORDERS[self.key] = self

    # -- the table ---------------------------------------------------------------------------
    def reserve(self, layers: int, heads: int, device: torch.device | str | None = None) -> None:
        """The shape of the step's maxima: `layers` attention layers (indices 0..layers-1) of
        `heads` query heads. Then each layer's maxima go into one (layers, heads) table that
        lives as long as the recorder: on a GPU the fused pass writes its row in place, and in
        a compiled model from the graph itself (no Python per layer a step; a captured CUDA
        graph keeps it). Call it before the first forward (the Watch places the table on the
        model's device when it opens; `device` places it now). Without it the maxima are
        recorded layer by layer through Python, as before."""
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers must be a positive int, got {layers!r}")
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"heads must be a positive int, got {heads!r}")
        self._shape = (layers, heads)
        if device is not None or self._device is not None:
            self.place(device if device is not None else self._device)  # type: ignore[arg-type]

    @property
    def reserved(self) -> tuple[int, int] | None:
        return self._shape

    def place(self, device: torch.device | str) -> None:
        """The table (if reserved, or once it is) on `device`, at -inf: once, before the first
        forward."""
        dev = self._device = torch.device(device)
        if self._shape is None:
            return
        table = self.table
        if table is not None and table.device == dev and tuple(table.shape) == self._shape:
            return
        table = torch.full(self._shape, float("-inf"), dtype=torch.float32, device=dev)
        if dev.type == "cuda":  # a captured CUDA graph writes it in place, never a copy
            torch._dynamo.mark_static_address(table)
        self.table, self._wrote = table, False
        self._launches.clear()  # planned for the table before

    def arm(self, active: bool) -> None:
        """Whether the next step's forwards record; a probed step's begin with the table
        cleared (of what evaluations with grad on, replays, or a compiled graph's forwards on
        unprobed steps wrote since the last step's maxima were taken): one fill."""
        self.active = active
        if active and self._wrote and self.table is not None:
            self.table.fill_(float("-inf"))
            self._wrote = False

    def _row_fits(self, layer: int, mx: torch.Tensor) -> bool:
        t = self.table
        return t is not None and 0 <= layer < t.size(0) and mx.size(-1) == t.size(1)

    def record(self, layer: int, mx: torch.Tensor) -> None:
        """mx: the max scaled logits of one forward of layer `layer`, (H,), (B, H), or an
        attention kernel's own per-query maxima (B, H, L): FlexAttention's `max_scores` with
        `return_aux=AuxRequest(max_scores=True)`. Kept on probed steps only. Compiled, with the
        table reserved, the row is max'd by the graph itself on every training forward (no
        Python of spikewatch's a layer, nothing that splits a CUDA graph; `arm` clears it)."""
        if COMPILE_SAFE and torch.compiler.is_compiling():
            table = self.table
            heads = _heads(mx.detach())
            if (
                table is not None
                and torch.is_grad_enabled()
                and self._row_fits(layer, heads)
                and heads.device == table.device
            ):
                table[layer] = torch.maximum(table[layer], heads.float())
                self._wrote = True
                return
            torch.ops.spikewatch.record_attn_max(heads, self.key, layer)
        else:
            self._keep(layer, mx)

    def record_logits(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        causal: bool = True,
        mask: torch.Tensor | None = None,
        scale: float | None = None,
        n_rep: int = 1,
    ) -> None:
        """The maxima of q k^T (q: (B, H, T, D); k: (B, H / n_rep, S, D), grouped-query keys
        repeated here) on probed training steps, computed only then."""
        if COMPILE_SAFE and torch.compiler.is_compiling():
            if (
                self.table is not None
                and mask is None
                and torch.is_grad_enabled()
                and attention.fused_table_refusal(self.table, q, k, layer) is None
            ):  # in the graph: the kernel writes the layer's row (every training forward)
                attention.fused_table_into(self.table, q, k, layer, causal=causal, scale=scale)
                self._wrote = True
                return
            torch.ops.spikewatch.record_max_logits(
                q.detach(),
                k.detach(),
                None if mask is None else mask.detach(),
                self.key,
                layer,
                causal,
                scale,
                n_rep,
                torch.is_grad_enabled(),
            )
        elif self.active and torch.is_grad_enabled() and not _recomputing():
            table = self.table
            if table is not None and mask is None and 0 <= layer < table.size(0):
                # the table's eager launch, planned once per signature: a layer's Python is the
                # lookup and the launch (the kernel reads q and k; no autograd graph)
                sig = (q.shape, k.shape, q.stride(), k.stride(), q.dtype, k.dtype, q.device,
                       causal, scale)  # fmt: skip
                launch = self._launches.get(sig, _UNPLANNED)
                if launch is _UNPLANNED:
                    launch = self._plan(sig, table, q, k, causal, scale)
                if launch is not None:
                    launch(table, q, k, layer)  # type: ignore[operator]
                    self._wrote = True
                    return
            # a probe: no autograd graph over its score blocks
            self._record_logits(layer, q.detach(), k.detach(), mask, causal, scale, n_rep)

    def _plan(
        self,
        sig: tuple,
        table: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        causal: bool,
        scale: float | None,
    ) -> object:
        """The eager launch for q and k of this signature (None: the table does not take it),
        kept: a run sees a handful (one sequence length, or a few under padding)."""
        launch = None
        if attention.fused_table_refusal(table, q, k, 0) is None:
            launch = attention.table_launch(q, k, causal=causal, scale=scale)
        if len(self._launches) >= 64:  # varying lengths: keep the plans bounded
            self._launches.clear()
        self._launches[sig] = launch
        return launch

    def sdpa(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
    ) -> torch.Tensor:
        """A plain loop's attention in one call: `scaled_dot_product_attention(q, k, v)` (all
        (B, H, T, D)), recording the layer's per-head max logit on probed steps."""
        self.record_logits(layer, q, k, causal=causal)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def _record_logits(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
        scale: float | None,
        n_rep: int,
    ) -> None:
        """The fused pass straight into the layer's running maxima where it takes the call
        (one launch a layer and micro-batch), else the maxima computed and kept."""
        if not self.active or _recomputing():
            return
        table = self.table
        if (
            table is not None
            and mask is None
            and attention.fused_table_refusal(table, q, k, layer) is None
        ):  # one launch straight into the layer's row: no operator, no allocation
            attention.fused_table_into(table, q, k, layer, causal=causal, scale=scale)
            self._wrote = True
            return
        held = self._by_layer.get(layer)
        if held is None or (held.dim() == 1 and held.dtype == torch.float32):
            into = attention.fused_heads_into(held, q, k, causal=causal, mask=mask, scale=scale)
            if into is not None:
                self._by_layer[layer] = into
                return
        self._keep(layer, _max_logits(q, k, mask, causal, scale, n_rep))

    def _keep(self, layer: int, mx: torch.Tensor) -> None:
        if not self.active or _recomputing():
            return
        mx = _heads(mx.detach()).float()
        if self._row_fits(layer, mx) and mx.device == self.table.device:  # type: ignore[union-attr]
            row = self.table[layer]  # type: ignore[index]
            torch.maximum(row, mx, out=row)
            self._wrote = True
            return
        old = self._by_layer.get(layer)
        self._by_layer[layer] = mx if old is None else torch.maximum(old, mx)

    def take(self) -> tuple[tuple[int, ...], torch.Tensor] | None:
        """(the layers, their (L, H) maxima) of the step, then forget them; None when the step
        was not probed or nothing recorded. From the table, every row is given: a layer that
        recorded nothing is -inf there (the host transfer leaves such values out). The table
        is cleared when the next probed step is armed (`arm`)."""
        by_layer, self._by_layer = self._by_layer, {}
        if not self.active:
            return None
        table = self.table
        if table is not None and self._wrote:
            rows, heads = table.shape
            beside = [i for i in sorted(by_layer) if by_layer[i].shape == (heads,)]
            if not beside:  # the table itself: the step's transfer copies it (its `cat`, in
                # the gate) before the next probed step clears it (`arm`, after the step)
                return tuple(range(rows)), table
            layers, values = tuple(range(rows)), table.clone()
            for i in beside:  # recorded beside the table (past its rows, or another device)
                if i < rows:
                    values[i] = torch.maximum(values[i], by_layer[i].to(values.device))
            more = [i for i in beside if i >= rows]
            if more:
                values = torch.cat([values, torch.stack([by_layer[i] for i in more]).to(values)])
                layers += tuple(more)
            return layers, values
        if not by_layer:
            return None
        layers = tuple(sorted(by_layer))
        return layers, torch.stack([by_layer[i] for i in layers])  # (L, H)


def _heads(mx: torch.Tensor) -> torch.Tensor:
    """(H,) from maxima given as (H,), (B, H) or (B, H, L)."""
    if mx.dim() == 3:
        return mx.amax(dim=(0, 2))
    return mx.amax(dim=0) if mx.dim() == 2 else mx


def _max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    n_rep: int,
) -> torch.Tensor:
    fused = attention.fused_max(q, k, causal=causal, mask=mask, scale=scale)  # k's heads shared
    if fused is not None:
        return fused
    if n_rep > 1:  # grouped-query attention: each key head serves n_rep query heads
        k = k.repeat_interleave(n_rep, dim=1)
    return max_logits(q, k, causal=causal, mask=mask, scale=scale, chunk=RECORD_CHUNK)


def _register() -> bool:
    """The two operators, with their side effect declared; False where this torch cannot
    declare one (then a compiled forward records through guarded Python, as eager code)."""
    try:
        from torch._library.effects import EffectType
    except ImportError:  # pragma: no cover - older torch
        return False

    # cudagraph_unsafe: the ops run Python that reads the recorder's state (`active`, the dict of
    # maxima); inside a captured CUDA graph (mode="reduce-overhead") they would run once, at
    # capture, and the maxima stop there. Tagged, the compiler splits the graph around them.
    tags = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()

    @torch.library.custom_op("spikewatch::record_attn_max", mutates_args=(), tags=tags)
    def record_attn_max(mx: torch.Tensor, key: int, layer: int) -> None:
        rec = _RECORDERS.get(key)
        if rec is not None:
            rec._keep(layer, mx)

    @torch.library.custom_op("spikewatch::record_max_logits", mutates_args=(), tags=tags)
    def record_max_logits(
        q: torch.Tensor,
        k: torch.Tensor,
        mask: torch.Tensor | None,
        key: int,
        layer: int,
        causal: bool,
        scale: float | None,
        n_rep: int,
        training: bool,
    ) -> None:
        rec = _RECORDERS.get(key)
        if rec is not None and rec.active and training:
            rec._record_logits(layer, q, k, mask, causal, scale, n_rep)

    for op in (record_attn_max, record_max_logits):
        op.register_fake(lambda *args: None)
        if not hasattr(op, "register_effect"):  # pragma: no cover - older torch
            return False
        op.register_effect(EffectType.ORDERED)
    return True


COMPILE_SAFE = _register()
