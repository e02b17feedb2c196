"""What the Watch costs the loop thread and the device, counted on a CPU with `meta` as the GPU.

The plain-loop GPT (examples/plain_loop.py) at its "124M" shape (12 x 768, T=1024, B=16; 86M
parameters with the byte vocabulary) or a ~1B shape, on the `meta` device with torch's fused
AdamW, through the Watch with its GPU defaults (the step's values read one step late, the fused
max pass, host-memory snapshots, disk checkpoints written by a thread), over enough steps that
every cadence fires. `meta` stands in for the device: every op dispatches (the host pays what
it pays before a GPU's kernels run) but computes nothing; a read of a device value (`.item`,
`.tolist`, a copy to the host) returns ones and is counted.

Per step and per event (a state-statistics step, a host-memory snapshot, a disk checkpoint, a
rollback's decision), against the same loop without spikewatch:
- host ms on the loop thread inside spikewatch (its methods timed, the optimizer's own update
  and one zero_grad subtracted): mean, p99, max;
- waits: a host read of a device value before its copy is due (`.item`, `.tolist`, a blocking
  copy); the step's one transfer read one step late is due (on a GPU its copy has landed);
- kernels spikewatch adds, with CUDA's fan-out (a foreach norm of an order without a fused
  kernel launches one per tensor; a `cat` of strided inputs one copy per input);
- FLOPs (`FlopCounterMode`, with a formula for spikewatch's fused max op) and bytes read and
  written, each over the bare step's own;
- a predicted H200 ratio: bare / (bare + r * host + waits * t_wait + flops / P + bytes / BW),
  with r and t_wait fitted on the 2026-12-04 H200 run's per-part figures, and its error there.

    python benchmarks/host_cost.py                # 124M, 120 steps; table, then one JSON line
    python benchmarks/host_cost.py --shape 1b
    python benchmarks/host_cost.py --smoke        # a tiny shape, seconds (the test suite's)
    python benchmarks/host_cost.py --pauses --steps 10000   # a long run's pauses, ~12 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spikewatch import Watch  # noqa: E402
from spikewatch.trainer.checkpoints.memory import MemoryTier  # noqa: E402
from spikewatch.trainer.checkpoints.tiers import Tiers  # noqa: E402
from spikewatch.trainer.core.actions import Action, Continue, Rollback  # noqa: E402
from spikewatch.trainer.core.callbacks import Callback, StepState  # noqa: E402
from spikewatch.trainer.core.probes import Probes  # noqa: E402
from spikewatch.trainer.core.transfer import HostTransfer, clip_by_global_norm  # noqa: E402
from spikewatch.trainer.model import attention  # noqa: E402
from spikewatch.trainer.model.attn_max import AttnMax  # noqa: E402

SHAPES = {  # (d, layers, heads, T, B)
    "124m": (768, 12, 12, 1024, 16),
    "1b": (2048, 16, 16, 1024, 8),
    "smoke": (64, 2, 2, 64, 2),
}
META = torch.device("meta")
aten = torch.ops.aten

# -- H200 and the 2026-12-04 run (docs/figures.md, run 2) ----------------------------------------
H200_BF16_FLOPS = 989e12 * 0.6  # dense bf16 at a realistic efficiency
H200_HBM = 4.8e12 * 0.8  # bytes/s at a realistic efficiency
BARE_124M_MS = 28.2  # the compiled 124M plain loop, bare
RUN2_PARTS_MS = {"grad norms and base": 1.2, "maxima": 5.2, "state": 3.7, "memory tier": 6.6}


# -- meta as the device ---------------------------------------------------------------------------
class MetaDevice:
    """Reads of `meta` values return ones and are counted; a copy to the host is a wait unless
    it is due (the step's transfer read one step late, whose copy a GPU has landed by then)."""

    def __init__(self) -> None:
        self.waits: Counter[str] = Counter()
        self.due_reads = 0
        self.background_bytes = 0  # copies to the host made off the loop thread
        self.due = False
        self.step = 0  # the loop's step (the harness sets it)
        self._lib: Any = None
        self._main = threading.main_thread()

    def __enter__(self) -> MetaDevice:
        self._lib = torch.library.Library("aten", "IMPL")
        self._lib.impl("_local_scalar_dense", self._item, "Meta")
        self._lib.impl("copy_", self._copy, "Meta")
        # one multi-tensor launch on a GPU: one call here (meta's own runs a copy_ a tensor)
        self._lib.impl("_foreach_copy_", self._foreach_copy, "Meta")
        return self

    def __exit__(self, *exc: object) -> None:
        self._lib._destroy()
        self._lib = None

    def _item(self, x: torch.Tensor) -> Any:
        self.waits["item"] += 1
        return 1.0 if x.dtype.is_floating_point else (True if x.dtype == torch.bool else 1)

    def _foreach_copy(
        self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool = False
    ) -> None:
        return None

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> Any:
        if dst.device.type == "cpu" and src.device.type == "meta":
            if threading.current_thread() is not self._main or non_blocking:
                # queued (a side stream's DMA into pinned memory) or off the loop: no wait
                self.background_bytes += src.numel() * src.element_size()
            elif self.due:
                self.due_reads += 1
            else:
                self.waits["to_host"] += 1
            if dst.numel() <= 65536:
                dst.fill_(1)
        return dst


class StandInStream:
    """A CUDA stream on meta: what is queued on it runs at once (meta runs nothing)."""

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None


class StandInEvent:
    """A CUDA event on meta. The host waiting for it on the loop thread is a wait unless it
    was recorded in an earlier step (a snapshot's copy evicted steps later; the step's
    transfer, read one step late: on a GPU they have landed by then) or the read is due."""

    def __init__(self, dev: MetaDevice, step: int) -> None:
        self.dev, self.step = dev, step

    def synchronize(self) -> None:
        if threading.current_thread() is not self.dev._main:
            return
        if self.dev.due or self.step < self.dev.step:
            self.dev.due_reads += 1
        else:
            self.dev.waits["event"] += 1


def meta_as_cuda(dev: MetaDevice, patch: Callable[[Any, str, Any], None]) -> None:
    """`meta` takes spikewatch's CUDA paths (trainer/core/streams.py): side streams, events,
    the step's transfer into a host buffer, the memory tier's staged copy of a snapshot into
    a host block (registration as pinning is the only part left out: a GPU host's one-off)."""
    from spikewatch.trainer.checkpoints import pinned
    from spikewatch.trainer.core import streams

    stream = StandInStream()
    patch(streams, "is_cuda", lambda t: t.device.type in ("cuda", "meta"))
    patch(streams, "new_stream", lambda device: stream)
    patch(streams, "current_stream", lambda device: stream)
    patch(streams, "record_event", lambda device, s=None: StandInEvent(dev, dev.step))
    if hasattr(streams, "timing_event"):  # (the code before round 14 has none: A B runs)
        patch(streams, "timing_event", lambda device, s=None: StandInEvent(dev, dev.step))
        patch(streams, "seconds_between", lambda a, b: None)  # meta times nothing: by chunks
        patch(streams, "keep_until_done", lambda t, s: None)
    patch(streams, "on", lambda s: contextlib.nullcontext())
    patch(streams, "free_bytes", lambda device: 1 << 40)  # room to stage on the device
    patch(streams, "host_buffer", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    patch(pinned, "_register", lambda ptr, size: True)
    patch(pinned, "_unregister", lambda ptr: None)


@contextlib.contextmanager
def fused_adamw_on_meta() -> Iterator[None]:
    """torch's fused AdamW (the GPU's) accepts `meta` parameters (its kernel has a meta form)."""
    import torch.optim.adam as adam
    import torch.optim.adamw as adamw
    import torch.optim.optimizer as optimizer

    saved = optimizer._device_dtype_check_for_fused

    def check(p: torch.Tensor, cuda_unsupported: bool = False) -> None:
        if p.device.type != "meta":
            saved(p, cuda_unsupported)

    mods = [m for m in (optimizer, adam, adamw) if hasattr(m, "_device_dtype_check_for_fused")]
    for m in mods:
        m._device_dtype_check_for_fused = check  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m in mods:
            m._device_dtype_check_for_fused = saved  # type: ignore[attr-defined]


def fused_max_on_meta(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor | None:
    """`attention.fused_max` as it runs on a GPU: the eligibility check, then the custom op
    (its fake on meta)."""
    from spikewatch.trainer.model.kernels.max_logits import refusal

    why = refusal(q, k, mask)
    if why is not None and not why.startswith("it runs on CUDA"):
        return None
    scale = q.size(-1) ** -0.5 if scale is None else float(scale)
    return torch.ops.spikewatch.fused_max_logits(q.detach(), k.detach(), causal, scale)


def fused_heads_on_meta(
    out: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor | None:
    """`attention.fused_heads_into` as it runs on a GPU: the check, then the mutating op."""
    from spikewatch.trainer.model.kernels.max_logits import refusal

    why = refusal(q, k, mask)
    if why is not None and not why.startswith("it runs on CUDA"):
        return None
    if out is None:
        out = torch.full((q.size(1),), float("-inf"), device=q.device, dtype=torch.float32)
    scale = q.size(-1) ** -0.5 if scale is None else float(scale)
    torch.ops.spikewatch.fused_head_max_(out, q.detach(), k.detach(), causal, scale)
    return out


def fused_table_refusal_on_meta(
    table: torch.Tensor, q: torch.Tensor, k: torch.Tensor, layer: int
) -> str | None:
    """`attention.fused_table_refusal` as it runs on a GPU: meta stands in for CUDA."""
    from spikewatch.trainer.model.kernels.max_logits import table_refusal

    why = table_refusal(table, q, k, layer)
    return None if why is not None and why.startswith("it runs on CUDA") else why


class KernelStandIn:
    """The fused max kernel as `_launch` launches it in eager code on a GPU, on meta: the
    launch (Triton's launcher from Python, a fixed host cost on a GPU: `t_launch` in the
    prediction) is recorded rather than run; its FLOPs and bytes are counted from the shapes."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[int, ...], int, bool]] = []  # (q shape, keys, causal)

    def __getitem__(self, grid: Any) -> Any:
        def launch(q: torch.Tensor, k: torch.Tensor, *args: Any, **kw: Any) -> None:
            self.launches.append((tuple(q.shape), k.size(2), bool(kw["CAUSAL"])))

        return launch

    def take(self) -> tuple[int, int, int]:
        """(launches, FLOPs, bytes) since the last take."""
        out = self.launches
        self.launches = []
        flops = sum(2 * b * h * d * _causal_pairs(t, s, c) for (b, h, t, d), s, c in out)
        nbytes = sum(2 * 2 * b * h * t * d for (b, h, t, d), _s, _c in out)  # q and k, bf16
        return len(out), flops, nbytes


class StateKernelStandIn:
    """The probes' one-pass Adam statistics kernel (trainer/model/kernels/adam_state.py) on
    meta: its launch from Python recorded, its bytes counted (p, m and v read once, fp32)."""

    def __init__(self) -> None:
        self.launches = 0
        self.elements = 0

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kw: Any) -> None:
            self.launches += 1

        return launch

    def take(self, n_params: int) -> tuple[int, int]:
        """(launches, bytes) since the last take."""
        out, self.launches = self.launches, 0
        return out, out * 3 * 4 * n_params


def _causal_pairs(t: int, s: int, causal: bool) -> int:
    """Query-key pairs the max kernel computes on a GPU (bf16 tiles of 128 x 64): causal, a
    query block stops at the key block holding its last row (56% of the square at T = 1024)."""
    if not causal:
        return t * s
    bm, bn = 128, 64
    pairs = 0
    for m in range(math.ceil(t / bm)):
        rows = min(bm, t - m * bm)
        keys = min(math.ceil(min((m + 1) * bm, s) / bn) * bn, s)
        pairs += rows * keys
    return pairs


def _register_flops() -> None:
    from torch.utils.flop_counter import flop_registry

    from spikewatch.trainer.model.kernels import max_logits as _k  # noqa: F401  (the op)

    if torch.ops.spikewatch.head_max_table_ in flop_registry:  # this file loaded once before
        return

    def flops(q_shape: Any, k_shape: Any, causal: bool) -> int:
        b, h, t, d = q_shape
        return 2 * b * h * d * _causal_pairs(t, k_shape[2], causal)

    @register_flop_formula(torch.ops.spikewatch.fused_max_logits)
    def _fused_max_flops(q, k, causal, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
        return flops(q, k, causal)

    @register_flop_formula(torch.ops.spikewatch.fused_head_max_)
    def _fused_heads_flops(out, q, k, causal, *args, out_shape=None, **kw) -> int:  # noqa: ANN001
        return flops(q, k, causal)

    @register_flop_formula(torch.ops.spikewatch.head_max_table_)
    def _table_flops(table, q, k, layer, causal, *args, out_shape=None, **kw) -> int:  # noqa: ANN001
        return flops(q, k, causal)


_register_flops()


# -- counting kernels, FLOPs and bytes ----------------------------------------------------------
# spikewatch's ops launched through Triton's Python launcher (a fixed host cost each on a GPU)
TRITON_FROM_PYTHON = {"fused_max_logits", "fused_head_max_", "head_max_table_"}
_NO_KERNEL = {
    *("empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "detach"),
    # the profiler's markers (an optimizer's step is wrapped in one): no device work
    *("_record_function_enter_new", "_record_function_exit", "_record_function_enter"),
}
_FUSED_ORDS = (1, 2, math.inf, -math.inf)


def kernels_of(func: Any, args: tuple, kwargs: dict) -> int:
    """Kernels an aten op launches on CUDA: one, or its fan-out."""
    name = func.overloadpacket.__name__
    if func.is_view or name in _NO_KERNEL or name == "_local_scalar_dense":
        return 0
    if name == "_foreach_norm":
        ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        ord_ = float(ord_) if not torch.is_tensor(ord_) else 2.0
        return 1 if ord_ in _FUSED_ORDS else len(args[0])
    if name == "cat":
        strided = sum(1 for t in args[0] if torch.is_tensor(t) and not t.is_contiguous())
        return 1 + strided
    return 1


def _nbytes(x: Any) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, list | tuple):
        return sum(_nbytes(t) for t in x)
    return 0


class Count(TorchDispatchMode):
    """Kernels (with fan-out) and bytes read and written by the ops dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0
        self.bytes = 0
        self.triton = 0  # spikewatch's Triton launches (a fixed host cost each on a GPU)
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        k = kernels_of(func, args, kwargs)
        if func.namespace == "spikewatch" and func.overloadpacket.__name__ in TRITON_FROM_PYTHON:
            self.triton += 1
        if k:
            self.kernels += k
            self.by_op[func.overloadpacket.__name__] += k
            self.bytes += _nbytes(args) + _nbytes(list(kwargs.values())) + _nbytes(out)
        return out


# -- timing spikewatch on the loop thread -------------------------------------------------------
class Clock:
    """Exclusive time by part: spikewatch's methods, wrapped; nested parts charge their own.
    Calls on the thread that made the clock (the loop's) only: a checkpoint's writer thread
    runs some of the same methods (the disk tier's staging) on its own time."""

    def __init__(self) -> None:
        self.spent: Counter[str] = Counter()
        self._stack: list[list[Any]] = []
        self.calls: Counter[str] = Counter()
        self.thread = threading.get_ident()

    def wrap(self, owner: Any, name: str, part: str) -> None:
        fn = getattr(owner, name)
        clock = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != clock.thread:
                return fn(*args, **kwargs)
            now = time.perf_counter()
            if clock._stack:
                top = clock._stack[-1]
                clock.spent[top[0]] += now - top[1]
            clock._stack.append([part, now])
            clock.calls[part] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                p, t0 = clock._stack.pop()
                clock.spent[p] += end - t0
                if clock._stack:
                    clock._stack[-1][1] = end

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        setattr(owner, name, timed)

    def take(self) -> Counter[str]:
        out, self.spent = self.spent, Counter()
        return out


@dataclass
class StepRow:
    step: int
    host_ms: float
    parts: dict[str, float]
    waits: int
    events: set[str] = field(default_factory=set)
    kernels: int = 0
    bytes: int = 0
    flops: int = 0
    triton: int = 0
    table: int = 0
    state_launches: int = 0
    by_op: Counter[str] = field(default_factory=Counter)


class DecideAt(Callback):
    """A rollback's decision at chosen steps, to the newest snapshot before it (as a spike's
    would be, as far as the loop can tell); decided after the update (the device path)."""

    def __init__(self, at: set[int]) -> None:
        self.at = at
        self.core: Any = None

    def on_step(self, state: StepState) -> Action:
        if state.step not in self.at:
            return Continue()
        kept = [s for s in self.core.checkpointer.memory.steps() if s < state.step]
        return Rollback(to_step=max(kept, default=0), reason="host-cost: a decision")


def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location("plain_loop", REPO / "examples/plain_loop.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(shape: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, tuple[int, int]]:
    d, layers, heads, t, b = SHAPES[shape]
    ex = _load_example()
    with torch.device("meta"):
        model = ex.GPT(d, layers, heads, t)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    return model, opt, (b, t)


def bare_step(model: Any, opt: Any, b: int, t: int) -> None:
    """The loop without spikewatch: forward, backward, clip (the Watch clips for the user),
    the update."""
    x = torch.empty(b, t, dtype=torch.long, device=META)
    loss = model(x, x)
    loss.backward()
    clip_by_global_norm(list(model.parameters()), 1.0)  # clip_grad_norm_'s foreach arithmetic
    opt.step()
    opt.zero_grad(set_to_none=True)


class Harness:
    """The Watch's loop on meta, each step's host time, waits and events recorded."""

    def __init__(self, shape: str, steps: int, *, disk: bool, settings: dict | None = None,
                 rollback_at: tuple[int, ...] = (), detail: bool = False) -> None:  # fmt: skip
        self.shape, self.steps, self.detail = shape, steps, detail
        self.model, self.opt, (self.b, self.t) = build(shape)
        self.dev = MetaDevice()
        self.clock = Clock()
        self.rows: list[StepRow] = []
        self.step = 0
        self._events: set[str] = set()
        self.rollback_at = set(rollback_at)
        self.kernel = KernelStandIn()
        self.state_kernel = StateKernelStandIn()
        ck: dict[str, Any] = {"interval": 100 if disk else None}
        base = {"probes": {"read": "next_step"}, "checkpoint": ck}
        self.settings = _merge(base, settings or {})
        self.tmp = tempfile.TemporaryDirectory(prefix="host-cost-")
        self.after_step: Any = None  # called with the step's row, once it is recorded

    # patched for the run only
    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        saved: list[tuple[Any, str, Any]] = []

        def patch(owner: Any, name: str, value: Any) -> None:
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

        harness = self
        start, fetch = HostTransfer.start, HostTransfer.fetch

        def start_(xfer: HostTransfer) -> None:
            xfer._bench_step = harness.step  # type: ignore[attr-defined]
            xfer._bench_waits = sum(harness.dev.waits.values())  # type: ignore[attr-defined]
            start(xfer)

        def fetch_(xfer: HostTransfer) -> Any:
            # due: started in an earlier step, or before a wait (a wait is for everything
            # enqueued before it, this copy too)
            earlier = getattr(xfer, "_bench_step", harness.step) < harness.step
            waited = getattr(xfer, "_bench_waits", 1 << 62) < sum(harness.dev.waits.values())
            harness.dev.due = earlier or waited
            try:
                return fetch(xfer)
            finally:
                harness.dev.due = False

        patch(HostTransfer, "start", start_)
        patch(HostTransfer, "fetch", fetch_)
        meta_as_cuda(self.dev, patch)
        patch(attention, "fused_max", fused_max_on_meta)
        patch(attention, "fused_heads_into", fused_heads_on_meta)
        patch(attention, "fused_table_refusal", fused_table_refusal_on_meta)
        from spikewatch.trainer.model.kernels import max_logits as mx_kernels

        patch(mx_kernels, "_max_kernel", self.kernel)
        from spikewatch.trainer.core import probes as probes_mod
        from spikewatch.trainer.model.kernels import adam_state

        patch(probes_mod, "ONE_PASS_OFF_GPU", True)  # meta stands in for CUDA
        patch(adam_state, "_adam_state_kernel", self.state_kernel)
        tiers_save = Tiers.save

        def save_(tiers: Tiers, step: int, build: Any, which: Any = None, **kw: Any) -> Any:
            out = tiers_save(tiers, step, build, which, **kw)
            harness._events.update(out)
            return out

        patch(Tiers, "save", save_)
        wait = MemoryTier.before_mutation

        def before_mutation(tier: MemoryTier) -> float:
            slot = tier._pending
            if slot is not None and not slot.events and not slot.ready.is_set():
                harness.dev.waits["snapshot_join"] += 1
            return wait(tier)

        patch(MemoryTier, "before_mutation", before_mutation)
        init = MemoryTier.__init__

        def init_(tier: MemoryTier, *args: Any, **kw: Any) -> None:
            init(tier, *args, **kw)
            tier.spare_ahead = True  # as on CUDA: the next snapshot's block pinned in a thread

        patch(MemoryTier, "__init__", init_)
        try:
            with fused_adamw_on_meta():
                yield
        finally:
            for owner, name, value in reversed(saved):
                setattr(owner, name, value)

    def run(self, count_every: int = 0) -> list[StepRow]:
        """`count_every`: count kernels, FLOPs and bytes on every step (slow) when 1."""
        with self.patched(), self.dev:
            return self._run(count_every)

    def _run(self, count_every: int) -> list[StepRow]:
        clock = self.clock
        # rebuilt under the patches: fused AdamW's check
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95),
                                     fused=True)  # fmt: skip
        decider = DecideAt(self.rollback_at)
        watch = Watch(self.model, self.opt, db="none", run_dir=self.tmp.name, name="host-cost",
                      max_steps=self.steps, grad_clip=1.0, settings=self.settings,
                      callbacks=[decider])  # fmt: skip
        self.model.use_recorder(watch.attn)
        for owner, name, part in (
            (watch, "begin_step", "base"),
            (watch, "step", "base"),
            (AttnMax, "record_logits", "maxima"),
            (Probes, "before_update", "state"),
            (Probes, "after_update", "state"),
            (Tiers, "save", "checkpoint"),
            (Tiers, "before_mutation", "checkpoint"),
            (MemoryTier, "ahead", "checkpoint"),
        ):
            clock.wrap(owner, name, part)
        if self.detail:  # the base part split by what it does (each charges its own time)
            from spikewatch.trainer.core.guard import SpikeGuard
            from spikewatch.trainer.core.same_step import SameStepGate
            from spikewatch.trainer.core.step_core import StepCore

            for owner, name, part in (
                (SameStepGate, "factor_after", "base:same_step"),
                (SameStepGate, "late_inputs", "base:same_step"),
                (HostTransfer, "add", "base:transfer"),
                (HostTransfer, "add_step", "base:transfer"),
                (HostTransfer, "start", "base:transfer"),
                (HostTransfer, "fetch", "base:transfer"),
                (Probes, "grad_norms", "base:grad_norms"),
                (SpikeGuard, "on_step", "base:guard"),
                (StepCore, "_agree", "base:agree"),
                (StepCore, "_record", "base:record"),
                (StepCore, "_take_read", "base:take_read"),
                (Watch, "_tensors", "base:tensors"),
                (Watch, "_arm_attention", "base:arm"),
                (Watch, "begin_step", "base:begin"),
                (StepCore, "save_if_due", "base:save_if_due"),
                (StepCore, "_emit_update_metrics", "base:emit_update"),
            ):
                clock.wrap(owner, name, part)
            # a checkpoint's step split too: its state built, each tier's own part, the copies
            from spikewatch.trainer.checkpoints.disk import Checkpointer
            from spikewatch.trainer.checkpoints.pinned import SideCopies
            from spikewatch.trainer.checkpoints.staging import Stager
            from spikewatch.trainer.core.restore import Restorer

            for owner, name, part in (
                (Restorer, "snapshot", "checkpoint:build"),
                (MemoryTier, "save", "checkpoint:memory"),
                (Checkpointer, "save", "checkpoint:disk"),
                (Stager, "stage", "checkpoint:stage"),
                (SideCopies, "start", "checkpoint:copies"),
            ):
                clock.wrap(owner, name, part)
        import spikewatch.trainer.watch as watch_mod

        clock.wrap(watch_mod, "clip_by_global_norm", "clip")  # the user's clip: not spikewatch's
        clock.wrap(self.opt, "step", "update")  # the optimizer's own: not spikewatch's
        clock.wrap(self.opt, "zero_grad", "zero_grad")
        zeroed: list[float] = []  # each zero_grad's time this step
        timed_zero = self.opt.zero_grad

        def zero_grad(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return timed_zero(*args, **kwargs)
            finally:
                zeroed.append(time.perf_counter() - t0)

        self.opt.zero_grad = zero_grad  # type: ignore[method-assign]
        watch.open()
        core = watch.core
        assert core is not None
        decider.core = core
        x = torch.empty(self.b, self.t, dtype=torch.long, device=META)
        gc.collect()
        gc.freeze()
        for i in range(self.steps):
            self.step = self.dev.step = i + 1
            self._events = set()
            waits0 = sum(self.dev.waits.values())
            taken = core.step_count + 1
            count = count_every and i % count_every == 0
            modes = (Count(), FlopCounterMode(display=False)) if count else None
            with contextlib.ExitStack() as stack:
                if modes is not None:
                    for m in modes:
                        stack.enter_context(m)
                watch.begin_step(i)
                loss = self.model(x, x)
                loss.backward()
                outcome = watch.step(loss)
            spent = clock.take()
            if core.probes.state_active(taken):  # asked after the step: a state step may move
                self._events.add("state")
            own = sum(v for k, v in spent.items() if k not in BARE_PARTS)
            # the bare loop's own zero_grad is the step's first (it frees the gradients);
            # a second one (the Watch's, over gradients already None) is spikewatch's
            zeros, zeroed[:] = list(zeroed), []
            own += sum(zeros) - (zeros[0] if zeros else 0.0)
            if outcome == "rolled_back":
                self._events.add("decision")
            row = StepRow(
                step=self.step,
                host_ms=1e3 * own,
                parts={k: 1e3 * v for k, v in spent.items()},
                waits=sum(self.dev.waits.values()) - waits0,
                events=set(self._events),
            )
            launched, kflops, kbytes = self.kernel.take()  # the table's, launched directly
            n_params = sum(p.numel() for p in self.model.parameters())
            state_launched, sbytes = self.state_kernel.take(n_params)
            if modes is not None:
                row.kernels = modes[0].kernels + launched + state_launched
                row.bytes = modes[0].bytes + kbytes + sbytes
                row.triton = modes[0].triton + launched + state_launched
                row.by_op = modes[0].by_op
                row.state_launches = state_launched
                row.table = launched
                row.flops = modes[1].get_total_flops() + kflops
            self.rows.append(row)
            if self.after_step is not None:
                self.after_step(row)
        close_t0 = time.perf_counter()
        watch.close()
        self.close_ms = 1e3 * (time.perf_counter() - close_t0)
        gc.unfreeze()
        return self.rows

    def bare_host_ms(self, steps: int = 5) -> float:
        """The bare step's own host time on meta (forward, backward, clip, update), the median
        of `steps` after two: this machine's speed at meta's dispatch, measured in the same
        process, so that host figures from machines of other speeds can be set side by side."""
        with fused_adamw_on_meta():
            model, opt, (b, t) = build(self.shape)
            times = []
            for i in range(steps + 2):
                t0 = time.perf_counter()
                bare_step(model, opt, b, t)
                if i >= 2:
                    times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    def bare_counts(self) -> tuple[int, int, int]:
        """(kernels, bytes, FLOPs) of one bare step."""
        with fused_adamw_on_meta():
            model, opt, (b, t) = build(self.shape)
            bare_step(model, opt, b, t)  # the optimizer's state exists
            with Count() as c, FlopCounterMode(display=False) as f:
                bare_step(model, opt, b, t)
        return c.kernels, c.bytes, f.get_total_flops()


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# -- the figures ------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(math.ceil(q * len(s))) - 1)]


EVENTS = ("state", "memory", "disk", "decision")
BARE_PARTS = ("update", "zero_grad", "clip")  # what the bare loop does too
_HEAVIER = {"state": EVENTS[1:], "memory": EVENTS[2:], "disk": EVENTS[3:], "decision": ()}


def summarise(rows: list[StepRow], skip: int = 2) -> dict[str, Any]:
    """Per step (mean, p99, max) and per event (the mean of steps with it, over plain steps)."""
    rows = [r for r in rows if r.step > skip]  # the first steps build what is built once
    # every cadence (state steps, snapshots, disk checkpoints), not a rollback's decision: an
    # event of its own, which a real run meets rarely and this short one once
    host = [r.host_ms for r in rows if "decision" not in r.events]
    plain = [r.host_ms for r in rows if not r.events]
    base = statistics.median(plain) if plain else 0.0
    per_event = {}
    for ev in EVENTS:  # each step under its weightiest event only
        with_ev = [r for r in rows if ev in r.events and not r.events & set(_HEAVIER[ev])]
        if with_ev:
            per_event[ev] = {
                "steps": len(with_ev),
                "host_ms": statistics.mean(r.host_ms for r in with_ev) - base,
                "max_ms": max(r.host_ms for r in with_ev),
                "waits": statistics.mean(r.waits for r in with_ev),
            }
    snap = [r for r in rows if "memory" in r.events and "disk" not in r.events]
    disk = [r for r in rows if "disk" in r.events and "decision" not in r.events]
    waits_plain = [r.waits for r in rows if not r.events or r.events == {"state"}]
    parts: dict[str, float] = defaultdict(float)
    rows = [r for r in rows if "decision" not in r.events]
    for r in rows:
        for k, v in r.parts.items():
            if k not in BARE_PARTS:
                parts[k] += v / len(rows)
    return {
        "host_ms_per_step": statistics.mean(host),
        "host_ms_p99": pct(host, 0.99),
        "host_ms_max": max(host),
        "host_ms_plain_step": base,
        "max_event_ms": max(
            (r.host_ms for r in rows if r.events and not r.events & {"disk", "decision"}),
            default=base,
        ),
        # compiled: the maxima's launches are the graph's, not the loop thread's Python
        "max_event_ms_compiled": max(
            (
                r.host_ms - r.parts.get("maxima", 0.0)
                for r in rows
                if r.events and not r.events & {"disk", "decision"}
            ),
            default=base,
        ),
        # a disk checkpoint's step on the loop thread (its state built and its copy queued;
        # the write is the writer thread's), apart: the budget's events leave the write out
        "max_disk_event_ms": max(
            (r.host_ms for r in rows if "disk" in r.events and "decision" not in r.events),
            default=0.0,
        ),
        # the disk checkpoint's steps, part by part (with --detail: its build, each tier's own)
        "disk_step_parts_ms": {
            k: round(statistics.mean(r.parts.get(k, 0.0) for r in disk), 3)
            for k in sorted({k for r in disk for k in r.parts})
        },
        "waits_per_step": statistics.mean(waits_plain) if waits_plain else 0.0,
        "waits_per_snapshot": statistics.mean(r.waits for r in snap) if snap else 0.0,
        "events": per_event,
        "parts_ms_per_step": dict(parts),
    }


def predict(host_ms: float, waits: float, triton: float, flops: float, nbytes: float,
            bare_ms: float = BARE_124M_MS, kernels: float = 0.0) -> float:  # fmt: skip
    """The H200's step with the Watch over without, from per-step counts: bare / (bare +
    r * host + triton * t_launch + kernels * t_kernel + waits * t_wait + flops / P + bytes / BW)."""
    c = CALIBRATION
    added = (
        c["r"] * host_ms
        + triton * c["t_launch_ms"]
        + kernels * c["t_kernel_ms"]
        + waits * c["t_wait_ms"]
        + 1e3 * flops / H200_BF16_FLOPS
        + 1e3 * nbytes / H200_HBM
    )
    return bare_ms / (bare_ms + added)


def pin_threads() -> None:
    """The calling (loop) thread on CPU 0, each thread started after this on the other CPUs.
    On a 2-core machine a disk checkpoint's writer (torch.save, CRC-32, fsync) otherwise takes
    the loop's core for a few steps and slows the whole step, the bare loop's own clip and
    update with it; a GPU node's host has cores to spare. What stays shared is the GIL."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs two CPUs at least")
    rest = set(cpus[1:])
    run = threading.Thread.run

    def pinned(self: threading.Thread) -> None:
        os.sched_setaffinity(0, rest)
        run(self)

    threading.Thread.run = pinned  # type: ignore[method-assign]
    os.sched_setaffinity(0, {cpus[0]})


def pauses(steps: int, shape: str = "smoke", durations: str | None = None) -> dict[str, Any]:
    """No pause that grows with the run, on meta: the Watch's loop (every cadence, disk
    checkpoints) over `steps` steps; the longest step of spikewatch's host time, the longest
    full (generation-2) collection and the objects the collector tracks (set-up frozen out, this
    script's own per-step rows left out), over the first tenth and over the whole run. A tiny
    shape: the Watch's own work is the same at any size, and meta's dispatch makes each step
    ~25x a CPU's (10,000 steps take ~12 minutes here). Also: the slowdowns the watchdog told
    of (the run's pace is steady: each is a false alarm), and with `durations` each step's
    wall time written to that file (JSON), for `benchmarks/stalls.py --replay`."""
    import logging

    h = Harness(shape, steps, disk=True)
    told: list[str] = []

    class Told(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("slowdown at step"):
                told.append(record.getMessage())

    watchdog_log = logging.getLogger("spikewatch.trainer.core.watchdog")
    handler = Told(level=logging.WARNING)
    watchdog_log.addHandler(handler)
    walls: list[float] = []
    last = [time.monotonic()]
    tenth = steps // 10
    full: list[tuple[int, float]] = []
    started: list[float] = []
    tracked: dict[str, int] = {}

    def timed(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            full.append((h.step, 1e3 * (time.perf_counter() - started.pop())))

    def after_step(row: StepRow) -> None:
        now = time.monotonic()
        walls.append(now - last[0])
        last[0] = now
        if row.step in (tenth, steps):  # the run's, less this script's own rows (4 a step)
            ours = sum(gc.is_tracked(o) for r in h.rows for o in (r, r.parts, r.events, r.by_op))
            tracked[str(row.step)] = len(gc.get_objects()) - ours

    h.after_step = after_step
    gc.callbacks.append(timed)
    try:
        rows = h.run()
    finally:
        gc.callbacks.remove(timed)
        watchdog_log.removeHandler(handler)
    if durations:
        Path(durations).write_text(json.dumps([round(w, 6) for w in walls]))
    first = [r for r in rows[2:] if r.step <= tenth]

    def longest(rs: list[StepRow]) -> dict[str, Any]:
        top = max(rs, key=lambda r: r.host_ms)
        return {"ms": round(top.host_ms, 2), "step": top.step, "events": sorted(top.events)}

    return {
        "shape": shape,
        "steps": steps,
        "longest_step_first_tenth": longest(first),
        "longest_step_all": longest(rows[2:]),
        "p99_ms_first_tenth": round(pct([r.host_ms for r in first], 0.99), 2),
        "p99_ms_last_tenth": round(pct([r.host_ms for r in rows[-tenth:]], 0.99), 2),
        "full_collections": len(full),
        "longest_full_collection_ms_first_tenth": round(
            max((ms for s, ms in full if s <= tenth), default=0.0), 2
        ),
        "longest_full_collection_ms_all": round(max((ms for _, ms in full), default=0.0), 2),
        "tracked_objects": tracked,
        "slowdowns_told": len(told),
        "step_wall_ms_median": round(1e3 * sorted(walls)[len(walls) // 2], 2) if walls else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="124m")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument(
        "--count-steps", type=int, default=0, help="steps counted for kernels, FLOPs and bytes"
    )
    ap.add_argument("--no-disk", action="store_true", help="no disk checkpoints")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape and 30 steps")
    ap.add_argument("--settings", default="{}", help="Watch settings as JSON, merged")
    ap.add_argument("--detail", action="store_true", help="the base part split by what it does")
    ap.add_argument(
        "--pauses",
        action="store_true",
        help="a long run (--steps, at the smoke shape): does the longest pause grow?",
    )
    ap.add_argument("--durations", help="with --pauses: each step's wall time to this JSON file")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="the loop thread on CPU 0, every other thread (checkpoint writer, copier, sealer, "
        "store) on the rest: a host with cores to spare for them, as a GPU node has",
    )
    args = ap.parse_args(argv)
    if args.pin:
        pin_threads()
    if args.pauses:
        torch.set_num_threads(1)
        out = pauses(args.steps, durations=args.durations)
        print(json.dumps(out))
        return out
    if args.smoke:
        args.shape, args.steps = "smoke", 30
    torch.set_num_threads(1)
    import logging

    logging.basicConfig(level=logging.ERROR)
    settings = json.loads(args.settings)
    print(f"torch {torch.__version__}, shape {args.shape} {SHAPES[args.shape]}, "
          f"{args.steps} steps on meta")  # fmt: skip
    timed = Harness(args.shape, args.steps, disk=not args.no_disk, settings=settings,
                    rollback_at=(args.steps - 5,), detail=args.detail)  # fmt: skip
    timed.run()
    s = summarise(timed.rows)
    # kernels, FLOPs and bytes over one cycle of every cadence (50 steps: 10, 25 and 50 divide
    # it), in a second run (the counting modes cost host time of their own)
    n = args.count_steps or (50 if not args.smoke else 25)
    counted = Harness(args.shape, n, disk=False, settings=settings)
    counted.run(count_every=1)
    crows = [r for r in counted.rows if r.step > 0]
    bare_k, bare_b, bare_f = counted.bare_counts()
    bare_meta_ms = counted.bare_host_ms()
    k = statistics.mean(r.kernels for r in crows) - bare_k
    b = statistics.mean(r.bytes for r in crows) - bare_b
    f = statistics.mean(r.flops for r in crows) - bare_f
    n_params = sum(p.numel() for p in timed.model.parameters())
    triton = statistics.mean(r.triton for r in crows)
    bare_ms = BARE_124M_MS * bare_f / BARE_124M_FLOPS  # the 124M step's time, scaled by FLOPs
    # per step over every cadence; the forced rollback's decision is an event of its own (a
    # real run meets one rarely, this short one once)
    waits_avg = statistics.mean(r_.waits for r_ in timed.rows[2:] if "decision" not in r_.events)
    # eager: every Triton launch from Python; compiled (the 2026-12-04 runs' mode): the
    # recorder's table op is a kernel of the graph (Inductor launches it from its own code,
    # tests/trainer/test_compile.py shows it there), so neither its Python, timed in the
    # `maxima` part, nor a launch from Python stays on the loop thread
    table = statistics.mean(r.table for r in crows)
    others = triton - statistics.mean(r.state_launches for r in crows)  # the maxima's
    by_table = table > 0 and abs(table - others) < 1e-9  # (means of counts: not exact)
    host_compiled = s["host_ms_per_step"] - (s["parts_ms_per_step"].get("maxima", 0.0)
                                             if by_table else 0.0)  # fmt: skip
    pred_eager = predict(s["host_ms_per_step"], waits_avg, triton, f, b, bare_ms, k)
    pred = predict(host_compiled, waits_avg, triton - table, f, b, bare_ms, k)
    ops: Counter[str] = Counter()
    for r_ in crows:
        ops.update(r_.by_op)
    out = {
        "shape": args.shape,
        "parameters": n_params,
        "steps": args.steps,
        "host_ms_per_step": round(s["host_ms_per_step"], 3),
        "host_ms_p99": round(s["host_ms_p99"], 3),
        "host_ms_max": round(s["host_ms_max"], 3),
        "max_event_ms": round(s["max_event_ms"], 3),
        "max_event_ms_compiled": round(
            s["max_event_ms_compiled"] if by_table else s["max_event_ms"], 3
        ),
        "max_disk_event_ms": round(s["max_disk_event_ms"], 3),
        "disk_step_parts_ms": s["disk_step_parts_ms"],
        "pinned": args.pin,
        "waits_per_step": round(s["waits_per_step"], 3),
        "waits_per_snapshot": round(s["waits_per_snapshot"], 3),
        "waits_by_kind": dict(timed.dev.waits),
        "kernels_per_step": round(k, 1),
        "flops_ratio": round(f / bare_f, 5),
        "bytes_ratio": round(b / bare_b, 5),
        "predicted_h200_ratio": round(pred, 4),
        "predicted_h200_ratio_eager": round(pred_eager, 4),
        "host_ms_per_step_compiled": round(host_compiled, 3),
        # this machine's speed: the bare step's own host time on meta; the host figures over it
        "bare_meta_ms": round(bare_meta_ms, 1),
        "host_per_bare_meta": round(s["host_ms_per_step"] / bare_meta_ms, 5),
        "host_per_bare_meta_compiled": round(host_compiled / bare_meta_ms, 5),
        "events": {ev: {kk: round(v, 3) for kk, v in d.items()} for ev, d in s["events"].items()},
        "parts_ms_per_step": {kk: round(v, 3) for kk, v in s["parts_ms_per_step"].items()},
        "close_ms": round(timed.close_ms, 1),
        "triton_launches_per_step": round(triton, 2),
        "table_launches_per_step": round(table, 2),
        "waits_per_step_all_events": round(waits_avg, 4),
        "watched_kernels_by_op": {op: round(c / len(crows), 1) for op, c in ops.most_common(12)},
    }
    print("| figure | value |")
    print("|---|---:|")
    for key in ("host_ms_per_step", "host_ms_p99", "host_ms_max", "max_event_ms",
                "max_event_ms_compiled", "max_disk_event_ms",
                "waits_per_step", "waits_per_snapshot", "kernels_per_step", "flops_ratio",
                "bytes_ratio", "predicted_h200_ratio", "predicted_h200_ratio_eager",
                "host_ms_per_step_compiled", "bare_meta_ms"):  # fmt: skip
        print(f"| {key} | {out[key]} |")
    for ev, d in out["events"].items():
        print(f"| event {ev} | +{d['host_ms']:.2f} ms host (max {d['max_ms']:.2f}), "
              f"{d['waits']:.2f} waits, {d['steps']} steps |")  # fmt: skip
    print(json.dumps(out))
    return out


# The constants of `predict`, from the H200 runs of 2026-12-04 (docs/figures.md; the derivation
# is in docs/host_cost.md):
# - r: the H200 host's time per host ms on this machine's meta: the Watch's gate + conclude took
#   3.2 ms there, and 28 ms here on meta (this script's "base" part on the code of that run);
# - t_launch_ms: a Triton launch's fixed cost from Python (the fused max pass: 0.22 / 0.23 ms at
#   D = 64 / 128 for twice the FLOPs, ~0.055 ms of it the GPU's work a layer at this shape);
# - t_wait_ms: one host wait (a drain: the GPU idles while the host catches up): the memory
#   tier cost 165 ms a snapshot in run 2, whose snapshot made 1.4 waits (this script, that code).
# - t_kernel_ms: a small kernel's cost on the device beyond its bytes and FLOPs (its launch
#   latency and tail, ~3-5 us on a fed H100/H200), for each kernel spikewatch adds: assumed,
#   not fitted (the runs give no per-kernel figure).
CALIBRATION = {"r": 3.2 / 28.0, "t_launch_ms": 0.19, "t_wait_ms": 165.0 / 1.4, "t_kernel_ms": 0.004}
BARE_124M_FLOPS = 3 * 2 * 86.2e6 * 16 * 1024 * 1.17  # ~10.2 TFLOP a step (review), for scaling


if __name__ == "__main__":
    main()
