from __future__ import annotations

import pytest
import torch

from spikewatch.trainer.builtin.data import unigram_entropy
from spikewatch.trainer.builtin.loop import build_trainer, fit
from spikewatch.trainer.config import load_config
from spikewatch.trainer.core.actions import Continue, SkipUpdate
from spikewatch.trainer.core.callbacks import Callback, StepState

from .conftest import tiny_config

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


def _state(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_two_identical_runs_are_bitwise_equal(tmp_path) -> None:
    cfg = tiny_config()
    a = build_trainer(cfg, run_dir=tmp_path / "a")
    ra = a.fit()
    b = build_trainer(cfg, run_dir=tmp_path / "b")
    rb = b.fit()
    assert ra.train_losses == rb.train_losses
    assert ra.val_losses == rb.val_losses
    for k, v in _state(a).items():
        assert torch.equal(v, _state(b)[k]), k


def test_muon_and_muonclip_runs_are_deterministic_and_learn(tmp_path) -> None:
    for name in ("muon", "muonclip"):
        cfg = tiny_config(f"optim.name={name}", "train.max_steps=20", "optim.lr=0.01")
        r1 = fit(cfg, run_dir=tmp_path / f"{name}1")
        r2 = fit(cfg, run_dir=tmp_path / f"{name}2")
        assert r1.train_losses == r2.train_losses
        assert r1.train_losses[-1] < r1.train_losses[0] - 0.5


def test_muonclip_records_per_head_max_logits(tmp_path) -> None:
    r = fit(tiny_config("optim.name=muonclip"), run_dir=tmp_path)
    names = set(r.metric_names)
    assert {f"layer/{i}/head/{h}/attn_max" for i in range(2) for h in range(4)} <= names


class _Recorder(Callback):
    def __init__(self, skip_at: int | None = None) -> None:
        self.states: list[StepState] = []
        self.skip_at = skip_at

    def pre_update(self, state: StepState):
        return SkipUpdate("test") if state.step == self.skip_at else Continue()

    def post_step(self, state: StepState) -> None:
        self.states.append(state)


def _nan_grad_at(trainer, step: int) -> None:
    """Make every gradient of one parameter NaN on the given step (a hardware-fault stand-in)."""

    def hook(g):
        return g * float("nan") if trainer.step_count + 1 == step else g

    trainer.model.blocks[0].mlp.up_proj.weight.register_hook(hook)


def test_nonfinite_gradient_never_reaches_the_weights(tmp_path) -> None:
    cfg = tiny_config("train.max_steps=3")
    rec = _Recorder()
    tr = build_trainer(cfg, run_dir=tmp_path, callbacks=[rec])
    _nan_grad_at(tr, 2)
    # step 1 normally, then snapshot, then the poisoned step 2
    tr.cfg = tiny_config("train.max_steps=3", "train.stop_after=1")
    tr.fit()
    weights = _state(tr)
    opt = {
        id(p): {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
        for p, s in tr.optimizer.state.items()
    }
    tr.cfg = tiny_config("train.max_steps=3", "train.stop_after=2")
    result = tr.fit()
    for k, v in _state(tr).items():
        assert torch.equal(v, weights[k]), k
    for p, s in tr.optimizer.state.items():
        for k, v in s.items():
            if torch.is_tensor(v):
                assert torch.equal(v, opt[id(p)][k])
    poisoned = rec.states[-1]
    assert poisoned.nonfinite and not poisoned.applied and poisoned.action == "skip_update"
    assert result.interventions[-1]["kind"] == "skip_update"
    assert "non-finite" in result.interventions[-1]["reason"]
    tr.cfg = cfg
    tr.fit()  # and training goes on, finite, afterwards
    assert rec.states[-1].applied and torch.isfinite(torch.tensor(rec.states[-1].loss))


def test_callback_skip_update_leaves_weights_unchanged(tmp_path) -> None:
    rec = _Recorder(skip_at=4)
    tr = build_trainer(tiny_config("train.stop_after=3"), run_dir=tmp_path, callbacks=[rec])
    tr.fit()
    before = _state(tr)
    tr.cfg = tiny_config("train.stop_after=4")
    tr.fit()
    assert all(torch.equal(v, before[k]) for k, v in _state(tr).items())
    assert rec.states[-1].action == "skip_update" and rec.states[-1].batch_index == 3


def test_gradient_accumulation_matches_the_full_batch(tmp_path) -> None:
    full = fit(tiny_config("train.max_steps=5"), run_dir=tmp_path / "f")
    accum = fit(tiny_config("train.max_steps=5", "data.micro_batch_size=2"), run_dir=tmp_path / "a")
    torch.testing.assert_close(
        torch.tensor(accum.train_losses), torch.tensor(full.train_losses), rtol=1e-4, atol=1e-5
    )


def test_bf16_autocast_trains(tmp_path) -> None:
    r = fit(tiny_config("train.dtype=bfloat16", "train.max_steps=10"), run_dir=tmp_path)
    assert all(torch.isfinite(torch.tensor(r.train_losses)))
    assert r.train_losses[-1] < r.train_losses[0]


def test_eval_interval_and_summary(tmp_path) -> None:
    r = fit(tiny_config(), run_dir=tmp_path)
    assert [s for s, _ in r.val_losses] == [6, 12]
    s = r.summary()
    for key in (
        "run_id",
        "steps",
        "final_train_loss",
        "final_val_loss",
        "tokens",
        "interventions",
        "config",
    ):
        assert key in s
    assert s["steps"] == 12 and s["tokens"] == 12 * 8 * 32
    assert s["config"]["train"]["max_steps"] == 12
    assert (tmp_path / "config.json").exists()


def test_stop_after_ends_early_but_the_schedule_targets_max_steps(tmp_path) -> None:
    rec = _Recorder()
    r = fit(
        tiny_config("train.stop_after=5", "schedule.warmup_steps=2"),
        run_dir=tmp_path,
        callbacks=[rec],
    )
    assert r.steps == 5
    full = fit(tiny_config(), run_dir=tmp_path / "full")
    assert r.train_losses == full.train_losses[:5]


def test_tiny_cpu_learns_well_below_the_unigram_entropy(tmp_path) -> None:
    cfg = load_config("tiny_cpu", ["train.progress=false"])
    tr = build_trainer(cfg, run_dir=tmp_path)
    h = unigram_entropy(tr.sampler.corpora["text"].train)
    r = tr.fit()
    assert h > 3.0
    assert r.final_val_loss < 0.8 * h
