"""Per-tensor norms and in-place scaling over tensors that may live on several devices.

One mechanism for the clip (trainer/core/transfer.py, the sharded clip in core/world.py) and the
probes (core/probes.py). A model spread over devices (`device_map="auto"`) has gradients and
optimizer state on each; a foreach kernel runs per device and the (P,) vector of norms is
gathered on one device, as torch's `clip_grad_norm_` does. A missing gradient has norm 0, a
0-dim zero: never a parameter-sized `zeros_like` (ARCHITECTURE.md, "device-true").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["maxima", "norms", "scale_"]


def norms(
    xs: Sequence[torch.Tensor | None], device: torch.device, ord: float = 2.0
) -> torch.Tensor:
    """(P,) the `ord`-norm of each tensor (0 for None) on `device`, in fp32 (an fp16 gradient's
    norm above 65,504 is no overflow); one foreach kernel per device, and on the common path
    (every tensor present, one device) just that one."""
    present = [x for x in xs if x is not None]
    if not xs:
        return torch.zeros(0, device=device)
    if len(present) == len(xs) and all(x.device == device for x in present):
        return torch.stack(torch._foreach_norm(present, ord, dtype=torch.float32))
    by_device: dict[torch.device, list[int]] = {}
    for i, x in enumerate(xs):
        if x is not None:
            by_device.setdefault(x.device, []).append(i)
    out: list[torch.Tensor | None] = [None] * len(xs)
    for dev, index in by_device.items():
        found = torch._foreach_norm([xs[i] for i in index], ord, dtype=torch.float32)  # type: ignore[misc]
        for i, n in zip(index, found, strict=True):
            out[i] = n if dev == device else n.to(device, non_blocking=True)
    zero = torch.zeros((), device=device)
    return torch.stack([zero if n is None else n for n in out])


def maxima(xs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(P,) each tensor's maximum, on `device` (one foreach kernel per device). The tensors
    are magnitudes (Adam's second moments): an empty one counts 0, the maximum's identity
    there (an FSDP2 shard that holds no rows on this rank: a parameter with fewer rows than
    ranks; `_foreach_max` refuses empty tensors)."""
    if not xs:
        return torch.zeros(0, device=device)
    by_device: dict[torch.device, list[int]] = {}
    out: list[torch.Tensor | None] = [None] * len(xs)
    for i, x in enumerate(xs):
        if x.numel():
            by_device.setdefault(x.device, []).append(i)
        else:
            out[i] = torch.zeros((), dtype=x.dtype, device=device)
    for dev, index in by_device.items():
        for i, m in zip(index, torch._foreach_max([xs[i] for i in index]), strict=True):
            out[i] = m if dev == device else m.to(device, non_blocking=True)
    return torch.stack([m for m in out if m is not None])  # every one set above


def scale_(xs: Sequence[torch.Tensor], factor: torch.Tensor) -> None:
    """x *= factor for every x, the factor sent once to each other device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for x in xs:
        by_device.setdefault(x.device, []).append(x)
    for dev, group in by_device.items():
        f = factor if factor.device == dev else factor.to(dev, non_blocking=True)
        torch._foreach_mul_(group, f)
