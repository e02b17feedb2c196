"""spikewatch.hf in a Hugging Face Trainer run (examples/hf_trainer.py): detection, rollback and
recovery, gradient accumulation, per-head attention maxima against the model's own q and k,
and HF's own resume after SIGKILL."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from spikewatch.hf import attach_attention  # noqa: E402
from trainer.attention import AttnMax  # noqa: E402

from .conftest import (  # noqa: E402
    POISON,
    STEPS,
    assert_same_weights,
    final_weights,
    kill_when,
    launch,
    run_example,
    the_rollback,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("hf")
    db = ("--db", "none")
    return {
        "clean": run_example("hf_trainer", tmp / "clean", *STEPS, *db),
        "guarded": run_example("hf_trainer", tmp / "guarded", *STEPS, *POISON, *db),
        "unguarded": run_example(
            "hf_trainer", tmp / "unguarded", *STEPS, *POISON, "--no-rollback", *db
        ),
    }


def test_a_poisoned_region_is_rolled_back_and_the_run_recovers(runs) -> None:
    clean, guarded, unguarded = runs["clean"], runs["guarded"], runs["unguarded"]
    rb = the_rollback(guarded)
    assert 100 < rb["onset_step"] <= 106
    assert rb["to_step"] < rb["onset_step"]
    (start, end), *_ = rb["skip_ranges"]
    assert start <= 100 < end
    assert guarded["steps"] == clean["steps"] == 150  # the Trainer ran on past the lag
    assert not unguarded["interventions"]
    assert guarded["final_val_loss"] <= clean["final_val_loss"] * 1.02
    assert unguarded["final_val_loss"] >= clean["final_val_loss"] * 1.02


def test_probes_use_the_models_module_names(runs) -> None:
    names = set(runs["guarded"]["metric_names"])
    assert {"layer/0/head/3/attn_max", "layer/1/attn_max"} <= names
    assert {"layer/0/self_attn/grad_norm", "layer/1/mlp/grad_norm"} <= names
    assert "layer/model.embed_tokens/grad_norm" in names
    assert "layer/0/self_attn/adam_sqrt_v_max" in names


def test_gradient_accumulation(tmp_path) -> None:
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
    heads, layers, got = rec.take()
    assert heads[:2] == ["layer/0/head/0/attn_max", "layer/0/head/1/attn_max"]
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


def test_sigkill_then_hf_resume_equals_an_uninterrupted_run(tmp_path) -> None:
    args = ("--steps", "60", "--save-every", "10", "--db", "none", "--poison-at", "30")
    args = (*args, "--poison-len", "14")
    args = (*args, "--output-dir", "out")
    whole = run_example("hf_trainer", tmp_path / "whole", *args)
    killed = tmp_path / "killed"
    proc = launch("hf_trainer", killed, *args)
    kill_when(proc, (killed / "out" / "checkpoint-40" / "spikewatch.json").exists)
    resumed = run_example("hf_trainer", killed, *args, "--resume")
    (run,) = (killed / "out" / "spikewatch").iterdir()  # the resume went on with the same run
    assert resumed["run_id"] == run.name
    assert resumed["final_train_loss"] == whole["final_train_loss"]
    assert resumed["final_val_loss"] == whole["final_val_loss"]
    assert [i["to_step"] for i in resumed["interventions"]] == [
        i["to_step"] for i in whole["interventions"]
    ]
    assert_same_weights(
        final_weights(killed / resumed["run_dir"]),
        final_weights(tmp_path / "whole" / whole["run_dir"]),
    )
