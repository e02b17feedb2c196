"""spikewatch.hf beyond what test_examples.py covers: gradient accumulation, and per-head
attention maxima against the model's own q and k (grouped-query attention)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from spikewatch.hf import attach_attention  # noqa: E402
from trainer.model.attention import AttnMax  # noqa: E402

from .conftest import (  # noqa: E402
    POISON,
    STEPS,
    run_example,
    the_rollback,
)


def test_gradient_accumulation(tmp_path) -> None:
    """Two micro-batches of 4 rows make the same step as one batch of 8: the same loss (HF
    divides each micro-batch's loss by the whole step's tokens, so the Watch adds the shares)."""
    short = ("--steps", "6", "--db", "none")
    one = run_example("hf_trainer", tmp_path / "one", *short)
    two = run_example("hf_trainer", tmp_path / "two", *short, "--grad-accum", "2")
    assert two["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-4)
    s = run_example("hf_trainer", tmp_path, *STEPS, *POISON, "--grad-accum", "2", "--db", "none")
    rb = the_rollback(s)
    assert rb["to_step"] < rb["onset_step"] and 100 < rb["onset_step"] <= 106
    assert s["steps"] == 150


def test_attention_maxima_equal_the_models_own_q_and_k() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).train()
    rec = AttnMax()
    assert attach_attention(model, rec) == 2
    seen: dict[int, tuple] = {}

    def capture(module, args, kwargs) -> None:
        seen[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(capture, with_kwargs=True)
    rec.active = True
    x = torch.randint(0, 256, (3, 24))
    model(input_ids=x, labels=x).loss.backward()
    layers, got = rec.take()
    assert layers == (0, 1)
    for i, attn in enumerate(layer.self_attn for layer in model.model.layers):
        h, (cos, sin) = seen[i]
        B, T, _ = h.shape
        q = attn.q_proj(h).view(B, T, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(B, T, -1, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(attn.num_key_value_groups, dim=1)  # (B, H, T, D)
        s = (q @ k.transpose(-2, -1)) * attn.scaling
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        want = s.masked_fill(future, float("-inf")).amax(dim=(0, 2, 3))  # (H,)
        torch.testing.assert_close(got[i], want.detach(), rtol=1e-5, atol=1e-5)
