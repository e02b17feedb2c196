"""What `Watch.batches(..., loss_fn=...)` takes, made into `batch -> loss tensor` once.

A replay (the spike's cause) and the row naming call `loss_fn(batch)` for the loss. The loop's
own model often is that function already: nanoGPT's returns `(logits, loss)` from
`model(x, y)`, a Hugging Face model an output with `.loss` from `model(**batch)`. So `loss_fn`
may be the model itself (called with the batch's items: `model(*batch)` for a tuple or list,
`model(**batch)` for a dict, else `model(batch)`), and whatever it returns may be the loss, a
tuple or list holding it (its last 0-dim floating tensor), or an object or dict with a `loss`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["as_loss", "loss_function"]


def as_loss(out: Any) -> torch.Tensor:
    """The loss in what a model or a loss function returned; TypeError naming what it got."""
    if isinstance(out, torch.Tensor):
        return out
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, tuple | list):
        scalars = [x for x in out if isinstance(x, torch.Tensor) and x.dim() == 0]
        scalars = [x for x in scalars if x.is_floating_point()]
        if scalars:
            return scalars[-1]
    raise TypeError(
        f"loss_fn returned {type(out).__name__}, in which there is no loss: return the loss "
        "tensor, a tuple holding it (as (logits, loss)), or an output with .loss"
    )


def loss_function(fn: Callable[[Any], Any] | torch.nn.Module) -> Callable[[Any], torch.Tensor]:
    """`fn` as `batch -> loss`: a model is called with the batch's items."""
    if isinstance(fn, torch.nn.Module):
        model = fn

        def call(batch: Any) -> Any:
            if isinstance(batch, Mapping):
                return model(**batch)
            if isinstance(batch, tuple | list):
                return model(*batch)
            return model(batch)

        return lambda batch: as_loss(call(batch))
    return lambda batch: as_loss(fn(batch))
