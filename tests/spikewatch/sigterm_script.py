"""Two gloo ranks under torchrun, a DDP model in a Watch loop that runs until it is stopped;
rank 1's batches take 0.2 s from batch 5 on, so that rank 0 is inside the step's all-reduce,
waiting for it, most of the time (where a SIGTERM cannot run Python's handler until the
collective returns). Run: torchrun --nproc_per_node=2 sigterm_script.py OUT MODE, MODE `batches`
(the loop over `watch.batches`) or `own` (a loop of its own: `for it in range(...)`). Each rank
prints how its loop ended, so a rank the launcher had to kill is told from one that ended."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from spikewatch import Watch


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(32, 16), torch.nn.Flatten(), torch.nn.Linear(128, 1)
    )
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_at(i: int) -> torch.Tensor:
        if rank == 1 and i >= 5:
            time.sleep(0.2)
        return torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(i))

    settings = {"checkpoint": {"interval": 5}}
    watch = Watch(ddp, opt, db=f"sqlite:///{out}/runs.db", run_dir=out / "run",
                  settings=settings)  # fmt: skip
    ended = "ended"
    try:
        with watch:
            if mode == "batches":
                for x in watch.batches(batch_at):
                    loss = ddp(x).square().mean()
                    loss.backward()
                    watch.step(loss)
            else:
                for it in range(100_000):
                    loss = ddp(batch_at(it)).square().mean()
                    loss.backward()
                    watch.step(loss)
    except KeyboardInterrupt as e:
        ended = f"interrupted ({e})"
    print(f"rank {rank} {ended} at step {watch.step_count}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
