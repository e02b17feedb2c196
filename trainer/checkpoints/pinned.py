"""Host buffers for device tensors, and the copies into them that never make the host wait.

Shared by the host-memory tier (memory.py) and the asynchronous disk save (disk.py, staging.py).

- `HostBlock`: one exact-size host allocation carved into tensors. On CUDA it is pinned by
  registering it (`cudaHostRegister`, as torch.distributed.checkpoint's stager does), not by
  `pin_memory=True`, whose caching host allocator rounds every block up to a power of two (a
  budget of pinned snapshots could be exceeded twice over).
- `SideCopies`: device-to-host copies queued on a side stream of each source tensor's own
  device, after the work already queued there; `device_wait` orders the compute streams after
  them (the GPU waits, the host does not: nothing is read between backward and the update),
  `host_wait` is for the host's own readers (a restore, a writer thread, a buffer reused).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from spikewatch.trainer.core import streams

__all__ = ["BlockLayout", "HostBlock", "SideCopies", "device_wait", "host_wait"]

log = logging.getLogger(__name__)

_ALIGN = 512  # bytes: every tensor of a block starts on a DMA-friendly boundary


def _register(ptr: int, size: int) -> bool:
    """Page-lock [ptr, ptr + size) for DMA (cudaHostRegisterPortable); False if CUDA refused."""
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 1))
    if err:
        log.warning("host-memory pinning of %.1f MB refused (cudaError %d)", size / 2**20, err)
    return err == 0


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class BlockLayout:
    """Where tensors shaped like `like` ({key: tensor}) lie in one block: their keys, shapes,
    dtypes, sizes and byte offsets (each aligned to 512 bytes), and the block's bytes. Made
    once per shape by its owner (the memory tier's copy plan), so that a block is allocated
    without a Python step a tensor."""

    def __init__(self, like: dict[str, torch.Tensor]) -> None:
        self.keys = tuple(like)
        self.shapes = [t.shape for t in like.values()]
        self.dtypes = [t.dtype for t in like.values()]
        self.sizes = [t.numel() * t.element_size() for t in like.values()]
        self.offsets, total = [], 0
        for n in self.sizes:
            self.offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        self.nbytes = total
        self.signature = (self.keys, tuple(zip(self.shapes, self.dtypes, strict=True)))


class HostBlock:
    """Host tensors shaped like `like` ({key: tensor}, or their `BlockLayout`) in one
    allocation of exactly their size, pinned by registration when `pin`. The tensors
    themselves (views of the block, three dispatches each) are made when first asked for:
    a snapshot's copy on a GPU fills the block by byte ranges (`SideCopies.start_block`), and
    the block made ahead in a thread took the GIL from the loop for ~5 ms at 124M making them."""

    def __init__(
        self, like: dict[str, torch.Tensor] | BlockLayout, pin: bool, separate: bool = False
    ) -> None:
        """`separate`: each tensor a storage of its own over the block's memory (a file's
        tensors: torch.save refuses views of one storage as different dtypes, and writes a
        view's whole storage), not a view of the block's."""
        self.layout = like if isinstance(like, BlockLayout) else BlockLayout(like)
        self.separate = separate
        total = self.nbytes = self.layout.nbytes
        self.pinned = False
        self.data = torch.empty(max(total, 1), dtype=torch.uint8)
        if pin and total and not _register(self.data.data_ptr(), total):
            # the caching host allocator's pinned memory (rounded up to a power of two)
            self.data = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        else:
            self.pinned = pin and total > 0

    @functools.cached_property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.views()

    def views(self, yield_every: int = 0) -> dict[str, torch.Tensor]:
        """The block's tensors (`tensors` caches them). `yield_every` n > 0 (a thread making
        them while the loop runs): the GIL is let go every n tensors, so the loop thread waits
        for a few views at most, not for the interpreter's switch interval (5 ms) at a time."""
        lay = self.layout
        raw = self.data.numpy() if self.separate else None  # the block's memory, as a buffer
        out = {}
        for i, (k, o, n, dtype, shape) in enumerate(
            zip(lay.keys, lay.offsets, lay.sizes, lay.dtypes, lay.shapes, strict=True)
        ):
            if raw is None:
                out[k] = self.data[o : o + n].view(dtype).view(shape)
            elif n == 0:
                out[k] = torch.empty(shape, dtype=dtype)
            else:  # a storage of its own, over the block's bytes (which it keeps alive)
                count = n // dtype.itemsize
                out[k] = torch.frombuffer(raw, dtype=dtype, count=count, offset=o).view(shape)
            if yield_every and i % yield_every == yield_every - 1:
                time.sleep(0)
        return out

    @classmethod
    def with_views(cls, layout: BlockLayout, pin: bool, separate: bool = False) -> HostBlock:
        """A block made in a thread ahead of its use, its tensors made there too, a few at a
        time (`views`)."""
        block = cls(layout, pin, separate)
        block.__dict__["tensors"] = block.views(yield_every=16)
        return block

    def __del__(self) -> None:  # before the memory itself goes (the block holds it until then)
        if getattr(self, "pinned", False):
            self.pinned = False
            try:
                _unregister(self.data.data_ptr())
            except Exception:  # at interpreter exit the CUDA runtime may be gone
                pass


