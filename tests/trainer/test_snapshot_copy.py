"""A host-memory snapshot's copy on a GPU (trainer/checkpoints/pinned.py `start_block`), run on
the CPU: the CPU's tensors stand for a device's (streams and events are stand-ins that run
nothing), and 0-dim tensors for the ones torch's non-fused Adam keeps on the host. Every byte
lands where its source says, on each path (staged on the device, straight to the host), and a
snapshot's loop-thread work does not grow with the number of tensors."""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spikewatch.trainer.checkpoints import memory as memory_module
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
        self.copy_s: float | None = None  # what the device's timing events say of a copy
        self.kept: list[tuple[torch.Tensor, object]] = []  # (a buffer let go, its stream)
        self.stream = SimpleNamespace(wait_stream=lambda s: None, wait_event=lambda e: None)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        stream = self.stream

        def event(device: torch.device, s: object = None) -> object:
            self.events += 1
            return SimpleNamespace(synchronize=lambda: None)

        monkeypatch.setattr(streams, "is_cuda", lambda t: t.dim() > 0)
        monkeypatch.setattr(streams, "new_stream", lambda d: stream)
        monkeypatch.setattr(streams, "current_stream", lambda d: stream)
        monkeypatch.setattr(streams, "record_event", event)
        monkeypatch.setattr(streams, "timing_event", event)
        monkeypatch.setattr(streams, "seconds_between", lambda a, b: self.copy_s)
        monkeypatch.setattr(streams, "keep_until_done", lambda t, s: self.kept.append((t, s)))
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


@pytest.mark.parametrize(
    ("free", "chunk"), [(1 << 40, None), (0, None), (1 << 40, 700)],
    ids=["staged", "straight", "chunked"],
)  # fmt: skip
def test_a_snapshot_lands_every_byte_on_each_path(monkeypatch, free: int, chunk: int) -> None:
    """Staged: each device run goes to the host as its own bytes; a copy of the whole block's
    span from the staging buffer overwrote the host's step counts between them. Chunked: the
    device keeps a buffer of a chunk's bytes (or of its largest tensor), each chunk's tensors
    copied into it from its start and its bytes to the chunk's place in the block."""
    _Device(free).install(monkeypatch)
    src = _sources(5)
    block = HostBlock(src, pin=False)
    block.data.fill_(0xAB)  # what a reused block held: none of it may survive
    copies = SideCopies(stage=True, chunk=chunk)
    plan = object()
    events = copies.start_block(block, list(src.values()), plan)
    assert len(events) == 1  # one device (its runs on one stream: the last run's events)
    for k, t in src.items():
        assert torch.equal(block.tensors[k], t), k
    staging = copies._staging.get(torch.device("cpu"))
    runs = [r for r in copies._planned[3] if r.dev is not None]
    if free == 0:  # no room: straight to the host
        assert staging is None
    elif chunk is None:  # a run's whole span: three tensors between the host's step counts
        assert len(runs) == 6
        assert staging.numel() == max(r.hi - r.lo for r in runs) > 2 * 512
    else:  # two of the 512-byte-aligned tensors at a time
        assert len(runs) == 10  # each three-tensor run in two
        assert staging.numel() == max(r.hi - r.lo for r in runs) <= chunk
    # the next snapshot, the layout planned: new values land as well, in another block
    for t in src.values():
        t.add_(1)
    other = HostBlock(src, pin=False)
    copies.start_block(other, list(src.values()), plan)
    for k, t in src.items():
        assert torch.equal(other.tensors[k], t), k


