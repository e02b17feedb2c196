"""Fused flash-style attention (forward and backward) that also returns the max logit.

A flash-attention forward keeps a running row maximum of the scores for its online softmax;
the max pre-softmax logit per (batch, head), which QK-Clip and the probes need every step, is
that maximum reduced over rows, so it costs nothing extra. `scaled_dot_product_attention`
cannot report it. The kernels follow the standard FlashAttention-2 scheme (Dao 2023; Triton's
fused-attention tutorial): the forward stores the row log-sum-exp, the backward recomputes the
probabilities blockwise, one kernel for dK/dV (looping over queries) and one for dQ (looping
over keys), so there are no atomics. Any T (masked tails), head dims up to 128 (padded to a
power of two), causal or not, fp32 / fp16 / bf16 inputs with fp32 accumulation (one dtype: q and
k are cast to v's; fp32 dots in IEEE fp32 unless torch allows TF32 for matmuls). Which calls it
takes is decided in one place, trainer/model/kernels/eligibility.py.

On a CPU it runs only under Triton's interpreter (`TRITON_INTERPRET=1`, set before this module
is imported), where `tl.dot` on bf16 is wrong: there, every operand is upcast to fp32 inside
the kernel. `reference_attention` is the plain-PyTorch definition it is tested against.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from spikewatch.trainer.model.kernels.eligibility import common_dtype, tensor_refusal

__all__ = ["flash_attention", "reference_attention"]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634


@triton.jit
def _fwd_kernel(
    Q, K, V, Out, LSE, MAXB,
    qk_scale, T, num_m_blocks,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)  # B * H on the axis of 2**31 - 1 programs
    pid_m = tl.program_id(1)
    base = bh.to(tl.int64) * T * D
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < T
    mask_d = offs_d < D
    q = tl.load(
        Q + base + offs_m[:, None] * D + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # (M, Dp)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = T
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T)
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + offs_n
        kt = tl.load(
            K + base + n[None, :] * D + offs_d[:, None],
            mask=(n[None, :] < T) & mask_d[:, None],
            other=0.0,
        )  # (Dp, N)
        v = tl.load(
            V + base + n[:, None] * D + offs_d[None, :],
            mask=(n[:, None] < T) & mask_d[None, :],
            other=0.0,
        )  # (N, Dp)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (M, N) scores in log2 units
        valid = n[None, :] < T
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= n[None, :])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(
        Out + base + offs_m[:, None] * D + offs_d[None, :],
        acc.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, m_i + tl.math.log2(l_i), mask=mask_m)
    tl.store(MAXB + bh * num_m_blocks + pid_m, tl.max(tl.where(mask_m, m_i, float("-inf")), 0))


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    qk_scale, sm_scale, T,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    base = bh.to(tl.int64) * T * D
    row = bh.to(tl.int64) * T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_nd = (offs_n[:, None] < T) & (offs_d[None, :] < D)
    k = tl.load(K + base + offs_n[:, None] * D + offs_d[None, :], mask=mask_nd, other=0.0)
    v = tl.load(V + base + offs_n[:, None] * D + offs_d[None, :], mask=mask_nd, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for start_m in range(lo, T, BLOCK_M):
        m = start_m + offs_m
        mask_md = (m[:, None] < T) & (offs_d[None, :] < D)
        q = tl.load(Q + base + m[:, None] * D + offs_d[None, :], mask=mask_md, other=0.0)
        do = tl.load(DO + base + m[:, None] * D + offs_d[None, :], mask=mask_md, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(LSE + row + m, mask=m < T, other=0.0)
        delta = tl.load(DELTA + row + m, mask=m < T, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (M, N), log2 units
        valid = (m[:, None] < T) & (offs_n[None, :] < T)
        if CAUSAL:
            valid = valid & (m[:, None] >= offs_n[None, :])
        p = tl.where(valid, tl.math.exp2(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    tl.store(
        DK + base + offs_n[:, None] * D + offs_d[None, :],
        (dk * sm_scale).to(DK.dtype.element_ty),
        mask=mask_nd,
    )
    tl.store(
        DV + base + offs_n[:, None] * D + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=mask_nd
    )


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    qk_scale, sm_scale, T,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)  # B * H on the axis of 2**31 - 1 programs
    pid_m = tl.program_id(1)
    base = bh.to(tl.int64) * T * D
    row = bh.to(tl.int64) * T
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_md = (offs_m[:, None] < T) & (offs_d[None, :] < D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :], mask=mask_md, other=0.0)
    do = tl.load(DO + base + offs_m[:, None] * D + offs_d[None, :], mask=mask_md, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + row + offs_m, mask=offs_m < T, other=0.0)
    delta = tl.load(DELTA + row + offs_m, mask=offs_m < T, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = T
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T)
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + offs_n
        mask_nd = (n[:, None] < T) & (offs_d[None, :] < D)
        k = tl.load(K + base + n[:, None] * D + offs_d[None, :], mask=mask_nd, other=0.0)
        v = tl.load(V + base + n[:, None] * D + offs_d[None, :], mask=mask_nd, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        valid = (offs_m[:, None] < T) & (n[None, :] < T)
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= n[None, :])
        p = tl.where(valid, tl.math.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(
        DQ + base + offs_m[:, None] * D + offs_d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=mask_md,
    )


def _blocks(d: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), each within an A100's shared memory (166,912
    bytes a block; tests/trainer/test_kernel_aot.py compiles every case for sm_80 and sm_90).
    Small blocks in the interpreter keep the tests fast and exercise multi-block tails."""
    if INTERPRET:
        return 16, 16, 1, 1
    if dtype == torch.float32:  # fp32 tiles take twice the shared memory
        return 64, 32, 4, 2
    if d <= 64:
        return 128, 64, 4, 3
    return 64, 64, 4, 2


