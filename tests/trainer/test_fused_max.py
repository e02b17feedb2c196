"""The fused max-logit pass (trainer/model/kernels/max_logits.py) against a float64 reference
(TRITON_INTERPRET=1 on a CPU; tests/trainer/test_kernel_aot.py compiles it for sm_80 / sm_90)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "needs CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it)", allow_module_level=True
    )

from spikewatch.trainer.model.kernels.max_logits import fused_max_logits, refusal  # noqa: E402


def _reference(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """max over (i, j <= i if causal) of scale * q_i . k_j, in float64, keys repeated per group."""
    q, k = q.double(), k.double().repeat_interleave(q.size(1) // k.size(1), dim=1)
    s = q @ k.transpose(-2, -1)
    if causal:
        T, S = s.shape[-2:]
        future = torch.ones(T, S, dtype=torch.bool).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s.flatten(-2).amax(-1) * scale


@pytest.mark.parametrize(
    ("shape_q", "heads_k", "causal"),
    [
        ((2, 4, 37, 32), 4, True),  # a tail block
        ((1, 4, 50, 64), 2, True),  # grouped-query keys, each shared by 2 query heads
        ((1, 3, 16, 128), 1, False),  # one key head for all (multi-query), not causal
        ((2, 2, 33, 16), 2, False),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_maximum_is_the_references(shape_q, heads_k, causal, dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape_q) + heads_k)
    B, H, T, D = shape_q
    q = (torch.randn(B, H, T, D, generator=g) * 2).to(dtype)
    k = (torch.randn(B, heads_k, T, D, generator=g) * 2).to(dtype)
    got = fused_max_logits(q, k, causal=causal)
    assert got.shape == (B, H) and got.dtype == torch.float32
    want = _reference(q, k, causal, D**-0.5).float()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_strided_queries_are_read_in_place() -> None:
    """The plain loop's q is a view (B, T, H, D) -> (B, H, T, D): no copy, the same maximum."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 40, 3 * 4 * 32, generator=g)
    q, k, _ = (t.view(2, 40, 4, 32).transpose(1, 2) for t in x.split(4 * 32, dim=2))
    assert not q.is_contiguous()
    torch.testing.assert_close(
        fused_max_logits(q, k, causal=True), fused_max_logits(q.contiguous(), k.contiguous())
    )
    torch.testing.assert_close(fused_max_logits(q, k), _reference(q, k, True, 32**-0.5).float())


def test_the_future_does_not_count_and_the_scale_is_applied_to_the_max() -> None:
    q = torch.zeros(1, 1, 20, 32)
    k = torch.zeros(1, 1, 20, 32)
    q[0, 0, 2, 0] = 10.0
    k[0, 0, 15, 0] = 10.0  # only queries >= 15 see key 15: query 2 cannot
    k[0, 0, 1, 0] = 1.0
    q[0, 0, 0, 0] = -3.0  # query 0 sees only key 0 (zero): its logit is 0
    assert fused_max_logits(q, k, causal=True).item() == pytest.approx(10.0 / 32**0.5)
    assert fused_max_logits(q, k, causal=False).item() == pytest.approx(100.0 / 32**0.5)
    assert fused_max_logits(q, k, causal=False, scale=0.5).item() == pytest.approx(50.0)
    with pytest.raises(ValueError, match="positive"):
        fused_max_logits(q, k, scale=-1.0)


def test_what_it_refuses_says_why(monkeypatch) -> None:
    q = torch.zeros(1, 4, 8, 32)
    assert refusal(q, q) is None
    assert "mask" in refusal(q, q, torch.ones(8, 8, dtype=torch.bool))
    assert "head dim 8" in refusal(torch.zeros(1, 4, 8, 8), torch.zeros(1, 4, 8, 8))
    assert "evenly" in refusal(q, torch.zeros(1, 3, 8, 32))
    assert "not fp16" in refusal(q.double(), q.double())
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "CUDA" in refusal(q, q)
    with pytest.raises(ValueError, match="cannot take this call: it runs on CUDA"):
        fused_max_logits(q, q)


