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

import logging
from collections.abc import Sequence
from typing import Any

import torch

from trainer.core import streams

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


Events = list[tuple[torch.device, Any]]


class SideCopies:
    """`dst.copy_(src)` for (host dst, device src) pairs, queued on one side stream per device."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def start(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Events:
        """Queue the copies (no wait); returns an event per source device. A source on the CPU
        (torch's non-fused Adam keeps its step count there) is copied at once."""
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
                for dst, src in group:
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(stream)  # its memory is not reused before the copy
            events.append((dev, streams.record_event(dev, stream)))
        return events


def device_wait(events: Events) -> None:
    """Work queued from now on each device's current stream runs after the copies."""
    for dev, event in events:
        streams.current_stream(dev).wait_event(event)


def host_wait(events: Events) -> None:
    """Block the host until the copies have landed."""
    for _, event in events:
        event.synchronize()
