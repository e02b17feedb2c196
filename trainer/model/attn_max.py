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
        self.key = next(_KEYS)  # how the compiled graph's operators find this recorder
        _RECORDERS[self.key] = self

    def record(self, layer: int, mx: torch.Tensor) -> None:
        """mx: (B, H) or (H,) max scaled logits of one forward of layer `layer` (kept on probed
        steps only)."""
        if COMPILE_SAFE and torch.compiler.is_compiling():
            torch.ops.spikewatch.record_attn_max(mx.detach(), self.key, layer)
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
            # a probe: no autograd graph over its score blocks
            self._record_logits(layer, q.detach(), k.detach(), mask, causal, scale, n_rep)

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
        mx = mx.detach().float()
        mx = mx.amax(dim=0) if mx.dim() == 2 else mx  # (H,)
        old = self._by_layer.get(layer)
        self._by_layer[layer] = mx if old is None else torch.maximum(old, mx)

    def take(self) -> tuple[tuple[int, ...], torch.Tensor] | None:
        """(the recorded layers, their (L, H) maxima) of the step, then forget them."""
        if not self._by_layer:
            return None
        layers = tuple(sorted(self._by_layer))
        values = torch.stack([self._by_layer[i] for i in layers])  # (L, H)
        self._by_layer = {}
        return layers, values


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
