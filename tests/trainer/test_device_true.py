"""What runs on a CPU runs on a CUDA device (issue 49), tested on a CPU: `meta` stands in for
a second device, fakes for CUDA streams and events. Each test fails on the code before the fix
it guards (the first GPU run crashed at its first rollback)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spikewatch import Watch
from spikewatch.trainer.checkpoints import pinned
from spikewatch.trainer.checkpoints.memory import MemoryTier, _Slot, _state_device
from spikewatch.trainer.config import ProbesConfig
from spikewatch.trainer.core import streams
from spikewatch.trainer.core.actions import Action, Continue, Rollback
from spikewatch.trainer.core.callbacks import Callback, StepState
from spikewatch.trainer.core.norms import scale_
from spikewatch.trainer.core.probes import Probes
from spikewatch.trainer.core.transfer import clip_by_global_norm

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

META = torch.device("meta")


# -- checkpoints are read to the CPU ------------------------------------------------------------
class _OnAnotherDevice(Callback):
    """At the step that asks for a rollback, the probes report another device (as a CUDA model's
    do); the checkpoint read must not follow it."""

    def __init__(self, at: int) -> None:
        self.at, self.watch = at, None
        self.step_kept_on: list[torch.device] = []

    def pre_update(self, state: StepState) -> Action:
        if state.step == self.at:
            return Rollback(to_step=self.at - 5, reason="test")
        return Continue()

    def post_step(self, state: StepState) -> None:
        if state.step == self.at and state.action == "rollback":
            self.watch.core.probes.device = META

    def on_rollback(self, step: int, record: dict) -> None:
        self.watch.core.probes.device = torch.device("cpu")
        opt = self.watch.optimizer
        self.step_kept_on = [s["step"].device for s in opt.state.values()]


def test_device_a_disk_rollback_reads_to_the_cpu_whatever_the_models_device(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # step counts: CPU tensors
    cb = _OnAnotherDevice(at=12)
    settings = {"checkpoint": {"interval": 5, "memory_interval": None}}
    watch = Watch(model, opt, run_dir=tmp_path, db="none", settings=settings, callbacks=[cb])
    cb.watch = watch
    with watch:
        for i in range(15):
            watch.begin_step(i)
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            watch.step(loss)
    (rb,) = watch.interventions
    assert (rb["from_step"], rb["to_step"], rb["tier"]) == (12, 5, "disk")
    assert cb.step_kept_on and set(cb.step_kept_on) == {torch.device("cpu")}


def test_device_optimizer_step_counts_stay_where_torch_keeps_them() -> None:
    p = torch.nn.Parameter(torch.ones(2, device=META))
    plain = torch.optim.AdamW([p])
    fused = torch.optim.AdamW([p], fused=True)
    assert _state_device(plain, p, "step") == torch.device("cpu")  # no .item() per step
    assert _state_device(fused, p, "step") == META
    assert _state_device(plain, p, "exp_avg") == META


# -- norms, clipping and probes over devices ------------------------------------------------------
def _two_devices() -> list[torch.nn.Parameter]:
    """The first parameter on `meta` (the "primary" device), the others on the CPU, each with a
    gradient on its own device: a model spread by device_map="auto"."""
    params = [torch.nn.Parameter(torch.ones(3, device=META))]
    params += [torch.nn.Parameter(torch.ones(4)) for _ in range(2)]
    for p in params:
        p.grad = torch.ones_like(p)
    return params


def test_device_norms_of_gradients_on_several_devices_gather_on_the_first() -> None:
    params = _two_devices()
    total, factor, per_tensor = clip_by_global_norm(params, None)
    assert per_tensor.device == META and per_tensor.shape == (3,) and total.device == META


def test_device_fp16_gradient_norms_do_not_overflow() -> None:
    """fp16 holds at most 65,504: a norm past it is no reason to call a gradient non-finite."""
    p = torch.nn.Parameter(torch.zeros(10_000, dtype=torch.float16))
    p.grad = torch.full_like(p, 1000.0)  # norm 100,000
    total, _, per_tensor = clip_by_global_norm([p], None)
    assert per_tensor.dtype == torch.float32
    assert total.item() == pytest.approx(1e5, rel=1e-3)


def test_device_scale_sends_the_factor_to_each_device() -> None:
    xs = [torch.ones(2), torch.ones(2, device=META)]
    scale_(xs, torch.tensor(0.5))
    assert torch.equal(xs[0], torch.full((2,), 0.5))


class _BigAllocations(TorchDispatchMode):
    """Counts op outputs of at least `size` elements."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.seen = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if torch.is_tensor(a)}
        for t in out if isinstance(out, list | tuple) else [out]:
            if not torch.is_tensor(t) or t.numel() < self.size:
                continue
            if t.untyped_storage().data_ptr() not in inputs:  # new memory, not a view
                self.seen.append(str(func))
        return out


