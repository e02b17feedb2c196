"""A host-memory snapshot's copy on a GPU (trainer/checkpoints/pinned.py `start_block`), run on
the CPU: the CPU's tensors stand for a device's (streams and events are stand-ins that run
nothing), and 0-dim tensors for the ones torch's non-fused Adam keeps on the host. Every byte
lands where its source says, on each path (staged on the device, straight to the host), and a
snapshot's loop-thread work does not grow with the number of tensors."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spikewatch.trainer.checkpoints import pinned
from spikewatch.trainer.checkpoints.format import Snapshot
from spikewatch.trainer.checkpoints.memory import MemoryTier
from spikewatch.trainer.checkpoints.pinned import HostBlock, SideCopies
from spikewatch.trainer.core import streams


class _Device:
    """CPU tensors of one dimension or more are "on the device"; 0-dim ones on the host."""

    def __init__(self, free: int = 1 << 40) -> None:
        self.free = free
        self.events = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        stream = SimpleNamespace(wait_stream=lambda s: None, wait_event=lambda e: None)

        def event(device: torch.device, s: object = None) -> object:
            self.events += 1
            return SimpleNamespace(synchronize=lambda: None)

        monkeypatch.setattr(streams, "is_cuda", lambda t: t.dim() > 0)
        monkeypatch.setattr(streams, "new_stream", lambda d: stream)
        monkeypatch.setattr(streams, "current_stream", lambda d: stream)
        monkeypatch.setattr(streams, "record_event", event)
        monkeypatch.setattr(streams, "on", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(streams, "free_bytes", lambda d: self.free)
        monkeypatch.setattr(pinned, "_register", lambda ptr, size: True)  # no page-locking
        monkeypatch.setattr(pinned, "_unregister", lambda ptr: None)


def _sources(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Mixed dtypes and shapes, the host's step counts between the device's tensors (as a
    walk of a non-fused AdamW's state gives them)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        out[f"o/{i}/exp_avg"] = torch.randn(3 + i, 5, generator=g)
        out[f"o/{i}/exp_avg_sq"] = torch.rand(7, generator=g).to(torch.bfloat16)
        out[f"o/{i}/step"] = torch.tensor(float(10 + i))
        out[f"o/{i}/w16"] = torch.randn(2, 3, 4, generator=g).to(torch.float16)
    return out


@pytest.mark.parametrize("free", [1 << 40, 0], ids=["staged", "straight"])
def test_a_snapshot_lands_every_byte_on_each_path(monkeypatch, free: int) -> None:
    """Staged: each device run goes to the host as its own bytes; a copy of the whole block's
    span from the staging buffer overwrote the host's step counts between them."""
    _Device(free).install(monkeypatch)
    src = _sources(5)
    block = HostBlock(src, pin=False)
    block.data.fill_(0xAB)  # what a reused block held: none of it may survive
    copies = SideCopies(stage=True)
    plan = object()
    events = copies.start_block(block, list(src.values()), plan)
    assert len(events) == 6  # the device's runs, the host's step counts between them
    for k, t in src.items():
        assert torch.equal(block.tensors[k], t), k
    # the next snapshot, the layout planned: new values land as well, in another block
    for t in src.values():
        t.add_(1)
    other = HostBlock(src, pin=False)
    copies.start_block(other, list(src.values()), plan)
    for k, t in src.items():
        assert torch.equal(other.tensors[k], t), k


def test_a_planned_snapshot_dispatches_no_more_for_more_tensors(monkeypatch) -> None:
    """The staging views are made once per plan: a snapshot's dispatches on the loop thread
    are a few per run of one device, not three per tensor; the host block is filled by byte
    ranges, its own views never made."""
    _Device().install(monkeypatch)

    def dispatches(n: int) -> int:
        src = {k: v for k, v in _sources(n).items() if v.dim() > 0}  # one device run
        block = HostBlock(src, pin=False)
        copies, plan = SideCopies(stage=True), object()
        copies.start_block(block, list(src.values()), plan)  # plans
        with _Count() as count:
            copies.start_block(block, list(src.values()), plan)
        # the block's views are never made for its copy (made ahead in a thread, they held
        # the GIL from the loop: ~5 ms at 124M)
        assert "tensors" not in vars(block)
        for k, t in src.items():
            assert torch.equal(block.tensors[k], t), k
        return count.n

    assert dispatches(40) == dispatches(4) <= 4  # a foreach copy, a slice, a copy


def test_the_memory_tier_copies_a_non_fused_adams_state_whole(monkeypatch) -> None:
    """torch's AdamW with foreach (its default on a GPU) keeps its step counts on the host:
    the tier groups each device's tensors into one run, copies the host's at once, and a
    restore from the snapshot gives the step's parameters, moments and step counts."""
    dev = _Device()
    dev.install(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)

    def train() -> None:
        opt.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()

    for _ in range(3):
        train()
    tier = MemoryTier(model, opt, interval=1, budget_bytes=1 << 24)
    want = {k: v.clone() for k, v in tier._live().items()}
    assert any(v.dim() == 0 for v in want.values())  # host step counts
    kinds = [v.dim() > 0 for v in want.values()]
    assert kinds == sorted(kinds, reverse=True)  # the device's run first, the host's after
    snap = Snapshot(3, torch_files={}, json_files={"trainer.json": {}}, meta={"step": 3})
    events_before = dev.events
    tier.save(3, snap, set())
    assert dev.events - events_before == 2  # one device run: staged, then to the host
    tier.before_mutation()
    for _ in range(2):
        train()
    assert not torch.equal(model[0].weight, want["p/0.weight"])
    tier.load_tensors(3)
    for k, v in tier._live().items():
        assert torch.equal(v, want[k]), k
    assert all(float(s["step"]) == 3.0 for s in opt.state.values())


class _Count(TorchDispatchMode):
    def __enter__(self) -> _Count:
        self.n = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.n += 1
        return func(*args, **(kwargs or {}))
