"""A run's dated logbook as Markdown, in the spirit of the OPT-175B chronicles.

One entry per thing that happened, oldest first, each with its UTC time: the start and its
stability settings, spikes (onset, detection, how far above the level), non-finite steps,
rollbacks (from where, to which checkpoint, the skipped batches, the LR scale, the outcome),
halts, leading-signal notes (grouped when they repeat on consecutive steps), the branches a
rollback started, and the end. Built from the store only, so it works for any run it holds.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from spikewatch.observatory import store
from spikewatch.observatory.findings import findings, skipped

__all__ = ["logbook"]


def _when(dt: datetime) -> str:
    return dt.strftime("%Y-%m-%d %H:%M:%S UTC")


def _settings(config: dict[str, Any]) -> str:
    m, o = config.get("model", {}), config.get("optim", {})
    switches = [
        f"{k}={m[k]}"
        for k in ("qk_norm", "z_loss", "attn_softcap", "final_softcap", "norm_placement")
        if m.get(k) not in (None, False, "pre")
    ]
    parts = [
        m.get("model_type") or m.get("class"),
        m.get("n_layer") and f"{m['n_layer']} layers",
        m.get("d_model") and f"d={m['d_model']}",
        m.get("n_head") and f"{m['n_head']} heads",
        m.get("parameters") and f"{m['parameters'] / 1e6:,.1f}M parameters",
    ]
    shape = ", ".join(str(p) for p in parts if p) or "model not described"
    opt = " ".join(p for p in (o.get("name"), o.get("lr") is not None and f"lr={o['lr']:g}") if p)
    opt = opt or "optimizer not described"
    if o.get("qk_clip_tau"):
        opt += f", QK-Clip tau={o['qk_clip_tau']}"
    return f"{shape}; {opt}; " + (", ".join(switches) or "no stability switches")


def _entry(e: store.EventRow) -> str | None:
    d = e.data
    if e.kind == "spike":
        return (
            f"**Spike** detected at step {e.step} (branch {e.branch}): onset step "
            f"{d.get('onset_step')}, peak step {d.get('peak_step')}, "
            f"{d.get('score', 0):.1f} robust sigmas above the loss level."
        )
    if e.kind == "rollback":
        out = (
            f"**Rollback** from step {d.get('from_step', e.step)} to the checkpoint of step "
            f"{d.get('to_step')}, {d.get('skipped') or skipped(d)}, "
            f"LR x{d.get('lr_scale', 1.0)}."
        )
        found = findings(d)
        return f"{out} {found[0].upper()}{found[1:]}." if found else out
    if e.kind == "halt":
        return f"**Halted** at step {e.step}: {e.message}"
    if e.kind in ("skip", "nonfinite"):
        return f"**{e.kind.capitalize()}** at step {e.step}: {e.message}"
    if e.kind == "note" and d.get("kind") == "outcome":
        return (
            f"Outcome of the rollback at step {d.get('detect_step')}: {d.get('outcome')} at "
            f"step {d.get('recovered_at_step')}, loss {d.get('loss_delta', 0):+.4f} against "
            f"the pre-spike level {d.get('pre_spike_loss') or float('nan'):.4f}."
        )
    if e.kind == "note":
        return f"Note at step {e.step} ({d.get('signal', e.source)}): {e.message}"
    return f"{e.kind} at step {e.step}: {e.message}"


def logbook(session: Session, *, run_id: str) -> str:
    run = store.get_run(session, run_id=run_id)
    lines = [
        f"# Logbook of run `{run.run_id}` ({run.name})",
        "",
        f"- {_when(run.created_at)}: started. {_settings(run.config)}.",
    ]
    entries: list[tuple[datetime, int, str]] = []
    last_note: tuple[str, int] | None = None
    for e in store.events(session, run_id=run_id):
        text = _entry(e)
        if e.kind == "note":
            key = (str(e.data.get("signal")), e.step or 0)
            if last_note and last_note[0] == key[0] and key[1] - last_note[1] <= 1:
                last_note = key
                continue  # the same warning on consecutive steps: one entry
            last_note = key
        if text:
            entries.append((e.created_at, e.step or 0, text))
    for b in store.branches(session, run_id=run_id):
        if b.parent is not None:
            entries.append(
                (
                    b.created_at,
                    b.fork_step or 0,
                    f"Branch {b.number} starts from "
                    f"step {b.fork_step} of branch {b.parent}: {b.reason}",
                )
            )
    entries.sort(key=lambda t: (t[0], t[1]))
    lines += [f"- {_when(when)}: {text}" for when, _, text in entries]
    end = run.ended_at or run.updated_at
    lines.append(
        f"- {_when(end)}: {run.status} at step {run.last_step}, last loss "
        f"{run.last_loss if run.last_loss is not None else float('nan'):.4f}; "
        f"{run.spikes} spike(s), {run.rollbacks} rollback(s), {run.branches} branch(es)."
    )
    return "\n".join(lines) + "\n"
