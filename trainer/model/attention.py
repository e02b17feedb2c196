"""Attention backends that can also report the per-head maximum pre-softmax logit.

`scaled_dot_product_attention` is fastest but hides its logits, and QK-Clip and the probes need
the exact max logit per (batch, head). `eager` materialises QK^T (the reference); `chunked`
processes query blocks so the score matrix is never whole, and takes the max from the scores it
already has; `triton` is the fused kernel in trainer/model/kernels/attention.py (CUDA, or the
interpreter on a CPU). The max is taken before any soft-cap: it is the logit QK-Clip bounds.
"""

from __future__ import annotations

import functools
import math
import threading

import torch
import torch.nn.functional as F

__all__ = [
    "RECORD_CHUNK",
    "attention",
    "fused_max",
    "fused_table_into",
    "fused_table_refusal",
    "max_logits",
]

Backend = str  # "sdpa" | "eager" | "chunked" | "triton"


def _make_causal_mask(q_start: int, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """(q_len, k_len) bool, True where query q_start+i may attend to key j."""
    i = torch.arange(q_start, q_start + q_len, device=device)[:, None]
    j = torch.arange(k_len, device=device)[None, :]
    return j <= i


def _make_future_bias(
    q_start: int, q_len: int, k_len: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """0 where allowed, -inf on the future: added in place, cheaper than a masked fill."""
    bias = torch.zeros(q_len, k_len, device=device, dtype=dtype)
    mask = _make_causal_mask(q_start, q_len, k_len, device)
    return bias.masked_fill_(~mask, float("-inf"))


# Cached eagerly: the same few shapes recur every step, and building them is a good part of a
# small model's cost. A compiled graph builds them inside itself instead (Dynamo would trace
# through the cache and warn that it does).
_cached_mask = functools.lru_cache(maxsize=256)(_make_causal_mask)
_cached_bias = functools.lru_cache(maxsize=256)(_make_future_bias)


def _causal_mask(q_start: int, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _make_causal_mask(q_start, q_len, k_len, device)
    return _cached_mask(q_start, q_len, k_len, device)


def _future_bias(
    q_start: int, q_len: int, k_len: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _make_future_bias(q_start, q_len, k_len, device, dtype)
    return _cached_bias(q_start, q_len, k_len, device, dtype)


def _block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    softcap: float | None,
    want_max: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of a query block over keys; also the block's max logit per (B, nh)."""
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, nh, Tq, Tk)
    if softcap is not None:
        capped = softcap * torch.tanh(s / softcap)
    if mask is not None:  # mask after the cap: tanh(-inf) = -1 would un-mask the future
        s = s.masked_fill(~mask, float("-inf"))
    m = s.detach().flatten(-2).amax(-1) if want_max else None  # (B, nh), the pre-cap logit
    if softcap is not None:
        s = capped if mask is None else capped.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(v.dtype)
    return p @ v, m  # (B, nh, Tq, hs)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: Backend,
    causal: bool = True,
    softcap: float | None = None,
    need_max: bool = False,
    chunk: int = 128,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k, v: (B, nh, T, hs). Returns (out (B, nh, T, hs), max logit (B, nh) or None)."""
    T = q.size(-2)
    if backend == "sdpa":
        if softcap is not None:
            raise ValueError("the sdpa backend cannot apply an attention soft-cap")
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return out, (max_logits(q, k, causal=causal, chunk=chunk) if need_max else None)
    if backend == "triton":
        if softcap is not None:
            raise ValueError("the triton backend does not apply an attention soft-cap")
        from spikewatch.trainer.model.kernels.attention import (
            flash_attention,  # imports Triton: only when used
        )

        out, fmx = flash_attention(q, k, v, causal=causal)
        return out, (fmx if need_max else None)
    if backend == "eager":
        mask = _causal_mask(0, T, T, q.device) if causal else None
        return _block(q, k, v, mask, softcap, need_max)
    if backend != "chunked":
        raise ValueError(f"unknown attention backend {backend!r}")
    outs: list[torch.Tensor] = []
    mx: torch.Tensor | None = None
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        k_end = end if causal else T
        mask = _causal_mask(start, end - start, k_end, q.device) if causal else None
        o, m = _block(q[:, :, start:end], k[:, :, :k_end], v[:, :, :k_end], mask, softcap, need_max)
        outs.append(o)
        if m is not None:
            mx = m if mx is None else torch.maximum(mx, m)
    return torch.cat(outs, dim=2), mx


# The fused pass (trainer/model/kernels/max_logits.py) is taken on CUDA only; tests set this to
# run it through Triton's interpreter on a CPU.
FUSED_OFF_GPU = False


def fused_max(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor | None:
    """The fused max-logit pass's (B, nh) maxima where it takes the call (CUDA, no mask, head
    dim 16..128; k may have fewer heads, shared by groups of queries), else None."""
    if mask is not None or not (q.is_cuda or FUSED_OFF_GPU):
        return None
    from spikewatch.trainer.model.kernels.max_logits import (  # imports Triton
        fused_max_logits,
        refusal,
    )

    if refusal(q, k) is not None:
        return None
    return fused_max_logits(q, k, causal=causal, scale=scale)


def fused_heads_into(
    out: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor | None:
    """The fused pass's per-head maxima over the batch, max'd into `out` ((H,) fp32; None: a
    new one at -inf) in one launch, where it takes the call (as `fused_max`); else None."""
    if mask is not None or not (q.is_cuda or FUSED_OFF_GPU):
        return None
    from spikewatch.trainer.model.kernels.max_logits import (  # imports Triton
        fused_head_max_,
        refusal,
    )

    if refusal(q, k) is not None:
        return None
    if out is None:
        out = torch.full((q.size(1),), float("-inf"), device=q.device, dtype=torch.float32)
    return fused_head_max_(out, q, k, causal=causal, scale=scale)


def fused_table_refusal(
    table: torch.Tensor, q: torch.Tensor, k: torch.Tensor, layer: int
) -> str | None:
    """Why the fused pass cannot max a layer's per-head maxima into its row of the recorder's
    (layers, heads) table (None: it can): CUDA (or the tests' interpreter), no mask, and
    `kernels.max_logits.table_refusal`."""
    if not (q.is_cuda or FUSED_OFF_GPU):
        return f"the fused pass runs on CUDA, not on {q.device.type}"
    from spikewatch.trainer.model.kernels.max_logits import table_refusal  # imports Triton

    return table_refusal(table, q, k, layer)


def fused_table_into(
    table: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    layer: int,
    *,
    causal: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """`table[layer]` max'd with the layer's per-head maxima over the batch, in one launch (for
    a call `fused_table_refusal` took: not asked again)."""
    from spikewatch.trainer.model.kernels.max_logits import head_max_table_  # imports Triton

    return head_max_table_(table, q, k, layer, causal=causal, scale=scale, check=False)


def table_launch(q: torch.Tensor, k: torch.Tensor, *, causal: bool, scale: float | None):
    """`fused_table_into`'s launch for every call with q and k of this signature, worked out
    once (`kernels.max_logits.TableLaunch`), for a call `fused_table_refusal` took; None where
    q and k need a cast or a copy first (then `fused_table_into`, each call)."""
    from spikewatch.trainer.model.kernels.max_logits import TableLaunch  # imports Triton

    if not TableLaunch.fits(q, k):
        return None
    return TableLaunch(q, k, causal, q.size(-1) ** -0.5 if scale is None else float(scale))


@torch.no_grad()
def max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = True,
    chunk: int = 128,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    fused: bool = True,
) -> torch.Tensor:
    """Max scaled logit per (B, nh), for backends that do not expose their scores: the fused
    pass where it takes the call (`fused_max`: one kernel, no score matrix in memory), else
    blockwise in PyTorch (no softmax and no backward: about a quarter of attention's forward).

    q: (B, nh, Tq, hs), k: (B, nh, Tk, hs) (grouped-query keys repeated to nh by the caller);
    `mask`: an attention mask broadcastable to (B, nh, Tq, Tk), boolean (True = attend) or
    additive (0 / -inf), as Hugging Face models pass it; `scale` defaults to 1/sqrt(hs);
    `fused=False`: the blockwise pass even where the fused one runs."""
    out = fused_max(q, k, causal=causal, mask=mask, scale=scale) if fused else None
    if out is not None:
        return out
    (B, nh, T, _), mx = q.shape, None
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    # one copy each of a strided q and k (torchtitan's (B, L, N, H) transposed): else every
    # block's matmul copies its part again
    qf = q.contiguous().flatten(0, 1)  # (B nh, Tq, hs)
    kt = k.to(q.dtype).contiguous().flatten(0, 1).transpose(1, 2)  # (B nh, hs, Tk), q's dtype
    n = qf.size(0)
    block = _scratch(n * min(chunk, T) * k.size(-2), q)
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        k_end = end if causal else k.size(-2)
        s = block[: n * (end - start) * k_end].view(n, end - start, k_end)
        torch.bmm(qf[:, start:end], kt[:, :, :k_end], out=s)  # the block's scores, as q's dtype
        if causal:
            s.add_(_future_bias(start, end - start, k_end, q.device, s.dtype))
        if mask is not None:
            s = _masked(s.view(B, nh, end - start, k_end), mask[..., start:end, :k_end])
        m = s.reshape(n, -1).amax(-1)  # one contiguous reduction: ~2x faster than over two dims
        mx = m if mx is None else torch.maximum(mx, m)
    assert mx is not None
    return mx.view(B, nh) * scale  # the max scaled, not every score: max(cs) = c max(s), c > 0


_SCRATCH = threading.local()
# The largest score block kept between calls (bytes): the pass's blocks at the shapes a CPU
# trains (B nh = 64, T = 256: 4 MB; the 124M shape at B=16, T=1024: 50 MB) fit; larger ones are
# allocated per call.
SCRATCH_MAX_BYTES = 64 * 2**20


def _scratch(numel: int, like: torch.Tensor) -> torch.Tensor:
    """`numel` elements for the max pass's score blocks, on a CPU one buffer per thread reused
    by every call: a fresh block each time is a fresh mapping whose pages fault in, a third of
    the pass's time in a torchtitan step (B=4, H=16, T=256, D=16: 6.1 -> 4.0 ms a layer). CUDA's
    caching allocator reuses blocks already; a compiled graph allocates its own."""
    big = numel * like.element_size() > SCRATCH_MAX_BYTES
    if like.device.type != "cpu" or big or torch.compiler.is_compiling():
        return torch.empty(numel, dtype=like.dtype, device=like.device)
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.dtype != like.dtype or buf.numel() < numel:
        buf = _SCRATCH.buf = torch.empty(numel, dtype=like.dtype)
    return buf[:numel]


# Query block of the recording attention functions: 64 rows keep a (B, H, 64, T) score block
# in cache on CPU (1.7x faster than 128 at B=16, H=4, T=128, D=32).
RECORD_CHUNK = 64


def _masked(s: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scores with masked-out positions at -inf (a boolean mask) or the mask added (additive:
    its finite entries are 0 for attended positions in Hugging Face's masks)."""
    if mask.dtype == torch.bool:
        return s.masked_fill(~mask, float("-inf"))
    return s + mask.to(s.dtype)
