from __future__ import annotations

import copy
import math

import pytest
import torch

from spikewatch.observatory import metric_names as M
from spikewatch.trainer.builtin.loop import build_trainer, fit
from spikewatch.trainer.core.callbacks import Callback, StepState
from spikewatch.trainer.core.probes import layer_of
from spikewatch.trainer.model.gpt import GPT

from .conftest import tiny_config

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

LAYERS = ["embed", "0/attn", "0/mlp", "1/attn", "1/mlp", "lm_head"]


class _Reference(Callback):
    """Recomputes each probe the plain way, from the live trainer (test-only access)."""

    def __init__(self, tr_ref: list) -> None:
        self.ref = tr_ref
        self.seen: dict[int, dict[str, float]] = {}
        self.expected: dict[int, dict[str, float]] = {}
        self.update_seen: dict[int, dict[str, float]] = {}
        self.update_expected: dict[int, dict[str, float]] = {}
        self._before: dict[str, torch.Tensor] = {}

    def pre_update(self, state: StepState):
        tr = self.ref[0]
        exp: dict[str, float] = {}
        sq: dict[str, float] = {}
        for n, p in tr.model.named_parameters():  # grads are clipped by now: undo the factor
            sq[layer_of(n)] = sq.get(layer_of(n), 0.0) + (p.grad.norm() / state.clip_factor) ** 2
        for layer, v in sq.items():
            exp[M.layer(layer, "grad_norm")] = math.sqrt(v)
        twin = GPT(tr.model.cfg.model_copy(update={"attention": "eager"}))
        twin.load_state_dict(tr.model.state_dict())
        x, y = tr.sampler.batch(state.batch_index, state.step)
        with torch.no_grad():
            out = twin(x, y, need_attn_max=True)
            lse = torch.logsumexp(out.logits, -1)
        for i in range(2):
            for h in range(4):
                exp[M.attn_max(i, h)] = out.attn_max[i, h].item()
        exp[M.Z_MEAN] = lse.mean().item()
        exp[M.LOGIT_MAX] = out.logits.max().item()
        self.expected[state.step] = exp
        self.seen[state.step] = dict(state.metrics)
        self._before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        return super().pre_update(state)

    def post_step(self, state: StepState) -> None:
        tr = self.ref[0]
        exp: dict[str, float] = {}
        pn: dict[str, float] = {}
        un: dict[str, float] = {}
        for n, p in tr.model.named_parameters():
            la = layer_of(n)
            pn[la] = pn.get(la, 0.0) + self._before[n].norm().item() ** 2
            un[la] = un.get(la, 0.0) + (p.detach() - self._before[n]).norm().item() ** 2
        for la in pn:
            exp[M.layer(la, "param_norm")] = math.sqrt(pn[la])
            exp[M.layer(la, "update_norm")] = math.sqrt(un[la])
            exp[M.layer(la, "update_ratio")] = math.sqrt(un[la]) / math.sqrt(pn[la])
        m2: dict[str, float] = {}
        sv: dict[str, list[torch.Tensor]] = {}
        for n, p in tr.model.named_parameters():
            st = tr.optimizer.state[p]
            la = layer_of(n)
            m2[la] = m2.get(la, 0.0) + st["exp_avg"].norm().item() ** 2
            sv.setdefault(la, []).append(st["exp_avg_sq"].sqrt().reshape(-1))
        for la in m2:
            v = torch.cat(sv[la])
            exp[M.layer(la, "adam_m_norm")] = math.sqrt(m2[la])
            exp[M.layer(la, "adam_sqrt_v_mean")] = v.mean().item()
            exp[M.layer(la, "adam_sqrt_v_max")] = v.max().item()
            exp[M.layer(la, "adam_v_tiny_frac")] = (v.square() < 1e-16).float().mean().item()
        self.update_expected[state.step] = exp

    def on_update_metrics(self, step: int, metrics) -> None:
        self.update_seen[step] = dict(metrics)


def test_probe_values_equal_reference_computations(tmp_path) -> None:
    ref: list = []
    cb = _Reference(ref)
    tr = build_trainer(
        tiny_config("train.max_steps=6", "probes.state_interval=1"),
        run_dir=tmp_path,
        callbacks=[cb],
    )
    ref.append(tr)
    tr.fit()
    assert sorted(cb.seen) == list(range(1, 7)) and sorted(cb.update_seen) == list(range(1, 7))
    for step, exp in cb.expected.items():
        for name, want in exp.items():
            assert cb.seen[step][name] == pytest.approx(want, rel=1e-4, abs=1e-6), (step, name)
    for step, exp in cb.update_expected.items():
        for name, want in exp.items():
            tol = 0.02 if name.endswith("tiny_frac") else 1e-4  # a sampled estimate
            got = cb.update_seen[step][name]
            assert got == pytest.approx(want, rel=tol, abs=1e-6 if tol < 0.01 else tol), (
                step,
                name,
            )


def test_embedding_rows_never_seen_show_as_tiny_second_moments(tmp_path) -> None:
    seen: dict[int, dict] = {}

    class Grab(Callback):
        def on_update_metrics(self, step, metrics):
            seen[step] = dict(metrics)

    fit(
        tiny_config("train.max_steps=4", "probes.state_interval=1"),
        run_dir=tmp_path,
        callbacks=[Grab()],
    )
    # byte-level Shakespeare never uses most of the 256 byte values: their rows get no gradient
    assert seen[4][M.layer("embed", "adam_v_tiny_frac")] > 0.3
    assert seen[4][M.layer("0/attn", "adam_v_tiny_frac")] < 0.05