def test_device_a_missing_gradient_costs_no_parameter_sized_zeros() -> None:
    big = torch.nn.Parameter(torch.ones(4096))  # no gradient (frozen, or unused this step)
    small = torch.nn.Parameter(torch.ones(8))
    small.grad = torch.ones(8)
    with _BigAllocations(4096) as mode:
        _, _, per_tensor = clip_by_global_norm([big, small], 1.0)
    assert not mode.seen
    assert per_tensor.tolist() == [0.0, pytest.approx(math.sqrt(8))]


def _probes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Probes:
    cfg = ProbesConfig(interval=1, state_interval=1)
    return Probes(model, opt, cfg, layer_of=lambda n: n.split(".")[0])


def test_device_probes_on_another_device_with_an_optimizer_without_moments() -> None:
    """SGD has no Adam moments: its empty statistics must be made on the model's device."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)).to(META)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probes = _probes(model, opt)
    probes.before_update(1)
    probes.after_update(1, applied=True)
    step, names, values, _ = probes.take_pending()
    assert values.device == META and len(names) == values.numel()


def test_device_probe_norms_over_parameters_on_two_devices() -> None:
    params = _two_devices()
    model = torch.nn.Module()
    model.a, model.b, model.c = params  # type: ignore[assignment]
    probes = _probes(model, torch.optim.SGD(params, lr=0.1))
    assert probes._norm(probes.groups, [p.detach() for p in params]).device == META


def test_device_no_parameter_copy_is_kept_and_no_copy_of_v_is_made() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 128)).sum().backward()
    opt.step()
    probes = _probes(model, opt)
    probes.before_update(1)
    opt.step()
    from spikewatch.trainer.core import probes as probes_module

    chunk = probes_module.ROOT_CHUNK
    probes_module.ROOT_CHUNK = 128 * 128  # sqrt(v) of one weight at a time, at most
    try:
        with _BigAllocations(128 * 128) as mode:  # the v of a weight (a sample is 4,096)
            names, _ = probes._optimizer_stats()
    finally:
        probes_module.ROOT_CHUNK = chunk
    # sum(sqrt(v)) takes sqrt(v) a chunk of at most ROOT_CHUNK elements at a time (a fused L1
    # norm instead of an order-1/2 norm's kernel per tensor); nothing else the size of a v
    assert set(mode.seen) == {"aten._foreach_sqrt.default"} and names
    assert len(mode.seen) == 2  # the two weights, one chunk each: never both at once
    probes.after_update(1, applied=True)
    assert probes._prev is None  # the parameters' copy of a state step is given back


# -- streams and events of the tensor's own device -----------------------------------------------
class _FakeCuda:
    """Streams and events that record their device and what was asked of them."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        test = self

        class Stream:
            def __init__(self, device=None) -> None:  # noqa: ANN001
                self.device = device

            def wait_stream(self, other) -> None:  # noqa: ANN001
                test.log.append(("wait_stream", self.device, other.device))

            def wait_event(self, event) -> None:  # noqa: ANN001
                test.log.append(("wait_event", self.device, event.stream.device))

        class Event:
            def record(self, stream) -> None:  # noqa: ANN001
                self.stream = stream
                test.log.append(("record", stream.device))

            def synchronize(self) -> None:
                test.log.append(("synchronize", self.stream.device))

        self.Stream, self.Event = Stream, Event

    def install(self, monkeypatch) -> None:  # noqa: ANN001
        monkeypatch.setattr(torch.cuda, "Stream", self.Stream)
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.Stream(device))
        monkeypatch.setattr(torch.cuda, "stream", lambda s: _Null())


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_device_an_event_is_recorded_on_the_tensors_device_not_the_current_one(monkeypatch) -> None:
    fake = _FakeCuda()
    fake.install(monkeypatch)
    gpu1 = torch.device("cuda", 1)
    event = streams.record_event(gpu1)
    assert fake.log == [("record", gpu1)] and event.stream.device == gpu1


def test_device_memory_tier_the_device_waits_for_the_copy_not_the_host(monkeypatch) -> None:
    """`before_mutation` runs between backward and the update: a host wait there stalls the
    launch queue every snapshot."""
    fake = _FakeCuda()
    fake.install(monkeypatch)
    model = torch.nn.Linear(2, 2)
    tier = MemoryTier(model, torch.optim.SGD(model.parameters()), interval=1, budget_bytes=2**20)
    gpu1 = torch.device("cuda", 1)
    free, landed = fake.Event(), fake.Event()
    free.record(fake.Stream(gpu1))  # the copy staged on the device (HBM to HBM): done soon
    landed.record(fake.Stream(torch.device("cuda", 0)))  # (another stream, to tell them apart)
    fake.log.clear()
    tier._pending = _Slot(step=1, buffers={}, packed=b"")
    tier._pending.events = [(gpu1, landed, free)]
    tier._pending.ready.set()  # (a host wait on it could not hang the test)
    tier.before_mutation()
    # the update waits for the staging copy, not for the host's: no ("synchronize", ...)
    assert fake.log == [("wait_event", gpu1, gpu1)]