def test_a_staging_buffer_outgrown_is_kept_until_its_copies_are_done(monkeypatch) -> None:
    """The start's snapshot holds no optimizer state; the next one's plan needs a larger
    staging buffer: the smaller one, which the start's copy to the host may still be reading
    on the side stream, is let go through the allocator's `record_stream` for that stream
    (dropped outright, its memory went to the compute stream at once)."""
    dev = _Device()
    dev.install(monkeypatch)
    copies = SideCopies(stage=True)
    small = {k: v for k, v in _sources(2).items() if v.dim() > 0}
    block = HostBlock(small, pin=False)
    copies.start_block(block, list(small.values()), object())
    first = copies._staging[torch.device("cpu")]
    assert dev.kept == []
    large = {k: v for k, v in _sources(6).items() if v.dim() > 0}
    other = HostBlock(large, pin=False)
    copies.start_block(other, list(large.values()), object())
    assert copies._staging[torch.device("cpu")].numel() > first.numel()
    assert len(dev.kept) == 1 and dev.kept[0][0] is first and dev.kept[0][1] is dev.stream
    for k, t in large.items():
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
    # one device run: its start (timed), staged (the update may go on), landed on the host
    assert dev.events - events_before == 3
    tier.before_mutation()
    for _ in range(2):
        train()
    assert not torch.equal(model[0].weight, want["p/0.weight"])
    tier.load_tensors(3)
    for k, v in tier._live().items():
        assert torch.equal(v, want[k]), k
    assert all(float(s["step"]) == 3.0 for s in opt.state.values())


def test_the_memory_tier_stages_whole_only_where_the_copy_would_not_hide(
    monkeypatch, caplog
) -> None:
    """A chunk's bytes on the device until the copy is measured and while it takes under 0.8
    of a step (the next forward and backward hides it); the whole snapshot where it does not;
    a chunk again only below 0.6 (no flapping). Said when first known and when it changes;
    every snapshot restores its step's tensors whichever way it was staged."""
    dev = _Device()
    dev.install(monkeypatch)
    monkeypatch.setattr(memory_module, "STAGE_CHUNK", 1100)  # a few tensors a chunk
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=False, foreach=False)
    tier = MemoryTier(model, opt, interval=1, budget_bytes=1 << 24, keep_last=8)
    staged = []

    def step_and_save(step: int, copy_s: float | None) -> list[str]:
        opt.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        tier.before_mutation()
        opt.step()
        dev.copy_s = copy_s  # what the last snapshot's timing events say once it landed
        assert tier.due(step, 0.1)  # a 100 ms step
        caplog.clear()
        snap = Snapshot(step, torch_files={}, json_files={"trainer.json": {}}, meta={})
        tier.save(step, snap, set())
        want[step] = {k: v.clone() for k, v in tier._live().items()}
        staged.append(tier._copies._staging[torch.device("cpu")].numel())
        return [r.getMessage() for r in caplog.records if "host-memory snapshots" in r.message]

    want: dict[int, dict[str, torch.Tensor]] = {}
    with caplog.at_level(logging.INFO, logger="spikewatch"):
        assert step_and_save(1, None) == []  # nothing measured yet: a chunk at a time
        assert tier._copies.chunk == 1100
        said = step_and_save(2, 0.05)  # hides: said once, as it is
        assert len(said) == 1 and "50.0 ms against a 100.0 ms step" in said[0]
        assert "1100" not in said[0] and "at a time" in said[0]
        assert step_and_save(3, None) == [] and tier._copies.chunk == 1100  # not landed yet
        said = step_and_save(4, 0.09)  # does not hide: whole
        assert tier._copies.chunk is None and len(said) == 1 and "staged whole" in said[0]
        assert step_and_save(5, 0.065) == [] and tier._copies.chunk is None  # kept
        said = step_and_save(6, 0.05)
        assert tier._copies.chunk == 1100 and len(said) == 1 and "at a time" in said[0]
    assert tier.copy_s == 0.05
    assert staged[0] == staged[1] == staged[2] <= 1100 < staged[3] == staged[4]
    # each buffer let go (at each change) is kept until the side stream's copies are done
    assert [(t.numel(), s) for t, s in dev.kept] == [
        (staged[2], dev.stream),
        (staged[4], dev.stream),
    ]
    assert staged[5] <= 1100
    for step in range(1, 7):
        tier.load_tensors(step)
        for k, v in tier._live().items():
            assert torch.equal(v, want[step][k]), (step, k)


