"""An accelerate loop under `torchrun --nproc_per_node=2` (gloo, CPU): `accelerator.prepare`, an
`IterableDataset` stream that accelerate dispatches from rank 0, `accelerator.accumulate` with 2
micro-batches a step, the Watch in its lines (`route`, `batches(loader, accumulate=2)`,
`observe_loss`). The stream's micro-batches POISON.. (argv[2]) have spoilt labels; with
$CRASH_AT=N the job is killed (os._exit) as step N begins. Writes OUT.rank<r>.json (OUT =
argv[1], also the run directory): the window ids each micro-batch fed, the steps, the
interventions."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from spikewatch import Watch
from spikewatch.corpus import text_corpus

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    out, first = sys.argv[1], int(sys.argv[2])
    crash = int(os.environ.get("CRASH_AT", "0"))
    ex = _example("dataloader_loop")
    train, _ = text_corpus()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = _example("plain_loop").GPT(32, 2, 4, 32)  # type: ignore[attr-defined]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(ex.Stream(train, 32, 4, range(first, first + 40)), batch_size=4)  # type: ignore[attr-defined]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    settings = {"checkpoint": {"memory_interval": 10, "interval": 50}}
    watch = Watch(model, optimizer, scheduler, run_dir=out, db=f"sqlite:///{out}.db",
                  max_steps=120, resume="auto", settings=settings)  # fmt: skip
    watch.open()
    watch.route(optimizer, scheduler)
    fed = []
    for x, y, ids in watch.batches(loader, accumulate=2, loss_fn=lambda b: model(b[0], b[1])):
        if crash and watch.step_count == crash:
            os._exit(1)  # a kill: nothing closed
        fed.append(ids.tolist())
        with accelerator.accumulate(model):
            loss = model(x, y)
            watch.observe_loss(loss)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    watch.close()
    done = {"fed": fed, "steps": watch.step_count, "interventions": watch.interventions}
    Path(f"{out}.rank{accelerator.process_index}.json").write_text(json.dumps(done))


if __name__ == "__main__":
    main()
