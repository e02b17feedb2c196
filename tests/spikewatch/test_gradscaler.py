"""fp16's GradScaler through the Watch, the HF (accelerate) route and Lightning, on a CPU with
`torch.amp.GradScaler("cpu")` (issue 49): the gradients measured and clipped are the true ones,
an overflow is the scaler's (its update skipped, its scale halved, no spike, no rollback), a
refusal survives the scaler's own `found_inf`, and the scaler is updated on every path."""

from __future__ import annotations

import math

import pytest
import torch

from spikewatch import Watch
from spikewatch.trainer.core.actions import Action, Continue, SkipUpdate
from spikewatch.trainer.core.callbacks import Callback, StepState
from spikewatch.trainer.model.optim.factor import FoundInf

from .conftest import example

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

STEPS = 12
INIT_SCALE = 2.0**10


class _Seen(Callback):
    def __init__(self) -> None:
        self.steps: list[StepState] = []

    def post_step(self, state: StepState) -> None:
        self.steps.append(state)


class _RefuseAt(_Seen):
    """Refuses one update before it happens (the host path)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def pre_update(self, state: StepState) -> Action:
        return SkipUpdate(reason="test") if state.step == self.at else Continue()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return example("plain_loop").GPT(32, 2, 4, 16)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randint(0, 256, (4, 17), generator=g)
    return x[:, :-1], x[:, 1:]


def _true_norm(model: torch.nn.Module, i: int) -> float:
    """The step-0 gradient norm of batch i, unscaled, by plain autograd."""
    model.zero_grad()
    model(*_batch(i)).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    model.zero_grad()
    return float(norm)


def _plain(tmp_path, *, fused: bool, inf_at: int | None = None, cb: Callback | None = None):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    seen = cb or _Seen()
    step = {"n": 0}
    hook = next(iter(model.parameters())).register_hook(
        lambda g: g * math.inf if step["n"] == inf_at else g
    )
    scales = []
    with Watch(model, opt, run_dir=tmp_path, db="none", scaler=scaler, callbacks=[seen]) as w:
        for i in range(STEPS):
            step["n"] = i + 1
            w.begin_step(i)
            loss = model(*_batch(i))
            scaler.scale(loss).backward()
            w.step(loss)
            scales.append(scaler.get_scale())
    hook.remove()
    return model, seen, scales


def _reference(*, fused: bool) -> torch.nn.Module:
    """The same training with the scaler and no Watch (AMP's documented loop)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    for i in range(STEPS):
        loss = model(*_batch(i))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("fused", [False, True])
def test_gradscaler_the_watch_sees_true_gradients_and_trains_as_amp_does(tmp_path, fused) -> None:
    model, seen, scales = _plain(tmp_path, fused=fused)
    first = seen.steps[0]
    assert first.grad_norm == pytest.approx(_true_norm(_model(), 0), rel=1e-5)  # not x 1024
    assert first.metrics["amp/loss_scale"] == INIT_SCALE
    assert all(s.applied and not s.overflow for s in seen.steps)
    ref = _reference(fused=fused)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("fused", [False, True])
def test_gradscaler_an_overflow_is_the_scalers_not_a_spike(tmp_path, fused) -> None:
    model, seen, scales = _plain(tmp_path, fused=fused, inf_at=5)
    fifth = seen.steps[4]
    assert fifth.overflow and not fifth.nonfinite and not fifth.applied
    assert scales[4] == INIT_SCALE / 2 and scales[3] == INIT_SCALE  # the scaler backed off
    assert [s.step for s in seen.steps if not s.applied] == [5]
    assert all(s.action == "continue" for s in seen.steps)  # no refusal record, no rollback


def test_gradscaler_found_inf_keeps_spikewatchs_refusal() -> None:
    """A GradScaler's step sets the fused optimizer's `found_inf` just before the update: a
    refusal spikewatch set earlier must survive it."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    stepper = FoundInf(opt)
    p.grad = torch.ones(4)
    stepper.set_step_factor(torch.tensor(0.0))  # refused
    opt.found_inf = torch.tensor(0.0)  # what GradScaler.step sets: no overflow
    opt.step()
    stepper.settle(False)
    assert torch.equal(p.detach(), torch.ones(4))
    assert float(opt.state[p]["step"]) == 0.0


def test_gradscaler_accelerate_optimizer_is_found_and_updated_after_a_refusal(tmp_path) -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer

    accelerate.Accelerator(cpu=True)
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    opt = AcceleratedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), device_placement=False, scaler=scaler
    )
    seen = _RefuseAt(3)
    with Watch(model, opt, run_dir=tmp_path, db="none", callbacks=[seen]) as w:
        w.route(opt)  # as the HF callback does: the Trainer's optimizer.step() is gated
        for i in range(6):
            w.begin_step(i)
            loss = model(*_batch(i))
            w.observe_loss(loss)
            scaler.scale(loss).backward()  # accelerator.backward
            opt.step()  # the Trainer's; a refused one must still leave the scaler updated
            opt.zero_grad()
    assert seen.steps[0].grad_norm == pytest.approx(_true_norm(_model(), 0), rel=1e-5)
    assert [s.applied for s in seen.steps] == [True, True, False, True, True, True]
    norms = [s.grad_norm for s in seen.steps]  # a scaler left unupdated leaves them x 1024
    assert max(norms) < 10 * min(norms), norms


def _lightning(tmp_path, *, fused: bool, watched: bool, inf_at: int | None = None):
    """A Lightning "16-mixed" run (GradScaler on the CPU) of the plain-loop GPT, with or
    without the callback; `inf_at`: an overflow (inf gradients, finite loss) at that step."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins.precision import MixedPrecision

    from spikewatch.lightning import SpikewatchCallback

    losses: list[float] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()
            first = next(iter(self.net.parameters()))
            first.register_hook(lambda g: g * math.inf if self.global_step == inf_at else g)

        def training_step(self, batch, idx):  # noqa: ANN001, ANN201
            loss = self.net(*_batch(idx))
            losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=fused)

    seen = _Seen()
    callbacks = [SpikewatchCallback(db="none", callbacks=[seen], run_root=tmp_path / "sw")]
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    trainer = pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
        callbacks=callbacks if watched else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader(range(6), batch_size=None))
    return module, seen, losses, scaler


