"""Per-head attention maxima for the model families people train from a config (GPT-2, Llama,
Mistral, Qwen2, Qwen3, Gemma 1-3, Phi, Phi-3), each at a tiny size: the recorded maxima equal a
reference computed from the model's own q, k, scaling and mask, captured where the model hands
them to its attention function (after its projections, norms and rotary embedding), by a plain
matmul that the recording code does not share. A model that cannot be covered is named in a
warning."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

from transformers import AttentionInterface  # noqa: E402

from spikewatch import hf, hf_attention  # noqa: E402
from spikewatch.trainer.model.attn_max import AttnMax  # noqa: E402

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention where the family has it
    max_position_embeddings=64,
)
FAMILIES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", TINY),
    "mistral": ("MistralConfig", "MistralForCausalLM", TINY),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", TINY),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**TINY, "head_dim": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**TINY, "head_dim": 16}),
    # soft-capped logits and a sliding window shorter than the sequence
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**TINY, "head_dim": 16, "sliding_window": 8}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {**TINY, "head_dim": 16, "sliding_window": 8},
    ),
    "phi": ("PhiConfig", "PhiForCausalLM", TINY),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**TINY, "pad_token_id": 0}),
}


def _reference(q, k, scaling, mask, causal) -> torch.Tensor:
    """Max over batch, queries and allowed keys of q.k * scaling, per head: (H,)."""
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)  # (B, H, S, D)
    s = torch.einsum("bhtd,bhsd->bhts", q.double(), k.double()) * scaling
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else mask == 0
    else:
        T, S = s.shape[-2:]
        allowed = torch.ones(T, S, dtype=torch.bool).tril(S - T) if causal else None
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s.amax(dim=(0, 2, 3)).float()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_attention_maxima_equal_the_models_own_q_and_k(family: str) -> None:
    config_name, model_name, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    impl = "eager" if family == "gemma2" else "sdpa"  # Gemma 2 has no SDPA (its soft-cap)
    config = getattr(transformers, config_name)(**kwargs, attn_implementation=impl)
    model = getattr(transformers, model_name)(config).train()
    rec = AttnMax()
    assert hf.attach_attention(model, rec) == 2, family
    seen: dict[int, tuple] = {}

    def capture(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        causal = bool(kw.get("is_causal", getattr(module, "is_causal", True)))
        scale = query.size(-1) ** -0.5 if scaling is None else scaling
        seen[module.layer_idx] = (query.detach(), key.detach(), scale, attention_mask, causal)
        return hf_attention._attention(
            module, query, key, value, attention_mask, dropout, scaling, **kw
        )

    AttentionInterface.register(hf.ATTN_IMPLEMENTATION, capture)
    try:
        rec.active = True
        x = torch.randint(1, 256, (2, 24))
        out = model(input_ids=x, labels=x)
        out.loss.backward()
    finally:
        hf.register_attention()  # the recording function again, for the other tests
    assert torch.isfinite(out.loss)
    layers, got = rec.take()
    assert layers == (0, 1)
    for i in layers:
        q, k, scale, mask, causal = seen[i]
        want = _reference(q, k, scale, mask, causal)
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)


def test_gemma2_keeps_its_soft_capped_attention() -> None:
    """The recording attention computes what the model's own eager attention does (SDPA has
    no soft-cap): the same attention outputs with it as without it."""
    config_name, model_name, kwargs = FAMILIES["gemma2"]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(
        **kwargs, attn_logit_softcapping=1.0, attn_implementation="eager"
    )
    model = getattr(transformers, model_name)(config).train()
    with torch.no_grad():  # logits of a few units, so that the soft-cap at 1.0 bites
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(300.0)
    outputs: list[torch.Tensor] = []
    model.model.layers[1].self_attn.register_forward_hook(
        lambda m, a, out: outputs.append(out[0].detach())
    )
    x = torch.randint(1, 256, (2, 24))
    model(input_ids=x)
    rec = AttnMax()
    hf.attach_attention(model, rec)
    rec.active = True
    model(input_ids=x)
    assert rec.take()[1].max() > 3.0  # the raw logits the cap folds
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-5)


def test_a_model_that_cannot_be_covered_is_named(caplog) -> None:
    config_name, model_name, kwargs = FAMILIES["llama"]
    model = getattr(transformers, model_name)(
        getattr(transformers, config_name)(**kwargs, attn_implementation="flex_attention")
    )
    with caplog.at_level(logging.WARNING, logger="spikewatch"):
        assert hf.attach_attention(model, AttnMax()) == 0
    assert "LlamaForCausalLM" in caplog.text and "flex_attention" in caplog.text

    class Plain(torch.nn.Module):  # no transformers attention modules at all
        config = transformers.LlamaConfig(**kwargs, attn_implementation="sdpa")

        def set_attn_implementation(self, name: str) -> None:
            self.config._attn_implementation = name

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spikewatch"):
        assert hf.attach_attention(Plain(), AttnMax()) == 0
    assert "Plain" in caplog.text and "layer_idx" in caplog.text


def test_a_hugging_face_model_in_a_plain_loop_records_its_maxima_unasked(tmp_path, caplog) -> None:
    """The Watch in the user's own loop routes a transformers model's attention through its
    recording function by itself (the maxima were silently missing without
    `spikewatch.hf.attach_attention`); a model whose attention it cannot see is said, once."""
    from spikewatch import Watch

    config_name, model_name, kwargs = FAMILIES["llama"]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(
        getattr(transformers, config_name)(**kwargs, attn_implementation="sdpa")
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with caplog.at_level(logging.INFO, logger="spikewatch"):
        with Watch(model, opt, run_dir=tmp_path / "hf", db="none", max_steps=3) as watch:
            for _ in range(3):
                x = torch.randint(0, kwargs["vocab_size"], (2, 8))
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                watch.step(loss)
    names = watch.summary()["metric_names"]
    assert any(n.endswith("/attn_max") and "/head/" in n for n in names), names
    assert "per-head attention maxima: recorded in LlamaForCausalLM's attention" in caplog.text
    assert "no per-head attention maxima" not in caplog.text

    caplog.clear()
    lin = torch.nn.Linear(4, 1)
    with caplog.at_level(logging.INFO, logger="spikewatch"):
        with Watch(lin, torch.optim.SGD(lin.parameters(), lr=0.1), run_dir=tmp_path / "lin",
                   db="none", max_steps=3) as watch:  # fmt: skip
            for _ in range(3):
                loss = lin(torch.ones(2, 4)).square().mean()
                loss.backward()
                watch.step(loss)
    assert caplog.text.count("no per-head attention maxima") == 1
