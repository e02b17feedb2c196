"""The step's one host transfer (trainer/core/transfer.py) on hand-made tensors: what it reads
back by name, and what it works out on the host rather than on the device."""

from __future__ import annotations

import math

import torch

from spikewatch.trainer.core.transfer import NOT_RECORDED, HostTransfer

BIG = 2.0**66  # exact in fp32; its square is not finite there


def test_per_layer_norms_are_summed_on_the_host_from_per_tensor_ones() -> None:
    """Three tensors in layer 0, one in layer 1: each layer's norm is the 2-norm of its
    tensors' norms. In fp32 on the device 3 x 2^66 squared overflows; summed on the host it does
    not. The per-tensor values themselves are no metric."""
    xfer = HostTransfer()
    xfer.add(["loss"], torch.tensor(2.5))
    xfer.add_by_layer(["l0/grad_norm", "l1/grad_norm"], torch.tensor([3 * BIG, 4 * BIG, 0.0, 2.0]),
                      [0, 0, 0, 1])  # fmt: skip
    xfer.add(["late/x"], torch.tensor([7.0]), late=True)
    now, late = xfer.fetch()
    assert now == {"loss": 2.5, "l0/grad_norm": 5 * BIG, "l1/grad_norm": 2.0}
    assert late == {"late/x": 7.0}


def test_values_after_hidden_ones_keep_their_names() -> None:
    xfer = HostTransfer()
    xfer.add_by_layer(["a", "b"], torch.tensor([1.0, 2.0, 2.0]), [1, 0, 1])
    xfer.add(["h0", "h1"], torch.tensor([NOT_RECORDED, 3.0]), sparse=True)
    xfer.add_by_layer(["c"], torch.tensor([0.5]), [0])
    xfer.add(["z"], torch.tensor(9.0))
    now, late = xfer.fetch()
    assert now == {"a": 2.0, "b": math.sqrt(5.0), "h1": 3.0, "c": 0.5, "z": 9.0} and not late


def test_runs_of_values_are_read_by_name_late_sparse_and_empty_alike() -> None:
    """A run read late, a sparse run late (its -inf left out, a NaN kept), a reduction over no
    values (still asked: its metrics exist on every step), each under its own names."""
    xfer = HostTransfer()
    xfer.add(["a", "b"], torch.tensor([1.0, 2.0]))
    xfer.add(["s0", "s1", "s2"], torch.tensor([NOT_RECORDED, math.nan, 4.0]), late=True,
             sparse=True)  # fmt: skip
    xfer.add_reduced(torch.zeros(0), lambda vs: {"count": float(len(vs))}, late=True)
    xfer.add(["c"], torch.tensor(3.0), late=True)
    now, late = xfer.fetch()
    assert now == {"a": 1.0, "b": 2.0}
    assert set(late) == {"s1", "s2", "count", "c"} and math.isnan(late["s1"])
    assert (late["s2"], late["count"], late["c"]) == (4.0, 0.0, 3.0)
    assert xfer.names == ["a", "b", "s0", "s1", "s2", "c"]