@pytest.mark.parametrize("fused", [False, True])
def test_gradscaler_lightning_16_mixed_trains_as_lightning_does(tmp_path, fused) -> None:
    """Lightning steps the scaler itself (and, for a fused optimizer, leaves the unscaling to
    the kernel): the Watch's unscaling must not be a second one, nor its settle break the
    scaler's step; the recorded loss is unscaled."""
    ref, _, _, _ = _lightning(tmp_path / "ref", fused=fused, watched=False)
    module, seen, losses, _ = _lightning(tmp_path / "sw", fused=fused, watched=True)
    assert len(seen.steps) == 6
    for state, loss in zip(seen.steps, losses, strict=True):
        assert state.loss == pytest.approx(loss, rel=1e-3)  # not x 1024
    for (name, a), b in zip(module.state_dict().items(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("fused", [False, True])
def test_gradscaler_lightning_an_overflow_is_recorded_as_the_scalers(tmp_path, fused) -> None:
    """With a non-fused optimizer GradScaler does not even call it on an overflow: the step
    must still reach the Watch, as the scaler's, not as a spike."""
    _, seen, _, scaler = _lightning(tmp_path, fused=fused, watched=True, inf_at=3)
    assert len(seen.steps) == 6
    assert [s.overflow for s in seen.steps] == [False, False, False, True, False, False]
    assert not any(s.nonfinite for s in seen.steps)
    assert all(s.action == "continue" for s in seen.steps)
    assert scaler.get_scale() == INIT_SCALE / 2


def test_gradscaler_a_scaler_that_scaled_nothing_is_a_clear_error(tmp_path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(RuntimeError, match=r"backward scaler.scale\(loss\)"):
        with Watch(model, opt, run_dir=tmp_path, db="none", scaler=scaler) as w:
            loss = model(*_batch(0))
            loss.backward()  # not scaler.scale(loss)
            w.step(loss)