# the grid's second axis holds at most 65,535 programs: the query or key blocks go there, B * H on
# the first (2**31 - 1)
MAX_GRID_Y = 65535


def _grid(bh: int, blocks: int) -> tuple[int, int]:
    if blocks > MAX_GRID_Y:
        raise ValueError(f"sequence too long for the Triton attention: {blocks} blocks > 65535")
    return bh, blocks


def _precision(dtype: torch.dtype) -> str | None:
    """fp32 dots in IEEE fp32 unless the user allowed TF32 for matmuls (torch's own switch);
    16-bit inputs take the tensor cores' native path (None: Triton's default)."""
    if dtype != torch.float32:
        return None
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    why = tensor_refusal(q, k, v)
    if why is not None:
        raise ValueError(f"the Triton attention cannot take this call: {why}")


def _forward(q, k, v, causal: bool, sm_scale: float):
    B, H, T, D = q.shape
    bm, bn, warps, stages = _blocks(D, q.dtype)
    o = torch.empty_like(q)
    lse = torch.empty(B * H, T, device=q.device, dtype=torch.float32)  # log2 units
    nm = triton.cdiv(T, bm)
    maxb = torch.empty(B * H, nm, device=q.device, dtype=torch.float32)
    _fwd_kernel[_grid(B * H, nm)](
        q, k, v, o, lse, maxb, sm_scale * LOG2E, T, nm,
        D=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=triton.next_power_of_2(D),
        CAUSAL=causal, UPCAST=INTERPRET, PRECISION=_precision(q.dtype),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    mx = maxb.view(B, H, nm).amax(-1) / LOG2E  # (B, H), back to natural units
    return o, lse, mx


def _backward(q, k, v, o, lse, do, causal: bool, sm_scale: float):
    B, H, T, D = q.shape
    bm, bn, warps, stages = _blocks(D, q.dtype)
    do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1).view(B * H, T)  # rowsum(dO * O)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = dict(
        D=D,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=triton.next_power_of_2(D),
        CAUSAL=causal,
        UPCAST=INTERPRET,
        PRECISION=_precision(q.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    _bwd_dkdv_kernel[_grid(B * H, triton.cdiv(T, bn))](
        q, k, v, do, lse, delta, dk, dv, sm_scale * LOG2E, sm_scale, T, **args
    )
    _bwd_dq_kernel[_grid(B * H, triton.cdiv(T, bm))](
        q, k, v, do, lse, delta, dq, sm_scale * LOG2E, sm_scale, T, **args
    )
    return dq, dk, dv


# The kernels as two custom operators with their own autograd: torch.compile treats them as one
# opaque call each (no tracing into Triton launches, no graph break), eager code the same.
@torch.library.custom_op("spikewatch::flash_attention_fwd", mutates_args=())
def _flash_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(q.contiguous(), k.contiguous(), v.contiguous(), causal, sm_scale)


@_flash_fwd.register_fake
def _(q, k, v, causal, sm_scale):  # noqa: ANN001, ANN202
    B, H, T, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((B * H, T), dtype=torch.float32)
    return out, lse, q.new_empty((B, H), dtype=torch.float32)


@torch.library.custom_op("spikewatch::flash_attention_bwd", mutates_args=())
def _flash_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    causal: bool,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _backward(q, k, v, o, lse, do, causal, sm_scale)


@_flash_bwd.register_fake
def _(q, k, v, o, lse, do, causal, sm_scale):  # noqa: ANN001, ANN202
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
    )


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, v, causal, sm_scale = inputs
    o, lse, _ = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.sm_scale = causal, sm_scale


def _grads(ctx, do, _dlse, _dmx):  # noqa: ANN001, ANN202
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _flash_bwd(q, k, v, o, lse, do, ctx.causal, ctx.sm_scale)
    return dq, dk, dv, None, None


_flash_fwd.register_autograd(_grads, setup_context=_setup_context)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v: (B, H, T, D). Returns (out (B, H, T, D), max scaled logit (B, H), fp32; the
    max carries no gradient)."""
    _check(q, k, v)
    dtype = common_dtype(q, k, v)  # one dtype for tl.dot (fp32 q, k beside a bf16 v: cast)
    q, k = q.to(dtype), k.to(dtype)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.size(-1))
    out, _, mx = _flash_fwd(q, k, v, causal, scale)
    return out, mx.detach()


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: softmax(QK^T * scale + mask) V in fp32, and the max masked logit."""
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.size(-1))
    s = (q.float() @ k.float().transpose(-2, -1)) * scale  # (B, H, T, T)
    if causal:
        T = q.size(-2)
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    out = torch.softmax(s, dim=-1) @ v.float()
    return out.to(q.dtype), s.detach().amax(dim=(-2, -1))
