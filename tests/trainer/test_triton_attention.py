"""The fused Triton attention against its plain-PyTorch reference (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from spikewatch.trainer.config import ModelConfig
from spikewatch.trainer.model.gpt import build_model

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "needs CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it)", allow_module_level=True
    )

from spikewatch.trainer.model.kernels.attention import flash_attention, reference_attention  # noqa: E402

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2)}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(1, 2, 37, 32), (2, 1, 16, 64), (1, 1, 50, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_output_gradients_and_max_match_the_reference(causal, shape, dtype) -> None:
    g = torch.Generator().manual_seed(hash((causal, shape)) % 2**31)
    q, k, v = (
        (torch.randn(*shape, generator=g) * 1.5).to(dtype).requires_grad_() for _ in range(3)
    )
    out, mx = flash_attention(q, k, v, causal=causal)
    ref, ref_mx = reference_attention(q, k, v, causal=causal)
    assert out.dtype == dtype and mx.shape == shape[:2] and mx.dtype == torch.float32
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(mx, ref_mx, atol=1e-5, rtol=1e-5)
    do = torch.randn(*shape, generator=g).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=f"d{name}")


def test_max_logit_is_the_masked_maximum() -> None:
    """A huge logit in the masked (future) triangle must not count."""
    q = torch.zeros(1, 1, 20, 32)
    k = torch.zeros(1, 1, 20, 32)
    q[0, 0, 2, 0] = 10.0
    k[0, 0, 15, 0] = 10.0  # only queries >= 15 may see key 15: query 2 cannot
    k[0, 0, 1, 0] = 1.0
    v = torch.randn(1, 1, 20, 32)
    _, mx = flash_attention(q, k, v, causal=True)
    assert mx.item() == pytest.approx(10.0 / 32**0.5)
    _, mx_full = flash_attention(q, k, v, causal=False)
    assert mx_full.item() == pytest.approx(100.0 / 32**0.5)


def test_model_with_triton_backend_matches_sdpa() -> None:
    cfg = dict(n_layer=2, n_head=2, d_model=64, max_seq_len=64)
    tri = build_model(ModelConfig(attention="triton", **cfg), seed=0)
    ref = build_model(ModelConfig(attention="eager", **cfg), seed=0)
    x = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(0))
    y = x.roll(-1, 1)
    a, b = tri(x, y, need_attn_max=True), ref(x, y, need_attn_max=True)
    torch.testing.assert_close(a.loss, b.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.attn_max, b.attn_max, atol=1e-5, rtol=1e-5)
    a.loss.backward()
    b.loss.backward()
    for (n, pa), pb in zip(tri.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_bad_shapes_are_refused() -> None:
    q = torch.randn(1, 1, 8, 32)
    with pytest.raises(ValueError, match="share one"):
        flash_attention(q, q[..., :16], q)
    big = torch.randn(1, 1, 8, 256)
    with pytest.raises(ValueError, match="head dim 256 is outside 16..128"):
        flash_attention(big, big, big)
    small = torch.randn(1, 1, 8, 8)  # tl.dot needs K >= 16: it would not compile on a GPU
    with pytest.raises(ValueError, match="head dim 8 is outside 16..128"):
        flash_attention(small, small, small)
