"""`spikewatch data-check PATH...`: documents with long repeated n-gram runs (OLMo 2's filter,
reports/repeats.py) in a corpus, before training, written as the same JSON-lines blocklist
that `spikewatch quarantine` writes for the samples a rollback named.

Reads, streaming: JSON-lines (one document per line, its text in `--field`, its id in "id" if it
has one), plain text files (one document each), NumPy token arrays (`.npy`, memory-mapped: rows
of a 2-D array, or a 1-D array cut at `--eos`) and Hugging Face datasets saved to disk (a
directory with `dataset_info.json`, read with `datasets` if installed, else its Arrow files
with `pyarrow`). A directory is searched for those. Documents go to the detector in chunks of
about 8 MB, so memory stays flat whatever the corpus size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spikewatch.observatory.reports.repeats import (
    MAX_N,
    MIN_REPEATS,
    Repeat,
    scan_texts,
    scan_tokens,
)

__all__ = ["Doc", "add_parser", "check", "documents"]

CHUNK_BYTES = 8 << 20
TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


@dataclass(slots=True)
class Doc:
    """One document: its id, where it is, and its text (bytes) or tokens."""

    id: str
    file: str
    line: int | None
    text: bytes | None = None
    tokens: np.ndarray | None = None

    @property
    def size(self) -> int:
        if self.text is not None:
            return len(self.text)
        return 0 if self.tokens is None else int(self.tokens.nbytes)


def documents(path: Path, field: str = "text", eos: int | None = None) -> Iterator[Doc]:
    """Every document under `path` (a file or a directory), in a stable order."""
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            yield from _hf_dataset(path, field)
            return
        for p in sorted(path.rglob("*")):
            if p.is_file() and p.suffix in (*TEXT_SUFFIXES, *JSONL_SUFFIXES, ".npy"):
                yield from documents(p, field, eos)
        return
    if not path.is_file():
        raise ValueError(f"{path}: no such file or directory")
    if path.suffix in JSONL_SUFFIXES:
        yield from _jsonl(path, field)
    elif path.suffix == ".npy":
        yield from _tokens(path, eos)
    else:
        yield Doc(id=str(path), file=str(path), line=None, text=path.read_bytes())


def _jsonl(path: Path, field: str) -> Iterator[Doc]:
    """JSON lines, parsed a block at a time (one `json.loads` of the block's lines as one JSON
    array: the parsing stays in C); a block that does not parse is parsed line by line, so the
    error names its line."""
    line0, file = 0, str(path)
    for lines in _line_blocks(path):
        full = [i for i, raw in enumerate(lines) if raw.strip()]
        try:
            objs = json.loads(b"[" + b",".join(lines[i] for i in full) + b"]")
        except json.JSONDecodeError:
            objs = [_line_json(path, line0 + i + 1, lines[i]) for i in full]
        for i, obj in zip(full, objs, strict=True):
            text = obj.get(field) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                n = line0 + i + 1
                raise ValueError(f"{path}:{n}: no text in field {field!r} (--field names it)")
            doc_id = obj.get("id")
            n = line0 + i + 1
            doc_id = f"{file}:{n}" if doc_id is None else str(doc_id)
            yield Doc(doc_id, file, n, text.encode("utf-8", errors="replace"))
        line0 += len(lines)


def _line_blocks(path: Path) -> Iterator[list[bytes]]:
    """The file's lines, about CHUNK_BYTES at a time (a line is never cut)."""
    rest = b""
    with path.open("rb") as f:
        while block := f.read(CHUNK_BYTES):
            data = rest + block
            cut = data.rfind(b"\n") + 1
            data, rest = data[:cut], data[cut:]
            if data:
                yield data[:-1].split(b"\n")
    if rest:
        yield [rest]


