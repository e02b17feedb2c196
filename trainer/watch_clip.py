"""The loop's own gradient clipping, seen by the Watch.

A loop that the Watch routes (`Watch.route`: the loop's `optimizer.step()` goes through the
gate) often clips its gradients itself first, as nanoGPT's train.py does
(`torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)`). The Watch measures the
gradient at the gate, after that clip: it would see the clipped norm, capped at the clip's
bound, and a gradient-norm spike would not show. So while a routed Watch is open,
`torch.nn.utils.clip_grad_norm_` goes through here: a 2-norm clip of exactly the watched
model's trainable parameters is made by the Watch's own clip (`clip_by_global_norm`: torch's
arithmetic, the same gradients after it), which keeps the per-tensor norms it computes from
before the clip; the gate then takes those (no second norm pass) and the clip is the loop's
alone. Any other call (other parameters, another norm, `error_if_nonfinite`) is torch's, as
it was. The loop's line stays as it is; it returns the total norm, as torch's does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["LoopClip", "see_loop_clips"]

Seen = Callable[[list[torch.Tensor], float], torch.Tensor | None]

_original: Any = None
_seers: list[weakref.ref[Any]] = []  # each a routed Watch's `LoopClip`


class LoopClip:
    """One routed Watch's view of the loop's clip: `take` at the gate gives (total, factor,
    per-tensor norms) of the step's clip, if the loop made one of the watched parameters."""

    def __init__(self, params: Callable[[], list[torch.Tensor] | None]) -> None:
        self._params = params  # the watched trainable parameters (None: not open or sharded)
        self._seen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor | None:
        from spikewatch.trainer.core.transfer import clip_by_global_norm

        mine = self._params()
        if mine is None:
            return None
        trainable = [p for p in params if p.requires_grad]
        if len(trainable) != len(mine) or any(
            a is not b for a, b in zip(trainable, mine, strict=True)
        ):
            return None
        self._seen = clip_by_global_norm(mine, float(max_norm))
        return self._seen[0]

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        seen, self._seen = self._seen, None
        return seen


def _clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if float(norm_type) == 2.0 and not error_if_nonfinite:
        for ref in list(_seers):
            seer = ref()
            total = None if seer is None else seer.clip(params, max_norm)
            if total is not None:
                return total
    return _original(params, max_norm, norm_type, error_if_nonfinite, foreach)


def see_loop_clips(seer: LoopClip) -> Callable[[], None]:
    """`torch.nn.utils.clip_grad_norm_` goes through `seer` from now on (and through every
    other routed Watch's); returns the undo, which puts torch's back when none is left."""
    global _original
    if _original is None:
        _original = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = _clip_grad_norm_
    ref = weakref.ref(seer)
    _seers.append(ref)

    def undo() -> None:
        global _original
        if ref in _seers:
            _seers.remove(ref)
        _seers[:] = [r for r in _seers if r() is not None]
        if not _seers and _original is not None:
            if torch.nn.utils.clip_grad_norm_ is _clip_grad_norm_:
                torch.nn.utils.clip_grad_norm_ = _original
            _original = None

    return undo
