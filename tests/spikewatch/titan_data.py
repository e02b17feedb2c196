"""The data of spikewatch's torchtitan jobs in the tests and the GPU check (nothing is
downloaded): a byte-level tokenizer, and a loader of windows of the shipped corpus
(`spikewatch.corpus`), each data-parallel rank its own, with a poisoned region on one rank
(`--dataloader.poison_at/poison_len/poison_rank`, one row of each batch with
`--dataloader.poison_row`), with `--dataloader.ids` each row's window start as its "id" (a
plain torchtitan Trainer would hand it to the model), and a SIGKILL once at each of some
batches (`--dataloader.die_at 36,60`, a marker file each in the working directory: the
restarted job goes on)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer

__all__ = ["ByteTokenizer", "WindowsLoader", "window_start"]


class ByteTokenizer(BaseTokenizer):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, tokenizer_path: str | None = None, **kw: Any) -> None:
        super().__init__()
        self.eos_id = 0

    def encode(self, text: str, *a: Any, **k: Any) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], *a: Any, **k: Any) -> str:
        return bytes(ids).decode(errors="replace")

    def get_vocab_size(self) -> int:
        return 256


def window_start(i: int, rank: int, world: int, n: int, seq_len: int) -> int:
    """Where rank `rank`'s row `i` starts in the corpus of `n` bytes."""
    import numpy as np

    rng = np.random.default_rng([0, i * world + rank])
    return int(rng.integers(0, n - seq_len - 1))


class _Windows(IterableDataset):
    """Row i of data-parallel rank r: window (i * world + r) of the corpus; rows of batches
    [poison_at, poison_at + poison_len) (in batches of `batch` rows) poisoned on
    `poison_rank` (or every rank for -1)."""

    def __init__(
        self,
        seq_len: int,
        rank: int,
        world: int,
        batch: int,
        poison: Any,
        die_at: str,
        ids: bool,
    ) -> None:
        from spikewatch.corpus import text_corpus

        self.data, _ = text_corpus(source="code")
        self.seq_len, self.rank, self.world, self.batch, self.poison = (
            seq_len, rank, world, batch, poison,
        )  # fmt: skip
        self.die_at = {int(b) for b in die_at.split(",") if b}
        self.ids = ids
        self.i = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            i, self.i = self.i, self.i + 1
            if i % self.batch == 0 and i // self.batch in self.die_at:
                marker = f"died-{i // self.batch}"
                if not os.path.exists(marker):
                    open(marker, "w").close()  # noqa: SIM115
                    os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no checkpoint
            start = window_start(i, self.rank, self.world, len(self.data), self.seq_len)
            row = self.data[start : start + self.seq_len + 1].long()
            x, y = row[:-1], row[1:]
            at, length, rank, only = self.poison
            if at <= i // self.batch < at + length and rank in (-1, self.rank):
                if only in (-1, i % self.batch):
                    y = torch.zeros_like(y)  # a corrupt shard: every target a NUL byte
            yield ({"input": x, "id": start} if self.ids else {"input": x}), y

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = int(state["i"])


class WindowsLoader(ParallelAwareDataloader):
    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        poison_at: int = -1
        poison_len: int = 0
        poison_rank: int = -1
        poison_row: int = -1
        die_at: str = ""
        ids: bool = False

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any,
        seq_len: int,
        local_batch_size: int,
        **kw: Any,
    ) -> None:
        poison = (config.poison_at, config.poison_len, config.poison_rank, config.poison_row)
        data = _Windows(
            seq_len, dp_rank, dp_world_size, local_batch_size, poison, config.die_at,
            config.ids,
        )  # fmt: skip
        super().__init__(
            data, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size
        )
