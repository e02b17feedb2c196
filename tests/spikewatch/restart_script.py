"""A Watch loop under `torchrun --max-restarts=1` whose loader hangs once (at batch 25 of the
first launch): the watchdog records the stall, the process exits with EXIT_STALLED after
`exit_after_s`, torchrun starts it again, and `resume="auto"` takes the newest checkpoint.
Run: torchrun --max-restarts=1 --nproc_per_node=1 restart_script.py OUT."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from spikewatch import Watch


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(32, 16), torch.nn.Flatten(), torch.nn.Linear(128, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hung = out / "hung-once"

    def batch_at(i: int) -> torch.Tensor:
        if i == 25 and not hung.exists():
            hung.touch()
            time.sleep(600)  # a loader that never returns (the watchdog ends the process)
        time.sleep(0.02)
        return torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(i))

    settings = {"guard": {"stall": {"min_s": 1.0, "factor": 10.0, "exit_after_s": 2.0}}}
    with Watch(model, opt, max_steps=40, db=f"sqlite:///{out}/runs.db", run_dir=out / "run",
               checkpoint_every=5, resume="auto", settings=settings) as watch:  # fmt: skip
        for x in watch.batches(batch_at):
            loss = model(x).square().mean()
            loss.backward()
            watch.step(loss)
    print(f"finished at step {watch.step_count}", flush=True)


if __name__ == "__main__":
    main()
