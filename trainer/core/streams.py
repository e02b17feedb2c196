"""CUDA streams and events of a tensor's own device (ARCHITECTURE.md, "device-true").

`torch.cuda.Event().record()` and `torch.cuda.Stream()` with no device take the *current* device,
which is not the tensor's when a model spans devices or a rank's tensors live on another GPU
than the current one: an event recorded on the wrong stream completes before the copy it should
mark, and the host then reads a stale pinned buffer (the guard sees a wrong loss). Every stream
and event spikewatch makes comes from here, named by the tensor's device.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["current_stream", "is_cuda", "new_stream", "record_event"]


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
