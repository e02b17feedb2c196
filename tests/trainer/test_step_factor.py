"""Optimizers refused on the device by a step factor (trainer/model/optim/factor.py): with factor
1 they are torch's AdamW to the bit; with factor 0 parameters, moments, momenta and step counts
stay exactly as they were, non-finite gradients included; torch's fused AdamW is driven through
its `found_inf` flag the same way."""

from __future__ import annotations

import copy

import pytest
import torch

from spikewatch.trainer.config import ModelConfig, OptimConfig
from spikewatch.trainer.model.gpt import build_model
from spikewatch.trainer.model.optim import AdamW, build_optimizer
from spikewatch.trainer.model.optim.factor import FoundInf, factor_optimizer

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

ONE, ZERO = torch.ones(()), torch.zeros(())


def _model() -> torch.nn.Module:
    return build_model(ModelConfig(n_layer=2, n_head=4, d_model=32, max_seq_len=64), seed=0)


def _backward(model: torch.nn.Module, seed: int, nan: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (4, 24), generator=g)
    model(x, torch.roll(x, -1, 1)).loss.backward()
    if nan:  # a hardware fault in one tensor's gradient
        next(model.parameters()).grad[0, 0] = float("nan")


def _step(opt, factor: torch.Tensor | None) -> None:  # noqa: ANN001
    driver = factor_optimizer(opt)
    assert driver is not None
    driver.set_step_factor(factor)
    opt.step()
    driver.settle(factor is None or bool(factor))  # the host learns it after the update
    opt.zero_grad(set_to_none=True)


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith("wte")]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2 or n.startswith("wte")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _same_state(a: dict, b: dict) -> bool:
    """Two optimizer state_dicts, tensors compared bitwise."""
    if a["state"].keys() != b["state"].keys():
        return False
    for i, sa in a["state"].items():
        for k, v in sa.items():
            w = b["state"][i][k]
            if not (torch.equal(v, w) if torch.is_tensor(v) else v == w):
                return False
    return True


def test_spikewatch_adamw_is_torchs_adamw_to_the_bit() -> None:
    """torch's default CPU path (single-tensor) is the reference; factor 1 on every step."""
    ours_m, ref_m = _model(), _model()
    ours = AdamW(_groups(ours_m), lr=1e-2, betas=(0.9, 0.95))
    ref = torch.optim.AdamW(_groups(ref_m), lr=1e-2, betas=(0.9, 0.95), foreach=False)
    for i in range(12):
        _backward(ours_m, i)
        _step(ours, ONE)
        _backward(ref_m, i)
        ref.step()
        ref.zero_grad(set_to_none=True)
    for a, b in zip(ours_m.parameters(), ref_m.parameters(), strict=True):
        assert torch.equal(a, b)
    assert _same_state(ours.state_dict(), ref.state_dict())


@pytest.mark.parametrize("name", ["adamw", "muon", "fused"])
@pytest.mark.parametrize("nan", [False, True])
def test_a_refused_step_leaves_everything_as_it_was(name: str, nan: bool) -> None:
    model = _model()
    if name == "fused":  # torch's own fused kernel, through its found_inf flag
        opt = torch.optim.AdamW(_groups(model), lr=1e-2, fused=True)
        assert isinstance(factor_optimizer(opt), FoundInf)
    else:
        opt = build_optimizer(model, OptimConfig(name=name, lr=1e-2, weight_decay=0.1))
    for i in range(3):
        _backward(model, i)
        _step(opt, ONE)
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _backward(model, 99, nan=nan)
    _step(opt, ZERO)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    assert _same_state(state, opt.state_dict())
    assert "found_inf" not in opt.__dict__  # settled: a later plain step is a plain step
    _backward(model, 3)
    _step(opt, ONE)  # and the run goes on from there as if the refused step never was
    twin = _model()
    twin.load_state_dict(weights)
    if name == "fused":
        twin_opt = torch.optim.AdamW(_groups(twin), lr=1e-2, fused=True)
    else:
        twin_opt = build_optimizer(twin, OptimConfig(name=name, lr=1e-2, weight_decay=0.1))
    twin_opt.load_state_dict(state)
    _backward(twin, 3)
    _step(twin_opt, ONE)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_torchs_adamw_loads_spikewatchs_state_and_goes_on_alike() -> None:
    """The saved state is torch's format (step counts as CPU tensors), both ways."""
    ours_m, ref_m = _model(), _model()
    ours = AdamW(_groups(ours_m), lr=1e-2)
    for i in range(4):
        _backward(ours_m, i)
        _step(ours, ONE)
    ref_m.load_state_dict(ours_m.state_dict())
    ref = torch.optim.AdamW(_groups(ref_m), lr=1e-2, foreach=False)
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))  # a state_dict shares the tensors
    again = AdamW(_groups(_model()), lr=1e-2)
    again.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert all(s["step"] == 4 for s in again.state.values())  # host numbers again
    _backward(ours_m, 4)
    _step(ours, ONE)
    _backward(ref_m, 4)
    ref.step()
    for a, b in zip(ours_m.parameters(), ref_m.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_unsettled_factor_is_read_before_the_next_step() -> None:
    """A client that never says (no settle): the next step reads the factor itself."""
    model = _model()
    opt = AdamW(_groups(model), lr=1e-2)
    _backward(model, 0)
    opt.set_step_factor(ZERO)
    opt.step()
    _backward(model, 1)
    opt.step()  # a plain step: the refused one was not counted
    assert all(s["step"] == 1 for s in opt.state.values())


def test_optimizers_without_a_factor_are_named_as_such() -> None:
    model = _model()
    assert factor_optimizer(torch.optim.AdamW(model.parameters())) is None  # not fused
    assert factor_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)) is None
    wrapped = type("Wrapper", (), {"optimizer": AdamW(model.parameters())})()
    assert factor_optimizer(wrapped) is wrapped.optimizer  # accelerate's / Lightning's wrapper
