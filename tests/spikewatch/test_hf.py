"""spikewatch.hf beyond what test_examples.py covers: gradient accumulation, and per-head
attention maxima against the model's own q and k (grouped-query attention)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from spikewatch.hf import attach_attention  # noqa: E402
from spikewatch.trainer.model.attn_max import AttnMax  # noqa: E402

from .conftest import (  # noqa: E402
    POISON,
    STEPS,
    run_example,
    the_rollback,
)

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


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


def test_an_epoch_based_run_says_it_cannot_make_up_a_rollback(tmp_path, caplog) -> None:
    """HF fixes its epochs when training starts: an epoch-based run that rolls back ends short
    of its plan, and says so at start and at the end; the user's max_grad_norm is theirs again
    after training, and the logbook's model line comes from the model's config."""
    poison = ("--poison-at", "40", "--poison-len", "14")  # in each epoch of 75 batches
    args = ("--steps", "150", "--epochs", "2", *poison, "--db", f"sqlite:///{tmp_path / 'sw.db'}")
    with caplog.at_level("WARNING", logger="spikewatch"):
        s = run_example("hf_trainer", tmp_path, *args)
    assert s["interventions"], "the poisoned region is rolled back"
    assert s["planned_steps"] == 150 and s["steps"] < 150
    said = caplog.text
    assert "holds exactly its 150 planned updates" in said
    assert f"made {s['steps']} of 150 planned updates" in said
    from sqlalchemy.orm import Session

    from spikewatch.observatory.reports.logbook import logbook
    from spikewatch.observatory.store.db import make_engine

    with Session(make_engine(f"sqlite:///{tmp_path / 'sw.db'}")) as session:
        text = logbook(session, run_id=s["run_id"])
    assert "llama, 2 layers, d=64, 4 heads" in text and "AdamW lr=0.003" in text


def test_the_users_max_grad_norm_is_theirs_outside_the_step(tmp_path) -> None:
    from transformers import Trainer, TrainingArguments

    from spikewatch.hf import SpikewatchCallback

    seen: list[float] = []

    class Spy(SpikewatchCallback):
        def on_save(self, args, state, control, **kw):  # noqa: ANN001
            seen.append(args.max_grad_norm)
            return super().on_save(args, state, control, **kw)

    x = torch.randint(0, 256, (32, 16), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": r, "labels": r} for r in x]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=8,
        max_grad_norm=0.7,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=_tiny_llama(), args=args, train_dataset=rows, callbacks=[Spy(db="none")]
    )
    trainer.train()
    assert trainer.args.max_grad_norm == 0.7 and seen == [0.7, 0.7]
    saved = torch.load(tmp_path / "out" / "checkpoint-2" / "training_args.bin", weights_only=False)
    assert saved.max_grad_norm == 0.7


def test_the_trainer_logs_the_watchs_grad_norm_without_computing_it_again(
    tmp_path, monkeypatch
) -> None:
    """The Watch clips (after measuring), so the Trainer runs with max_grad_norm 0, where it
    would compute the norm once more for its log. It logs the Watch's pre-clip norm instead:
    the same numbers as the Trainer's own run without spikewatch, and no second pass."""
    from transformers import Trainer, TrainingArguments

    from spikewatch.hf import SpikewatchCallback

    x = torch.randint(0, 256, (48, 16), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": r, "labels": r} for r in x]

    def train(callbacks: list) -> tuple[list[float], int]:
        args = TrainingArguments(
            output_dir=str(tmp_path / f"out{len(callbacks)}"),
            max_steps=6,
            per_device_train_batch_size=8,
            learning_rate=1e-2,
            max_grad_norm=0.5,  # clips from the first step on: pre- and post-clip differ
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        calls = []
        real = torch.nn.utils.clip_grad_norm_

        def counted(*a, **k):  # noqa: ANN002, ANN003, ANN202
            calls.append(1)
            return real(*a, **k)

        with monkeypatch.context() as m:
            m.setattr(torch.nn.utils, "clip_grad_norm_", counted)
            trainer = Trainer(
                model=_tiny_llama(), args=args, train_dataset=rows, callbacks=callbacks
            )
            trainer.train()
        norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
        assert "_get_grad_norm" not in trainer.__dict__  # the Trainer's own method again
        return norms, len(calls)

    plain, plain_calls = train([])
    watched, watched_calls = train([SpikewatchCallback(db="none")])
    assert plain_calls == 6 and len(plain) == 6 and max(plain) > 0.5
    assert watched_calls == 0
    assert watched == pytest.approx(plain, rel=1e-5)


def test_a_stop_every_rank_agreed_on_ends_the_trainer_after_that_step(tmp_path) -> None:
    """A SIGTERM under torchrun is a stop every rank agrees on at one step's all-reduce
    (tests/spikewatch/test_rank_faults.py shows it in a Watch loop): the Trainer's training
    ends after that step, as Lightning's does (`trainer.should_stop`), and the run reads
    "stopped" there. In one process `request_stop` is agreed at once."""
    from sqlalchemy.orm import Session
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from spikewatch.hf import SpikewatchCallback
    from spikewatch.observatory import store
    from spikewatch.observatory.store.db import make_engine

    model = _tiny_llama()
    rows = [{"input_ids": torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(i))}
            for i in range(80)]  # fmt: skip
    for r in rows:
        r["labels"] = r["input_ids"]
    db = f"sqlite:///{tmp_path / 'sw.db'}"
    watch = SpikewatchCallback(db=db, name="stopped")

    class Signalled(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            if state.global_step == 4:  # as the signal's handler does, mid-run
                watch.watch.core.request_stop()

    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=20, report_to=[],
                             per_device_train_batch_size=4, save_strategy="no",
                             learning_rate=1e-3, use_cpu=True)  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=rows,
                      callbacks=[watch, Signalled()])  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 5  # the stop asked during step 4 ends step 5
    with Session(make_engine(db)) as session:
        (run,) = store.list_runs(session)
    assert (run.status, run.last_step) == ("stopped", 5)
