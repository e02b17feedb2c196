"""Which calls the fused Triton attention takes: one check for every caller (the built-in
GPT's `auto` backend, the Hugging Face attention function, the kernel's own entry).

Imports no Triton. Measured by compiling the kernels ahead of time for sm_80 and sm_90
(tests/trainer/test_kernel_aot.py): a head dim below 16 does not compile (`tl.dot` needs
K >= 16), above 128 is not supported; fp16, bf16 and fp32 inputs compile. Mixed dtypes (HF
Llama's RoPE gives fp32 q and k beside a bf16 v; the built-in `qk_norm` under bf16 autocast)
fail in `tl.dot` on a GPU, so the kernel's entry casts q and k to v's dtype, as SDPA under
autocast would. The CPU interpreter upcasts everything and would hide both.
"""

from __future__ import annotations

import os

import torch

__all__ = ["MAX_HEAD_DIM", "MIN_HEAD_DIM", "common_dtype", "refusal", "tensor_refusal"]

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def common_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The one dtype the kernel runs in: v's (the activations' under autocast)."""
    return v.dtype


def refusal(
    device: torch.device,
    head_dim: int,
    dtype: torch.dtype,
    *,
    mask: bool = False,
    dropout: float = 0.0,
    softcap: float | None = None,
) -> str | None:
    """Why the fused kernel cannot take a call of this kind (None: it can)."""
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return f"it runs on CUDA (or TRITON_INTERPRET=1 on a CPU), not on {device.type}"
    if mask:
        return "it takes no attention mask (causal or full attention only)"
    if dropout:
        return "it applies no attention dropout"
    if softcap is not None:
        return "it applies no attention soft-cap"
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        return f"head dim {head_dim} is outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM}"
    if dtype not in DTYPES:
        return f"dtype {dtype} is not fp16, bf16 or fp32"
    return None


def tensor_refusal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
) -> str | None:
    """`refusal` for actual q, k, v: (B, H, T, D) each, self-attention (keys as many as
    queries, grouped-query keys already repeated)."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        return f"q, k, v must share one (B, H, T, D) shape, got {q.shape}, {k.shape}, {v.shape}"
    if not (q.device == k.device == v.device):
        return f"q, k, v on different devices ({q.device}, {k.device}, {v.device})"
    return refusal(
        q.device,
        q.size(-1),
        common_dtype(q, k, v),
        mask=mask is not None,
        dropout=dropout,
        softcap=softcap,
    )
