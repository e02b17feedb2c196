"""What a rollback found, in one phrase, the same wherever a verdict is told (the console, the
logbook, an alert, the run page): a learning-rate cut it made, the cause its replay found, the
ranks whose own loss departed, and the samples the attribution named: each said in every
report, not in one of them only (a JSON field, a table column, a chart)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["findings", "skipped", "suspect_devices"]

_CAUSES = {
    "data_x_state": "the data (it comes back on the same batches)",
    "transient": "transient (it does not come back on the same batches)",
    "state": "the optimizer state (it comes back on batches that trained well)",
    "device": "the device (the same rows give another loss on a replay or on another rank)",
    "unknown": "unknown",
}


def findings(data: Mapping[str, Any], most: int = 4) -> str:
    """'cause: ...; ranks 1; 26 samples named: batch 200 rows 0,1; ...' ('' when nothing is
    known beyond the rollback itself)."""
    parts = []
    cut = data.get("lr_scale")
    if isinstance(cut, int | float) and 0 < cut < 1:  # said wherever the rollback is told
        total = data.get("lr_scale_after")
        overall = (
            f" (x{total:g} of its schedule in all)"
            if isinstance(total, int | float) and abs(total - cut) > 1e-12
            else ""
        )
        why = data.get("lr_cut")
        parts.append(f"the learning rate cut x{cut:g} from now on{overall}"
                     + (f": {why}" if why else ""))  # fmt: skip
    cause = data.get("cause")
    if cause:
        parts.append(f"cause: {_CAUSES.get(str(cause), str(cause))}")
    ranks = data.get("ranks")
    if ranks:
        parts.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} departed")
    if data.get("device_ranks"):
        how = {
            "replay": "otherwise the first time",
            "swap": "wrong: another rank computes its rows",
        }
        ranks_shown = ", ".join(map(str, data["device_ranks"]))
        check = how.get(str(data.get("device_check")), "")
        parts.append(f"the device of rank(s) {ranks_shown} computed it {check}".rstrip())
    if data.get("suspect_devices"):
        shown = ", ".join(map(str, data["suspect_devices"]))
        parts.append(
            f"rank(s) {shown}: a suspect device (spikes keep coming there without a data cause)"
        )
    samples = data.get("samples") or []
    att = data.get("attribution") or {}
    if samples:
        by_batch: dict[Any, list[str]] = {}
        for s in samples:
            by_batch.setdefault(s.get("batch"), []).append(str(s.get("row")))
        shown = "; ".join(f"batch {b} rows {','.join(r)}" for b, r in list(by_batch.items())[:most])
        more = f" and {len(by_batch) - most} more batches" if len(by_batch) > most else ""
        parts.append(f"{len(samples)} of {att.get('rows', '?')} rows named: {shown}{more}")
    elif att:
        parts.append(f"no row of {att.get('rows', '?')} stands out (whole batches skipped)")
    return "; ".join(parts)


def skipped(data: Mapping[str, Any]) -> str:
    """What a rollback skipped, one phrase for every report (the console, the record's reason,
    the logbook, the run page, alerts): the named samples when only they were left out (their
    batches' other rows train), else the whole batches: the same words in every report."""
    passed = int(data.get("passed_over") or 0)  # the Watch: the loop's data flowed on
    also = (
        f"; {passed} clean batch{'es' if passed != 1 else ''} since the restored step passed over"
    )
    also = also if passed else ""
    n = int(data.get("skipped_samples") or 0)
    if n:
        kept = ", ".join(f"[{a}, {b})" for a, b in data.get("batches_kept") or [])
        plural = "s" if n != 1 else ""
        return f"skipping {n} named sample{plural} of batches {kept} (the other rows train){also}"
    ranges = data.get("skip_ranges") or []
    if ranges:
        return "skipping batches " + ", ".join(f"[{a}, {b})" for a, b in ranges) + also
    return "skipping nothing" + also


def suspect_devices(events: Iterable[Mapping[str, Any]]) -> dict[int, int]:
    """Rank -> rollbacks without a data cause (device or transient) that named it, for the ranks
    named by two or more: a suspect device."""
    counts: dict[int, int] = {}
    for d in events:
        if d.get("cause") in ("device", "transient"):
            for r in d.get("device_ranks") or d.get("ranks") or []:
                counts[int(r)] = counts.get(int(r), 0) + 1
    return {r: n for r, n in sorted(counts.items()) if n >= 2}
