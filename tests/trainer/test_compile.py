"""The built-in trainer with `train.compile = true`: the training forward is one graph with every
probe on, through a rollback and its replay (two with probes.interval > 1: probed and unprobed
steps), and the run decides as the eager one does."""

from __future__ import annotations

import pytest
import torch

from spikewatch.trainer.builtin.loop import fit

from .conftest import tiny_config

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

FAULT = 'faults=[{kind="shifted_labels", start=150, length=10}]'
RUN = ("train.max_steps=200", "checkpoint.interval=10", "eval.interval=100", FAULT)


class CountingBackend:
    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)


@pytest.fixture
def counting(monkeypatch) -> CountingBackend:
    backend = CountingBackend()
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, backend=backend))
    torch._dynamo.reset()
    return backend


def test_a_compiled_run_rolls_back_on_one_graph_as_the_eager_run_does(
    tmp_path, counting: CountingBackend
) -> None:
    compiled = fit(tiny_config(*RUN, "train.compile=true"), run_dir=tmp_path / "compiled")
    assert counting.graphs == 1
    eager = fit(tiny_config(*RUN), run_dir=tmp_path / "eager")
    kinds = [(i["kind"], i["step"], i.get("to_step"), i.get("cause")) for i in eager.interventions]
    assert any(k == "rollback" for k, *_ in kinds)
    assert [
        (i["kind"], i["step"], i.get("to_step"), i.get("cause")) for i in compiled.interventions
    ] == kinds
    assert compiled.final_val_loss == pytest.approx(eager.final_val_loss, rel=1e-3)


def test_probing_every_other_step_adds_one_graph(tmp_path, counting: CountingBackend) -> None:
    cfg = tiny_config("train.max_steps=12", "train.compile=true", "probes.interval=2")
    fit(cfg, run_dir=tmp_path)
    assert counting.graphs == 2


def test_the_triton_attention_compiles_as_one_opaque_call(tmp_path, counting) -> None:
    """The fused kernel (its maxima free for QK-Clip and the probes) is a custom operator with
    its own backward: one graph, no break, the eager run's losses."""
    tiny = ("model.attention=triton", "train.max_steps=4", "data.batch_size=2", "data.seq_len=16")
    tiny = (*tiny, "model.d_model=64")  # head dim 16: the kernel's smallest (tl.dot's K >= 16)
    compiled = fit(tiny_config(*tiny, "train.compile=true"), run_dir=tmp_path / "compiled")
    eager = fit(tiny_config(*tiny), run_dir=tmp_path / "eager")
    assert counting.graphs == 1
    assert compiled.train_losses == pytest.approx(eager.train_losses, rel=1e-5)
    assert any("head" in n for n in compiled.metric_names)
