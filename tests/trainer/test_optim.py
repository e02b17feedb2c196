from __future__ import annotations

import pytest
import torch

from spikewatch.trainer.config import ModelConfig, OptimConfig
from spikewatch.trainer.model.gpt import build_model
from spikewatch.trainer.model.optim import (
    Muon,
    build_optimizer,
    newton_schulz,
    param_groups,
    qk_clip,
)

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


def _model(**kw):
    return build_model(ModelConfig(n_layer=2, n_head=4, d_model=32, max_seq_len=64, **kw), seed=0)


def _batch(B=4, T=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (B, T), generator=g)
    return x, torch.roll(x, -1, 1)


def _names(model, group):
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_adamw_groups_exempt_embeddings_and_gains_from_weight_decay() -> None:
    model = _model()
    groups = {g["name"]: g for g in param_groups(model, OptimConfig(weight_decay=0.1))}
    no_decay = _names(model, groups["no_decay"])
    decay = _names(model, groups["decay"])
    assert "wte.weight" in no_decay and "norm_f.weight" in no_decay
    assert all(
        n == "wte.weight" or p.ndim == 1 for n, p in model.named_parameters() if n in no_decay
    )
    assert "lm_head.weight" in decay and "blocks.0.attn.q_proj.weight" in decay
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 0.1
    assert decay | no_decay == set(dict(model.named_parameters()))


def test_muon_groups_take_only_hidden_matrices() -> None:
    model = _model()
    groups = {g["name"]: g for g in param_groups(model, OptimConfig(name="muon"))}
    muon = _names(model, groups["muon"])
    assert muon and all(".attn." in n or ".mlp." in n for n in muon)
    assert "lm_head.weight" in _names(model, groups["decay"])
    assert "wte.weight" in _names(model, groups["no_decay"])


def _run_steps(opt_factory, model, steps=5):
    opt = opt_factory(model)
    for i in range(steps):
        opt.zero_grad()
        model(*_batch(seed=i)).loss.backward()
        opt.step()
    return model


def test_adamw_path_matches_torch_adamw() -> None:
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    ours = _run_steps(lambda m: build_optimizer(m, cfg), _model())

    def reference(m):
        decay = [p for n, p in m.named_parameters() if p.ndim == 2 and not n.startswith("wte")]
        rest = [p for n, p in m.named_parameters() if p.ndim < 2 or n.startswith("wte")]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
            lr=1e-2,
            betas=(0.9, 0.95),
            eps=1e-8,
        )

    ref = _run_steps(reference, _model())
    for (n, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=n)


def test_muon_adamw_groups_match_torch_adamw() -> None:
    torch.manual_seed(0)
    p1 = torch.nn.Parameter(torch.randn(10))
    p2 = torch.nn.Parameter(p1.detach().clone())
    ours = Muon([{"params": [p1], "weight_decay": 0.05}], lr=3e-2)
    ref = torch.optim.AdamW(
        [p2], lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, foreach=False
    )
    for i in range(8):
        g = torch.randn(10, generator=torch.Generator().manual_seed(i))
        p1.grad, p2.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p1, p2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.state[p1]["exp_avg_sq"], ref.state[p2]["exp_avg_sq"])


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48)])
def test_newton_schulz_singular_values_near_one(shape) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    s_in = torch.linalg.svdvals(g)
    s = torch.linalg.svdvals(newton_schulz(g, steps=5))
    # The quintic's tuned coefficients trade exactness for speed: values land in ~[0.68, 1.2]
    # (Jordan et al.), whatever the input's spread.
    assert s_in.max() / s_in.min() > 4
    assert s.min() > 0.65 and s.max() < 1.25


def test_muon_update_rms_matches_adamw_scale() -> None:
    """0.2 * sqrt(max(A, B)) makes the update RMS ~0.2 per unit LR, whatever the shape."""
    for shape in [(64, 16), (16, 64)]:
        p = torch.nn.Parameter(torch.zeros(*shape))
        p.grad = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        opt = Muon([{"params": [p], "use_muon": True}], lr=1.0, weight_decay=0.0)
        opt.step()
        assert p.detach().pow(2).mean().sqrt().item() == pytest.approx(0.2, rel=0.15)


def test_muon_refuses_non_matrix_params() -> None:
    with pytest.raises(ValueError, match="2-D"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(3))], "use_muon": True}], lr=1.0)


def _max_logits(model, x, y):
    with torch.no_grad():
        return model(x, y, need_attn_max=True).attn_max  # (L, nh)


def test_qk_clip_brings_every_head_to_tau_and_leaves_the_rest() -> None:
    model = _model()
    attn0 = model.blocks[0].attn
    with torch.no_grad():
        attn0.q_proj.weight.mul_(60)
        attn0.k_proj.weight.mul_(60)
    x, y = _batch()
    before = _max_logits(model, x, y)
    tau = float(before[0].median())
    q_before = attn0.q_proj.weight.detach().clone()
    qk_clip(model.attention_modules(), before, tau)
    after = _max_logits(model, x, y)
    over = before[0] > tau
    assert over.any() and not over.all()
    torch.testing.assert_close(
        after[0][over], torch.full_like(after[0][over], tau), rtol=1e-4, atol=0
    )
    torch.testing.assert_close(after[0][~over], before[0][~over])  # layer 0's input is unchanged
    rows = attn0.q_proj.weight.view(4, 8, -1)
    torch.testing.assert_close(rows[~over], q_before.view(4, 8, -1)[~over], rtol=0, atol=0)


def test_muonclip_step_bounds_recomputed_max_logit() -> None:
    """The clip uses this step's forward (as Kimi K2 does): the next forward can exceed tau
    only by what the update itself moved, which a small LR keeps within the tolerance."""
    from spikewatch.trainer.builtin.step import apply_update, forward_backward

    model = _model()
    with torch.no_grad():
        for a in model.attention_modules():
            a.q_proj.weight.mul_(40)
            a.k_proj.weight.mul_(40)
    tau = 10.0
    opt = build_optimizer(model, OptimConfig(name="muonclip", lr=1e-4, qk_clip_tau=tau))
    x, y = _batch()
    assert _max_logits(model, x, y).max() > 5 * tau
    t = forward_backward(
        model, x, y, micro_batch=4, dtype="float32", need_attn_max=True, grad_clip=1.0
    )
    apply_update(model, opt, 1.0, t.attn_max, tau)
    assert _max_logits(model, x, y).max() <= tau * 1.02


def test_qk_clip_works_with_adamw() -> None:
    from spikewatch.trainer.builtin.step import apply_update, forward_backward

    model = _model()
    with torch.no_grad():
        model.blocks[1].attn.q_proj.weight.mul_(50)
    opt = build_optimizer(model, OptimConfig(name="adamw", lr=1e-3, qk_clip_tau=5.0))
    x, y = _batch()
    t = forward_backward(
        model, x, y, micro_batch=4, dtype="float32", need_attn_max=True, grad_clip=None
    )
    apply_update(model, opt, 1.0, t.attn_max, 5.0)
    assert _max_logits(model, x, y).max() <= 5.0 * 1.02
