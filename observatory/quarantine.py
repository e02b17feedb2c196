"""The blocklist: the samples a run's rollbacks named, as JSON lines a data loader can read
(`spikewatch quarantine RUN`), in the format `spikewatch data-check` writes too.

One line per sample: {"source": "rollback", "run": RUN, "step": detection step, "batch": batch
index, "row": row, "id": the data's own id (or null), "loss": ..., "grad_norm": ...,
"preview": its beginning}. A loader keeps out the lines' `id`s (documents, file offsets), or,
replaying the same sampler, the (batch, row) pairs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from sqlalchemy.orm import Session

from observatory.store import queries
from observatory.strict_json import tagged

__all__ = ["blocklist_lines", "read_blocklist"]


def blocklist_lines(session: Session, *, run_id: str) -> list[str]:
    """The run's named samples as JSON lines (strict JSON: a NaN loss is the string "nan")."""
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
