"""The attention maxima's table (trainer/model/attn_max.py `AttnMax.reserve`): one (layers,
heads) tensor for the run, each layer's row max'd in place by one launch of the fused pass; in a
compiled model that launch is a kernel of the graph (a `triton_op`), with no Python of
spikewatch's per layer; a layer that recorded nothing is left out of the step's metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from spikewatch.observatory import metric_names as M
from spikewatch.trainer.core.transfer import HostTransfer, StepTensors
from spikewatch.trainer.model import attention
from spikewatch.trainer.model.attn_max import AttnMax

from .test_fused_max import _reference

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

REPO = Path(__file__).resolve().parents[2]


def _qk(seed: int, heads_k: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, 24, 16, generator=g), torch.randn(2, heads_k, 24, 16, generator=g)


def test_each_layer_maxes_into_its_row_over_micro_batches(monkeypatch) -> None:
    """Two micro-batches into rows 0 and 2 (grouped-query keys at row 2), nothing into row 1:
    the rows equal the float64 maxima over both micro-batches, row 1 stays -inf, and the host
    transfer leaves row 1's names out rather than store a -inf."""
    monkeypatch.setattr(attention, "FUSED_OFF_GPU", True)  # the interpreter stands in for CUDA
    rec = AttnMax()
    rec.reserve(3, 4, device="cpu")
    rec.arm(True)
    micro = [(_qk(1), _qk(2, heads_k=2)), (_qk(3), _qk(4, heads_k=2))]
    for (q0, k0), (q2, k2) in micro:
        rec.record_logits(0, q0, k0)
        rec.record_logits(2, q2, k2, n_rep=2)
    taken = rec.take()
    assert taken is not None
    layers, values = taken
    assert layers == (0, 1, 2)
    scale = 16**-0.5
    want0 = torch.stack([_reference(q, k, True, scale).amax(0) for (q, k), _ in micro]).amax(0)
    want2 = torch.stack([_reference(q, k, True, scale).amax(0) for _, (q, k) in micro]).amax(0)
    torch.testing.assert_close(values[0], want0.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values[2], want2.float(), atol=1e-5, rtol=1e-5)
    assert torch.isneginf(values[1]).all()
    assert rec.table is not None and rec.table.data_ptr() == rec.table.data_ptr()
    xfer = HostTransfer()
    one = torch.tensor(1.0)
    xfer.add_step(StepTensors(loss=one, grad_norm=one, clip_factor=one, grad_norms=one,
                              attn_max=values, attn_layers=layers))  # fmt: skip
    now, _late = xfer.fetch()
    assert M.layer_attn_max(0) in now and M.layer_attn_max(2) in now
    assert M.layer_attn_max(1) not in now and M.attn_max(1, 0) not in now
    assert now[M.attn_max(2, 3)] == pytest.approx(float(want2[3]), abs=1e-5)
    # a layer's maximum over its heads, taken on the host from the heads' values
    assert now[M.layer_attn_max(2)] == max(now[M.attn_max(2, h)] for h in range(4))
    assert now[M.layer_attn_max(2)] == pytest.approx(float(want2.max()), abs=1e-5)


def test_each_call_launches_for_its_own_shape_causality_and_scale(monkeypatch) -> None:
    """The eager launch is planned once per q and k signature and reused: calls that differ
    only in causality, scale, sequence length, strides or k's dtype each get their own, and
    every row equals the float64 maxima of its own calls."""
    monkeypatch.setattr(attention, "FUSED_OFF_GPU", True)
    rec = AttnMax()
    rec.reserve(5, 4, device="cpu")
    rec.arm(True)
    q, k = _qk(6)
    g = torch.Generator().manual_seed(7)
    q40, k40 = torch.randn(2, 4, 40, 16, generator=g), torch.randn(2, 4, 40, 16, generator=g)
    k_strided = torch.randn(2, 4, 16, 24, generator=g).transpose(-1, -2)  # head dim not unit
    calls = [  # (layer, q, k, causal, scale)
        (0, q, k, True, None),
        (1, q, k, False, None),  # the same shapes, not causal
        (2, q, k, True, 0.5),  # the same shapes, another scale
        (3, q40, k40, True, None),  # another length
        (3, q, k, True, None),  # ... and the first one again, into another row
        (4, q, k_strided, True, None),  # a copy first
        (4, q, k.bfloat16(), True, None),  # a cast first
        (4, q, k.double(), True, None),  # a dtype the fused pass refuses: the torch path
    ]
    for layer, qq, kk, causal, scale in calls:
        rec.record_logits(layer, qq, kk, causal=causal, scale=scale)
    taken = rec.take()
    assert taken is not None
    _layers, values = taken
    for row in range(5):
        want = torch.stack([
            _reference(qq, kk.float(), causal, 16**-0.5 if scale is None else scale).amax(0)
            for layer, qq, kk, causal, scale in calls if layer == row
        ]).amax(0)  # fmt: skip
        torch.testing.assert_close(values[row], want.float(), atol=1e-5, rtol=1e-5)


