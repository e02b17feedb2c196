"""Two gloo ranks under torchrun, a DDP model in a Watch loop; rank 1's batch function sleeps
4 s at step 30 (its loader hangs), so rank 0 waits for it in the step's all-reduce. The stall
bound is 1 s. Run: torchrun --nproc_per_node=2 stall_script.py OUT. With `straggle` after OUT,
rank 1's batches take 60 ms each from batch 10 on (a slow loader on one node), for 80 steps;
with `slow_forward`, rank 1's forward takes 60 ms more from step 10 on (a slow device); with
`slow_backward`, its backward does (its forward as fast as rank 0's); with `fsdp_slow`, the
model is sharded with FSDP2 (every rank waits inside the all-gathers and reduce-scatters for
the slowest) and rank 1's forward takes 60 ms more from step 10 on; `fsdp_clean`, the same
with no rank slowed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from spikewatch import Watch


def stuck_in_rank_1s_loader(i: int) -> None:
    time.sleep(4.0)


def main() -> None:
    out = Path(sys.argv[1])
    straggle = sys.argv[2:] == ["straggle"]
    slow_forward = sys.argv[2:] == ["slow_forward"]
    slow_backward = sys.argv[2:] == ["slow_backward"]
    fsdp_slow = sys.argv[2:] == ["fsdp_slow"]
    fsdp_clean = sys.argv[2:] == ["fsdp_clean"]  # the same job, no rank slowed: no straggler
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(32, 16), torch.nn.Flatten(), torch.nn.Linear(128, 1)
    )
    if fsdp_slow or fsdp_clean:
        from torch.distributed.fsdp import fully_shard

        import spikewatch.trainer.core.watchdog as watchdog

        watchdog.ARRIVAL_EVERY = 1  # the flight recorder read every wake: a short run will do
        model = torch.nn.Sequential(
            torch.nn.Embedding(32, 16), torch.nn.Flatten(),
            *[torch.nn.Linear(128, 128) for _ in range(3)], torch.nn.Linear(128, 1),
        )  # fmt: skip
        for layer in model[2:]:
            fully_shard(layer)
        fully_shard(model)
    if (slow_forward or fsdp_slow) and rank == 1:

        def slow_device(module: torch.nn.Module, args: object) -> None:
            if watch.step_count >= 10:
                time.sleep(0.06)

        model.register_forward_pre_hook(slow_device)
    if slow_backward and rank == 1:

        def slow_in_backward(module: torch.nn.Module, grad_output: object) -> None:
            if watch.step_count >= 10:
                time.sleep(0.06)

        model[2].register_full_backward_pre_hook(slow_in_backward)
    ddp = model if fsdp_slow or fsdp_clean else DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_at(i: int) -> torch.Tensor:
        if straggle and i >= 10 and rank == 1:
            time.sleep(0.06)
        elif (
            i == 30
            and rank == 1
            and not (straggle or slow_forward or slow_backward or fsdp_slow or fsdp_clean)
        ):
            stuck_in_rank_1s_loader(i)
        return torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(i))

    settings = {"guard": {"stall": {"min_s": 1.0, "factor": 10.0}}}
    steps = 80 if straggle or slow_forward or slow_backward else 40
    steps = 120 if fsdp_slow or fsdp_clean else steps
    with Watch(ddp, opt, max_steps=steps, db=f"sqlite:///{out}/runs.db", run_dir=out / "run",
               settings=settings) as watch:  # fmt: skip
        for x in watch.batches(batch_at):
            loss = ddp(x).square().mean()
            loss.backward()
            watch.step(loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