def _line_json(path: Path, n: int, raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None


def _tokens(path: Path, eos: int | None) -> Iterator[Doc]:
    arr = np.load(path, mmap_mode="r")
    if arr.ndim == 2:
        for i in range(arr.shape[0]):
            yield Doc(id=f"{path}:{i}", file=str(path), line=i, tokens=np.asarray(arr[i]))
        return
    if arr.ndim != 1:
        raise ValueError(f"{path}: token arrays are 1-D (cut at --eos) or 2-D (rows)")
    cuts = [0, len(arr)] if eos is None else [0, *(np.flatnonzero(arr == eos) + 1), len(arr)]
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        if b > a:
            yield Doc(id=f"{path}:{a}", file=str(path), line=i, tokens=np.asarray(arr[a:b]))


def _hf_dataset(path: Path, field: str) -> Iterator[Doc]:
    """A `datasets.Dataset.save_to_disk` directory: its text column, or its token ids."""
    try:
        from datasets import load_from_disk

        rows: Any = load_from_disk(str(path))
    except ImportError:
        rows = _arrow_rows(path)
    for i, row in enumerate(rows):
        doc_id = str(row.get("id", f"{path}:{i}"))
        if isinstance(row.get(field), str):
            yield Doc(id=doc_id, file=str(path), line=i, text=row[field].encode("utf-8"))
        elif "input_ids" in row:
            yield Doc(id=doc_id, file=str(path), line=i, tokens=np.asarray(row["input_ids"]))
        else:
            raise ValueError(f"{path}: row {i} has no {field!r} text and no input_ids")


def _arrow_rows(path: Path) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow as pa
    except ImportError:
        raise ValueError(
            f"{path} is a Hugging Face dataset: reading it needs `datasets` or `pyarrow` "
            "(pip install datasets)"
        ) from None
    for f in sorted(path.glob("*.arrow")):
        with pa.memory_map(str(f)) as source:
            for batch in pa.ipc.open_stream(source):
                yield from batch.to_pylist()


def check(
    paths: list[Path],
    *,
    field: str = "text",
    eos: int | None = None,
    min_repeats: int = MIN_REPEATS,
    max_n: int = MAX_N,
    progress: bool = False,
) -> dict[str, Any]:
    """Scan every document; returns {"documents", "bytes" (the documents' text, or token
    arrays' bytes), "file_bytes" (the files read), "seconds", "mb_per_s" (file bytes, in
    MB = 10**6 bytes, per second), "flagged": [blocklist entries]}."""
    t0 = time.perf_counter()
    flagged: list[dict[str, Any]] = []
    counts = {"documents": 0, "bytes": 0}
    file_bytes = sum(_size(p) for p in paths)
    bar = _Progress(file_bytes) if progress else None
    for path in paths:
        chunk: list[Doc] = []
        size = 0
        for doc in documents(path, field, eos):
            chunk.append(doc)
            size += len(doc.text) if doc.text is not None else doc.size
            if size >= CHUNK_BYTES:
                flagged += _scan(chunk, min_repeats, max_n, counts, bar)
                chunk, size = [], 0
        flagged += _scan(chunk, min_repeats, max_n, counts, bar)
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    return {
        **counts,
        "file_bytes": file_bytes,
        "seconds": seconds,
        "mb_per_s": file_bytes / 1e6 / max(seconds, 1e-9),
        "min_repeats": min_repeats,
        "max_n": max_n,
        "flagged": flagged,
    }


def _scan(
    chunk: list[Doc], min_repeats: int, max_n: int, counts: dict[str, int], bar: Any
) -> list[dict[str, Any]]:
    texts = [d for d in chunk if d.text is not None]
    tokens = [d for d in chunk if d.tokens is not None]
    rule = {"min_repeats": min_repeats, "max_n": max_n}
    found: list[tuple[Doc, Repeat]] = []
    text_of = [d.text for d in texts if d.text is not None]
    found += [(texts[i], r) for i, r in scan_texts(text_of, **rule)]
    tokens_of = [d.tokens for d in tokens if d.tokens is not None]
    found += [(tokens[i], r) for i, r in scan_tokens(tokens_of, **rule)]
    size = sum(d.size for d in chunk)
    counts["documents"] += len(chunk)
    counts["bytes"] += size
    if bar is not None:
        bar.advance(size)
    return [_entry(d, r) for d, r in found]


def _entry(doc: Doc, r: Repeat) -> dict[str, Any]:
    """A blocklist line, as `spikewatch quarantine` writes them
    (observatory/reports/quarantine.py)."""
    return {
        "source": "data-check",
        "id": doc.id,
        "file": doc.file,
        "line": doc.line,
        "offset": r.offset,
        "reason": r.reason(),
        "n": r.n,
        "repeats": r.repeats,
        "preview": r.ngram,
    }


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


class _Progress:
    """Bytes scanned, on stderr (rich), when stderr is a terminal."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        self.p = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            transient=True,
        )
        self.task = self.p.add_task("data-check", total=total or None)
        self.p.start()

    def advance(self, n: int) -> None:
        self.p.advance(self.task, n)

    def close(self) -> None:
        self.p.stop()


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "data-check",
        help="documents with long repeated n-gram runs (OLMo 2's filter), as a blocklist",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # defaults in --help
    )
    p.add_argument("paths", nargs="+", type=Path, help="files or directories")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--out", default=None, help="write the blocklist (JSON lines) here")
    p.add_argument("--field", default="text", help="JSON-lines / dataset text field")
    p.add_argument("--eos", type=int, default=None, help="a 1-D token array's document end")
    p.add_argument("--min-repeats", type=int, default=MIN_REPEATS, help="copies in a run")
    p.add_argument("--max-n", type=int, default=MAX_N, help="longest n-gram, in words")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.min_repeats < 2 or not 1 <= args.max_n <= 64:
        raise ValueError("--min-repeats must be >= 2 and --max-n in [1, 64]")
    result = check(
        args.paths,
        field=args.field,
        eos=args.eos,
        min_repeats=args.min_repeats,
        max_n=args.max_n,
        progress=not args.json and sys.stderr.isatty(),
    )
    if args.out:
        lines = "".join(json.dumps(e) + "\n" for e in result["flagged"])
        Path(args.out).write_text(lines, encoding="utf-8")
    if args.json:
        print(json.dumps(result))  # noqa: T201 - the command's output
        return 0
    for e in result["flagged"]:
        print(f"{e['id']}: {e['reason']} ({e['preview'][:60]!r})")  # noqa: T201
    print(  # noqa: T201
        f"{len(result['flagged'])} of {result['documents']} documents flagged "
        f"({result['bytes'] / 1e6:.1f} MB of text in {result['file_bytes'] / 1e6:.1f} MB of "
        f"files, at {result['mb_per_s']:.0f} MB/s; MB = 10^6 bytes)"
        + (f"; blocklist in {args.out}" if args.out else "")
    )
    return 0