def test_a_probed_step_begins_with_the_table_cleared(monkeypatch) -> None:
    """What a compiled graph wrote on an unprobed step (it records every training forward) or
    a replay wrote is cleared when the next probed step is armed; an unprobed step gives none."""
    monkeypatch.setattr(attention, "FUSED_OFF_GPU", True)
    rec = AttnMax()
    rec.reserve(1, 4, device="cpu")
    rec.arm(True)
    q, k = _qk(5)
    rec.record_logits(0, q * 10, k)  # a large maximum
    rec.arm(False)
    assert rec.take() is None  # not probed: nothing given
    rec.arm(True)  # the table cleared
    rec.record_logits(0, q, k)
    taken = rec.take()
    assert taken is not None
    want = _reference(q, k, True, 16**-0.5).amax(0).float()
    torch.testing.assert_close(taken[1][0], want, atol=1e-5, rtol=1e-5)


def test_maxima_beside_the_table_join_it() -> None:
    """Maxima recorded by the user (`record`) go into the table's row; a layer past its rows is
    given after them, not lost."""
    rec = AttnMax()
    rec.reserve(2, 3, device="cpu")
    rec.arm(True)
    rec.record(0, torch.tensor([[1.0, 5.0, 2.0], [3.0, 0.0, 1.0]]))  # (B, H)
    rec.record(0, torch.tensor([0.0, 7.0, 0.0]))
    rec.record(4, torch.tensor([9.0, 8.0, 7.0]))
    taken = rec.take()
    assert taken is not None
    layers, values = taken
    assert layers == (0, 1, 4)
    assert values[0].tolist() == [3.0, 7.0, 2.0]
    assert torch.isneginf(values[1]).all()
    assert values[2].tolist() == [9.0, 8.0, 7.0]
    with pytest.raises(ValueError, match="layers must be"):
        rec.reserve(0, 3)


GRAPH = textwrap.dedent(
    """
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from spikewatch.trainer.model import attention
    from spikewatch.trainer.model.attn_max import AttnMax
    from spikewatch.trainer.model.kernels import max_logits

    # a CPU stands in for CUDA: the graph is traced (fake tensors), never run
    attention.FUSED_OFF_GPU = True
    real = max_logits.refusal
    max_logits.refusal = lambda q, k, mask=None: (None if q.device.type == "cpu"
                                                  else real(q, k, mask))

    class Captured(Exception):
        pass

    for reserve in (True, False):
        torch._dynamo.reset()
        rec = AttnMax()
        if reserve:
            rec.reserve(2, 2, device="cpu")

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = torch.nn.Linear(32, 96)

            def forward(self, x):
                for layer in range(2):
                    q, k, v = self.qkv(x).view(2, 8, 3, 2, 16).permute(2, 0, 3, 1, 4)
                    x = x + rec.sdpa(layer, q, k, v).transpose(1, 2).reshape(2, 8, 32)
                return x.sum()

        graphs = []

        def fw(gm, example_inputs):
            graphs.append(gm.code)

            def run(*args):
                raise Captured
            return run

        net = torch.compile(Net(), backend=aot_autograd(fw_compiler=fw), fullgraph=True)
        rec.arm(True)
        try:
            net(torch.randn(2, 8, 32))
        except Captured:
            pass
        code = graphs[0]
        print("RESERVE", reserve, "TRITON", code.count("higher_order.triton_kernel_wrapper"),
              "EFFECT", code.count("record_max_logits"))
    """
)


def test_a_compiled_forward_launches_the_maxima_from_its_graph() -> None:
    """Reserved, the compiled forward holds the fused max kernel itself, once a layer, and no
    operator that runs spikewatch's Python at the graph's run time (the effectful
    `record_max_logits`, which is what a forward without the table holds: ~0.2 ms of host a
    layer on a GPU). Traced without the interpreter (it cannot run under fake tensors)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", GRAPH], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    found = {}
    for line in out.stdout.splitlines():
        if line.startswith("RESERVE"):
            _, reserve, _, triton, _, effect = line.split()
            found[reserve] = (int(triton), int(effect))
    assert found == {"True": (2, 0), "False": (0, 2)}, out.stderr[-3000:]
