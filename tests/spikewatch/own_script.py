"""A user's own script, not one of the examples: a GRU language model, a dict batch with ids
that `get_batch` returns whole (the global batch), DDP under torchrun, and a `loss_fn` that
calls the module inside the DDP wrapper (as one naturally does for one row's loss). Rank 1's
share of batches [60, 66) is noise. Writes OUT/rank<r>.json: the ids of the rows the rank
trained first, and the summary's interventions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from spikewatch import Watch


class GRULM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.gru, self.out = (
            nn.Embedding(64, 32),
            nn.GRU(32, 32, batch_first=True),
            nn.Linear(32, 64),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.emb(x))
        return nn.functional.cross_entropy(self.out(h).flatten(0, 1), y.flatten())


def get_batch(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    x = torch.randint(0, 64, (8, 16), generator=g)
    y = (x * 3 + 1) % 64
    if 60 <= i < 66:
        y[4:] = torch.randint(0, 64, (4, 16), generator=g)  # rows 4..7: rank 1's share
    return {"x": x, "y": y, "id": [f"doc{i}-{r}" for r in range(8)]}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GRULM()
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = []
    with Watch(ddp, opt, max_steps=100, grad_clip=1.0, db=f"sqlite:///{out}/runs.db",
               run_dir=out / "run") as watch:  # fmt: skip
        for b in watch.batches(get_batch, loss_fn=lambda b: model(b["x"], b["y"])):
            if not first:
                first = list(b["id"])
            loss = ddp(b["x"], b["y"])
            loss.backward()
            watch.step(loss)
        summary = watch.summary()
    seen = {"first": first, "interventions": summary["interventions"]}
    (out / f"rank{rank}.json").write_text(json.dumps(seen, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
