"""The host-memory tier: rollback targets in RAM, so that a rollback never waits on disk.

Per rank, each snapshot is a copy of this rank's own tensors (its parameters and buffers, and its
optimizer state: whole replicas under DDP, its shards under FSDP2) in host buffers, plus the
small state a checkpoint's JSON and RNG files hold. The copy is asynchronous: on CUDA it is
queued on a side stream into pinned buffers, on a CPU a background thread makes it; the loop
only waits (`before_mutation`) if the optimizer is about to change the weights before the copy
is done, which on any step longer than the copy never happens. A restore copies the buffers
back into the live tensors, in place; no collective, no planning, no file.

Why not torch.distributed.checkpoint's `get_state_dict(cpu_offload=True)` here: it gathers or
reshards for another world size, which a tier that lives and dies with this process never
needs; in-place copies of each rank's own tensors are the cheapest correct copy. Disk
checkpoints (trainer/checkpoints/disk.py, sharded.py) keep DCP for crashes and resharding.

Retention is the disk tier's exponential rule (retention.py) within a byte budget: the newest
`keep_last`, then one per power-of-two age bucket, pins first; when the budget holds fewer
snapshots than that, the oldest unpinned go first, then the oldest pinned (the disk tier may
still hold them). Buffers of evicted snapshots are reused, so memory is mapped once.
"""

from __future__ import annotations

import copy
import io
import logging
import math
import operator
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from spikewatch.observatory.retention import keep
from spikewatch.trainer.checkpoints.format import CheckpointError, Snapshot
from spikewatch.trainer.checkpoints.pinned import (
    BlockLayout,
    Events,
    HostBlock,
    SideCopies,
    device_wait,
    host_wait,
)
from spikewatch.trainer.checkpoints.worker import worker
from spikewatch.trainer.core import streams
from spikewatch.trainer.core.state import split_optimizer
from spikewatch.trainer.core.world import local, say

__all__ = ["Lent", "MemoryTier", "default_budget_bytes", "snapshot_bytes"]

log = logging.getLogger(__name__)

_HEAVY = {"model.pt", "optimizer.pt", "optimizer.1.pt"}  # copied from the live tensors instead


def _live_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[Any]:
    """This rank's own tensors in a fixed order: parameters, buffers, then each parameter's
    optimizer state tensors (by key). Yields (key, tensor)."""
    for name, p in model.named_parameters():
        yield f"p/{name}", local(p).detach()
    for name, b in model.named_buffers():
        yield f"b/{name}", local(b).detach()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in sorted(optimizer.state.get(p, {}).items()):
            if torch.is_tensor(v):
                yield f"o/{i}/{k}", local(v).detach()


