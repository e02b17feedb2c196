"""The probes' state statistics in one pass (trainer/model/kernels/adam_state.py): from p, m and
v after the update and torch's Adam / AdamW arithmetic, with no copy of the parameters; equal to
the op-by-op statistics (a copy before the update, norms of the difference) within float
tolerance. Run through Triton's interpreter (CUDA's form, on a CPU)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from spikewatch import Watch
from spikewatch.corpus import text_corpus, windows
from spikewatch.observatory import metric_names as M
from spikewatch.trainer.core import probes as probes_mod
from spikewatch.trainer.core.callbacks import Callback
from spikewatch.trainer.core.probes import Probes
from spikewatch.trainer.model.kernels.adam_state import AdamState

from ..spikewatch.conftest import example

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


@pytest.mark.parametrize(
    ("cls", "wd", "steps", "betas", "form"),
    [
        (torch.optim.AdamW, 0.1, 4, (0.9, 0.95), {}),
        (torch.optim.Adam, 0.01, 4, (0.9, 0.95), {}),
        # one update with b2 = 0.999: 1 - b2^t is 1e-3 (the kernel's series, no cancellation);
        # the fused form's step counts are read where they live, a float64 count through a copy
        (torch.optim.AdamW, 0.1, 1, (0.9, 0.999), {"fused": True}),
        (torch.optim.Adam, 0.0, 3, (0.0, 0.99), {"step_dtype": torch.float64}),
    ],
)
def test_the_one_pass_equals_a_copy_and_its_difference(cls, wd, steps, betas, form) -> None:
    """Against statistics computed here from a copy of the parameters taken before the update
    (what the op-by-op form does), in float64; two param groups with learning rates of their
    own (the bias corrections are each tensor's own)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Linear(300, 7))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 1e-3}]
    opt = cls(groups, lr=3e-3, weight_decay=wd, betas=betas, fused=form.get("fused"))
    x = torch.randn(16, 40)
    for _ in range(steps):
        before = [p.detach().double().clone() for p in model.parameters()]
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    params = list(model.parameters())
    if "step_dtype" in form:
        for p in params:
            opt.state[p]["step"] = opt.state[p]["step"].to(form["step_dtype"])
    one = AdamState(params, opt)
    assert one.refusal() is None
    got = one(1e-16)
    state = [opt.state[p] for p in params]
    want = {
        "p2": [b.square().sum() for b in before],
        "u2": [
            (p.detach().double() - b).square().sum() for p, b in zip(params, before, strict=True)
        ],
        "m2": [s["exp_avg"].double().square().sum() for s in state],
        "root_v": [s["exp_avg_sq"].double().sqrt().sum() for s in state],
        "v_max": [s["exp_avg_sq"].double().max() for s in state],
    }
    for key, values in want.items():
        torch.testing.assert_close(got[key].double(), torch.stack(values), rtol=2e-5, atol=0)
    # the sampled count of v below the threshold: every (numel // 4096)-th entry, as the probes
    threshold = float(state[0]["exp_avg_sq"].median())
    counts = one(threshold)["tiny"]
    sample = [s["exp_avg_sq"].view(-1)[:: max(1, s["exp_avg_sq"].numel() // 4096)] for s in state]
    assert counts.tolist() == [float((x < threshold).sum()) for x in sample]


def test_what_it_cannot_take_is_said() -> None:
    model = torch.nn.Linear(4, 4)
    assert "AdamW" not in (AdamState.optimizer_refusal(torch.optim.AdamW(model.parameters())) or "")
    assert "SGD" in AdamState.optimizer_refusal(torch.optim.SGD(model.parameters(), lr=0.1))
    assert "amsgrad" in AdamState.optimizer_refusal(
        torch.optim.AdamW(model.parameters(), amsgrad=True)
    )
    fresh = AdamState(list(model.parameters()), torch.optim.AdamW(model.parameters()))
    assert "without Adam's state" in fresh.refusal()


def _watched(tmp, monkeypatch, one_pass: bool) -> tuple[list, Any]:
    """The plain-loop GPT through the Watch for 20 steps (state steps every 10), each state
    step's pending statistics kept."""
    monkeypatch.setattr(probes_mod, "ONE_PASS_OFF_GPU", one_pass)
    seen: list = []

    class Keep(Callback):  # each state step's statistics, as the record gets them
        def on_update_metrics(self, step: int, metrics: dict) -> None:
            if any(M.STAT_UPDATE_NORM in k for k in metrics):
                seen.append((step, metrics))

    copies = []
    before = Probes.before_update

    def counted(self, step):  # noqa: ANN001, ANN202
        before(self, step)
        copies.append(self._prev is not None)

    monkeypatch.setattr(Probes, "before_update", counted)
    ex = example("plain_loop")
    torch.manual_seed(0)
    model = ex.GPT(32, 2, 4, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    watch = Watch(model, opt, run_dir=tmp / f"one{one_pass}", db="none", max_steps=20,
                  callbacks=[Keep()])  # fmt: skip
    model.use_recorder(watch.attn)
    train, _ = text_corpus()
    with watch:
        for x, y in watch.batches(lambda i: windows(train, i, 8, 32)):
            loss = model(x, y)
            loss.backward()
            watch.step(loss)
    monkeypatch.undo()
    return seen, copies


def test_the_watch_reports_the_same_statistics_without_a_parameter_copy(
    tmp_path, monkeypatch
) -> None:
    one, one_copies = _watched(tmp_path, monkeypatch, True)
    ops, op_copies = _watched(tmp_path, monkeypatch, False)
    assert [s for s, *_ in one] == [s for s, *_ in ops] == [10, 20]
    assert not any(one_copies) and sum(op_copies) == 2  # the op-by-op form copies on its 2
    for (_, a), (_, b) in zip(one, ops, strict=True):
        assert list(a) == list(b)  # the same statistics, in the same order
        torch.testing.assert_close(
            torch.tensor(list(a.values()), dtype=torch.float64),
            torch.tensor(list(b.values()), dtype=torch.float64),
            rtol=1e-4,
            atol=1e-12,
        )


def test_a_state_step_walks_its_tensors_once() -> None:
    """The check before the update and the pass after it take the same tensors (Adam updates
    its state in place): each parameter, m and v is asked for once a state step, not again by
    the pass (four walks of ~450 tensors at 124M were ~1.3 ms of a state step on meta); the
    columns of the sums are sliced only when asked for."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    asked: list[int] = []

    def local(t: torch.Tensor) -> torch.Tensor:
        asked.append(id(t))
        return t

    params = list(model.parameters())
    plain = AdamState(params, opt, local)
    assert plain.refusal() is None and plain(1e-16) and not asked  # nothing to unwrap
    one = AdamState(params, opt, local)
    one._sharded = True  # as FSDP2's DTensors: each tensor read through `local`
    one.prepare()  # the plan, built ahead on a plain step
    asked.clear()
    assert one.refusal() is None  # before the update
    opt.step()
    out = one(1e-16)  # after it
    assert len(asked) == 3 * len(params)  # p, m and v once each
    assert set(out) == {"sums", "v_max"}
    torch.testing.assert_close(out["m2"], out["sums"][:, 2])


def test_the_address_table_is_copied_again_only_when_a_tensor_moved(monkeypatch) -> None:
    """The kernel's table of where p, m, v and the step counts live goes to the device once
    while Adam updates its state in place, and again when the state's tensors are replaced (a
    `load_state_dict`): the statistics are then the new tensors', not what the old addresses
    held."""
    from spikewatch.trainer.model.kernels import adam_state

    copies: list[torch.dtype] = []
    host_to = adam_state._host_to

    def counted(values, dtype, device):  # noqa: ANN001, ANN202
        copies.append(dtype)
        return host_to(values, dtype, device)

    monkeypatch.setattr(adam_state, "_host_to", counted)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    one = AdamState(params, opt)
    tables = []
    for round_ in range(4):
        if round_ == 2:  # new state tensors, their values changed too
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            for p in params:
                opt.state[p]["exp_avg"].mul_(3.0)
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        copies.clear()
        assert one.refusal() is None
        got = one(1e-16)
        tables.append(copies.count(torch.int64))
        m2 = torch.stack([opt.state[p]["exp_avg"].double().square().sum() for p in params])
        torch.testing.assert_close(got["m2"].double(), m2, rtol=2e-5, atol=0)
    assert tables == [1, 0, 1, 0]
