"""Genuine spikes (issue 30): Adam's own instability on a CPU, detected, warned and cured.

    python benchmarks/studies/genuine_spikes.py --quick         # the MLP, 4 seeds (< 10 min)
    python benchmarks/studies/genuine_spikes.py --root runs/gs   # + the LM, lead times, remedies

The cases are examples/genuine_spikes.py's (a user can run each). Every run goes through the
Watch into a store (`--root`/spikewatch.db), so the dashboard shows them.

**Ground truth** comes from the loss alone, by a rule that does not use the detector: a step is
high when the loss exceeds 100x the floor of the 50 steps before it (their 10th percentile: the
bottom of the band, robust to the five deepest one-step troughs); a spike is a run of high steps
(gaps under 10 steps joined), its onset the first step back from there (at most 50) above 3x
that floor, its peak the highest loss, its end the last high step. These curves fall by orders
of magnitude, so a two-decade jump is unambiguous. (The floor was the window's minimum until
the detector's climb rule: near the MLP's floor the loss swings between 1e-9 and 1e-6 from step
to step, and a peak of that swing is 100x the one deepest trough before it, so the minimum
labelled ordinary swings as spikes; the last line's `min_floor` counts with it.)

**Detection** (the Watch, detection only, default detector): a labelled spike is detected when a
`spike` verdict's detection step lies in [onset, end + 3]; a verdict that matches no spike is a
false alarm. Also counted: verdicts per spike (one expected).

**Lead times** (full run): a signal's warning episode starts where its rule holds and did not on
the step before; a spike is warned when an episode starts within 100 steps before its onset;
the lead is the onset minus the first such start. False warnings: episodes starting on clean
stretches (steps farther than 100 before and 50 after every spike), per 10k clean steps. The
preconditioned sharpness (Bai et al.) is the largest eigenvalue of diag(1/(sqrt(v_hat)+eps)) H,
by power iteration on Hessian-vector products every `--sharpness-every` steps; its rule is
lr x sharpness > 38, Adam's stability limit (2 + 2 beta1) / (1 - beta1) at beta1 = 0.9.

**Remedies** (full run): the same seeds with each `--remedy` of the example; the final loss (the
geometric mean of the last 50 steps), the steps computed beyond the plan, the spikes left on
the kept curve and the halts.

Last line: one JSON object, {"seeds", "spiking_seeds", "spikes", "detected", "false_alarms", ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other studies
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/_common
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def _example() -> Any:
    """examples/genuine_spikes.py (the same file name as this one)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "genuine_spikes.py"
    spec = importlib.util.spec_from_file_location("genuine_spike_cases", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


import numpy as np  # noqa: E402
import torch  # noqa: E402
from early_warning import OFFLINE as WARNING_RULES  # noqa: E402
from early_warning import ONLINE, drop, episode_starts  # noqa: E402
from sqlalchemy import select  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from spikewatch.observatory import metric_names as M  # noqa: E402
from spikewatch.observatory import store  # noqa: E402
from spikewatch.observatory.store import across_runs as across  # noqa: E402
from spikewatch.observatory.store.models import Event  # noqa: E402
from spikewatch.trainer.core.callbacks import Callback, StepState  # noqa: E402

_cases = _example()
REMEDIES, run = _cases.REMEDIES, _cases.run
RISE, WINDOW, EDGE, GAP, FLOOR_Q = 100.0, 50, 3.0, 10, 10.0
HORIZON, AFTER = 100, 50
ADAM_LIMIT = 38.0  # (2 + 2 beta1) / (1 - beta1), beta1 = 0.9


class Sharpness(Callback):
    """lr x the largest eigenvalue of Adam's preconditioned Hessian, diag(1/(sqrt(v_hat)+eps))
    H, every `every` steps after the update: power iteration on the symmetric form D^1/2 H D^1/2
    with Hessian-vector products (double backward on the full batch), warm-started from the
    last eigenvector. Keeps (step, value) and the seconds it took."""

    priority = -100

    def __init__(self, case: Any, optimizer: torch.optim.Optimizer, every: int, iters: int = 8):
        self.case, self.optimizer, self.every, self.iters = case, optimizer, every, iters
        self.values: list[tuple[int, float]] = []
        self.seconds = 0.0
        self._u: list[torch.Tensor] | None = None

    def post_step(self, state: StepState) -> None:
        if state.step % self.every or not state.applied:
            return
        t0 = time.perf_counter()
        group = self.optimizer.param_groups[0]
        params = [p for p in group["params"] if p.requires_grad]
        (_, b2), eps = group["betas"], group["eps"]
        half = []
        for p in params:
            st = self.optimizer.state[p]
            v_hat = st["exp_avg_sq"] / (1 - b2 ** float(st["step"]))
            half.append((v_hat.sqrt() + eps).rsqrt())
        with sdpa_kernel(SDPBackend.MATH):  # twice differentiable (the fused kernels are not)
            loss = self.case.loss_fn(self.case.batch)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        u = self._u or [torch.randn_like(p) for p in params]
        lam = 0.0
        for _ in range(self.iters):
            norm = torch.sqrt(sum((x * x).sum() for x in u))
            u = [x / norm for x in u]
            hv = torch.autograd.grad(
                grads, params, grad_outputs=[h * x for h, x in zip(half, u, strict=True)],
                retain_graph=True,
            )  # fmt: skip
            z = [h * x for h, x in zip(half, hv, strict=True)]
            lam = float(sum((a * b).sum() for a, b in zip(u, z, strict=True)))
            u = [x.detach() for x in z]
        self._u = u
        self.values.append((state.step, group["lr"] * lam))
        self.seconds += time.perf_counter() - t0


def label(
    losses: list[float], floor: float = 0.0, q: float = FLOOR_Q
) -> list[tuple[int, int, int]]:
    """(onset, peak, end) of each spike of a loss curve (steps from 1), by the rule above, on
    the loss's excess over its floor (the least loss possible: 0, or the entropy of the
    smoothed targets). A spike must also raise the loss itself by 10% (a hundredfold jump of a
    1e-5 excess over a floor of 0.9 is no spike a user sees)."""
    total = np.asarray(losses, np.float64)
    v = np.maximum(total - floor, 1e-30)
    n = len(v)
    base = np.full(n, np.inf)
    if n > WINDOW:
        windows = np.lib.stride_tricks.sliding_window_view(v, WINDOW)[:-1]
        base[WINDOW:] = np.percentile(windows, q, axis=1)  # q = 0: the minimum
    high = v > RISE * base
    out: list[tuple[int, int, int]] = []
    i = 0
    while i < n:
        if not high[i]:
            i += 1
            continue
        end = i
        while end + 1 < n and (high[end + 1] or high[end + 1 : end + GAP + 1].any()):
            end += 1
        floor_i = base[i]
        onset = i
        while onset > i - WINDOW and v[onset - 1] > EDGE * floor_i:
            onset -= 1
        peak = onset + int(np.argmax(v[onset : end + 1]))
        if total[peak] >= 1.1 * total[i - WINDOW : i].min():
            out.append((onset + 1, peak + 1, end + 1))
        i = end + 1
    return out


def verdicts(session, run_id: str) -> list[tuple[int, int]]:
    """(detection step, onset) of the run's spike verdicts."""
    pk = across.runs_by_key(session, [run_id])[run_id].id
    rows = session.execute(
        select(Event.step, Event.data).where(Event.run_id == pk, Event.kind == "spike")
    ).all()
    return sorted((int(step), int(d.get("onset_step", step))) for step, d in rows)


def match(spikes: list[tuple[int, int, int]], found: list[tuple[int, int]]) -> dict[str, int]:
    detected = extra = 0
    used: set[int] = set()
    for onset, _, end in spikes:
        hits = [i for i, (d, _) in enumerate(found) if onset <= d <= end + 3]
        detected += bool(hits)
        extra += max(0, len(hits) - 1)
        used.update(hits)
    return {
        "spikes": len(spikes),
        "detected": detected,
        "extra_verdicts": extra,
        "false_alarms": len(found) - len(used),
    }


# (name, per-layer stat, rule, the rule in words): the census study's per-layer rules, and a drop
# of Adam's max sqrt(v) for the decay Bai et al. describe
_CENSUS = {o[0]: o for o in WARNING_RULES}
OFFLINE = [
    *(_CENSUS[n] for n in ("layer grad norm 3x", "update/param ratio 3x", "Adam v collapse")),
    (
        "Adam max sqrt(v) drop",
        M.STAT_ADAM_SQRT_V_MAX,
        drop(3.0),
        "a layer's max sqrt(v) < its median / 3",
    ),
    _CENSUS["attention logit 2x"],
]
SHARPNESS = "preconditioned sharpness"
PER_SEED = (
    "seed", "run_id", "spikes", "detected", "false_alarms", "extra_verdicts", "min_loss",
    "labels", "verdicts", "signals", "steps_run", "min_floor",
)  # fmt: skip


def episodes(session, run_id: str) -> dict[str, set[int]]:
    """Warning episode starts of every signal the run recorded."""
    pk = across.runs_by_key(session, [run_id])[run_id].id
    rows = session.execute(
        select(Event.step, Event.data).where(Event.run_id == pk, Event.kind == "note")
    ).all()
    out: dict[str, set[int]] = {}
    for name, is_it in ONLINE.items():
        out[name] = {
            int(step)
            for step, d in rows
            if d.get("kind") == "warning" and is_it(str(d.get("signal", "")))
        }
    tree_of = across.trees(session, [pk])
    for name, stat, rule, _ in OFFLINE:
        found: set[int] = set()
        for st, v in across.layer_values(session, [pk], tree_of, stat)[pk].values():
            if len(v):
                found |= episode_starts(st, rule(v))
        out[name] = found
    return out


def detection(
    case: str, seeds: list[int], steps: int, db: str, sharpness_every: int = 0
) -> list[dict[str, Any]]:
    rows = []
    for seed in seeds:
        probes: list[Sharpness] = []

        def extra(
            c: Any, opt: torch.optim.Optimizer, probes: list[Sharpness] = probes
        ) -> list[Callback]:
            probes.extend([Sharpness(c, opt, sharpness_every)] if sharpness_every else [])
            return list(probes)

        r = run(case, seed, steps, "none", db=db, callbacks=extra)
        spikes = label(r["losses"], r["floor"])
        with store.session_factory(db)() as s:
            found = verdicts(s, r["run_id"])
            signals = episodes(s, r["run_id"]) if sharpness_every else {}
        if probes:
            sharp = probes[0].values
            st = np.array([x for x, _ in sharp], np.int64)
            signals[SHARPNESS] = episode_starts(st, np.array([y > ADAM_LIMIT for _, y in sharp]))
        row = {"case": case, "seed": seed, "run_id": r["run_id"], "seconds": r["seconds"]}
        row |= match(spikes, found) | {"labels": spikes, "verdicts": found}
        row["min_floor"] = match(label(r["losses"], r["floor"], q=0.0), found)
        row["min_loss"] = float(min(r["losses"]))
        row["steps_run"] = len(r["losses"])
        row["signals"] = {k: sorted(v) for k, v in signals.items()}
        if probes:
            row["sharpness"] = probes[0].values
            row["sharpness_seconds"] = round(probes[0].seconds, 1)
        rows.append(row)
        shown = {k: v for k, v in row.items() if k not in ("labels", "verdicts", "signals")}
        print(json.dumps(shown | {"sharpness": None}))
    return rows


def lead_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per signal: isolated spikes (none other in the HORIZON + AFTER steps before the onset,
    so that a warning cannot be the last spike's aftermath) warned within HORIZON steps before
    the onset, the median lead, and the false warnings per 10k clean steps."""
    names = [*ONLINE, *(o[0] for o in OFFLINE), SHARPNESS]
    out = []
    for name in names:
        leads, warned, spikes, false, clean = [], 0, 0, 0, 0
        for r in rows:
            starts = r["signals"].get(name, [])
            near = np.zeros(r["steps_run"] + 2, bool)
            ends = [-(10**9)] + [end for _, _, end in r["labels"]]
            for k, (onset, _, end) in enumerate(r["labels"]):
                near[max(0, onset - HORIZON) : min(len(near), end + AFTER + 1)] = True
                if ends[k] >= onset - HORIZON - AFTER:
                    continue  # not isolated
                spikes += 1
                early = [x for x in starts if onset - HORIZON <= x <= onset]
                if early:
                    warned += 1
                    leads.append(onset - min(early))
            clean += int((~near[1:]).sum())
            false += sum(1 for x in starts if x < len(near) and not near[x])
        out.append(
            {
                "signal": name,
                "warned": warned,
                "spikes": spikes,
                "median_lead": statistics.median(leads) if leads else None,
                "false_warnings": false,
                "clean_steps": clean,
                "false_per_10k_clean": round(1e4 * false / clean, 1) if clean else None,
            }
        )
    return out


def remedies(case: str, seeds: list[int], steps: int, db: str) -> list[dict[str, Any]]:
    out = []
    for remedy in REMEDIES:
        runs = [run(case, seed, steps, remedy, db=db) for seed in seeds]
        row = {
            "case": case,
            "remedy": remedy,
            "final_loss": [r["final_loss"] for r in runs],
            "extra_steps": [r["steps_computed"] - steps for r in runs],
            "spikes_left": [len(label(r["losses"], r["floor"])) for r in runs],
            "halted": sum(1 for r in runs if r["halted"]),
            "eps_raised": [r["eps_raised"] for r in runs],
        }
        out.append(row)
        print(json.dumps(row))
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "seeds": len(rows),
        "spiking_seeds": sum(1 for r in rows if r["spikes"]),
        "spikes": sum(r["spikes"] for r in rows),
        "detected": sum(r["detected"] for r in rows),
        "false_alarms": sum(r["false_alarms"] for r in rows),
        "extra_verdicts": sum(r["extra_verdicts"] for r in rows),
        "min_floor": {  # the same verdicts against the labels of the window-minimum rule
            k: sum(r["min_floor"][k] for r in rows) for k in rows[0]["min_floor"]
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the MLP's detection only, 4 seeds")
    ap.add_argument("--root", default=None, help="where the store goes (default: a temp dir)")
    ap.add_argument("--cases", default="mlp,lm")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--steps", default="mlp=2500,lm=3000", help="steps per case")
    ap.add_argument("--remedy-cases", default="mlp,lm")
    ap.add_argument("--remedy-seeds", type=int, default=2)
    ap.add_argument("--sharpness-every", type=int, default=50)
    ap.add_argument("--report", action="store_true", help="the tables again from report.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    root = Path(args.root) if args.root else Path(__import__("tempfile").mkdtemp())
    root.mkdir(parents=True, exist_ok=True)
    db = f"sqlite:///{root / 'spikewatch.db'}"
    t0 = time.perf_counter()
    if args.quick:
        rows = detection("mlp", list(range(args.seeds or 4)), 2500, db)
        out = summary(rows) | {"case": "mlp", "seconds": round(time.perf_counter() - t0)}
        print(json.dumps(out))
        return
    steps = {k: int(v) for k, v in (x.split("=") for x in args.steps.split(","))}
    if args.report:
        report = json.loads((root / "report.json").read_text())
        for case, part in report.items():
            part["leads"] = lead_table(part["per_seed"])
            print(json.dumps({case: part["leads"]}))
        (root / "report.json").write_text(json.dumps(report, indent=1))
        return
    report: dict[str, Any] = {}
    for case in args.cases.split(","):
        seeds = list(range(args.seeds or 4))
        rows = detection(case, seeds, steps[case], db, args.sharpness_every)
        cost = [r["sharpness_seconds"] / r["seconds"] for r in rows if "sharpness_seconds" in r]
        report[case] = {
            "detection": summary(rows),
            "per_seed": [{k: r[k] for k in PER_SEED} for r in rows],
            "leads": lead_table(rows),
            "sharpness_share_of_run_time": round(statistics.median(cost), 3) if cost else None,
            "remedies": remedies(case, seeds[: args.remedy_seeds], steps[case], db)
            if case in args.remedy_cases.split(",") and args.remedy_seeds
            else [],
        }
        (root / "report.json").write_text(json.dumps(report, indent=1))
    parts = [report[c]["detection"] for c in report]
    total = {k: sum(d[k] for d in parts) for k in parts[0] if k != "min_floor"}
    total["min_floor"] = {k: sum(d["min_floor"][k] for d in parts) for k in parts[0]["min_floor"]}
    print(json.dumps(total | {"seconds": round(time.perf_counter() - t0)}))


if __name__ == "__main__":
    main()