class _Count(TorchDispatchMode):
    def __enter__(self) -> _Count:
        self.n = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_the_disk_tiers_copies_land_and_their_dispatches_do_not_grow(monkeypatch) -> None:
    """`SideCopies.start` (a disk checkpoint's copy on a GPU): every byte lands, the host's
    tensors at once, the sources held until the compute streams wait for the copy (no
    `record_stream` a tensor), and a multi-tensor copy a device: the loop thread's dispatches
    do not grow with the tensors (a `record_stream` and a `copy_` each before)."""
    _Device().install(monkeypatch)

    def dispatches(n: int) -> int:
        src = _sources(n)
        dst = [torch.full_like(t, 7) for t in src.values()]
        copies = SideCopies()
        with _Count() as count:
            events = copies.start(list(zip(dst, src.values(), strict=True)))
        assert len(events) == 1  # one device, one event; the host's copied at once
        for d, t in zip(dst, src.values(), strict=True):
            assert torch.equal(d, t)
        held = [t for t in src.values() if t.dim() > 0]
        assert len(copies._held) == len(held)  # until the streams wait for the copy
        assert all(a is b for a, b in zip(copies._held, held, strict=True))
        copies.release()
        assert copies._held == []
        return count.n

    assert dispatches(40) == dispatches(4) <= 2


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=False, foreach=False)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
    return model, opt


def test_a_disk_checkpoint_stages_each_file_into_its_own_block(monkeypatch, tmp_path) -> None:
    """An async disk save on a GPU copies the snapshot's tensors into one pinned block a file,
    made ahead by the writer thread (`prepare`), not a block a tensor made on the loop thread
    at the save; each file holds its own tensors' bytes (torch.save writes a view's whole
    storage: one block for every file would write every tensor into each), and reads back
    as the state it saved."""
    from spikewatch.trainer.checkpoints import format as ck
    from spikewatch.trainer.checkpoints.disk import Checkpointer
    from spikewatch.trainer.checkpoints.staging import to_host
    from spikewatch.trainer.config import CheckpointConfig

    _Device().install(monkeypatch)
    model, opt = _trained()
    # a file of several dtypes (torch.save refuses views of one storage as different types)
    model.register_buffer("b16", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))
    model.register_buffer("count", torch.tensor([3, 4], dtype=torch.int64))
    disk = Checkpointer(tmp_path, CheckpointConfig(interval=10, async_save=True, fsync=False))
    disk.open()

    def build(stage):  # noqa: ANN001, ANN202
        return ck.Snapshot(
            step=10,
            torch_files={"model.pt": to_host(model.state_dict(), stage),
                         "optimizer.pt": to_host(opt.state_dict(), stage)},
            json_files={"trainer.json": {"step": 10}}, meta={},
        )  # fmt: skip

    want = {"model.pt": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer.pt": {i: {k: v.clone() for k, v in s.items()}
                             for i, s in opt.state_dict()["state"].items()}}  # fmt: skip
    disk.prepare(build)
    for ahead in disk._stager._ahead.values():  # the writer thread made the blocks, and
        assert "tensors" in vars(ahead.result())  # their views (~1,200 dispatches at 124M)
    made = []
    real = pinned.HostBlock.__init__

    def counted(self, like, pin):  # noqa: ANN001, ANN202
        made.append(pin)
        real(self, like, pin)

    monkeypatch.setattr(pinned.HostBlock, "__init__", counted)
    disk.save(10, build)
    disk.before_mutation()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next update: the file keeps the step's values
    disk.wait()
    assert made == []  # the loop made no block at the save: the writer's, made ahead
    got = ck.read_checkpoint(ck.step_dir(tmp_path, 10))
    for k, v in want["model.pt"].items():
        assert torch.equal(got["model.pt"][k], v) and got["model.pt"][k].dtype == v.dtype, k
    stores = {t.untyped_storage().data_ptr() for t in got["model.pt"].values()}
    assert len(stores) == len(want["model.pt"])  # each loaded tensor its own storage
    for i, s in want["optimizer.pt"].items():
        for k, v in s.items():
            assert torch.equal(got["optimizer.pt"]["state"][i][k], v), (i, k)
    sizes = {
        n: (ck.step_dir(tmp_path, 10) / n).stat().st_size for n in ("model.pt", "optimizer.pt")
    }
    model_bytes = sum(v.numel() * v.element_size() for v in want["model.pt"].values())
    # the model's file: its own bytes (and 512-byte alignment, and pickled metadata), not
    # the optimizer's moments too
    assert sizes["model.pt"] < model_bytes + 512 * len(want["model.pt"]) + 4096


