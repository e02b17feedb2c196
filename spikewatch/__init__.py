"""spikewatch in your own training: `Watch` for any PyTorch loop; `spikewatch.hf` and
`spikewatch.lightning` for Hugging Face's Trainer and PyTorch Lightning.

    from spikewatch import AdamW, Watch

    optimizer = AdamW(model.parameters(), lr=3e-4)  # torch's AdamW, refusable on the GPU
    watch = Watch(model, optimizer, scheduler, max_steps=1000, grad_clip=1.0)
    for x, y in watch.batches(get_batch):   # get_batch(index) -> a batch
        loss = model(x, y)
        loss.backward()
        watch.step(loss)                    # optimizer.step, scheduler.step, zero_grad inside
    watch.close()

This module is the public surface; the machinery lives in `spikewatch.trainer` (the Watch and
its probes, guard and checkpoints), `spikewatch.observatory` (detector, policy, store) and
`spikewatch.web` (the dashboard). Every import name is spikewatch's own: nothing generic sits
at the top of site-packages, so a user's `trainer.py` or `web/` beside their script is theirs.

The names below load on first use (PEP 562), so `import spikewatch.observatory` or the
dashboard does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spikewatch.trainer.config import WatchSettings
    from spikewatch.trainer.core.blocklist import without_blocked
    from spikewatch.trainer.model.attention import max_logits
    from spikewatch.trainer.model.attn_max import AttnMax
    from spikewatch.trainer.model.optim.factor import AdamW
    from spikewatch.trainer.watch import Watch

_HOMES = {
    "AdamW": "spikewatch.trainer.model.optim.factor",
    "AttnMax": "spikewatch.trainer.model.attn_max",
    "Watch": "spikewatch.trainer.watch",
    "WatchSettings": "spikewatch.trainer.config",
    "max_logits": "spikewatch.trainer.model.attention",
    "without_blocked": "spikewatch.trainer.core.blocklist",
}

__all__ = ["AdamW", "AttnMax", "Watch", "WatchSettings", "max_logits", "without_blocked"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'spikewatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