class _Plan:
    """Which live tensors a snapshot copies, and under which keys: found by one walk of the
    model and the optimizer (`_live_tensors`'s order and keys), then read at each snapshot
    through the dicts that hold them (a module's `_parameters` / `_buffers`, a parameter's
    optimizer state), so that a tensor replaced in place of another (`param.data = ...` keeps the
    Parameter; a buffer or state entry reassigned) is the one copied, with no walk. Made again
    when the optimizer's state appears or is replaced (`load_state_dict`) or a shape changes."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        refs: list[tuple[str, dict[str, Any], str]] = []
        seen: set[int] = set()
        for kind, attr in (("p", "_parameters"), ("b", "_buffers")):
            seen.clear()
            for prefix, mod in model.named_modules():
                for name, t in getattr(mod, attr).items():
                    if t is None or id(t) in seen:
                        continue
                    seen.add(id(t))
                    refs.append(
                        (f"{kind}/{prefix + '.' if prefix else ''}{name}", getattr(mod, attr), name)
                    )
        params = [p for g in optimizer.param_groups for p in g["params"]]
        # the optimizer's non-tensor state (a step count kept as a number), read through its
        # dicts at each snapshot like the tensors: no walk of every parameter's state there
        self.other: list[tuple[int, dict[str, Any], str]] = []
        self.stateful = [p for p in params if optimizer.state.get(p) is not None]
        self.states = [optimizer.state[p] for p in self.stateful]
        self.state_sizes = [len(st) for st in self.states]
        for i, p in enumerate(params):
            st = optimizer.state.get(p, {})
            for k, v in sorted(st.items()):
                if torch.is_tensor(v):
                    refs.append((f"o/{i}/{k}", st, k))
                else:
                    self.other.append((i, st, k))
        # DTensors (FSDP2) are copied by their local shards; else each tensor as it is
        self.sharded = any(isinstance(holder[name], DTensor) for _, holder, name in refs)

        # grouped by device, in order of first appearance (the host-memory copy moves each
        # device's tensors as one run of the block: SideCopies.start_block)
        def where(t: torch.Tensor) -> tuple[bool, torch.device]:
            t = local(t)
            return streams.is_cuda(t), t.device

        first: dict[tuple[bool, torch.device], int] = {}
        for _, holder, name in refs:
            first.setdefault(where(holder[name]), len(first))
        refs.sort(key=lambda r: first[where(r[1][r[2]])])
        self.refs = refs
        self.keys = tuple(k for k, _, _ in refs)
        self.state_of = optimizer.state  # replaced by the optimizer's load_state_dict
        self.n_state = len(optimizer.state)
        live = self.live()
        self.shapes = list(map(torch.Tensor.size, live.values()))
        self.dtypes = list(map(_dtype, live.values()))
        self.signature = tuple(zip(self.shapes, self.dtypes, strict=True))
        self.layout = BlockLayout(live)  # a snapshot's host block, laid out once
        self.need = sum(self.layout.sizes)
        self.files = None if self.sharded else _FileShape.of(model, optimizer, refs)

    def live(self) -> dict[str, torch.Tensor]:
        """The tensors as they are (parameters not detached: the copies run without grad),
        with no dispatch a tensor (a `detach` each was ~0.6 ms a snapshot of meta at 124M)."""
        if self.sharded:
            return {key: local(holder[name]) for key, holder, name in self.refs}
        return {key: holder[name] for key, holder, name in self.refs}

    def fits(self, optimizer: torch.optim.Optimizer, live: dict[str, torch.Tensor]) -> bool:
        """The plan still holds for the tensors as they are (`live`, read through it): the
        optimizer's state neither replaced nor grown (no parameter's state dict replaced, none
        that gained or lost an entry), and every tensor of the shape and dtype planned."""
        return (
            optimizer.state is self.state_of
            and len(optimizer.state) == self.n_state
            and all(map(operator.is_, map(optimizer.state.get, self.stateful), self.states))
            and list(map(len, self.states)) == self.state_sizes
            and list(map(torch.Tensor.size, live.values())) == self.shapes
            and list(map(_dtype, live.values())) == self.dtypes
        )

    def other_state(self) -> dict[int, dict[str, Any]]:
        """The optimizer's non-tensor state (a step count kept as a number) by parameter
        index, as the snapshot holds it."""
        out: dict[int, dict[str, Any]] = {}
        for i, st, k in self.other:
            out.setdefault(i, {})[k] = st[k]
        return out


class _FileShape:
    """How a snapshot's buffers make the model's and the optimizer's state dicts as a disk
    checkpoint holds them (`Lent`): each state-dict key's buffer key, the optimizer's groups'
    sizes and its state's order and keys, found once per plan. None (`of`) where a state dict
    holds what the plan does not copy (a module's extra state, a hook's tensor) or is made
    another way (an optimizer's or a module's own `state_dict`, state-dict hooks; the built-in
    trainer's AdamW keeps its step counts as numbers and saves them as tensors): the disk tier
    builds its own then."""

    def __init__(
        self,
        model_keys: list[tuple[str, str]],
        group_sizes: list[int],
        state: list[tuple[int, list[str]]],
    ) -> None:
        self.model_keys = model_keys
        self.group_sizes = group_sizes
        self.state = state  # (parameter index, its tensor keys), in the optimizer's order

    @classmethod
    def of(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        refs: list[tuple[str, dict[str, Any], str]],
    ) -> _FileShape | None:
        if (
            type(optimizer).state_dict is not torch.optim.Optimizer.state_dict  # its own format
            or optimizer._optimizer_state_dict_pre_hooks
            or optimizer._optimizer_state_dict_post_hooks
            or any(type(m).state_dict is not torch.nn.Module.state_dict for m in model.modules())
        ):
            return None
        by_id = {id(holder[name]): key for key, holder, name in refs if key[0] in "pb"}
        model_keys = []
        for k, v in model.state_dict(keep_vars=True).items():
            if not torch.is_tensor(v) or id(v) not in by_id:
                return None
            model_keys.append((k, by_id[id(v)]))
        params = [p for g in optimizer.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        if len(index) != len(params):  # a parameter in two groups: torch's own packing differs
            return None
        state = []
        for p, st in optimizer.state.items():
            if not torch.is_tensor(p) or id(p) not in index:
                return None
            state.append((index[id(p)], [k for k, v in st.items() if torch.is_tensor(v)]))
        sizes = [len(g["params"]) for g in optimizer.param_groups]
        return cls(model_keys, sizes, state)

    def state_dicts(
        self,
        buffers: Mapping[str, torch.Tensor],
        other: dict[int, dict[str, Any]],
        groups: list[dict[str, Any]],
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(the model's state dict, the optimizer's) over `buffers`, as `state_dict()` gives
        them: the optimizer's parameters by index, its groups' hyperparameters as saved."""
        model = {k: buffers[key] for k, key in self.model_keys}
        state = {
            i: {**{k: buffers[f"o/{i}/{k}"] for k in keys}, **other.get(i, {})}
            for i, keys in self.state
        }
        packed, start = [], 0
        for g, n in zip(groups, self.group_sizes, strict=True):
            packed.append({**g, "params": list(range(start, start + n))})
            start += n
        return model, {"state": state, "param_groups": packed}


def snapshot_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes one snapshot of this rank's tensors takes (with the optimizer state as it is now;
    Adam's moments exist after its first step)."""
    return sum(t.numel() * t.element_size() for _, t in _live_tensors(model, optimizer))


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass
class _Slot:
    step: int
    buffers: Mapping[str, torch.Tensor]
    # everything but the tensors, pickled (`_pack`): the JSON files, meta, the RNG and
    # scheduler objects, the non-tensor optimizer state, the optimizer's hyperparameters. One
    # bytes object, which the garbage collector does not walk: a snapshot's ~850 JSON objects
    # kept live made each full collection longer as retention kept more snapshots
    packed: bytes | tuple[Any, ...]
    pins: set[str] = field(default_factory=set)
    # taken while its step was still on the device (read one step late): not a rollback
    # target until that step is decided (`complete`), dropped if it is refused (`drop`)
    awaiting: bool = False
    # what `complete` filled in (the state as decided: trainer.json's parts, meta), kept
    # beside `packed` rather than packed again with it
    decided: bytes | Any = None
    ready: threading.Event = field(default_factory=threading.Event)
    events: Events = field(default_factory=list)  # CUDA: the side-stream copies' events
    nbytes: int = 0
    # the block's sums once it has landed (`block_sums`, off the loop thread); `sealed` is set
    # when they are taken (None: they could not be)
    checksum: torch.Tensor | None = None
    sealed: threading.Event = field(default_factory=threading.Event)
    # cleared while the disk tier copies the snapshot for a file (`Lent`): its buffers are
    # not reused until then
    unheld: threading.Event = field(default_factory=_set_event)


# interval "auto" (CheckFreq, Mohan et al., FAST '21): a snapshot every k steps, k the fewest
# that keeps its measured cost to the loop within AUTO_BUDGET of the step time, between
# AUTO_STEPS[0] and AUTO_STEPS[1] (the upper bound: how far back a rollback's newest target
# may lie, as the fixed default had it). On a GPU only: on a CPU the copy is the loop's own
# memory traffic and the fixed AUTO_STEPS[1] holds (tests set AUTO_OFF_GPU).
AUTO_BUDGET = 0.005
AUTO_STEPS = (5, 25)
AUTO_OFF_GPU = False

# Staging on the device (SideCopies): a snapshot's copy to the host hides in the next forward
# and backward when it takes less than STAGE_HIDES of a step (measured: CUDA events around
# the copy, the loop's own step time). Then the sources go through a STAGE_CHUNK buffer
# (the update waits, on the device, for nearly the whole copy, which is over by then) and the
# device keeps a chunk's bytes; where it does not hide, the whole snapshot is staged (twice
# its bytes free), so that the update waits for an HBM copy only. A chunk until measured;
# back to a chunk below STAGE_HIDES * 0.75 (no flapping at the edge).
STAGE_CHUNK = 256 << 20
STAGE_HIDES = 0.8


class MemoryTier:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        interval: int | str,
        budget_bytes: int,
        keep_last: int = 2,
        agree: Callable[[int], int] = lambda n: n,
    ) -> None:
        """`agree`: the smallest of every rank's number (World.min_int), so that every rank
        keeps the same snapshots whatever its shard's size. `interval`: steps, or "auto"
        (CheckFreq on a GPU: `interval_for`)."""
        self.model = model
        self.optimizer = optimizer
        on_gpu = any(p.is_cuda for p in model.parameters()) or AUTO_OFF_GPU
        self.auto = interval == "auto" and on_gpu
        self.interval = (
            AUTO_STEPS[0] if self.auto else AUTO_STEPS[1] if interval == "auto" else int(interval)
        )
        self.cost_s: float | None = None  # the loop's cost of a snapshot, measured (auto)
        self.told: int | None = None  # the interval last said
        self.budget_bytes = budget_bytes
        self.keep_last = keep_last
        self.agree = agree
        self.slots: dict[int, _Slot] = {}
        self.free: list[Mapping[str, torch.Tensor]] = []
        self.last_saved: int | None = None
        self.last_stall_s = 0.0
        self.last_restore_s = 0.0
        self._pending: _Slot | None = None
        self._thread: Future[None] | None = None  # the copy in flight, on a CPU
        self._error: BaseException | None = None
        # staged on the device, a chunk at a time until the copy is measured (_choose_staging)
        self._copies = SideCopies(stage=True, chunk=STAGE_CHUNK)
        self.copy_s: float | None = None  # the device's time for a snapshot's copy, measured
        self._step_s = 0.0  # the loop's time a step (`due`)
        self._staging_told: int | None | bool = False  # the chunk last said (False: none yet)
        self._warned = False
        # the next snapshot's host block, pinned ahead in a thread (CUDA: registering ~1 GB
        # takes a good part of a second); `spare_ahead` also on a CPU (tests)
        self.spare_ahead = False
        self._spare: Future[HostBlock] | None = None
        self._spare_pool: ThreadPoolExecutor | None = None
        self._need = 0  # bytes of the last snapshot
        self._spare_state = 0  # parameters with optimizer state when the spare was shaped
        self._on_cuda = False  # the tensors of the last snapshot: pinned ahead on CUDA only
        self._plan: _Plan | None = None  # the copy plan, made once per shape
        self._plan_need = 0
        self.last_check_s = 0.0

    # -- what the tiers facade asks -------------------------------------------------------------
    def due(self, step: int, seconds_per_step: float = 0.0) -> bool:
        self._step_s = seconds_per_step
        if not self.auto:
            return step % self.interval == 0
        self.interval = self.interval_for(seconds_per_step)
        return self.last_saved is None or step - self.last_saved >= self.interval

    def interval_for(self, seconds_per_step: float) -> int:
        """CheckFreq's interval: the fewest steps between snapshots that keep the measured cost
        of one (what it held the loop: its own time, and the wait of the update after it for
        its copy) within AUTO_BUDGET of the time those steps take, within AUTO_STEPS. Until a
        cost is measured (the first snapshot after the start's anchor), the lower bound."""
        lo, hi = AUTO_STEPS
        if self.cost_s is None or seconds_per_step <= 0:
            return lo
        return max(lo, min(hi, math.ceil(self.cost_s / (AUTO_BUDGET * seconds_per_step))))

    def measured(self) -> None:
        """The snapshot in flight is copied: its cost to the loop is known (auto)."""
        if self.auto and self.last_saved:  # (not the start's anchor: the first plan and block)
            c = self.last_stall_s
            self.cost_s = c if self.cost_s is None else 0.5 * (self.cost_s + c)

    def steps(self) -> list[int]:
        return sorted(s for s, slot in self.slots.items() if not slot.awaiting)

    def has(self, step: int) -> bool:
        slot = self.slots.get(step)
        return slot is not None and not slot.awaiting

    @property
    def bytes_held(self) -> int:
        return sum(s.nbytes for s in self.slots.values())

    def capacity(self, per_snapshot: int) -> int:
        return self.budget_bytes // max(per_snapshot, 1)

    # -- saving ---------------------------------------------------------------------------
    def save(self, step: int, snap: Snapshot, pins: set[str], awaiting: bool = False) -> float:
        """Start copying this rank's tensors for `step`; returns how long the loop blocked.
        `awaiting`: the step is still on the device (its values not read): the snapshot
        waits for `complete` (its decided state) or `drop` before a rollback may use it."""
        t0 = time.perf_counter()
        self.before_mutation()
        live = self._live()
        plan = self._plan
        assert plan is not None
        need = self._plan_need
        if not self._make_room(step, need):
            return time.perf_counter() - t0
        buffers = self._buffers(live)
        slot = _Slot(
            step=step,
            buffers=buffers,
            packed=_pack(_small(snap), plan.other_state(), _groups(self.optimizer)),
            pins=set(pins),
            awaiting=awaiting,
            nbytes=_nbytes(buffers),
        )
        self.slots[step] = slot
        self._copy(slot, live)
        _sealer().submit(_seal, slot)  # its sums once it lands, off the loop thread
        self.last_saved = step
        self._need = need
        if self._room():
            self._prepare_spare(live)
        self.last_stall_s = time.perf_counter() - t0
        return self.last_stall_s

    def _live(self) -> dict[str, torch.Tensor]:
        """This rank's tensors by key, through the copy plan (made again when it no longer
        fits: the optimizer's state appeared or was replaced, or a shape changed)."""
        plan = self._plan
        if plan is not None:
            live = plan.live()
            if plan.fits(self.optimizer, live):
                return live
        plan = self._plan = _Plan(self.model, self.optimizer)
        live = plan.live()
        self._plan_need = plan.need
        self._on_cuda = any(streams.is_cuda(t) for t in live.values())
        return live

    def invalidate(self) -> None:
        """The live tensors may have been replaced (a restore that made new ones): plan anew."""
        self._plan = None

    def ahead(self) -> None:
        """Between snapshots (each step that saves none): pin the next snapshot's block in a
        thread while training goes on, when no evicted one may serve it and the budget holds
        one more. Also once the optimizer's state has appeared after the step-0 snapshot."""
        if self._spare is not None and self._spare_state != len(self.optimizer.state):
            self._spare = None  # made before the optimizer's state existed: of another shape
        ahead = self._on_cuda or self.spare_ahead  # else no spare is made: no walk of the tensors
        if ahead and self._spare is None and not self.free and self.slots and self._room():
            self._prepare_spare(self._live())

    def _room(self) -> bool:
        """A spare fits in the budget beside what is held (bytes, not a count of full
        snapshots: the step-0 snapshot holds no optimizer state and is smaller)."""
        return self.bytes_held + self._need <= self.budget_bytes

    def _prepare_spare(self, live: dict[str, torch.Tensor]) -> None:
        pin = self._on_cuda
        if not (pin or self.spare_ahead) or self._spare is not None or self.free:
            return
        if self._spare_pool is None:
            self._spare_pool = ThreadPoolExecutor(1, thread_name_prefix="mem-pin")
        # the block is shaped in the thread from the tensors' shapes and dtypes alone (no meta
        # copy of each made here on the loop: ~450 allocations, ~4 ms of the snapshot's host)
        plan = self._plan
        layout = plan.layout if plan is not None else BlockLayout(live)
        self._spare = self._spare_pool.submit(HostBlock, layout, pin)
        self._spare_state = len(self.optimizer.state)
        if pin and plan is not None:  # the device copy's plan too (its views, its staging)
            self._copies.prepare(plan.layout, list(live.values()), plan)

    def _take_spare(self, live: dict[str, torch.Tensor]) -> _Buffers | None:
        """The block pinned ahead, if it fits `live` (it waits for the thread if still
        pinning)."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        block = spare.result()
        plan = self._plan
        fits = plan is not None and (
            block.layout is plan.layout or block.layout.signature == plan.layout.signature
        )
        return _Buffers(block) if fits else None

    def _make_room(self, step: int, need: int) -> bool:
        """Evict what retention drops, then (budget) the oldest unpinned and the oldest pinned
        ones; False when not even one snapshot fits."""
        self.slots.pop(step, None)  # a step saved again (a rollback target) replaces its copy
        slots = self.agree(self.capacity(need))
        if slots < 1:
            if not self._warned:
                log.warning(
                    "host-memory tier: one snapshot needs %.1f MB, the budget is %.1f MB: "
                    "rollbacks use the disk tier",
                    need / 2**20,
                    self.budget_bytes / 2**20,
                )
                self._warned = True
            return False
        older = [s for s in self.slots if s < step]  # newer ones: an abandoned branch, dropped
        pins = [s for s in older if self.slots[s].pins]  # by the rollback that abandons it
        kept = keep([*older, step], step, pins=pins, keep_last=self.keep_last)
        order = sorted(kept - {step}, key=lambda s: (bool(self.slots[s].pins), s))
        newer = len(self.slots) - len(older)
        while order and len(order) + newer + 1 > slots:
            order.pop(0)
        for s in [s for s in older if s not in order]:
            self._evict(s)
        return True

    def _evict(self, step: int) -> None:
        slot = self.slots.pop(step)
        _landed(slot)
        slot.unheld.wait()  # a file's copy of it, in the disk's writer thread (`Lent`)
        self.free.append(slot.buffers)

    @property
    def lends(self) -> bool:
        """Whether a snapshot of the tensors as last planned can be lent (`lend`)."""
        return self._plan is not None and self._plan.files is not None

    def lend(self, step: int) -> Lent | None:
        """The snapshot of `step` (just saved) for a disk checkpoint of the same step, which
        then neither builds the state dicts nor copies the device's tensors a second time on
        the loop thread (Tiers.save). None when it is not held or its plan cannot make the
        files (`_FileShape`)."""
        slot, plan = self.slots.get(step), self._plan
        if slot is None or plan is None or plan.files is None:
            return None
        slot.unheld.clear()
        return Lent(slot, plan.files)

    def _buffers(self, live: dict[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """Host buffers shaped like `live`: reused from an evicted snapshot when they match."""
        plan = self._plan
        assert plan is not None
        for i, bufs in enumerate(self.free):
            if getattr(bufs, "signature", None) == (plan.keys, plan.signature):
                return self.free.pop(i)
        self.free.clear()  # another shape (the optimizer state appeared): map afresh
        spare = self._take_spare(live)
        if spare is None:
            spare = _Buffers(HostBlock(plan.layout, pin=self._on_cuda))
        spare.signature = (plan.keys, plan.signature)
        return spare

    def _choose_staging(self) -> None:
        """Stage the whole snapshot on the device only where its copy to the host would not
        hide in the next forward and backward (STAGE_HIDES of a step): read from the last
        snapshot's copy once it has landed (never waited for), and said when first known and
        when it changes."""
        c = self._copies.copy_seconds()
        if c is None:
            return
        self.copy_s = c
        step_s, chunk = self._step_s, self._copies.chunk
        if step_s <= 0:
            return
        if chunk is not None and c > STAGE_HIDES * step_s:
            chunk = None
        elif chunk is None and c < 0.75 * STAGE_HIDES * step_s:
            chunk = STAGE_CHUNK
        self._copies.set_chunk(chunk)  # the last copies have landed: the buffer is unread
        if chunk == self._staging_told:
            return
        self._staging_told = chunk
        what = (
            f"staged on the device {chunk / 2**20:.0f} MB (or one larger tensor) at a time (it "
            "hides in the next forward and backward)"
            if chunk is not None
            else f"staged whole on the device ({self._plan_need / 2**20:.0f} MB of its memory "
            "where twice that is free: it does not hide in the next forward and backward)"
        )
        say(log, f"host-memory snapshots: the copy to the host takes {1e3 * c:.1f} ms against "
            f"a {1e3 * step_s:.1f} ms step: {what}")  # fmt: skip

    def _copy(self, slot: _Slot, live: dict[str, torch.Tensor]) -> None:
        block = getattr(slot.buffers, "block", None)
        if self._on_cuda and block is not None:  # side streams of the tensors' own devices
            self._choose_staging()
            slot.events = self._copies.start_block(block, list(live.values()), self._plan)
            self._pending = slot
            return
        pairs = [(slot.buffers[k], t) for k, t in live.items()]
        if self._on_cuda:
            slot.events = self._copies.start(pairs)
            self._pending = slot
            return
        self._pending = slot
        # a long-lived thread (worker.py): none started on the loop per snapshot
        self._thread = worker("mem-copy").submit(self._copy_in_thread, slot, pairs)

    def _copy_in_thread(self, slot: _Slot, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            with torch.no_grad():  # (the live tensors: parameters are not detached)
                for buf, t in pairs:
                    buf.copy_(t)
        except BaseException as e:  # raised in the loop's thread by before_mutation
            self._error = e
        finally:
            slot.ready.set()

    def before_mutation(self) -> float:
        """The weights may change after this: on CUDA the compute streams wait for the copy in
        flight (the device waits, never the host: this runs between backward and the update);
        on a CPU the host waits for the copying thread. Returns the seconds the host waited."""
        slot = self._pending
        if slot is None:
            return 0.0
        t0 = time.perf_counter()
        if slot.events:
            device_wait(slot.events)
            self._copies.release()
        else:
            slot.ready.wait()
            if self._thread is not None:
                self._thread.result()
                self._thread = None
        self._pending = None
        if self._error is not None:
            err, self._error = self._error, None
            self.slots.pop(slot.step, None)
            raise RuntimeError(f"host-memory snapshot of step {slot.step} failed: {err}") from err
        waited = time.perf_counter() - t0
        self.last_stall_s += waited
        self.measured()
        return waited

    def complete(self, step: int, trainer: dict[str, Any], meta: dict[str, Any]) -> bool:
        """The step of an awaiting snapshot is decided and applied: its state as decided (the
        guard's and the same-step tier's statistics, the records) fills the parts left open;
        the snapshot is a rollback target from now on. False if it is no longer held."""
        slot = self.slots.get(step)
        if slot is None or not slot.awaiting:
            return False
        slot.decided = _copy_of((trainer, meta))
        slot.awaiting = False
        return True

    def drop(self, step: int) -> None:
        """Forget the snapshot of `step` (its step was refused: the optimizer's counts in it
        are not the run's); its buffers are reused."""
        if step in self.slots:
            self._evict(step)
            if self.last_saved == step:
                self.last_saved = max(self.slots, default=None)

    # -- restoring ------------------------------------------------------------------------
    def read(self, step: int) -> dict[str, Any]:
        """What the core's restore needs, as a disk checkpoint's read gives it; the tensors
        are copied back by `load_tensors` (the core calls it through loaded['memory'])."""
        self.before_mutation()
        if step not in self.slots:
            raise CheckpointError(f"no host-memory snapshot of step {step}")
        _landed(self.slots[step])
        self.verify(step)
        slot = self.slots[step]
        out = _unpack(slot.packed)[0]
        if slot.decided is not None:
            trainer, meta = _copied(slot.decided)
            out["trainer.json"].update(trainer)
            out["meta"].update(meta)
        out["memory"] = step
        return out

    def verify(self, step: int) -> None:
        """The snapshot of `step` is what was copied: its block's sums, taken when it landed,
        taken again now (the host's memory bandwidth: ~0.1 s a GB, at a rollback only). Raises
        CheckpointError naming how many 32 KiB blocks changed."""
        slot = self.slots[step]
        _landed(slot)
        slot.sealed.wait()
        t0 = time.perf_counter()
        if slot.checksum is None:
            raise CheckpointError(f"host-memory snapshot of step {step} has no checksum")
        now = block_sums(slot.buffers)
        changed = int((now != slot.checksum).sum())
        self.last_check_s = time.perf_counter() - t0
        if changed:
            raise CheckpointError(
                f"host-memory snapshot of step {step} failed its check: {changed} of "
                f"{now.numel()} blocks of {CHECK_WORDS * 8 // 1024} KiB changed since it was taken"
            )

    @torch.no_grad()
    def load_tensors(self, step: int) -> None:
        """Copy the snapshot of `step` back into the live model and optimizer, in place."""
        t0 = time.perf_counter()
        slot = self.slots[step]
        _landed(slot)
        _, opt_other, groups = _unpack(slot.packed)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = self.optimizer.state
        has_state = any(k.startswith("o/") for k in slot.buffers)
        if not has_state:
            state.clear()  # the snapshot was taken before the optimizer's first step
        else:
            for i, other in opt_other.items():
                state[params[i]].update(other)
            for k in slot.buffers:  # state tensors the live optimizer lacks (a fresh optimizer)
                if k.startswith("o/"):
                    _, index, name = k.split("/", 2)
                    p = params[int(index)]
                    if name not in state[p]:
                        buf = slot.buffers[k]
                        device = _state_device(self.optimizer, p, name)
                        state[p][name] = torch.empty_like(buf, device=device)
                        self._plan = None
        live = dict(_live_tensors(self.model, self.optimizer))
        if live.keys() != slot.buffers.keys():
            raise CheckpointError(f"host-memory snapshot of step {step} does not fit the model")
        _copy_all([(t, slot.buffers[k]) for k, t in live.items()])
        for g, saved in zip(self.optimizer.param_groups, groups, strict=True):
            g.update(saved)
        self.last_restore_s = time.perf_counter() - t0

    # -- pins and branches ----------------------------------------------------------------
    def pin(self, step: int, reason: str) -> None:
        if step in self.slots:
            self.slots[step].pins.add(reason)

    def unpin(self, step: int, reason: str) -> None:
        if step in self.slots:
            self.slots[step].pins.discard(reason)

    def drop_after(self, step: int) -> list[int]:
        self.before_mutation()
        dropped = [s for s in self.slots if s > step]
        for s in dropped:
            self._evict(s)
        return dropped


class Lent:
    """A host-memory snapshot lent to the disk tier (`MemoryTier.lend`): `files` (in the disk's
    writer thread) waits for its copy to land and gives the model's and the optimizer's files
    over its buffers, which the disk tier copies into its own before `release` lets the
    memory tier reuse them. Always released, even when the save fails."""

    def __init__(self, slot: _Slot, shape: _FileShape) -> None:
        self.slot, self.shape = slot, shape

    def files(self) -> dict[str, Any]:
        slot = self.slot
        _landed(slot)
        _, other, groups = _unpack(slot.packed)
        model, optimizer = self.shape.state_dicts(slot.buffers, other, groups)
        return {"model.pt": model, **split_optimizer(optimizer)}

    def release(self) -> None:
        self.slot.unheld.set()


_COPIERS = max(1, min(4, os.cpu_count() or 1))


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """dst.copy_(src) for every pair: on CUDA queued at once (DMA), on a CPU spread over a few
    threads (a copy releases the GIL; one thread does not reach the memory bandwidth)."""
    cuda = {d.device for d, _ in pairs if d.is_cuda}
    if cuda:
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        for dev in cuda:  # each device the copies went to, not only the current one
            torch.cuda.synchronize(dev)
        return
    lanes: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(_COPIERS)]
    loads = [0] * _COPIERS
    for dst, src in sorted(pairs, key=lambda p: -p[0].numel()):  # largest first, least loaded
        i = loads.index(min(loads))
        lanes[i].append((dst, src))
        loads[i] += dst.numel()

    def run(lane: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in lane:
            dst.copy_(src)

    with ThreadPoolExecutor(max_workers=_COPIERS, thread_name_prefix="mem-copy") as pool:
        list(pool.map(run, lanes))


class _Buffers(Mapping[str, torch.Tensor]):
    """A snapshot's host tensors by key, keeping alive the one block they are carved from
    (whose views are made when first read: a restore, not a snapshot's copy on a GPU)."""

    def __init__(self, block: HostBlock) -> None:
        self.block = block
        self.signature: tuple | None = None  # the copy plan's (keys, shapes and dtypes)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.block.tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.block.layout.keys)

    def __len__(self) -> int:
        return len(self.block.layout.keys)


CHECK_WORDS = 1 << 12  # 8-byte words a sum covers (32 KiB): a change is found and placed


def block_sums(buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Sums (int64, wrapping) of a snapshot's bytes, one a 32 KiB block: a flipped bit, a
    stray write or a block copied short changes its block's sum. One pass at the memory's
    bandwidth (torch's CPU reduction, without the GIL)."""
    block = getattr(buffers, "block", None)
    if block is not None:
        data = block.data
    else:  # buffers not carved from one block
        data = torch.cat([b.reshape(-1).view(torch.uint8) for b in buffers.values()])
    words = data[: data.numel() // 8 * 8].view(torch.int64)
    whole = words.numel() // CHECK_WORDS * CHECK_WORDS
    return torch.cat([words[:whole].view(-1, CHECK_WORDS).sum(1), words[whole:].sum().view(1)])


_SEALER: list[ThreadPoolExecutor] = []  # one thread for the process: sums are taken in turn


def _sealer() -> ThreadPoolExecutor:
    if not _SEALER:
        _SEALER.append(ThreadPoolExecutor(1, thread_name_prefix="mem-seal"))
    return _SEALER[0]


def _seal(slot: _Slot) -> None:
    """In the sealer thread: once the snapshot's copy has landed, its block's sums."""
    try:
        _landed(slot)
        slot.checksum = block_sums(slot.buffers)
    except Exception:  # an unreadable block: it has no checksum and fails its check
        log.exception("host-memory snapshot of step %d: its checksum could not be taken", slot.step)
    finally:
        slot.sealed.set()


def _landed(slot: _Slot) -> None:
    """The host waits until the slot's copy has landed (its readers, its buffers' reuse)."""
    if slot.events:
        host_wait(slot.events)
        slot.ready.set()
    slot.ready.wait()


def _state_device(optimizer: torch.optim.Optimizer, p: torch.Tensor, name: str) -> torch.device:
    """Where torch keeps an optimizer state tensor: a step count on the CPU unless the group is
    fused or capturable (a step count on the GPU costs a read every step), else the
    parameter's device."""
    if name == "step":
        group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
        if not (group.get("fused") or group.get("capturable")):
            return torch.device("cpu")
    return local(p).device


def _nbytes(buffers: Mapping[str, torch.Tensor]) -> int:
    block = getattr(buffers, "block", None)
    if block is not None:  # (no views made)
        return sum(block.layout.sizes)
    return sum(t.numel() * t.element_size() for t in buffers.values())


def _pack(
    small: dict[str, Any], other: dict[int, dict[str, Any]], groups: list[dict[str, Any]]
) -> bytes | tuple[Any, ...]:
    """A slot's non-tensor state as one pickle (a copy by construction: `_unpack` gives new
    objects every time); a deep copy where something in it does not pickle (a function kept
    in an optimizer's param group, say)."""
    return _copy_of((small, other, groups))


def _unpack(
    packed: bytes | tuple[Any, ...],
) -> tuple[dict[str, Any], dict[int, dict[str, Any]], list[dict[str, Any]]]:
    small, other, groups = _copied(packed)
    return small, other, groups


def _copy_of(obj: Any) -> bytes | Any:
    """`obj` pickled (`_SmallPickler`), or deep-copied where it does not pickle."""
    try:
        out = io.BytesIO()
        _SmallPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return out.getvalue()
    except (pickle.PicklingError, TypeError, AttributeError):
        return copy.deepcopy(obj)


def _copied(packed: bytes | Any) -> Any:
    """A new copy of what `_copy_of` kept."""
    return pickle.loads(packed) if isinstance(packed, bytes) else copy.deepcopy(packed)


class _SmallPickler(pickle.Pickler):
    """A pickler that keeps a plain host tensor (the RNG states, a scheduler's or an
    optimizer's small tensors) as its bytes: torch's own pickling of a tensor writes a
    legacy `torch.save` archive of it (~0.25 ms to pickle a snapshot's small state on the
    loop thread, and as much again to read it back, against ~0.03 ms this way). Each such
    tensor comes back with memory of its own: two that shared a storage (views of one tensor)
    come back as two copies, their values as they were; a view of a large tensor keeps only
    its own bytes, where torch's pickling keeps the whole storage."""

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is torch.Tensor
            and obj.device.type == "cpu"
            and obj.layout is torch.strided
            and not obj.requires_grad
            and not obj.is_conj()
            and not obj.is_neg()
            and not obj.is_quantized
        ):
            raw = obj.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return _tensor_of, (raw, obj.dtype, tuple(obj.shape))
        return NotImplemented


def _tensor_of(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor `_SmallPickler` kept: its own memory, as it was."""
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's hyperparameters, per group (its parameters left out)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _small(snap: Snapshot) -> dict[str, Any]:
    """The snapshot's JSON files, meta and small torch objects (RNG, scheduler), to be packed
    (`_pack` copies them); a rank's `rng.rank<r>.pt` (torchrun) is unpacked as the sharded
    reader does."""
    out: dict[str, Any] = dict(snap.json_files)
    out["trainer.json"] = dict(out["trainer.json"])  # (a torchrun rank's RNG goes in below)
    out["meta"] = snap.meta
    for name, obj in snap.torch_files.items():
        if name in _HEAVY:
            continue
        obj = dict(obj)
        if name.startswith("rng.rank"):
            out["trainer.json"]["rng"] = obj.pop("json")
            if "scheduler" in obj:
                out["scheduler.pt"] = obj.pop("scheduler")
            name = "rng.pt"
        out[name] = obj
    return out


_dtype = operator.attrgetter("dtype")


def default_budget_bytes() -> int:
    """A quarter of the host's available memory, shared by the ranks on this host."""
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        pages = 8 * 2**30
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return pages // 4 // max(local_ranks, 1)
