from __future__ import annotations

import math

import pytest
import torch

from spikewatch.trainer.config import ModelConfig
from spikewatch.trainer.model.attention import attention, max_logits
from spikewatch.trainer.model.gpt import build_model, param_kind

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


def _qkv(B=2, H=3, T=50, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g) * 2 for _ in range(3)]


def _eager_reference(q, k, v, causal):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        T = q.size(-2)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, s.amax(dim=(-2, -1))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk", [7, 16, 64])
def test_chunked_equals_sdpa_and_eager_max(causal: bool, chunk: int) -> None:
    q, k, v = _qkv()
    ref_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    _, ref_max = _eager_reference(q, k, v, causal)
    out, mx = attention(q, k, v, backend="chunked", causal=causal, need_max=True, chunk=chunk)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mx, ref_max)
    eout, emax = attention(q, k, v, backend="eager", causal=causal, need_max=True)
    torch.testing.assert_close(eout, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(emax, ref_max)


def test_sdpa_backend_reports_the_same_max() -> None:
    q, k, v = _qkv(T=33)
    _, ref_max = _eager_reference(q, k, v, True)
    _, mx = attention(q, k, v, backend="sdpa", need_max=True, chunk=8)
    torch.testing.assert_close(mx, ref_max)
    torch.testing.assert_close(max_logits(q, k, chunk=5), ref_max)


def test_the_max_pass_reuses_its_score_block_and_stays_exact_in_float64_terms() -> None:
    """One CPU score block serves every call (shapes growing and shrinking, a mask, a strided
    q and k as torchtitan passes them, bf16 autocast around it); each answer is the float64
    maximum's, and an earlier answer is not overwritten by a later call."""

    def reference(q, k, causal, mask=None):
        s = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.size(-1))
        if causal:
            tq, tk = q.size(-2), k.size(-2)
            s = s.masked_fill(torch.ones(tq, tk, dtype=torch.bool).triu(1), float("-inf"))
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return s.amax(dim=(-2, -1)).float()

    big = _qkv(B=2, H=4, T=96, D=8, seed=1)
    first = max_logits(big[0], big[1], chunk=64)
    expected_first = reference(big[0], big[1], True)
    torch.testing.assert_close(first, expected_first)
    small = _qkv(B=1, H=2, T=20, D=8, seed=2)
    sq, sk = small[:2]
    torch.testing.assert_close(max_logits(sq, sk, chunk=64), reference(sq, sk, True))
    pad = torch.ones(1, 1, 20, 20, dtype=torch.bool)
    pad[..., 15:] = False  # the last five keys padded
    torch.testing.assert_close(
        max_logits(small[0], small[1], causal=False, mask=pad, chunk=8),
        reference(small[0], small[1], False, pad),
    )
    blh = torch.randn(2, 70, 4, 8, generator=torch.Generator().manual_seed(3)) * 3
    q, k = blh.transpose(1, 2), blh.flip(1).transpose(1, 2)  # (B, L, N, H) seen as (B, N, L, H)
    torch.testing.assert_close(max_logits(q, k, chunk=32), reference(q, k, True))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a probe reads its inputs' precision
        torch.testing.assert_close(max_logits(q, k, chunk=32), reference(q, k, True))
    torch.testing.assert_close(first, expected_first)  # not a view of the reused block


def test_chunked_gradients_equal_eager() -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(T=40))
    out_c, _ = attention(q, k, v, backend="chunked", chunk=16, softcap=5.0)
    gc = torch.autograd.grad(out_c.square().sum(), (q, k, v))
    out_e, _ = attention(q, k, v, backend="eager", softcap=5.0)
    ge = torch.autograd.grad(out_e.square().sum(), (q, k, v))
    for a, b in zip(gc, ge, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "chunked"])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_causal_output_ignores_the_future(backend: str, softcap: float | None) -> None:
    q, k, v = _qkv(T=30)
    out, _ = attention(q, k, v, backend=backend, softcap=softcap, chunk=8)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 20:] += 5.0
    v2[:, :, 20:] -= 7.0
    out2, _ = attention(q, k2, v2, backend=backend, softcap=softcap, chunk=8)
    torch.testing.assert_close(out[:, :, :20], out2[:, :, :20])
    assert not torch.allclose(out[:, :, 20:], out2[:, :, 20:])


def test_softcap_bounds_logits_but_max_is_precap() -> None:
    q, k, v = _qkv(T=20)
    out, mx = attention(q, k, v, backend="eager", softcap=1.0, need_max=True)
    _, ref_max = _eager_reference(q, k, v, True)
    torch.testing.assert_close(mx, ref_max)  # QK-Clip bounds the logit before the cap
    plain, _ = attention(q, k, v, backend="eager")
    assert not torch.allclose(out, plain)


