"""torchtitan's FlexAttention gives the attention maxima from its own kernel
(spikewatch/torchtitan/maxima.py): no second pass over q and k, the block mask applied, and in a
compiled model the table's row written by the graph (no operator running spikewatch's Python).

Flex gives its maxima on a GPU only in this torch; here torch's own reference arithmetic of the
Flex operator (the `flex_attention` higher-order op, which computes them on a CPU) stands in for
the compiled kernel. No training: a layer's forward and backward."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("torchtitan")

from functorch.compile import make_boxed_func  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch.nn.attention.flex_attention import (  # noqa: E402
    AuxOutput,
    _identity,
    create_block_mask,
    flex_attention_hop,
)
from torchtitan.models.common.attention import FlexAttention  # noqa: E402

from spikewatch.torchtitan.maxima import attach_inner_attention  # noqa: E402
from spikewatch.trainer.model.attn_max import AttnMax  # noqa: E402

L, HEADS, D, WINDOW, SCALE = 16, 4, 8, 4, 0.5


def _kernel(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):  # noqa: ANN001, ANN202, ARG001
    """The compiled Flex call's stand-in: torch's Flex operator, whose CPU arithmetic gives the
    maxima (in log2 units, as the kernel's; the public call turns them back)."""
    opts = {"OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": bool(return_aux.max_scores)}
    out, lse, mx = flex_attention_hop(
        q, k, v, score_mod or _identity, block_mask.as_tuple(), scale, opts
    )
    ln2 = math.log(2.0)
    return out, AuxOutput(
        lse=lse * ln2 if return_aux.lse else None,
        max_scores=mx * ln2 if return_aux.max_scores else None,
    )


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_heads = HEADS
        self.inner_attention = FlexAttention(FlexAttention.Config())


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = _Attention()
        self.proj = torch.nn.Linear(D, D)


class _Model(torch.nn.Module):
    """Two blocks named as torchtitan names them (`layers.N.attention.inner_attention`)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor, mask) -> torch.Tensor:  # noqa: ANN001
        for block in self.layers:  # q, k, v as (B, L, N, H)
            q, k = block.proj(x), block.proj(x.flip(1))
            x = x + block.attention.inner_attention(q, k, x, attention_masks=mask, scale=SCALE)
        return x


def _window(b, h, i, j):  # noqa: ANN001, ANN202
    return (i >= j) & (i - j < WINDOW)


def _reference(model: _Model, x: torch.Tensor, window: bool) -> torch.Tensor:
    """(layers, heads) maxima in float64, by hand: q k^T * scale over the allowed keys."""
    rows, allowed = [], torch.ones(L, L, dtype=torch.bool).tril()
    if window:
        i = torch.arange(L)
        allowed &= (i[:, None] - i[None, :]) < WINDOW
    x = x.double()
    for block in model.layers:
        w, b = block.proj.weight.double(), block.proj.bias.double()
        q, k = (x @ w.T + b).transpose(1, 2), (x.flip(1) @ w.T + b).transpose(1, 2)
        s = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~allowed, -math.inf)
        rows.append(s.amax(dim=(0, 2, 3)))
        p = torch.softmax(s, dim=-1)
        x = x + (p @ x.transpose(1, 2)).transpose(1, 2)
    return torch.stack(rows)


@pytest.fixture
def model(monkeypatch) -> _Model:
    monkeypatch.setattr(FlexAttention, "compiled_flex_attn", staticmethod(_kernel))
    torch.manual_seed(0)
    return _Model()


def _mask():  # noqa: ANN202
    return create_block_mask(_window, None, None, L, L, device="cpu")


def test_flex_gives_the_maxima_with_its_block_mask_and_the_same_output(model) -> None:
    """The table (reserved from the blocks and their heads) holds each layer's maxima over
    the keys the sliding window allows, equal to a float64 computation by hand, which the
    causal pass of the pre-hook (an upper bound) does not give; the layer's output is
    torchtitan's own forward's; an unprobed step keeps nothing."""
    rec = AttnMax()
    assert attach_inner_attention(model, rec, flex_maxima=True) == 2
    assert rec.reserved == (2, HEADS)
    rec.place("cpu")
    x, mask = torch.randn(2, L, HEADS, D), _mask()
    rec.arm(True)
    out = model(x, mask)
    out.sum().backward()  # the maxima are not in the gradient's way
    taken = rec.take()
    assert taken is not None
    layers, values = taken
    assert layers == (0, 1)
    want = _reference(model, x, window=True)
    torch.testing.assert_close(values.double(), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want, _reference(model, x, window=False))  # causal alone: not it
    plain = _Model()
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(out, plain(x, mask))  # torchtitan's forward, untouched
    rec.arm(False)
    model(x, mask)
    assert rec.take() is None


def test_compiled_the_graph_writes_the_table_and_runs_none_of_spikewatchs_python(model) -> None:
    """Compiled, the maxima leave Flex's call as a third output and max the table's row in
    the graph: no `record_attn_max` / `record_max_logits` operator (Python a layer at run time,
    a CUDA graph split) in it; the values equal the eager ones."""
    rec = AttnMax()
    attach_inner_attention(model, rec, flex_maxima=True)
    rec.place("cpu")
    x, mask = torch.randn(2, L, HEADS, D), _mask()
    graphs: list[str] = []

    def fw(gm, example_inputs):  # noqa: ANN001, ANN202, ARG001
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=fw))
    for _ in range(2):  # the second step runs the compiled graph alone
        rec.arm(True)
        compiled(x, mask).sum().backward()
        taken = rec.take()
        assert taken is not None
        torch.testing.assert_close(taken[1].double(), _reference(model, x, window=True),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
    assert graphs and all("record_attn_max" not in g for g in graphs), graphs
    assert all("record_max_logits" not in g for g in graphs)
    assert "OUTPUT_MAX': True" in graphs[0]


def test_on_a_cpu_the_pre_hook_computes_causal_maxima(model) -> None:
    """Where Flex gives no maxima (a CPU), each inner attention's q and k go to the causal
    pass: no table reserved, the maxima those of the causal mask."""
    rec = AttnMax()
    assert attach_inner_attention(model, rec) == 2
    assert rec.reserved is None
    x = torch.randn(2, L, HEADS, D)
    causal = create_block_mask(lambda b, h, i, j: i >= j, None, None, L, L, device="cpu")
    rec.arm(True)
    model(x, causal)
    taken = rec.take()
    assert taken is not None
    torch.testing.assert_close(taken[1].double(), _reference(model, x, window=False),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