def test_the_recorder_takes_the_fused_pass_where_it_runs(monkeypatch) -> None:
    """On a GPU the per-head maxima of `AttnMax.sdpa` / `record_logits` come from one fused
    launch (grouped-query keys unrepeated), eager or compiled; the same maxima as PyTorch's
    blockwise pass. On a CPU the blockwise pass stays (FUSED_OFF_GPU: the interpreter here)."""
    import spikewatch.trainer.model.attention as attention
    from spikewatch.trainer.model import attn_max
    from spikewatch.trainer.model.kernels import max_logits as kernel

    launches = []
    real = kernel._launch
    monkeypatch.setattr(kernel, "_launch", lambda *a: launches.append(1) or real(*a))
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 24, 32, generator=g)
    k = torch.randn(2, 2, 24, 32, generator=g)

    def recorded() -> torch.Tensor:
        rec = attn_max.AttnMax()
        rec.active = True
        rec.record_logits(0, q, k, n_rep=2)
        taken = rec.take()
        assert taken is not None
        return taken[1]

    blockwise = recorded()
    assert not launches
    monkeypatch.setattr(attention, "FUSED_OFF_GPU", True)
    torch.testing.assert_close(recorded(), blockwise)
    assert len(launches) == 1

    @torch.compile(backend="aot_eager", fullgraph=True)
    def forward(rec: attn_max.AttnMax, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        rec.record_logits(0, q, k, n_rep=2)
        return q.sum()

    rec = attn_max.AttnMax()
    rec.active = True
    forward(rec, q, k)
    taken = rec.take()
    assert taken is not None and len(launches) == 2
    torch.testing.assert_close(taken[1], blockwise)


@pytest.mark.parametrize("causal", [True, False])
def test_rows_and_keys_past_the_end_do_not_count_when_every_logit_is_negative(causal) -> None:
    """The padding of a tail block (zero queries, zero keys) gives logits of 0: were they
    counted, a head whose logits are all negative would report 0."""
    g = torch.Generator().manual_seed(9)
    q = -torch.rand(1, 2, 70, 32, generator=g) - 0.1
    k = torch.rand(1, 2, 70 if causal else 45, 32, generator=g) + 0.1
    got = fused_max_logits(q, k, causal=causal)
    assert (got < 0).all()
    torch.testing.assert_close(got, _reference(q, k, causal, 32**-0.5).float())


@pytest.mark.parametrize(("heads_k", "causal"), [(4, True), (2, True), (1, False)])
def test_head_maxima_go_straight_into_the_running_maximum(heads_k, causal) -> None:
    """The probes' form: each call max's its (scaled) maxima over the batch into `out`, so a
    layer's per-head maximum over a step's micro-batches is one launch each, no reduction."""
    from spikewatch.trainer.model.kernels.max_logits import fused_head_max_

    g = torch.Generator().manual_seed(11 + heads_k)
    micro = [
        (torch.randn(2, 4, 29, 32, generator=g), torch.randn(2, heads_k, 29, 32, generator=g))
        for _ in range(2)
    ]
    micro[1] = (-micro[1][0].abs() - 0.1, micro[1][1].abs() + 0.1)  # every logit negative
    out = torch.full((4,), float("-inf"))
    for q, k in micro:
        fused_head_max_(out, q, k, causal=causal, scale=0.3)
    want = torch.stack([_reference(q, k, causal, 0.3).amax(0) for q, k in micro]).amax(0)
    torch.testing.assert_close(out, want.float(), atol=1e-5, rtol=1e-5)
    only_negative = torch.full((4,), float("-inf"))
    fused_head_max_(only_negative, *micro[1], causal=causal, scale=0.3)
    assert (only_negative < 0).all()
    with pytest.raises(ValueError, match="out must be"):
        fused_head_max_(torch.zeros(3), *micro[0])


def test_a_recorded_layer_costs_two_kernels_a_micro_batch_at_most(monkeypatch) -> None:
    """With the fused pass, a layer's record is the running maximum's allocation (once a step)
    and the launch: no (B, H) result reduced, scaled and combined op by op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import spikewatch.trainer.model.attention as attention
    from spikewatch.trainer.model import attn_max

    monkeypatch.setattr(attention, "FUSED_OFF_GPU", True)

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if not func.is_view and func.namespace in ("aten", "spikewatch"):
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 24, 32, generator=g), torch.randn(2, 2, 24, 32, generator=g)
    rec = attn_max.AttnMax()
    rec.active = True
    with Ops() as mode:
        for _ in range(2):  # two micro-batches
            rec.record_logits(0, q, k, n_rep=2)
    assert mode.ops == ["full", "fused_head_max_", "fused_head_max_"]
    taken = rec.take()
    assert taken is not None
    torch.testing.assert_close(taken[1][0], _reference(q, k, True, 32**-0.5).amax(0).float())
