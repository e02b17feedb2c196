"""The per-head maximum pre-softmax logit in one fused pass: q k^T tiles in registers, a
running maximum, nothing else (no softmax, no V, no backward, no score matrix in memory).

For attention that runs as `scaled_dot_product_attention` (flash on a GPU, which cannot report
its scores), the probes and QK-Clip still need max_j q_i . k_j per (batch, head). The torch
path (trainer/model/attention.py: `max_logits`) materialises score blocks, ~0.4 GB a layer at
B=16, H=12, T=1024, and launches a few kernels per 64-row block; this kernel reads q and k once
and costs one matmul's FLOPs at the tensor cores' rate (a seventh of attention's forward plus
backward). The maximum is of fp32 accumulations of the same products SDPA computes, scaled
after the max (max(c s) = c max(s) for c > 0): exact, unlike a maximum of bf16-rounded scores.

Strided q and k are read in place (the usual `view(B, T, H, D).transpose(1, 2)` needs no
copy); grouped-query keys are shared by `n_rep` query heads without being repeated. Causal is
top-left aligned, as SDPA's `is_causal`: query i sees keys j <= i. Which calls it takes:
`refusal` (CUDA, or the interpreter on a CPU; no mask; head dim 16..128; fp16 / bf16 / fp32).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from spikewatch.trainer.model.kernels.eligibility import (
    DTYPES,
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    interpreting,
)

__all__ = ["TableLaunch", "fused_head_max_", "fused_max_logits", "head_max_table_", "refusal"]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_GRID_Y = 65535


@triton.jit
def _max_kernel(
    Q, K, MAXB, OUT, scale,
    T, S, H, n_rep, num_m_blocks, row,
    sqb, sqh, sqt, skb, skh, skt,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, HEADS: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)  # B * H on the long axis
    pid_m = tl.program_id(1)
    b = bh // H
    h = bh % H
    q_base = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    k_base = b.to(tl.int64) * skb + (h // n_rep).to(tl.int64) * skh
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < T
    mask_d = offs_d < D
    q = tl.load(
        Q + q_base + offs_m[:, None].to(tl.int64) * sqt + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # (M, Dp); rows past T are zeros, left out at the end
    if UPCAST:
        q = q.to(tl.float32)
    # an elementwise running maximum: one max per score, reduced over rows once at the end
    m2 = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    # key blocks every row of this query block sees whole (no mask): below the block's first
    # row (causal), and inside S
    lo = (S // BLOCK_N) * BLOCK_N
    hi = S
    if CAUSAL:
        lo = tl.minimum(pid_m * BLOCK_M, lo)
        hi = tl.minimum((pid_m + 1) * BLOCK_M, S)
    for start_n in range(0, lo, BLOCK_N):
        n = start_n + offs_n
        kt = tl.load(
            K + k_base + n[None, :].to(tl.int64) * skt + offs_d[:, None],
            mask=mask_d[:, None],
            other=0.0,
        )  # (Dp, N)
        if UPCAST:
            kt = kt.to(tl.float32)
        m2 = tl.maximum(m2, tl.dot(q, kt, input_precision=PRECISION))  # fp32 accumulation
    for start_n in range(lo, hi, BLOCK_N):  # the diagonal and the tail: masked
        n = start_n + offs_n
        kt = tl.load(
            K + k_base + n[None, :].to(tl.int64) * skt + offs_d[:, None],
            mask=(n[None, :] < S) & mask_d[:, None],
            other=0.0,
        )
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION)
        valid = n[None, :] < S
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= n[None, :])
        m2 = tl.maximum(m2, tl.where(valid, s, float("-inf")))
    m_i = tl.where(mask_m, tl.max(m2, 1), float("-inf"))
    if HEADS:  # scaled, into the head's running maximum (over blocks, rows, micro-batches)
        tl.atomic_max(OUT + row + h, tl.max(m_i, 0) * scale)
    else:
        tl.store(MAXB + bh.to(tl.int64) * num_m_blocks + pid_m, tl.max(m_i, 0))


def refusal(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None) -> str | None:
    """Why the fused pass cannot take these q (B, H, T, D) and k (B, H / n_rep, S, D); None: it
    can."""
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreting()):
        return f"it runs on CUDA (or TRITON_INTERPRET=1 on a CPU), not on {q.device.type}"
    if mask is not None:
        return "it takes no attention mask (causal or full attention only)"
    if q.dim() != 4 or k.dim() != 4 or q.size(0) != k.size(0) or q.size(-1) != k.size(-1):
        return f"q and k must be (B, H, T, D) and (B, Hk, S, D), got {q.shape}, {k.shape}"
    if k.size(1) == 0 or q.size(1) % k.size(1):
        return f"{q.size(1)} query heads do not share {k.size(1)} key heads evenly"
    if q.device != k.device:
        return f"q and k on different devices ({q.device}, {k.device})"
    if not MIN_HEAD_DIM <= q.size(-1) <= MAX_HEAD_DIM:
        return f"head dim {q.size(-1)} is outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM}"
    if q.dtype not in DTYPES or k.dtype not in DTYPES:
        return f"dtypes {q.dtype}, {k.dtype} are not fp16, bf16 or fp32"
    return None


def _blocks(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): q stays in registers, k streams through
    shared memory (within an A100's 166,912 bytes a block; tests/trainer/test_kernel_aot.py)."""
    if INTERPRET:
        return 16, 16, 1, 1
    if dtype == torch.float32:
        return 64, 64, 4, 2
    return 128, 64, 8, 3


