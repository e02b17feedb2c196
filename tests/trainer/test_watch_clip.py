"""The loop's own clip seen by a routed Watch (trainer/watch_clip.py): the gradient is
measured before the loop clips it, the clip is torch's to the bit, and torch's function is
back once the Watch closes."""

from __future__ import annotations

import torch

from spikewatch import Watch
from spikewatch.trainer.core.callbacks import Callback, StepState


class _Norms(Callback):
    def __init__(self) -> None:
        self.norms: list[float] = []

    def post_step(self, state: StepState) -> None:
        self.norms.append(state.grad_norm)


def _loop(tmp, routed: bool, steps: int = 3):  # noqa: ANN001, ANN202
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = _Norms()
    watch = None
    if routed:
        watch = Watch(model, opt, max_steps=steps, run_dir=tmp, db="none", callbacks=[seen])
        watch.route(opt)
    totals = []
    x, y = torch.randn(32, 8) * 30, torch.randn(32, 1)  # big gradients: the clip bites
    for _ in range(steps):
        loss = (model(x) - y).square().mean()
        if watch is not None:
            watch.observe_loss(loss)
        loss.backward()
        totals.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    if watch is not None:
        watch.close()
    return model, totals, seen.norms


def test_a_routed_watch_measures_the_gradient_before_the_loops_clip(tmp_path) -> None:
    original = torch.nn.utils.clip_grad_norm_
    bare, totals, _ = _loop(tmp_path / "a", routed=False)
    watched, totals_w, norms = _loop(tmp_path / "b", routed=True)
    assert min(totals) > 1.0  # every step clipped
    assert norms == totals_w == totals  # the pre-clip norm, recorded and returned as torch's
    for p, q in zip(bare.parameters(), watched.parameters(), strict=True):
        assert torch.equal(p, q)  # the loop's clip, to the bit
    assert torch.nn.utils.clip_grad_norm_ is original  # torch's own, once the Watch closed


def test_a_clip_of_other_parameters_or_another_norm_is_torchs() -> None:
    original = torch.nn.utils.clip_grad_norm_
    other = torch.nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    model = torch.nn.Linear(2, 1)
    watch = Watch(model, torch.optim.SGD(model.parameters(), lr=0.1), db="none", max_steps=1)
    watch.route(watch.optimizer)
    try:
        watch.open()
        total = torch.nn.utils.clip_grad_norm_(other.parameters(), 0.1, norm_type=1.0)
        assert watch._loop_clip is not None and watch._loop_clip.take() is None
        assert float(total) > 0.1
    finally:
        watch.close()
    assert torch.nn.utils.clip_grad_norm_ is original


def test_a_loop_that_draws_its_own_batches_tells_their_tokens_with_the_loss(tmp_path) -> None:
    """nanoGPT's shape: the loop draws each micro-batch itself, so the Watch never sees it;
    `observe_loss(..., tokens=x)` counts them (two micro-batches a step here): the run's
    tokens and its tokens a second are the loop's, not half of them or none."""

    class _Tokens(Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[int, bool]] = []

        def post_step(self, state: StepState) -> None:
            self.seen.append((state.tokens, state.metrics.get("perf/tokens_per_s", 0) > 0))

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 8), torch.nn.Flatten(), torch.nn.Linear(64, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    told = _Tokens()
    watch = Watch(model, opt, max_steps=3, run_dir=tmp_path, db="none", callbacks=[told])
    watch.route(opt)
    for _ in range(3):
        for _micro in range(2):
            x = torch.randint(0, 50, (4, 8))
            loss = model(x).square().mean() / 2
            watch.observe_loss(loss, share=True, tokens=x)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    watch.close()
    assert told.seen == [(64, True), (128, True), (192, True)]  # 2 x 4 x 8 a step


def test_a_loss_the_loop_read_already_is_taken_as_a_number(tmp_path) -> None:
    """nano-gpt's `compute_loss` returns the step's loss as a float (it `.item()`s each
    micro-batch): `observe_loss(2.3)` records the same loss as the tensor would, and anything
    else is a clear error."""
    import pytest

    class _Losses(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def post_step(self, state: StepState) -> None:
            self.losses.append(state.loss)

    recorded = []
    for as_number in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        seen = _Losses()
        watch = Watch(model, opt, max_steps=3, run_dir=tmp_path / str(as_number), db="none",
                      callbacks=[seen])  # fmt: skip
        watch.route(opt)
        for i in range(3):
            loss = model(torch.full((2, 4), float(i + 1))).square().mean()
            watch.observe_loss(loss.item() if as_number else loss)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with pytest.raises(TypeError, match="a tensor or a number"):
            watch.observe_loss("2.3")  # type: ignore[arg-type]
        watch.close()
        recorded.append(seen.losses)
    assert len(recorded[0]) == 3 and recorded[0] == recorded[1]
