"""`spikewatch simulate` and `spikewatch advise`: their options, the scenario they describe, and
what they print."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from spikewatch.observatory.goodput.engine import BUCKETS, simulate
from spikewatch.observatory.goodput.model import (
    LLAMA3_MAINTENANCE_EVERY_S,
    LLAMA3_PER_GPU_DAY,
    LLAMA3_SDC_PER_GPU_DAY,
    Cause,
    Corruption,
    Failures,
    Maintenance,
    Scenario,
    Spikes,
    Tier,
)
from spikewatch.observatory.goodput.plan import (
    interval_grid,
    measure,
    optimize,
    pick_interval,
    report,
    simulated_optimum,
    young_daly,
)
from spikewatch.observatory.goodput.young_daly import daly, overhead, parse_duration, young

__all__ = [
    "FAILURE_MODELS",
    "add_parser",
    "add_parsers",
    "advise",
    "options",
    "run",
    "scenario_from_args",
]

# Failures per GPU-day. Llama 3: 419 in 54 days on 16,384 GPUs. Kokolis et al. (arXiv
# 2410.21680): 6.50 and 2.34 failures per 1000 node-days on RSC-1 and RSC-2, 8 GPUs a node; their
# causes are not split here the way Table 5 splits Llama 3's, so Table 5's shares serve for all.
SEARCH_SEEDS = 40  # the disk interval search's seeds (best_interval's)
FAILURE_MODELS = {"llama3": LLAMA3_PER_GPU_DAY, "rsc1": 6.50e-3 / 8, "rsc2": 2.34e-3 / 8}


def options(params: dict[str, str]) -> argparse.Namespace:
    """The command's options from name/value pairs (the dashboard's query string): the same
    names, defaults and checks as `spikewatch simulate`; a bad one raises ValueError."""
    parser = argparse.ArgumentParser(prog="simulate", exit_on_error=False, add_help=False)
    sub = parser.add_subparsers()
    add_parser(sub)
    cmd = sub.choices["simulate"]
    cmd.exit_on_error = False
    argv = ["simulate"]
    for name, value in params.items():
        flag = "--" + name.replace("_", "-")
        if flag not in cmd._option_string_actions:  # noqa: SLF001 - argparse has no public view
            raise ValueError(f"unknown option {name!r}")
        if cmd._option_string_actions[flag].nargs == 0:  # noqa: SLF001
            if value.lower() in ("1", "true", "on", "yes"):
                argv.append(flag)
        else:
            argv += [flag, value]
    try:
        args, rest = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(str(e)) from None
    if rest:
        raise ValueError(f"unexpected {' '.join(rest)}")
    return args


def add_parsers(sub: Any) -> None:
    """`simulate` and `advise`, each calling its function."""
    add_parser(sub)
    sub.choices["simulate"].set_defaults(func=run)
    advise_ = sub.add_parser("advise", help="checkpoint interval by Young/Daly")
    advise_.add_argument("--mtbf", required=True, help="mean time between failures, e.g. 3.1h")
    advise_.add_argument("--save-cost", required=True, help="time one save costs, e.g. 5min")
    advise_.add_argument("--json", action="store_true", help="also print a JSON line")
    advise_.set_defaults(func=advise)


def advise(args: argparse.Namespace) -> int:
    """Young's and Daly's intervals, and the simulated optimum of their own setting."""
    mtbf, cost = parse_duration(args.mtbf), parse_duration(args.save_cost)
    rows = [("Young", young(cost, mtbf)), ("Daly", daly(cost, mtbf))]
    out: dict[str, Any] = {"mtbf_s": mtbf, "save_cost_s": cost}
    for name, t in rows:
        print(  # noqa: T201 - the command's output
            f"{name:>5}: checkpoint every {t / 60:.1f} min "
            f"(expected overhead {100 * overhead(t, cost, mtbf):.1f}% of wall time)"
        )
        out[f"{name.lower()}_interval_s"] = t
        out[f"{name.lower()}_overhead"] = overhead(t, cost, mtbf)
    sim, lost = simulated_optimum(cost, mtbf)
    print(  # noqa: T201
        f"  Sim: checkpoint every {sim / 60:.1f} min (lost {100 * lost:.1f}% of wall time; "
        f"{100 * (sim / rows[1][1] - 1):+.1f}% from Daly): `spikewatch simulate` adds restarts, "
        "spikes, tiers and retention"
    )
    out["simulated_interval_s"] = sim
    out["simulated_overhead"] = lost
    if args.json:
        print(json.dumps(out))  # noqa: T201
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="goodput of a large run: failures, spikes, checkpoint tiers (a simulation)",
        description="Simulate a training run at any scale, many seeds, and report goodput with "
        "badput by bucket. Defaults: Llama 3 405B's interruptions and PaLM's spikes. Intervals "
        "are steps, or durations such as 30min.",
    )
    run_ = p.add_argument_group("the run")
    run_.add_argument("--gpus", type=int, default=16_384)
    run_.add_argument(
        "--step-time", default=None, help="one step's time (default 6s, or the run's measured)"
    )
    size = run_.add_mutually_exclusive_group()
    size.add_argument("--steps", type=int, default=None, help="steps to train")
    size.add_argument("--days", type=float, default=54.0, help="failure-free length (default 54)")
    fail = p.add_argument_group("failures")
    fail.add_argument("--failure-model", choices=sorted(FAILURE_MODELS), default="llama3")
    fail.add_argument(
        "--failures-per-gpu-day", type=float, default=None, help="overrides the model"
    )
    fail.add_argument("--causes", type=Path, default=None, help="JSON list of causes (see docs)")
    fail.add_argument("--restart", default="5min", help="detect + schedule + init + warm-up")
    sp = p.add_argument_group("spikes")
    sp.add_argument(
        "--spikes-per-1k", type=float, default=None, help="default: PaLM's 0.078, or the run's"
    )
    sp.add_argument(
        "--spike-back",
        default=None,
        help="steps before detection the target must lie: N or N,M,... (default 100, or the run's)",
    )
    sp.add_argument("--skip", type=int, default=None, help="batches skipped per rollback (350)")
    sp.add_argument(
        "--spike-repeat",
        type=float,
        default=0.0,
        help="chance a rolled-back spike comes back at its step (0: our fault runs)",
    )
    more = p.add_argument_group("more failure modes (docs/goodput.md: each default's source)")
    more.add_argument(
        "--recovery-failures", action="store_true", help="a restart or restore can fail too"
    )
    more.add_argument(
        "--maintenance",
        nargs="?",
        const="llama3",
        default=None,
        help="planned stops every DURATION (alone: Llama 3's 47 in 54 days, every 27.6h)",
    )
    more.add_argument("--maintenance-window", default="30min", help="a planned stop's length")
    more.add_argument(
        "--sdc-rate",
        default=None,
        help="silent data corruptions per GPU-day, or 'llama3' (6 in 54 days on 16,384 GPUs)",
    )
    more.add_argument(
        "--sdc-detect", default="1000", help="steps (or a duration) until a corruption is found"
    )
    more.add_argument(
        "--straggler", type=float, default=0.0, help="every step this fraction slower (0.05)"
    )
    tiers = p.add_argument_group("checkpoint tiers")
    tiers.add_argument("--tiers", default="memory,disk", help="memory,disk or disk")
    for name, d in (("memory", Scenario().tier("memory")), ("disk", Scenario().tier("disk"))):
        assert d is not None
        tiers.add_argument(
            f"--{name}-interval", default=str(d.interval), help=f"default {d.interval} steps"
        )
        tiers.add_argument(
            f"--{name}-stall",
            default=None,
            help=f"blocking per save ({d.stall_s:g}s, or the run's)",
        )
        tiers.add_argument(f"--{name}-restore", default=f"{d.restore_s:g}s")
        if name == "disk":  # a host-memory snapshot is whole once copied: its cost is the stall
            tiers.add_argument("--disk-write", default=f"{d.write_s:g}s", help="background write")
        tiers.add_argument(
            f"--{name}-retention",
            default="exponential",
            help="exponential[:K] (the newest K, then one per power-of-two age) or last:K",
        )
        tiers.add_argument(f"--{name}-max-kept", type=int, default=None, help="a count budget")
    tiers.add_argument("--memory-replicas", type=int, default=2, help="2: survives a host's loss")
    tiers.add_argument(
        "--retention", default=None, help="both tiers' retention: exponential[:K] or last:K"
    )
    out = p.add_argument_group("what to do")
    out.add_argument("--seeds", type=int, default=100)
    out.add_argument("--seed", type=int, default=0)
    out.add_argument(
        "--optimize",
        action="store_true",
        help="search the memory interval, disk interval and memory retention together",
    )
    out.add_argument(
        "--memory-budget",
        type=int,
        default=None,
        metavar="SNAPSHOTS",  # a count, not bytes: in the usage line too
        help="with --optimize: snapshots host memory holds (its size / one snapshot's)",
    )
    out.add_argument("--from-run", default=None, metavar="RUN", help="measured inputs from a run")
    out.add_argument("--db", default=None, help="store URL for --from-run")
    out.add_argument("--no-search", action="store_true", help="skip the disk interval search")
    out.add_argument("--json", action="store_true", help="one JSON object on stdout")


SHOWN = BUCKETS[1:6]  # badput rows printed even at zero: the ones every run has


def _steps(text: str, step_s: float, what: str) -> int:
    """An interval: a number of steps (`500`, `1e3`), or a duration (`30min`) in steps."""
    try:
        steps = float(text)
    except ValueError:
        steps = parse_duration(text) / step_s
        if steps < 1:
            raise ValueError(f"{what} {text!r} is shorter than one {step_s:g} s step") from None
        return round(steps)
    if steps < 1 or steps != int(steps):
        raise ValueError(f"{what} {text!r}: a whole number of steps >= 1, or a duration")
    return int(steps)


def _retention(text: str) -> tuple[str, int]:
    kind, _, k = text.replace("-", ":").partition(":")
    if kind not in ("exponential", "last") or (k and not k.isdigit()):
        raise ValueError(f"retention is exponential[:K] or last:K, not {text!r}")
    return kind, int(k) if k else 2


def _causes(path: Path) -> tuple[Cause, ...]:
    try:
        rows = json.loads(path.read_text())
        return tuple(
            Cause(
                str(r["name"]),
                float(r["share"]),
                None if r.get("restart") is None else parse_duration(str(r["restart"])),
                bool(r.get("host_lost", False)),
            )
            for r in rows
        )
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(
            f"--causes {path}: {e}; expected a JSON list of "
            '{"name": ..., "share": 0.3, "restart": "10min", "host_lost": false}'
        ) from None


def scenario_from_args(
    args: argparse.Namespace, measured: dict[str, Any] | None = None
) -> Scenario:
    """The scenario the options describe. `measured` (a stored run's figures) fills what the
    options leave unset: the step time, the stalls, the spike rate and the rollback distances;
    an option given wins."""
    got = measured or {}
    base = Scenario()
    step_s = parse_duration(args.step_time) if args.step_time else got.get("step_s", base.step_s)
    if not (step_s > 0 and math.isfinite(step_s)):
        raise ValueError(f"the step time must be > 0, got {args.step_time!r}")
    if args.steps is not None:
        steps = args.steps
    elif args.days > 0 and math.isfinite(args.days):
        steps = max(1, round(args.days * 86_400 / step_s))
    else:
        raise ValueError(f"--days must be > 0, got {args.days}")
    rate = args.failures_per_gpu_day
    failures = Failures(
        per_gpu_day=FAILURE_MODELS[args.failure_model] if rate is None else rate,
        causes=_causes(args.causes) if args.causes else base.failures.causes,
        during_recovery=args.recovery_failures,
    )
    backs = tuple(got.get("back_steps") or base.spikes.back_steps)
    if args.spike_back:
        try:
            backs = tuple(int(x) for x in args.spike_back.split(","))
        except ValueError:
            raise ValueError(f"--spike-back is N or N,M,..., not {args.spike_back!r}") from None
    per_1k = got.get("spikes_per_1k_steps", base.spikes.per_1k_steps)
    spikes = Spikes(
        per_1k_steps=per_1k if args.spikes_per_1k is None else args.spikes_per_1k,
        back_steps=backs,
        skip=base.spikes.skip if args.skip is None else args.skip,
        repeat=args.spike_repeat,
    )
    names = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if set(names) - {"memory", "disk"} or "disk" not in names:
        raise ValueError(f"--tiers is memory,disk or disk, not {args.tiers!r}")
    tiers = [_tier(args, name, step_s, got) for name in ("memory", "disk") if name in names]
    return Scenario(
        gpus=args.gpus,
        step_s=step_s,
        steps=steps,
        restart_s=parse_duration(args.restart),
        failures=failures,
        spikes=spikes,
        tiers=tuple(tiers),
        maintenance=Maintenance(
            every_s=None
            if args.maintenance is None
            else LLAMA3_MAINTENANCE_EVERY_S
            if args.maintenance == "llama3"
            else parse_duration(args.maintenance),
            window_s=parse_duration(args.maintenance_window),
        ),
        corruption=Corruption(
            per_gpu_day=0.0
            if args.sdc_rate is None
            else LLAMA3_SDC_PER_GPU_DAY
            if args.sdc_rate == "llama3"
            else _rate(args.sdc_rate, "--sdc-rate"),
            detect_steps=_steps(args.sdc_detect, step_s, "--sdc-detect"),
        ),
        straggler=args.straggler,
    )


def _rate(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{what} is a number per GPU-day or 'llama3', not {text!r}") from None


def _tier(args: argparse.Namespace, name: str, step_s: float, got: dict[str, Any]) -> Tier:
    default = Scenario().tier(name)
    assert default is not None
    kind, keep_last = _retention(args.retention or getattr(args, f"{name}_retention"))
    stall = getattr(args, f"{name}_stall")
    return Tier(
        name,
        _steps(getattr(args, f"{name}_interval"), step_s, f"--{name}-interval"),
        stall_s=parse_duration(stall) if stall else got.get(f"{name}_stall_s", default.stall_s),
        restore_s=parse_duration(getattr(args, f"{name}_restore")),
        write_s=parse_duration(args.disk_write) if name == "disk" else 0.0,
        retention=kind,
        keep_last=keep_last,
        max_kept=getattr(args, f"{name}_max_kept"),
        replicas=args.memory_replicas if name == "memory" else 1,
    )


def run(args: argparse.Namespace) -> int:
    if args.seeds < 1 or args.seed < 0:
        raise ValueError("--seeds must be >= 1 and --seed >= 0")
    out: dict[str, Any] = {}
    if args.from_run:
        from spikewatch.observatory.store.db import store_url
        from spikewatch.observatory.store.queries import session_factory

        with session_factory(store_url(args.db))() as session:
            out["measured"] = measure(session, args.from_run)
    sc = scenario_from_args(args, out.get("measured"))
    t0 = time.perf_counter()
    if args.optimize:
        if args.memory_budget is not None and args.memory_budget < 1:
            raise ValueError("--memory-budget must be >= 1 snapshot")
        found = optimize(sc, seed=args.seed, budget=args.memory_budget)
        sc = found.pop("scenario")
        out["optimize"] = {**found, "seconds": time.perf_counter() - t0}
    t1 = time.perf_counter()
    # the plan and the disk interval search in one pass of the engine
    grid, plans = ([], []) if args.no_search else interval_grid(sc)
    lanes = simulate([sc, *plans], [args.seeds] + [SEARCH_SEEDS] * len(plans), args.seed)
    best = pick_interval("disk", grid, lanes, first=1) if plans else None
    out = {**report(sc, lanes), "seconds": time.perf_counter() - t1, **out}
    out["young_daly"] = young_daly(sc, best)
    out["scenario"] = _describe(sc)
    if args.json:
        print(json.dumps(out))  # noqa: T201 - the command's output
    else:
        print(_text(out))  # noqa: T201
    return 0


def _describe(sc: Scenario) -> dict[str, Any]:
    return {
        "gpus": sc.gpus,
        "step_s": sc.step_s,
        "steps": sc.steps,
        "mtbf_h": sc.mtbf_s / 3600,
        "restart_s": sc.restart_s,
        "failures_per_gpu_day": sc.failures.per_gpu_day,
        "spikes_per_1k_steps": sc.spikes.per_1k_steps,
        "spike_back_steps": list(sc.spikes.back_steps)[:50],
        "skip": sc.spikes.skip,
        "tiers": [
            {
                "name": t.name,
                "interval": t.interval,
                "stall_s": t.stall_s,
                "restore_s": t.restore_s,
                "write_s": t.write_s,
                "retention": t.retention if t.retention == "last" else "exponential",
                "keep_last": t.keep_last,
                "max_kept": t.max_kept,
                "replicas": t.replicas,
            }
            for t in sc.tiers
        ],
    }


def _text(out: dict[str, Any]) -> str:
    s = out["scenario"]
    tiers = "; ".join(
        f"{t['name']} every {t['interval']} steps (stall {t['stall_s']:g} s, restore "
        f"{t['restore_s']:g} s, {t['retention']}"
        + (f" {t['keep_last']})" if t["retention"] == "last" else ")")
        for t in s["tiers"]
    )
    lines = [
        f"{s['gpus']:,} GPUs, {s['steps']:,} steps of {s['step_s']:g} s; a failure every "
        f"{s['mtbf_h']:.2f} h, {s['spikes_per_1k_steps']:.3g} spikes per 1k steps; {tiers}",
        f"goodput {out['goodput']:.4f} (5-95%: {out['goodput_p5']:.4f}-{out['goodput_p95']:.4f} "
        f"over {out['seeds']} seeds), {out['wall_days']:.1f} days of wall time",
    ]
    lines += [f"  {k:<40} {100 * v:6.2f}%" for k, v in out["badput"].items() if v or k in SHOWN]
    happened = {k: v for k, v in out.get("modes", {}).items() if v}
    if happened:
        shown = (f"{v:.1f} {k.replace('_', ' ')}" for k, v in happened.items())
        lines.append("  " + ", ".join(shown))
    lines.append(
        f"{out['failures']:.0f} failures ({out['restores_from_memory']:.0f} restored from memory), "
        f"{out['spike_rollbacks']:.1f} spike rollbacks, {100 * out['rollbacks_further_back']:.1f}% "
        f"of them further back than the newest save before the onset"
    )
    yd = out["young_daly"]
    if "daly_interval_s" in yd:
        young_min, daly_min = yd["young_interval_s"] / 60, yd["daly_interval_s"] / 60
        line = f"Young / Daly: disk every {young_min:.1f} / {daly_min:.1f} min"
        if yd.get("simulated_best_at_edge"):  # the grid's end: a bound, not an optimum
            bound = "or longer" if yd["simulated_best_at_edge"] == "longest" else "or shorter"
            line += (
                f"; simulated best disk interval (other tiers as set) "
                f"{yd['simulated_best_interval_s'] / 60:.1f} min {bound} (the "
                f"{yd['simulated_best_at_edge']} tried, {100 * yd['simulated_vs_daly']:+.0f}% "
                f"from Daly)"
            )
        elif "simulated_best_interval_s" in yd:
            line += (
                f"; simulated best disk interval (other tiers as set) "
                f"{yd['simulated_best_interval_s'] / 60:.1f} min "
                f"({100 * yd['simulated_vs_daly']:+.1f}% from Daly)"
            )
        if "simulated_best_interval_s" in yd and out["restores_from_memory"] > 0:
            line += (  # why the simulated best leaves Daly's behind
                f". Daly's interval assumes every failure restores from disk; here "
                f"{out['restores_from_memory']:.0f} of {out['failures']:.0f} failures restored "
                f"from host memory, so disk saves guard only the rest and can be sparser"
            )
        lines.append(line)
    if "optimize" in out:
        o = out["optimize"]
        b = o["best"]
        memory = (
            "no memory tier"
            if b["memory_interval"] is None
            else f"memory every {b['memory_interval']} steps ({b['memory_retention']})"
        )
        budget = "" if o["budget"] is None else f" within {o['budget']} snapshots"
        lines.append(
            f"best of {o['configurations']} plans{budget}: {memory}, disk every "
            f"{b['disk_interval']} steps: goodput {b['goodput']:.4f} against "
            f"{o['given']['goodput']:.4f} for the plan as given ({100 * o['gain']:+.2f} points; "
            f"{o['seconds']:.1f} s); the figures above are the best plan's"
        )
    return "\n".join(lines)
