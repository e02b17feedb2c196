"""torch.compile with every probe on (ARCHITECTURE.md: probes traceable by torch.compile, at
most one extra graph for probed steps). The plain-loop GPT of examples/plain_loop.py compiles
with no graph break, probed or not; a watched run of it, with a rollback, its replay and
evaluations, compiles its forward twice in all (training, and the grad-mode graph every
compiled model gets for evaluation); and under Inductor the per-head maxima are those of the
eager model (the recording operators survive the compiler)."""

from __future__ import annotations

import pytest
import torch

from spikewatch.trainer.model.attn_max import COMPILE_SAFE, AttnMax

from .conftest import POISON, STEPS, example, run_example, the_rollback

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not COMPILE_SAFE, reason="this torch cannot declare effects"),
]


class CountingBackend:
    """A torch.compile backend (aot_eager underneath: AOTAutograd traces the graph and its
    backward) that counts the graphs it is given."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)


def _gpt(rec: AttnMax) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    gpt = example("plain_loop").GPT(32, 2, 4, 32)
    gpt.use_recorder(rec)
    x = torch.randint(0, 256, (4, 32))
    return gpt, x, torch.roll(x, -1, 1)


@pytest.mark.parametrize("active", [True, False])
def test_the_plain_loop_gpt_compiles_without_a_graph_break(active: bool) -> None:
    rec = AttnMax()
    rec.active = active
    gpt, x, y = _gpt(rec)
    explained = torch._dynamo.explain(gpt)(x, y)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_a_watched_compiled_run_compiles_its_forward_twice_in_all(tmp_path, monkeypatch) -> None:
    counting = CountingBackend()
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, backend=counting))
    torch._dynamo.reset()
    summary = run_example("plain_loop", tmp_path / "compiled", *STEPS, *POISON, "--compile")
    rollback = the_rollback(summary)
    assert rollback["to_step"] < rollback["onset_step"]
    assert rollback.get("cause")  # the spike's batches were replayed through the compiled model
    assert "layer/1/head/3/attn_max" in summary["metric_names"]
    assert counting.graphs == 2  # training (probed, unprobed, replayed alike) and evaluation
    eager = run_example("plain_loop", tmp_path / "eager", *STEPS, *POISON)
    assert [(i["kind"], i["step"]) for i in summary["interventions"]] == [
        (i["kind"], i["step"]) for i in eager["interventions"]
    ]


def test_under_inductor_the_maxima_are_those_of_the_eager_model() -> None:
    rec = AttnMax()
    rec.active = True
    gpt, x, y = _gpt(rec)
    gpt(x, y).backward()
    layers, eager = rec.take()  # type: ignore[misc]
    torch._dynamo.reset()
    compiled = torch.compile(gpt)
    rec.active = True
    compiled(x, y).backward()
    layers_c, values = rec.take()  # type: ignore[misc]
    assert layers_c == layers == (0, 1)
    torch.testing.assert_close(values, eager)
    rec.active = False  # an unprobed step: the same graph, nothing recorded
    compiled(x, y).backward()
    assert rec.take() is None


@pytest.mark.parametrize(  # Lightning compiled (30 s) in the slow tier
    "name", ["hf_trainer", pytest.param("lightning_module", marks=pytest.mark.slow)]
)
def test_the_framework_examples_compiled_roll_back_as_they_do_eager(
    tmp_path, monkeypatch, name: str
) -> None:
    """HF's `torch_compile=True` and Lightning's `fit(torch.compile(module))`: probes on, the
    same rollback as the eager run, with the per-head maxima recorded."""
    counting = CountingBackend()
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, backend=counting))
    torch._dynamo.reset()
    compiled = run_example(name, tmp_path / "compiled", *STEPS, *POISON, "--compile")
    assert counting.graphs >= 1  # the framework did compile the model
    eager = run_example(name, tmp_path / "eager", *STEPS, *POISON)
    rollback = the_rollback(compiled)
    assert rollback["to_step"] < rollback["onset_step"]
    assert [(i["kind"], i["step"], i.get("to_step")) for i in compiled["interventions"]] == [
        (i["kind"], i["step"], i.get("to_step")) for i in eager["interventions"]
    ]  # a rollback, and the steps refused after it (the rest of the poisoned stretch), alike
    assert compiled["final_val_loss"] == pytest.approx(eager["final_val_loss"], rel=1e-3)
    assert "layer/1/head/3/attn_max" in compiled["metric_names"]
