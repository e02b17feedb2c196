"""A plain PyTorch loop fed by its own DataLoader, watched by spikewatch: the loop keeps its
`for x, y in train_loader` shape, only wrapped in `watch.batches(...)`.

    python examples/dataloader_loop.py --steps 300 --db sqlite:///x.db
    python examples/dataloader_loop.py --stream --poison-at 120 --poison-len 10

The default is a map-style dataset of the plays' windows in a shuffled DataLoader (no seeded
generator: torch's global RNG shuffles each epoch, as in most scripts), epoch after epoch
until `--steps`. `--stream` reads the windows from an `IterableDataset` instead (a stream
with no length, in a pre-shuffled shard's fixed order), and `--poison-at B --poison-len L`
spoils the labels of the stream's batches B..B+L-1 (a corrupt stretch of a shard): the Watch
refuses or rolls back, and the stream's poisoned batches are never fed again. Run it again
with the same `--run-dir` after a kill and it resumes where the data was (the loader's own
state where it has one, else fast-forwarded), saying which.

The lines that differ from the loop without spikewatch are marked `# spikewatch`.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from spikewatch import AdamW, Watch  # spikewatch
from spikewatch.corpus import shift_labels, text_corpus


def _plain_loop() -> object:
    """The plain-loop example's small GPT (examples/plain_loop.py), loaded by path."""
    path = Path(__file__).with_name("plain_loop.py")
    spec = importlib.util.spec_from_file_location("plain_loop_example", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("plain_loop_example", mod)
    spec.loader.exec_module(mod)
    return mod


class Windows(Dataset):
    """Non-overlapping windows of the corpus: item i is (x, y, i)."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        s = i * self.seq_len
        chunk = self.data[s : s + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:], i


class Stream(IterableDataset):
    """The windows as a stream, in the fixed shuffled order a pre-shuffled shard has: the
    stream's batches `poison` (a range of batch positions, with `batch_size`) have their labels
    spoilt, as a corrupt stretch of a shard would."""

    def __init__(self, data: torch.Tensor, seq_len: int, batch_size: int, poison: range) -> None:
        self.windows, self.batch_size, self.poison = Windows(data, seq_len), batch_size, poison
        self.order = torch.randperm(len(self.windows), generator=torch.Generator().manual_seed(7))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        for k, i in enumerate(self.order.tolist()):
            x, y, _ = self.windows[i]
            if k // self.batch_size in self.poison:
                y = shift_labels(y)
            yield x, y, i


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: torch.Tensor, args: argparse.Namespace) -> float:
    """The mean loss over the first 16 batches of the validation windows."""
    model.eval()
    loader = DataLoader(Windows(val, args.seq_len), batch_size=args.batch_size)
    losses = [model(x, y) for (x, y, _), _ in zip(loader, range(16), strict=False)]
    model.train()
    return float(torch.stack(losses).mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--stream", action="store_true", help="an IterableDataset (a shuffled shard)")
    p.add_argument("--poison-at", type=int, default=None, help="first poisoned stream batch")
    p.add_argument("--poison-len", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--db", default=None, help="store URL ('none' for no store)")
    p.add_argument("--run-dir", default=None, help="start there, or resume after a kill")
    p.add_argument("--summary-json", default=None)
    p.add_argument("--fed", default=None, help="write the window ids fed, one step a line")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train, val = text_corpus()

    if args.stream:
        first = args.poison_at
        poison = range(0) if first is None else range(first, first + args.poison_len)
        dataset: Dataset = Stream(train, args.seq_len, args.batch_size, poison)
        train_loader = DataLoader(dataset, batch_size=args.batch_size)
    else:
        train_loader = DataLoader(Windows(train, args.seq_len), batch_size=args.batch_size,
                                  shuffle=True, drop_last=True)  # fmt: skip
    gpt = _plain_loop().GPT  # type: ignore[attr-defined]
    model = gpt(args.d_model, args.layers, 4, args.seq_len)
    optimizer = AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))

    def loss_of(batch: tuple[torch.Tensor, ...]) -> torch.Tensor:  # spikewatch (replays)
        return model(batch[0], batch[1])  # spikewatch

    fed = []
    with Watch(model, optimizer, name="dataloader-loop", db=args.db,  # spikewatch
               run_dir=args.run_dir, resume="auto",  # spikewatch: start there, or resume
               max_steps=args.steps, grad_clip=1.0) as watch:  # spikewatch  # fmt: skip
        model.use_recorder(watch.attn)  # spikewatch (per-head attention maxima)
        for x, y, ids in watch.batches(train_loader, loss_fn=loss_of):  # spikewatch
            loss = model(x, y)
            loss.backward()
            watch.step(loss)  # spikewatch: measure, decide, update (or refuse), roll back
            fed.append(ids.tolist())
    watch.log_eval(evaluate(model, val, args))  # spikewatch: the final evaluation, after the block
    if args.summary_json:
        watch.write_summary(args.summary_json)
    if args.fed:
        Path(args.fed).write_text("".join(f"{' '.join(map(str, f))}\n" for f in fed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
