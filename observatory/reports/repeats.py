"""Documents with long runs of a repeated n-gram (OLMo 2's filter): a run of at least
`min_repeats` (32) consecutive copies of an n-gram of words, n from 1 to `max_n` (13). OLMo 2
traced its loss spikes to such documents and removed them from the corpus; `spikewatch
data-check` finds them before training, at the speed of reading.

Words are what lies between whitespace (bytes <= 32). A repeated n-gram makes the sequence of
words periodic with period n, so the sequence of word *fingerprints* (length and first byte)
is periodic too: that necessary condition is checked for every n at once over a whole chunk of
documents with a few NumPy passes (equality at distance n, then its runs), and only the rare
stretches that pass are checked exactly, word by word. The result is the exact word-level
answer; the cost is a few passes over the bytes (benchmarks/data_check.py measures it).
Token arrays (already tokenized data) take the same test on the token ids themselves.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MAX_N", "MIN_REPEATS", "Repeat", "scan_texts", "scan_tokens"]

MIN_REPEATS = 32
MAX_N = 13


@dataclass(frozen=True)
class Repeat:
    """The longest run found in a document: `repeats` copies of an n-gram of `n` words (or
    tokens), starting at word (token) `start`, byte `offset` in the document (texts only)."""

    n: int
    repeats: int
    start: int
    offset: int | None
    ngram: str

    def reason(self) -> str:
        return f"{self.n}-gram repeated {self.repeats} times"


def scan_texts(
    docs: Sequence[bytes], *, min_repeats: int = MIN_REPEATS, max_n: int = MAX_N
) -> Iterator[tuple[int, Repeat]]:
    """(index in `docs`, its longest run) for each document that has a run of at least
    `min_repeats` copies of an n-gram, n <= `max_n`."""
    if not docs:
        return
    buf = np.frombuffer(b" ".join(docs) + b" ", dtype=np.uint8)
    doc_start = np.cumsum([0] + [len(d) + 1 for d in docs[:-1]])
    edges = np.diff((buf > 32).view(np.int8), prepend=np.int8(0))
    starts = np.flatnonzero(edges == 1)  # a word's first byte
    ends = np.flatnonzero(edges == -1)  # one past its last (a space follows every document)
    lengths = np.minimum(ends - starts, 255).astype(np.uint16)
    fingerprint = (lengths << 8) | buf[starts]  # (length, first byte)
    best: dict[int, Repeat] = {}
    for lo, hi, n in _periodic(fingerprint, min_repeats, max_n):
        d = int(np.searchsorted(doc_start, starts[lo], side="right")) - 1
        base = int(doc_start[d])
        a, b = int(starts[lo]) - base, int(ends[min(hi, len(ends)) - 1]) - base
        found = _exact_words(docs[d][a:b], n, min_repeats)
        if found is not None:
            reps, at, offset, gram = found
            first_word = int(np.searchsorted(starts, base))
            rep = Repeat(n, reps, lo - first_word + at, a + offset, gram)
            if d not in best or rep.repeats * rep.n > best[d].repeats * best[d].n:
                best[d] = rep
    yield from sorted(best.items())


def scan_tokens(
    docs: Iterable[np.ndarray], *, min_repeats: int = MIN_REPEATS, max_n: int = MAX_N
) -> Iterator[tuple[int, Repeat]]:
    """The same test on token-id arrays (one per document)."""
    for i, tokens in enumerate(docs):
        t = np.asarray(tokens).reshape(-1)
        found = None
        for lo, hi, n in _periodic(t, min_repeats, max_n):
            reps = (hi - lo) // n
            if found is None or reps * n > found.repeats * found.n:
                gram = " ".join(str(int(v)) for v in t[lo : lo + n])
                found = Repeat(n, reps, lo, None, gram)
        if found is not None:
            yield i, found


def _periodic(seq: np.ndarray, min_repeats: int, max_n: int) -> Iterator[tuple[int, int, int]]:
    """(lo, hi, n): stretches seq[lo:hi] periodic with period n over at least min_repeats
    periods (seq[i] == seq[i + n] for lo <= i < hi - n), n ascending."""
    for n in range(1, max_n + 1):
        if len(seq) <= n:
            break
        need = (min_repeats - 1) * n  # equal pairs in a row
        eq = (seq[n:] == seq[:-n]).view(np.int8)
        change = np.diff(eq, prepend=np.int8(0), append=np.int8(0))
        run_starts = np.flatnonzero(change == 1)
        run_ends = np.flatnonzero(change == -1)
        for k in np.flatnonzero(run_ends - run_starts >= need):
            yield int(run_starts[k]), int(run_ends[k]) + n, n


_WORD = re.compile(rb"[^\x00-\x20]+")  # what lies between whitespace (bytes <= 32)


def _exact_words(text: bytes, n: int, min_repeats: int) -> tuple[int, int, int, str] | None:
    """The longest run of an n-gram of `text`'s words: (repeats, first word, its byte offset,
    the n-gram), or None below min_repeats."""
    found = list(_WORD.finditer(text))
    words = [m.group() for m in found]
    best: tuple[int, int] | None = None  # (run of equal pairs, first word)
    run, first = 0, 0
    for i in range(len(words) - n):
        if words[i] == words[i + n]:
            if run == 0:
                first = i
            run += 1
            if best is None or run > best[0]:
                best = (run, first)
        else:
            run = 0
    if best is None or best[0] // n + 1 < min_repeats:
        return None
    pairs, first = best
    gram = b" ".join(words[first : first + n]).decode("utf-8", errors="replace")
    return pairs // n + 1, first, found[first].start(), gram[:200]