def test_the_writer_thread_never_waits_for_a_block_queued_behind_it() -> None:
    """The writer thread makes a disk checkpoint's blocks ahead (`prepare`) and stages host
    tensors itself (host memory's lent snapshot): a block asked for ahead after the staging job
    was queued is still behind it, so the writer makes its own rather than wait for ever (a
    host_cost run hung there once the disk took host memory's snapshot)."""
    import threading
    from concurrent.futures import Future

    from spikewatch.trainer.checkpoints.staging import Stager, stage_tensors

    stager = Stager()
    stager._ahead["model.pt"] = Future()  # queued behind the caller: never done while it waits
    files = {"model.pt": {"w": torch.arange(6.0).reshape(2, 3)}}
    out: list[dict] = []
    writer = threading.Thread(target=lambda: out.append(stage_tensors(files, stager, wait=False)))
    writer.start()
    writer.join(10)
    assert not writer.is_alive()
    assert torch.equal(out[0]["model.pt"]["w"], files["model.pt"]["w"])
    assert "model.pt" not in stager._ahead  # the late block is not waited for later either


def test_a_file_written_from_a_lent_snapshot_on_a_gpus_path(monkeypatch, tmp_path) -> None:
    """On a GPU the host-memory snapshot a disk checkpoint takes (`MemoryTier.lend`) is copied
    by side streams; the disk's writer thread waits for those copies itself (never the loop)
    before it copies the snapshot's buffers into its file's, and the file reads back as the
    step's state, the weights moved on after it."""
    from spikewatch.trainer.checkpoints import format as ck
    from spikewatch.trainer.checkpoints.disk import Checkpointer
    from spikewatch.trainer.config import CheckpointConfig

    device = _Device()
    device.install(monkeypatch)
    waited: list[str] = []  # the threads that waited for the side streams' copies
    real_wait = pinned.host_wait

    def host_wait(events):  # noqa: ANN001, ANN202
        import threading

        waited.append(threading.current_thread().name)
        return real_wait(events)

    monkeypatch.setattr(memory_module, "host_wait", host_wait)
    model, opt = _trained()
    tier = MemoryTier(model, opt, interval=10, budget_bytes=1 << 24)
    disk = Checkpointer(tmp_path, CheckpointConfig(interval=10, async_save=True, fsync=False))
    disk.open()
    snap = Snapshot(step=10, torch_files={}, json_files={"trainer.json": {"step": 10}}, meta={})
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = {
        i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()
    }
    tier.save(10, snap, set())
    assert tier.slots[10].events  # the side streams' copies
    lent = tier.lend(10)
    assert lent is not None
    disk.save(10, lambda stage: snap, lent=lent)
    tier.before_mutation()
    disk.before_mutation()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    disk.wait()
    assert any(n.startswith("ckpt-writer") for n in waited)  # the writer waited for them,
    assert "MainThread" not in waited  # not the loop
    got = ck.read_checkpoint(ck.step_dir(tmp_path, 10))
    for k, v in want.items():
        assert torch.equal(got["model.pt"][k], v), k
    state = {**got["optimizer.pt"]["state"], **got["optimizer.1.pt"]["state"]}
    for i, s in want_opt.items():
        for k, v in s.items():
            assert torch.equal(state[i][k], v), (i, k)
    assert tier.slots[10].unheld.is_set()
