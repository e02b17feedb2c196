"""The blocklist: the samples a run's rollbacks named, as JSON lines a data loader can read
(`spikewatch quarantine RUN`), in the format `spikewatch data-check` writes too.

One line per sample: {"source": "rollback", "run": RUN, "step": detection step, "batch": batch
index, "row": row, "id": the data's own id (or null), "loss": ..., "grad_norm": ...,
"preview": its beginning}. A loader keeps out the lines' `id`s (documents, file offsets), or,
replaying the same sampler, the (batch, row) pairs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spikewatch.observatory.strict_json import tagged

if TYPE_CHECKING:  # the store is imported when the command runs: `spikewatch` starts fast
    from sqlalchemy.orm import Session

__all__ = ["add_parser", "blocklist_lines", "read_blocklist"]


def blocklist_lines(session: Session, *, run_id: str) -> list[str]:
    """The run's named samples as JSON lines (strict JSON: a NaN loss is the string "nan")."""
    from spikewatch.observatory.store import queries

    rows = queries.samples(session, run_id=run_id)
    return [
        json.dumps(
            tagged(
                {
                    "source": "rollback",
                    "run": run_id,
                    "step": r.step,
                    "batch": r.batch,
                    "row": r.row,
                    "id": r.sample_id,
                    "loss": r.loss,
                    "grad_norm": r.grad_norm,
                    "preview": r.preview,
                }
            ),
            allow_nan=False,
        )
        for r in rows
    ]


def read_blocklist(path: str) -> Iterator[dict[str, Any]]:
    """The lines of a blocklist file (quarantine's or data-check's), each a dict; a line that is
    not a JSON object is an error naming its number."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(entry, dict):
                raise ValueError(f"{path}:{n}: a blocklist line must be a JSON object")
            yield entry


def add_parser(sub: Any, default_db: Callable[[str], str | None]) -> None:
    """`spikewatch quarantine RUN [--db URL] [--out FILE]`; `default_db(run)` finds the store
    when --db is not given (as for `logbook`)."""
    p = sub.add_parser(
        "quarantine", help="the samples a run's rollbacks named, as a JSON-lines blocklist"
    )
    p.add_argument("run", help="run id, or its run directory (runs/<id>)")
    p.add_argument("--db", default=None, help="store URL (default as for train)")
    p.add_argument("--out", default=None, help="write the blocklist here (default: stdout)")
    p.set_defaults(func=lambda args: run(args, default_db))


def run(args: argparse.Namespace, default_db: Callable[[str], str | None]) -> int:
    from spikewatch.observatory.store.queries import session_factory

    with session_factory(args.db or default_db(args.run))() as session:
        try:
            lines = blocklist_lines(session, run_id=Path(args.run).name)
        except LookupError as e:
            raise ValueError(str(e)) from None
    text = "".join(line + "\n" for line in lines)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        print(text, end="")  # noqa: T201 - the command's output
    return 0