def _model(**kw):
    cfg = ModelConfig(n_layer=2, n_head=4, d_model=32, max_seq_len=64, **kw)
    return build_model(cfg, seed=0)


def _batch(B=2, T=24):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (B, T), generator=g)
    return x, torch.roll(x, -1, 1)


def test_init_is_a_pure_function_of_seed_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = _model(), _model()
    assert torch.equal(torch.random.get_rng_state(), before)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_loss_at_init_is_near_log_vocab() -> None:
    out = _model()(*_batch())
    assert out.loss.item() == pytest.approx(math.log(256), abs=0.1)


@pytest.mark.parametrize(
    "kw",
    [
        dict(qk_norm=True),
        dict(norm_placement="reordered"),
        dict(tie_embeddings=True),
        dict(attn_softcap=20.0, final_softcap=15.0),
        dict(attention="eager"),
        dict(attention="chunked", attn_chunk=5),
    ],
)
def test_every_switch_trains(kw) -> None:
    model = _model(**kw)
    out = model(*_batch(), need_attn_max=True)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert out.attn_max is not None and out.attn_max.shape == (2, 4)
    assert all(p.grad is not None for p in model.parameters())


def test_backends_agree_inside_the_model() -> None:
    x, y = _batch()
    losses = [_model(attention=b)(x, y).loss for b in ("sdpa", "eager", "chunked")]
    for other in losses[1:]:
        torch.testing.assert_close(other, losses[0], rtol=1e-5, atol=1e-5)


def test_final_softcap_bounds_output_logits() -> None:
    out = _model(final_softcap=2.0)(*_batch())
    assert out.logits.abs().max() <= 2.0


def test_tied_embeddings_share_storage() -> None:
    m = _model(tie_embeddings=True)
    assert m.lm_head.weight is m.wte.weight
    assert sum(1 for _ in m.parameters()) == len(dict(m.named_parameters()))


def test_param_kinds() -> None:
    kinds = {n: param_kind(n, p) for n, p in _model().named_parameters()}
    assert kinds["wte.weight"] == "embedding" and kinds["lm_head.weight"] == "head"
    assert kinds["blocks.0.attn.q_proj.weight"] == "matrix"
    assert kinds["blocks.1.mlp_norm.weight"] == "gain"


def test_z_loss_gradient_matches_finite_differences() -> None:
    torch.manual_seed(0)
    model = _model(z_loss=0.5).double()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # large logits: the z-loss term matters
    x, y = _batch(T=8)
    out = model(x, y)
    assert out.z_mean is not None
    ce_only = torch.nn.functional.cross_entropy(out.logits.view(-1, 256), y.reshape(-1))
    assert out.loss.item() > ce_only.item() + 0.5 * out.z_mean.item() ** 2 * 0.5
    w = model.lm_head.weight
    (grad,) = torch.autograd.grad(out.loss, w)
    eps = 1e-5
    g = torch.Generator().manual_seed(2)
    for _ in range(6):
        i, j = (int(torch.randint(0, n, (1,), generator=g)) for n in w.shape)
        with torch.no_grad():
            w[i, j] += eps
            up = model(x, y).loss.item()
            w[i, j] -= 2 * eps
            down = model(x, y).loss.item()
            w[i, j] += eps
        assert (up - down) / (2 * eps) == pytest.approx(grad[i, j].item(), rel=1e-3, abs=1e-7)


def test_z_loss_pushes_log_partition_towards_zero() -> None:
    """The z-loss term's gradient alone lowers mean log^2 Z (what PaLM used it for)."""
    x, y = _batch()
    m0 = _model(z_loss=None)
    m1 = _model(z_loss=1.0)
    lse = torch.logsumexp(m1(x, y).logits, -1).square().mean()
    d = m1(x, y).loss - m0(x, y).loss
    torch.testing.assert_close(d, lse, rtol=1e-5, atol=1e-6)


def test_off_the_cpu_the_max_pass_takes_its_blocks_on_the_tensors_own_device() -> None:
    """The reused score buffer is a CPU one: on another device (`meta` standing in for CUDA)
    each call's blocks are allocated there, so the pass runs and answers on that device."""
    q, k = (torch.empty(2, 3, 40, 8, device="meta") for _ in range(2))
    mx = max_logits(q, k, chunk=16, fused=False)
    assert mx.device.type == "meta" and mx.shape == (2, 3)