# per source device: (device, landed, sources free): the host may read the buffers after
# `landed`; the sources may change after `sources free` (a copy on the device: much sooner)
Events = list[tuple[torch.device, Any, Any]]


class SideCopies:
    """`dst.copy_(src)` for (host dst, device src) pairs, queued on one side stream per device.

    `start` copies any pairs straight to the host (the disk tier's staging). `start_block`
    copies into a `HostBlock` (the host-memory tier's snapshot): with `stage`, a device with
    room for it (twice its sources' bytes free) first copies its sources into one staging
    buffer on the device, kept for the next snapshot (HBM to HBM, a few ms for a 1B model with
    AdamW, where the copy to the host takes ~0.2 s over PCIe), and then to the host from there:
    the sources may change as soon as the staging copy is done, so the next update waits for
    that copy, not for the host's. With `chunk` bytes, the buffer holds that much (or the
    largest tensor) and the sources go through it a chunk at a time, each chunk's copy to the
    host before the next chunk's into the buffer (one side stream): the update then waits for
    nearly the whole copy to the host, which is free where that copy hides in the next forward
    and backward, and the device keeps a chunk's bytes rather than a snapshot's (the memory
    tier chooses, `MemoryTier._choose_staging`). `copy_seconds` is the device's time for the
    last block's copies, once they have landed."""

    def __init__(self, stage: bool = False, chunk: int | None = None) -> None:
        self._streams: dict[torch.device, Any] = {}
        self.stage = stage
        self.chunk = chunk  # staged this many bytes at a time (None: a run's whole span)
        self._staging: dict[torch.device, torch.Tensor] = {}
        # start_block's layout, made once per plan: (plan, the block's offsets, chunk, runs)
        self._planned: tuple[object, list[int], int | None, list[_Run]] | None = None
        self._held: list[torch.Tensor] = []  # start_block's sources, until `release`
        self._timed: list[tuple[Any, Any]] = []  # the last block's (start, landed) per device

    def set_chunk(self, chunk: int | None) -> None:
        """Stage `chunk` bytes at a time from the next block on (None: whole). Only once the
        last block's copies have landed (`copy_seconds` said so): the staging buffer dropped
        here is not read by a copy still queued."""
        if chunk != self.chunk:
            self.chunk = chunk
            for dev in list(self._staging):
                self._drop_staging(dev)
            self._planned = None

    def _stream(self, dev: torch.device) -> Any:
        stream = self._streams.get(dev)
        if stream is None:
            stream = self._streams[dev] = streams.new_stream(dev)
        stream.wait_stream(streams.current_stream(dev))  # after what made the tensors
        return stream

    def start(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Events:
        """Queue the copies (no wait); returns the events of each source device. A source on
        the CPU (torch's non-fused Adam keeps its step count there) is copied at once. Each
        device's copies are one multi-tensor copy from the loop thread (a `record_stream` and
        a `copy_` a tensor were two dispatches each, ~1,200 for a 124M model with AdamW); the
        sources are held until `release`, as `start_block`'s are."""
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        host: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for dst, src in pairs:
            dsts, srcs = (
                by_device.setdefault(src.device, ([], [])) if streams.is_cuda(src) else host
            )
            dsts.append(dst)
            srcs.append(src)
        events: Events = []
        with torch.no_grad():
            if host[0]:
                torch._foreach_copy_(*host)
            for dev, (dsts, srcs) in by_device.items():
                stream = self._stream(dev)
                with streams.on(stream):
                    torch._foreach_copy_(dsts, srcs, non_blocking=True)
                    landed = streams.record_event(dev, stream)
                events.append((dev, landed, landed))
                self._held += srcs  # their memory is not reused before the copy
        return events

    def start_block(
        self, block: HostBlock, sources: Sequence[torch.Tensor], plan: object
    ) -> Events:
        """`block`'s tensors (in its keys' order) copied from `sources` (in the same order),
        queued (no wait); returns the events of each source device.

        What depends only on the layout is made once per `plan` (an object the caller keeps
        while its sources' devices, shapes and dtypes hold: the memory tier's copy plan): the
        runs of consecutive sources on one device and, per device, the staging buffer's views
        and the run's byte range in the block. A snapshot then costs the loop thread, per run,
        one multi-tensor copy into the staging buffer, one copy of the run's bytes to the host
        and two events, whatever the number of tensors (the views were made a tensor at a
        time, three dispatches each, every snapshot). Sources on the CPU (torch's non-fused
        Adam keeps its step counts there) are copied at once, and a device's copy to the host
        covers its own run's bytes only: one span over the whole block overwrote them with the
        staging buffer's. The sources are held until `release` (the compute streams wait for
        their copy before anything may change or free them: `device_wait`), where a
        `record_stream` cost a call a tensor."""
        runs = self.prepare(block.layout, sources, plan)
        dsts: list[torch.Tensor] = []  # the block's views: only where a run copies a tensor each
        if any(run.dev is None or run.views is None for run in runs):
            dsts = list(block.tensors.values())
        events: Events = []
        started: dict[torch.device, tuple[Any, Any]] = {}  # a device's stream, its first event
        self._held = list(sources)
        with torch.no_grad():  # the sources are the live tensors: parameters need no detach
            for run in runs:
                a, b, dev = run.first, run.end, run.dev
                if dev is None:  # host memory already: at once
                    torch._foreach_copy_(dsts[a:b], self._held[a:b])
                    continue
                if dev not in started:
                    stream = self._stream(dev)
                    started[dev] = (stream, streams.timing_event(dev, stream))
                stream = started[dev][0]
                free = None
                # one stream a device: a device's last run's events mark all of its runs
                with streams.on(stream):
                    if run.views is None or run.staged is None:  # no room: straight to the host
                        for dst, src in zip(dsts[a:b], self._held[a:b], strict=True):
                            dst.copy_(src, non_blocking=True)
                    else:
                        torch._foreach_copy_(run.views, self._held[a:b])
                        if run.last:
                            free = streams.record_event(dev, stream)
                        block.data[run.lo : run.hi].copy_(run.staged, non_blocking=True)
                    if run.last:
                        landed = streams.timing_event(dev, stream)
                        events.append((dev, landed, landed if free is None else free))
        self._timed = [(started[dev][1], landed) for dev, landed, _ in events]
        return events

    def copy_seconds(self) -> float | None:
        """The device's time for the last block's copies (from the first to the last landed,
        the slowest device's), once they have all landed; None before, or once it was read."""
        times = [streams.seconds_between(a, b) for a, b in self._timed]
        if not times or any(t is None for t in times):
            return None
        self._timed = []
        return max(t for t in times if t is not None)

    def release(self) -> None:
        """The compute streams wait for the copies now: the sources need not be held."""
        self._held = []

    def prepare(
        self, layout: BlockLayout, sources: Sequence[torch.Tensor], plan: object
    ) -> list[_Run]:
        """`start_block`'s plan for blocks of `layout` (made at its first call if not before:
        the memory tier makes it ahead, at the set-up step, with its own copy plan)."""
        planned = self._planned
        chunk = self.chunk if self.stage else None
        if (
            planned is not None
            and planned[0] is plan
            and planned[1] == layout.offsets
            and planned[2] == chunk
        ):
            return planned[3]
        runs: list[_Run] = []
        sizes, offsets = layout.sizes, layout.offsets
        for i, src in enumerate(sources):
            dev = src.device if streams.is_cuda(src) else None
            end = offsets[i] + sizes[i]
            if (
                runs
                and runs[-1].dev == dev
                and (dev is None or chunk is None or end - offsets[runs[-1].first] <= chunk)
            ):
                runs[-1].end = i + 1
            else:  # another device, or the chunk is full (a tensor larger than it: its own)
                runs.append(_Run(dev, i, i + 1))
        need: dict[torch.device, int] = {}
        for run in runs:
            run.lo = offsets[run.first]
            run.hi = offsets[run.end - 1] + sizes[run.end - 1]
            if run.dev is not None:
                need[run.dev] = max(need.get(run.dev, 0), run.hi - run.lo)
        seen: set[torch.device | None] = set()
        for run in reversed(runs):  # each device's last run records its events
            run.last = run.dev not in seen
            seen.add(run.dev)
        flats = {dev: self._staging_buffer(dev, n) for dev, n in need.items()} if self.stage else {}
        for run in runs:
            flat = flats.get(run.dev) if run.dev is not None else None
            if flat is None:
                continue
            run.staged = flat[: run.hi - run.lo]
            run.views = [
                flat[o - run.lo : o - run.lo + n].view(t.dtype).view(t.shape)
                for o, n, t in zip(
                    layout.offsets[run.first : run.end],
                    sizes[run.first : run.end],
                    sources[run.first : run.end],
                    strict=True,
                )
            ]
        self._planned = (plan, list(layout.offsets), chunk, runs)
        return runs

    def _staging_buffer(self, dev: torch.device, span: int) -> torch.Tensor | None:
        """The device's staging buffer of at least `span` bytes (made at the first snapshot if
        twice its size is free on the device, then kept), or None: copy straight to the host."""
        flat = self._staging.get(dev)
        if flat is not None and flat.numel() >= span:
            return flat
        held = 0 if flat is None else flat.numel()
        self._drop_staging(dev)
        if span * 2 > streams.free_bytes(dev) + held:
            return None
        self._staging[dev] = flat = torch.empty(span, dtype=torch.uint8, device=dev)
        return flat

    def _drop_staging(self, dev: torch.device) -> None:
        """Let the device's staging buffer go once the side stream's copies queued so far are
        done: a copy to the host from it may still be in flight (a snapshot's plan is made
        again when the optimizer's state appears, the step after the start's snapshot), and
        the caching allocator would otherwise give its memory to the compute stream at once."""
        flat = self._staging.pop(dev, None)
        stream = self._streams.get(dev)
        if flat is not None and stream is not None:
            streams.keep_until_done(flat, stream)


class _Run:
    """Consecutive sources of a block on one device (None: the host), [first, end) by index
    and [lo, hi) in the block's bytes, no more than a chunk's bytes when staged a chunk at a
    time; with a staging buffer, its views for them (each run's from the buffer's start)."""

    def __init__(self, dev: torch.device | None, first: int, end: int) -> None:
        self.dev, self.first, self.end = dev, first, end
        self.lo = self.hi = 0
        self.last = True  # the device's last run: its events mark the device's copies
        self.views: list[torch.Tensor] | None = None
        self.staged: torch.Tensor | None = None


def device_wait(events: Events) -> None:
    """Work queued from now on each device's current stream runs after the sources are free
    to change (their copies landed, or were staged on the device)."""
    for dev, _, free in events:
        streams.current_stream(dev).wait_event(free)


def host_wait(events: Events) -> None:
    """Block the host until the copies have landed."""
    for _, landed, _ in events:
        landed.synchronize()
