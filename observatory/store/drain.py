"""Spools a run left behind, replayed by `spikewatch db upgrade` and `spikewatch serve`.

A run whose database was away until after its end leaves its records in its run directory's
`spool/` (observatory/store/sink.py). The next sink on that directory replays them (a resume of
the run; for `spikewatch train` without --run-dir, the next such start, whose spool is
`runs/_/spool`). For a run never resumed, the store's own commands do it: every run the store
knows names its run directory, so they replay `RUN_DIR/spool` and the `_/spool` beside it. A
segment a live process still writes is locked and left to it; replays are idempotent, so a
segment replayed twice is harmless.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import select

from spikewatch.observatory.store.db import make_engine
from spikewatch.observatory.store.models import Run

__all__ = ["drain_spools", "left_spools"]

log = logging.getLogger(__name__)


def left_spools(url: str) -> list[Path]:
    """Spool directories holding segments, of the runs the store at `url` knows."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            dirs = [d for (d,) in conn.execute(select(Run.run_dir).distinct()) if d]
    finally:
        engine.dispose()
    found: list[Path] = []
    for run_dir in dirs:
        for spool in (Path(run_dir) / "spool", Path(run_dir).parent / "_" / "spool"):
            if spool not in found and any(spool.glob("spool-*.jsonl")):
                found.append(spool)
    return found


def drain_spools(url: str, timeout: float = 300.0) -> dict[Path, int]:
    """Replay every left spool into the store; returns {spool directory: records replayed}.
    A directory whose database write fails keeps its segments (said in the log)."""
    from spikewatch.observatory.store.sink import DbSink

    out: dict[Path, int] = {}
    for spool in left_spools(url):
        sink = DbSink(url, spool_dir=spool)
        sink.close(timeout=timeout)
        out[spool] = sink.stats["replayed"]
        left = sorted(p.name for p in spool.glob("spool-*.jsonl"))
        if left:
            log.warning("spool %s: %d segments not replayed yet: %s", spool, len(left), left)
        else:
            log.info("spool %s: %d records replayed into the store", spool, out[spool])
    return out