def test_device_the_attention_max_ops_are_unsafe_to_capture_in_a_cuda_graph() -> None:
    """Under mode="reduce-overhead" an op captured in a CUDA graph runs its Python once, at
    capture: the recorder would see no maxima after it. Tagged, the compiler leaves it out."""
    from spikewatch.trainer.model import attn_max

    assert attn_max.COMPILE_SAFE
    for op in (torch.ops.spikewatch.record_attn_max, torch.ops.spikewatch.record_max_logits):
        assert torch.Tag.cudagraph_unsafe in op.default.tags


def test_device_a_pinned_block_is_exactly_its_tensors_size(monkeypatch) -> None:
    """`pin_memory=True` rounds each block up to a power of two (a budget of snapshots could be
    exceeded twice over): one registered block of exactly the tensors' size instead."""
    calls: list[tuple] = []
    monkeypatch.setattr(pinned, "_register", lambda ptr, size: calls.append(("pin", size)) or True)
    monkeypatch.setattr(pinned, "_unregister", lambda ptr: calls.append(("unpin",)))
    like = {"w": torch.ones(1500), "b": torch.ones(3, 5, dtype=torch.bfloat16)}
    block = pinned.HostBlock(like, pin=True)
    assert calls == [("pin", 6144 + 512)]  # 6,000 and 30 bytes, each to 512: not 8,192
    assert block.tensors["b"].shape == (3, 5) and block.tensors["b"].dtype == torch.bfloat16
    block.tensors["w"].copy_(like["w"])
    assert block.tensors["w"].sum().item() == 1500
    del block
    assert calls[-1] == ("unpin",)


def test_device_a_disk_save_of_a_step_in_flight_keeps_its_copies_ordered(
    monkeypatch, tmp_path
) -> None:
    """A disk checkpoint of the step in flight (read late) on CUDA: its tensors' copies are
    queued on side streams at the save, and the file is written after the step is decided.
    Between the two the loop may ask the tier to wait (a pin, a rollback's search): that must
    not forget the copies, or the next update would overwrite the weights under them. The
    device orders the update after the copies (no host wait), and the writer thread, not the
    loop, waits for them to land before it writes."""
    from spikewatch.trainer.checkpoints import disk as disk_mod
    from spikewatch.trainer.checkpoints import format as ck
    from spikewatch.trainer.checkpoints.staging import Queued, to_host
    from spikewatch.trainer.config import CheckpointConfig

    fake = _FakeCuda()
    fake.install(monkeypatch)
    gpu = torch.device("cuda", 0)
    free, landed = fake.Event(), fake.Event()
    free.record(fake.Stream(gpu))
    landed.record(fake.Stream(gpu))
    monkeypatch.setattr(disk_mod, "has_cuda", lambda files: True)
    monkeypatch.setattr(Queued, "start", lambda self, copies: [(gpu, landed, free)])
    fake.log.clear()
    cfg = CheckpointConfig(interval=10, async_save=True, fsync=False)
    disk = disk_mod.Checkpointer(tmp_path / "checkpoints", cfg)
    w = torch.ones(3)

    def build(stage):  # noqa: ANN001, ANN202
        return ck.Snapshot(step=10, torch_files={"model.pt": to_host({"w": w}, stage)},
                           json_files={"trainer.json": {"step": 10}}, meta={})  # fmt: skip

    disk.save(10, build, awaiting=True)
    disk.pin(10, "anchor")  # the loop waits on the tier in between
    disk.latest()
    assert fake.log == []  # nothing waited for on the host, nothing forgotten yet
    disk.before_mutation()  # the next update
    assert fake.log == [("wait_event", gpu, gpu)]  # the device orders it after the copies
    disk.complete(10, {"lr_scale": 1.0}, {})
    disk.wait()
    assert ("synchronize", gpu) in fake.log  # the writer thread waited for them to land
    assert disk.has(10)


def test_the_maxima_of_an_empty_shard_count_zero() -> None:
    """Under FSDP2 a parameter with fewer rows than ranks has an empty shard on some rank; its
    second moment's maximum counts 0 there (the values are magnitudes), where `_foreach_max`
    refuses an empty tensor and took the step down."""
    from spikewatch.trainer.core.norms import maxima

    xs = [torch.tensor([1.0, 3.0]), torch.empty(0, 4), torch.tensor([[2.0], [0.5]])]
    assert maxima(xs, torch.device("cpu")).tolist() == [3.0, 0.0, 2.0]