def test_probes_never_change_training(tmp_path) -> None:
    for backend in ("auto", "chunked"):
        on = fit(
            tiny_config(f"model.attention={backend}", "probes.state_interval=1"),
            run_dir=tmp_path / f"on-{backend}",
        )
        off = fit(
            tiny_config(f"model.attention={backend}", "probes.enabled=false"),
            run_dir=tmp_path / f"off-{backend}",
        )
        assert on.train_losses == off.train_losses
        assert on.val_losses == off.val_losses


def test_one_host_transfer_per_step(tmp_path, monkeypatch) -> None:
    calls: list[str] = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy"):
        original = getattr(torch.Tensor, name)

        def counting(self, *a, _orig=original, _name=name, **kw):
            import inspect

            caller = inspect.stack()[1].filename
            if "/torch/" not in caller:  # torch's own CPU-side bookkeeping is not ours
                calls.append(f"{_name}@{caller}")
            return _orig(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counting)
    steps = 8  # the last step computes update statistics: they are flushed at the end
    tr = build_trainer(
        tiny_config(
            f"train.max_steps={steps}",
            "eval.interval=none",
            "probes.state_interval=2",
            "optim.name=muonclip",
        ),
        run_dir=tmp_path,
    )
    calls.clear()
    tr.fit()
    ours = (
        "trainer/builtin/loop.py",
        "trainer/core/step_core.py",
        "trainer/core/transfer.py",
        "trainer/core/probes.py",
    )  # transfer.py: the fetch
    per_step = [c for c in calls if c.endswith(ours) and c.startswith("tolist")]
    # one per step, one end-of-fit flush of the last update statistics, one final evaluation
    assert len(per_step) == steps + 1, calls
    assert len(calls) == steps + 2, calls


def test_summary_lists_metrics_for_every_layer_and_head(tmp_path) -> None:
    r = fit(tiny_config("train.max_steps=30", "probes.state_interval=1"), run_dir=tmp_path)
    names = set(r.summary()["metric_names"])
    for la in LAYERS:
        for stat in (
            "grad_norm",
            "param_norm",
            "update_norm",
            "update_ratio",
            "adam_m_norm",
            "adam_sqrt_v_mean",
            "adam_sqrt_v_max",
            "adam_v_tiny_frac",
        ):
            assert M.layer(la, stat) in names, (la, stat)
    assert {M.attn_max(i, h) for i in range(2) for h in range(4)} <= names
    assert {M.Z_MEAN, M.LOGIT_MAX, M.LR, M.TOKENS_PER_S, M.GRAD_NORM, M.CLIP_FACTOR} <= names


def test_muon_layers_report_momentum_norm(tmp_path) -> None:
    r = fit(
        tiny_config("optim.name=muon", "probes.state_interval=1", "train.max_steps=3"),
        run_dir=tmp_path,
    )
    names = set(r.metric_names)
    assert M.layer("0/attn", "muon_momentum_norm") in names
    assert M.layer("embed", "muon_momentum_norm") not in names
    assert M.layer("embed", "adam_m_norm") in names  # the embedding stays on AdamW


def test_interval_and_switches(tmp_path) -> None:
    seen: dict[int, set] = {}

    class Grab(Callback):
        def post_step(self, state):
            seen[state.step] = set(state.metrics)

    fit(
        tiny_config("probes.interval=2", "probes.attn_max=false", "train.max_steps=4"),
        run_dir=tmp_path,
        callbacks=[Grab()],
    )
    assert M.layer("embed", "grad_norm") in seen[2] and M.layer("embed", "grad_norm") not in seen[1]
    assert not any("attn_max" in n for s in seen.values() for n in s)
    assert M.LOSS in seen[1] and M.GRAD_NORM in seen[1]


def test_layer_of() -> None:
    assert layer_of("wte.weight") == "embed"
    assert layer_of("norm_f.weight") == "lm_head"
    assert layer_of("blocks.3.attn.q_norm.weight") == "3/attn"
    assert layer_of("blocks.3.attn_norm.weight") == "3/attn"
    assert layer_of("blocks.0.mlp_norm.weight") == "0/mlp"


def test_probes_survive_a_deepcopy_free_resume(tmp_path) -> None:
    """Probe buffers are not part of checkpoints: a resumed run probes from its first step."""
    fit(tiny_config("checkpoint.interval=2", "train.stop_after=4"), run_dir=tmp_path)
    r = fit(tiny_config("checkpoint.interval=2"), run_dir=tmp_path, resume=True)
    assert M.layer("0/attn", "grad_norm") in r.metric_names
    assert copy.copy(r.steps) == 12


def test_adam_sqrt_v_sums_take_fused_norms_a_chunk_at_a_time(monkeypatch) -> None:
    """sum(sqrt(v)) per tensor as sqrt then the fused L1 norm, a few tensors at a time: the
    same values as the order-1/2 norm (which launches one CUDA kernel per tensor), with no
    order other than 1 dispatched and one norm call per chunk."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from spikewatch.trainer.core import probes as P

    g = torch.Generator().manual_seed(0)
    vs = [torch.rand(s, generator=g) ** 4 * 1e-3 for s in [(100,), (33, 17), (5,), (700, 30)]]
    want = P.norms(vs, torch.device("cpu"), 0.5).float().sqrt()

    class Orders(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.orders: list[float] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func.overloadpacket.__name__ == "_foreach_norm":
                self.orders.append(float(args[1]) if len(args) > 1 else 2.0)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(P, "ROOT_CHUNK", 1000)  # chunks: [100, 561, 5], [21000]
    with Orders() as mode:
        got = P.root_sums(vs, torch.device("cpu"))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert mode.orders == [1.0, 1.0]