def _precision(dtype: torch.dtype) -> str | None:
    if dtype != torch.float32:
        return None
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    out: torch.Tensor | None = None,
    scale: float = 1.0,
    row: int = 0,
    kernel: Any = None,
) -> torch.Tensor:
    """(B, H) max of q k^T, unscaled; with `out` (contiguous fp32), `out[row + h] =
    max(out[row + h], scale * that max over the batch)` in the kernel itself (returns `out`).
    `kernel`: the kernel as launched (`wrap_triton`'s inside a `triton_op`)."""
    B, H, T, D = q.shape
    S = k.size(2)
    if k.dtype != q.dtype:  # one dtype for tl.dot: the queries' (the activations')
        k = k.to(q.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    bm, bn, warps, stages = _blocks(q.dtype)
    nm = -(-T // bm)  # (triton.cdiv and next_power_of_2 are ~10 us wrappers a call)
    if nm > MAX_GRID_Y:
        raise ValueError(f"sequence too long for the fused max: {nm} blocks > {MAX_GRID_Y}")
    heads = out is not None
    if heads:
        assert out is not None
        if T == 0 or S == 0 or B == 0:
            return out  # no score: nothing raises the maximum
        maxb = out
    else:
        maxb = torch.empty(B * H, max(nm, 1), device=q.device, dtype=torch.float32)
        if T == 0 or S == 0:
            return maxb.fill_(float("-inf")).view(B, H, -1).amax(-1)
    kernel = _max_kernel if kernel is None else kernel
    kernel[(B * H, nm)](
        q, k, maxb, maxb, float(scale), T, S, H, H // k.size(1), nm, row,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        D=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=1 << max(D - 1, 0).bit_length(),
        CAUSAL=causal, UPCAST=INTERPRET, PRECISION=_precision(q.dtype), HEADS=heads,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return maxb if heads else maxb.view(B, H, nm).amax(-1)


# One opaque call for torch.compile (no tracing into the launch); eager code the same.
@torch.library.custom_op("spikewatch::fused_max_logits", mutates_args=())
def _fused(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    return _launch(q, k, causal) * scale


@_fused.register_fake
def _(q, k, causal, scale):  # noqa: ANN001, ANN202
    return q.new_empty((q.size(0), q.size(1)), dtype=torch.float32)


@torch.no_grad()
def fused_max_logits(
    q: torch.Tensor, k: torch.Tensor, *, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    """(B, H) fp32: max over (i, j) of scale * q_i . k_j (causal: j <= i), k's heads shared by
    groups of H / Hk query heads. Raises ValueError for a call `refusal` refuses."""
    why = refusal(q, k)
    if why is not None:
        raise ValueError(f"the fused max logits cannot take this call: {why}")
    scale = q.size(-1) ** -0.5 if scale is None else float(scale)
    if scale <= 0:
        raise ValueError(f"the scale must be positive, got {scale}")
    return _fused(q.detach(), k.detach(), causal, scale)


# The probes' form: one launch a layer, straight into the step's (H,) running maxima (no (B, H)
# result to reduce, scale and combine with the layer's earlier micro-batches: 3-4 kernels less a
# layer). A mutating op: torch.compile keeps it, in order, and knows what it writes.
@torch.library.custom_op("spikewatch::fused_head_max_", mutates_args=("out",))
def _fused_heads(
    out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float
) -> None:
    _launch(q, k, causal, out, scale)


@_fused_heads.register_fake
def _(out, q, k, causal, scale):  # noqa: ANN001, ANN202
    return None


@torch.no_grad()
def fused_head_max_(
    out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *, causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """`out` ((H,) fp32 on q's device) becomes max(out, the (B, H) maxima of `fused_max_logits`
    taken over the batch): a layer's per-head maximum over a step's micro-batches, in one launch
    each. Returns `out`. Raises ValueError for a call `refusal` refuses."""
    why = refusal(q, k)
    if why is not None:
        raise ValueError(f"the fused max logits cannot take this call: {why}")
    if out.shape != (q.size(1),) or out.dtype != torch.float32 or out.device != q.device:
        raise ValueError(f"out must be ({q.size(1)},) float32 on {q.device}, got {out.shape}")
    scale = q.size(-1) ** -0.5 if scale is None else float(scale)
    if scale <= 0:
        raise ValueError(f"the scale must be positive, got {scale}")
    _fused_heads(out, q.detach(), k.detach(), causal, scale)
    return out


# The recorder's form (trainer/model/attn_max.py): a layer's per-head maxima max'd into its row
# of the step's (layers, heads) table, a tensor that lives as long as the recorder. A
# `triton_op`: inside a compiled model Inductor launches the kernel from its own generated code,
# in the graph, with no Python of spikewatch's per layer (the opaque custom ops above run the
# launch's Python at the graph's run time), and a captured CUDA graph (mode="reduce-overhead")
# keeps it (the table has a fixed address). Eager code launches the kernel directly.
@triton_op("spikewatch::head_max_table_", mutates_args={"table"})
def _table_op(
    table: torch.Tensor, q: torch.Tensor, k: torch.Tensor, layer: int, causal: bool, scale: float
) -> None:
    _launch(q, k, causal, table, scale, row=layer * q.size(1), kernel=wrap_triton(_max_kernel))


class TableLaunch:
    """`head_max_table_`'s eager launch for q and k of one signature (shapes, strides, dtypes,
    device, causal, scale), its grid and arguments worked out once: a layer's call is then the
    launch alone (the recorder keeps one per signature; trainer/model/attn_max.py). Built only
    for a call the table takes (`table_refusal`) whose q and k need no cast and no copy. An
    fp32 call's precision (tf32 or ieee) is `torch.backends.cuda.matmul.allow_tf32` as it was
    when the signature was first seen (reading it costs more than the rest of a call)."""

    __slots__ = ("args", "consts", "empty", "grid", "heads", "strides")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> None:
        B, H, T, D = q.shape
        S = k.size(2)
        bm, bn, warps, stages = _blocks(q.dtype)
        nm = -(-T // bm)
        if nm > MAX_GRID_Y:
            raise ValueError(f"sequence too long for the fused max: {nm} blocks > {MAX_GRID_Y}")
        self.empty = T == 0 or S == 0 or B == 0  # no score: nothing raises the maximum
        self.grid = (B * H, nm)
        self.heads = H
        self.args = (float(scale), T, S, H, H // k.size(1), nm)
        self.strides = (*q.stride()[:3], *k.stride()[:3])
        self.consts = dict(
            D=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=1 << max(D - 1, 0).bit_length(), CAUSAL=causal,
            UPCAST=INTERPRET, PRECISION=_precision(q.dtype), HEADS=True, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip

    @staticmethod
    def fits(q: torch.Tensor, k: torch.Tensor) -> bool:
        """q and k as the kernel reads them: one dtype, unit stride in the head dim."""
        return q.dtype == k.dtype and q.stride(-1) == 1 and k.stride(-1) == 1

    def __call__(self, table: torch.Tensor, q: torch.Tensor, k: torch.Tensor, layer: int) -> None:
        if not self.empty:
            _max_kernel[self.grid](
                q, k, table, table, *self.args, layer * self.heads, *self.strides, **self.consts
            )


def table_refusal(table: torch.Tensor, q: torch.Tensor, k: torch.Tensor, layer: int) -> str | None:
    """Why `head_max_table_` cannot take this call (None: it can)."""
    why = refusal(q, k)
    if why is not None:
        return why
    if table.dim() != 2 or table.dtype != torch.float32 or not table.is_contiguous():
        return f"the table must be a contiguous (layers, heads) float32, got {table.shape}"
    if table.device != q.device:
        return f"the table is on {table.device}, q on {q.device}"
    if table.size(1) != q.size(1):
        return f"the table holds {table.size(1)} heads, q has {q.size(1)}"
    if not 0 <= layer < table.size(0):
        return f"layer {layer} is outside the table's {table.size(0)} rows"
    return None


def head_max_table_(
    table: torch.Tensor, q: torch.Tensor, k: torch.Tensor, layer: int, *, causal: bool = True,
    scale: float | None = None, check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """`table[layer]` becomes max(table[layer], the (B, H) maxima of `fused_max_logits` taken
    over the batch), in one launch: eager code launches the kernel itself (no operator
    dispatch); a compiled model puts the `triton_op` in its graph. Returns `table`. Raises
    ValueError for a call `table_refusal` refuses (`check=False`: the caller asked it already).
    No grad mode is needed: q and k are detached, and the kernel writes the table alone."""
    why = table_refusal(table, q, k, layer) if check else None
    if why is not None:
        raise ValueError(f"the fused max logits cannot take this call: {why}")
    scale = q.size(-1) ** -0.5 if scale is None else float(scale)
    if scale <= 0:
        raise ValueError(f"the scale must be positive, got {scale}")
    if torch.compiler.is_compiling():
        torch.ops.spikewatch.head_max_table_(table, q.detach(), k.detach(), layer, causal, scale)
    else:
        _launch(q.detach(), k.detach(), causal, table, scale, row=layer * q.size(1))
    return table
