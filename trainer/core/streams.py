"""CUDA streams and events of a tensor's own device (ARCHITECTURE.md, "device-true").

`torch.cuda.Event().record()` and `torch.cuda.Stream()` with no device take the *current* device,
which is not the tensor's when a model spans devices or a rank's tensors live on another GPU
than the current one: an event recorded on the wrong stream completes before the copy it should
mark, and the host then reads a stale pinned buffer (the guard sees a wrong loss). Every stream
and event spikewatch makes comes from here, named by the tensor's device.

Being one place, it is also where `benchmarks/host_cost.py` stands `meta` in for a GPU (streams
and events that run nothing, host buffers unpinned), so that the loop thread's work on a GPU's
paths is what it counts.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "current_stream",
    "free_bytes",
    "host_buffer",
    "is_cuda",
    "keep_until_done",
    "new_stream",
    "on",
    "record_event",
    "seconds_between",
    "timing_event",
]


def is_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def current_stream(device: torch.device) -> Any:
    """The stream the caller's work on `device` is queued on."""
    return torch.cuda.current_stream(device)


def new_stream(device: torch.device) -> Any:
    """A side stream on `device`."""
    return torch.cuda.Stream(device=device)


def record_event(device: torch.device, stream: Any = None) -> Any:
    """An event recorded on `stream` (default: `device`'s current stream): it completes when
    the work queued there before it has."""
    event = torch.cuda.Event()
    event.record(stream if stream is not None else current_stream(device))
    return event


def timing_event(device: torch.device, stream: Any = None) -> Any:
    """`record_event`'s, able to time the work between two of them (`seconds_between`)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream if stream is not None else current_stream(device))
    return event


def seconds_between(start: Any, end: Any) -> float | None:
    """The device's seconds from `start` to `end` (timing events), once `end` has completed;
    None before (the host never waits for it)."""
    if not end.query():
        return None
    return float(start.elapsed_time(end)) / 1e3


def keep_until_done(t: torch.Tensor, stream: Any) -> None:
    """`t`'s memory is not reused before the work queued on `stream` so far is done (the
    caching allocator's `record_stream`), though `t` be let go now."""
    t.record_stream(stream)


def on(stream: Any) -> Any:
    """A context in which work is queued on `stream`."""
    return torch.cuda.stream(stream)


def free_bytes(device: torch.device) -> int:
    """Bytes free on `device` (the driver's figure)."""
    return int(torch.cuda.mem_get_info(device)[0])


def host_buffer(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor, which a non-blocking copy from the device fills by DMA."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)
