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
from collections.abc import Sequence
from typing import Any

import torch

from spikewatch.trainer.core import streams

__all__ = ["HostBlock", "SideCopies", "device_wait", "host_wait"]

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


class HostBlock:
    """Host tensors shaped like `like` ({key: tensor}) in one allocation of exactly their size
    (each aligned to 512 bytes), pinned by registration when `pin`."""

    def __init__(self, like: dict[str, torch.Tensor], pin: bool) -> None:
        offsets, total = {}, 0
        for k, t in like.items():
            offsets[k] = total
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        self.nbytes = total
        self.pinned = False
        self.data = torch.empty(max(total, 1), dtype=torch.uint8)
        if pin and total and not _register(self.data.data_ptr(), total):
            # the caching host allocator's pinned memory (rounded up to a power of two)
            self.data = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        else:
            self.pinned = pin and total > 0
        self.tensors = {
            k: self.data[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for (k, t), o in zip(like.items(), offsets.values(), strict=True)
        }

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

    With `stage` (the host-memory tier), a device with room for it (twice the sources' bytes
    free) first copies the sources into one staging buffer on the device, kept for the next
    snapshot (HBM to HBM, a few ms for a 1B model with AdamW, where the copy to the host takes
    ~0.2 s over PCIe), and then to the host from there: the sources may change as soon as the
    staging copy is done, so the next update waits for that copy, not for the host's."""

    def __init__(self, stage: bool = False) -> None:
        self._streams: dict[torch.device, Any] = {}
        self.stage = stage
        self._staging: dict[torch.device, torch.Tensor] = {}

    def start(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Events:
        """Queue the copies (no wait); returns the events of each source device. A source on
        the CPU (torch's non-fused Adam keeps its step count there) is copied at once."""
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for dst, src in pairs:
            if src.device.type != "cuda":
                dst.copy_(src)
                continue
            by_device.setdefault(src.device, []).append((dst, src))
        events: Events = []
        for dev, group in by_device.items():
            stream = self._streams.get(dev)
            if stream is None:
                stream = self._streams[dev] = streams.new_stream(dev)
            stream.wait_stream(streams.current_stream(dev))  # after what made the tensors
            with torch.cuda.stream(stream):
                for _, src in group:
                    src.record_stream(stream)  # its memory is not reused before the copy
                flat = self._staging_buffer(dev, group) if self.stage else None
                if flat is None:
                    for dst, src in group:
                        dst.copy_(src, non_blocking=True)
                    landed = free = streams.record_event(dev, stream)
                else:
                    mark = functools.partial(streams.record_event, dev, stream)
                    free, landed = staged_copy(group, flat, mark)
            events.append((dev, landed, free))
        return events

    def _staging_buffer(
        self, dev: torch.device, group: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor | None:
        """The device's staging buffer for `group` (made at the first snapshot if twice its
        size is free on the device, then kept), or None: copy straight to the host."""
        _, _, span = layout([dst for dst, _ in group])
        flat = self._staging.get(dev)
        if flat is not None and flat.numel() >= span:
            return flat
        free, _ = torch.cuda.mem_get_info(dev)
        held = 0 if flat is None else flat.numel()
        if span * 2 > free + held:
            self._staging.pop(dev, None)
            return None
        self._staging[dev] = flat = torch.empty(span, dtype=torch.uint8, device=dev)
        return flat


def layout(dsts: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, list[int], int]:
    """Where each of `dsts` goes in a staging buffer: (the host block they are carved from, as
    bytes, or None; each one's byte offset; the bytes spanned). Destinations carved from one
    block (HostBlock) keep the block's offsets, so one copy moves them all to the host."""
    storage = dsts[0].untyped_storage()
    base_ptr = storage.data_ptr()
    if all(d.untyped_storage().data_ptr() == base_ptr and d.is_contiguous() for d in dsts):
        offsets = [d.data_ptr() - base_ptr for d in dsts]
        span = max(o + d.numel() * d.element_size() for o, d in zip(offsets, dsts, strict=True))
        block = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        return block, offsets, span
    offsets, total = [], 0
    for d in dsts:
        offsets.append(total)
        total += -(-d.numel() * d.element_size() // _ALIGN) * _ALIGN
    return None, offsets, total


def staged_copy(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    flat: torch.Tensor,
    mark: Any = None,
) -> tuple[Any, Any]:
    """The sources into `flat` (bytes, on their device) in one multi-tensor copy, then from
    there to the destinations: one copy of the whole span when they are carved from one host
    block, else one each. `mark()` (an event on the copies' stream) after each of the two;
    returns (sources free, landed)."""
    dsts = [dst for dst, _ in pairs]
    block, offsets, span = layout(dsts)
    views = [
        flat[o : o + s.numel() * s.element_size()].view(s.dtype).view(s.shape)
        for o, (_, s) in zip(offsets, pairs, strict=True)
    ]
    torch._foreach_copy_(views, [s for _, s in pairs])
    free = mark() if mark is not None else None
    if block is not None:
        block[:span].copy_(flat[:span], non_blocking=True)
    else:
        for dst, v in zip(dsts, views, strict=True):
            dst.copy_(v, non_blocking=True)
    landed = mark() if mark is not None else None
    return free, landed


def device_wait(events: Events) -> None:
    """Work queued from now on each device's current stream runs after the sources are free
    to change (their copies landed, or were staged on the device)."""
    for dev, _, free in events:
        streams.current_stream(dev).wait_event(free)


def host_wait(events: Events) -> None:
    """Block the host until the copies have landed."""
    for _, landed, _ in events:
        landed.synchronize()
