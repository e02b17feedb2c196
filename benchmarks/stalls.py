"""A run that stops or slows is noticed: each fault injected into a Watch loop on this CPU (the
plain-loop GPT at 2 x 32, steps of ~10 ms, the store a SQLite file, alerts to a webhook on
127.0.0.1), and what the record and the webhook got. One row per fault, then one JSON line.

- stall: the batch function sleeps `--hang` seconds at step 40; the bound is 1 s here
  (`guard.stall.min_s`; 120 s by default). Detected within the bound plus the watchdog's wake
  (1 s) is the budget; the stall event's stack must name the sleeping frame; one alert.
- slowdown: from step 200 every step sleeps as long as a step takes (2x), for 3,800 steps;
  one `slowdown` event and one alert, the step it came at and the seconds from the fault to
  it (the rule: the median of the last 16 steps past 1.5x the baseline, lasting 30 s).
- gone: a Watch loop in a process of its own, heartbeat every 0.5 s, SIGKILLed; the time from
  the kill until the store's rule (`queries.run_state`) reads "gone": budget two periods.
- clean: the same loop with no fault, checkpoints on disk and in host memory, an evaluation
  inside `watch.paused()`, and a rollback: stall and slowdown events must be 0.
- rank stops: two gloo ranks under torchrun (tests/spikewatch/stall_script.py), rank 1's loader
  asleep 4 s at step 30 while rank 0 waits for it in the step's all-reduce: the stall must name
  rank 1 as the rank behind, within the bound plus 1 s.
- straggler: the same two ranks, rank 1's batches 60 ms each from batch 10 on (its loader
  slow, the job at its pace): one slowdown naming rank 1 (`stall_script.py OUT straggle`).
- straggler under FSDP2: the model sharded with FSDP2, rank 1's forward 60 ms longer from
  step 10 on (every rank waits inside the collectives for it): one slowdown naming rank 1 by
  its lateness at the collectives (`stall_script.py OUT fsdp_slow`); the same job with no rank
  slowed (`fsdp_clean`): no stall, no slowdown.
- false alarms (`--false-alarms`): the demo and the four examples as a user runs them (their
  default sizes and steps, the examples with their poisoned region at batch 200 as their
  docstrings run them: checkpoints, evaluations and a rollback), each in a process of its
  own with the default stall settings: stall and slowdown events must be 0.
- replay (`--replay FILE`): a clean run's step times (`host_cost.py --pauses --durations
  FILE`: 10,000 steps of the Watch on meta, a shared machine's noise in them) fed to the
  slowdown rule on a clock made of them, at the default `slowdown_lasting_s` and others: the
  slowdowns each would tell (all false alarms), and how long the slow median's spells last.
- watchdog cost (`--cost`): the plain-loop example at the demo's size (2 x 128) in this process;
  the watchdog's own time (the loop thread's `beat` and `mark`, the thread's wakes) over the
  loop's time: budget 0.2% of a step.

    python benchmarks/stalls.py [--hang 4]     # the fault rows
    python benchmarks/stalls.py --false-alarms # ~10 minutes
    python benchmarks/stalls.py --cost
    python benchmarks/stalls.py --replay /tmp/durations.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from sqlalchemy.orm import Session

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

import plain_loop as ex  # noqa: E402

from spikewatch import Watch  # noqa: E402
from spikewatch.corpus import text_corpus, windows  # noqa: E402
from spikewatch.observatory import store  # noqa: E402
from spikewatch.observatory.store.db import make_engine  # noqa: E402
from spikewatch.trainer.core.actions import Continue, Rollback  # noqa: E402
from spikewatch.trainer.core.callbacks import Callback  # noqa: E402

FAST = {"min_s": 1.0, "factor": 10.0}  # steps of ~10 ms: a 1 s bound


class Hook:
    """A webhook on 127.0.0.1 that keeps the kinds it is sent."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                hook.kinds.append(str(body.get("kind")))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


class RollbackAt(Callback):
    def __init__(self, at: int, to: int) -> None:
        self.at, self.to, self.done = at, to, False

    def on_step(self, state: Any) -> Any:
        if state.step == self.at and not self.done:
            self.done = True
            return Rollback(to_step=self.to, reason="a rollback in a clean run")
        return Continue()


def loop(tmp: Path, steps: int, *, hang_at: int | None = None, hang_s: float = 0.0,
         slow_from: int | None = None, clean: bool = False) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(0)
    model = ex.GPT(32, 2, 4, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    db = f"sqlite:///{tmp / 'sw.db'}"
    settings = {"guard": {"stall": FAST}, "checkpoint": {"interval": 50, "memory_interval": 10}}
    hook = Hook()
    os.environ["SPIKEWATCH_ALERT_URLS"] = hook.url
    callbacks = [RollbackAt(150, 120)] if clean else []
    watch = Watch(model, opt, run_dir=tmp / "run", db=db, max_steps=steps, settings=settings,
                  callbacks=callbacks)  # fmt: skip
    train, val = text_corpus()
    took: list[float] = []
    hung_at: list[float] = []
    at: dict[int, float] = {}  # each step's end, on the monotonic clock

    def the_loader_hangs_here(i: int) -> None:
        hung_at.append(time.monotonic())
        time.sleep(hang_s)

    def batch_at(i: int) -> Any:
        if i == hang_at:
            the_loader_hangs_here(i)
        return windows(train, i, 8, 32)

    try:
        for x, y in watch.batches(batch_at):
            t0 = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            watch.step(loss)
            took.append(time.perf_counter() - t0)
            at[watch.step_count] = time.monotonic()
            if slow_from is not None and watch.step_count >= slow_from:
                time.sleep(sorted(took[:100])[len(took[:100]) // 2])  # as long as a step: 2x
            if clean and watch.step_count % 100 == 0:
                with watch.paused(), torch.no_grad():  # an evaluation
                    model(*windows(val, 0, 8, 32))
                    time.sleep(1.5)
        watch.close()
        time.sleep(1.0)  # the alerts' thread
    finally:
        hook.close()
        os.environ.pop("SPIKEWATCH_ALERT_URLS", None)
    with Session(make_engine(db)) as s:
        (run,) = store.list_runs(s)
        events = store.events(s, run_id=run.run_id)
    return {"events": events, "alerts": hook.kinds, "hung_at": hung_at, "at": at}


def stall(tmp: Path, hang: float) -> dict[str, Any]:
    out = loop(tmp, 60, hang_at=40, hang_s=hang)
    (ev,) = [e for e in out["events"] if e.kind == "stall"] or [None]
    if ev is None:
        return {"fault": "stall", "detected": False}
    late = ev.data["idle_s"] - ev.data["bound_s"]
    return {
        "fault": "stall (a batch function asleep)",
        "detected": True,
        "bound_s": ev.data["bound_s"],
        "past_bound_s": round(late, 3),
        "within_budget": late <= 1.0,
        "frame_named": "the_loader_hangs_here" in ev.data["loop_stack"],
        "alerts": out["alerts"].count("stall"),
        "resumed": any(e.kind == "resumed" for e in out["events"]),
    }


def slowdown(tmp: Path) -> dict[str, Any]:
    out = loop(tmp, 4000, slow_from=200)
    found = [e for e in out["events"] if e.kind == "slowdown"]
    after = [e for e in found if e.step >= 200]
    return {
        "fault": "slowdown (every step 2x from step 200)",
        "detected": bool(after),
        "at_step": after[0].step if after else None,
        "since_step": after[0].data.get("since_step") if after else None,
        "s_after_the_fault": round(out["at"][after[0].step] - out["at"][200], 1) if after else None,
        "ratio": after[0].data.get("ratio") if after else None,
        "false_before": len(found) - len(after),  # before the fault: false alarms
        "alerts": out["alerts"].count("slowdown"),
        "stalls": sum(e.kind == "stall" for e in out["events"]),
    }


SCRIPT = """
import json, sys, time, torch
sys.path.insert(0, sys.argv[3])
import plain_loop as ex
from spikewatch import Watch
from spikewatch.corpus import text_corpus, windows
torch.manual_seed(0)
model = ex.GPT(32, 2, 4, 32)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
train, _ = text_corpus()
settings = {"guard": {"stall": {"heartbeat_s": float(sys.argv[4])}}}
with Watch(model, opt, run_dir=sys.argv[1], db=sys.argv[2], max_steps=10**6,
           settings=settings) as watch:
    for x, y in watch.batches(lambda i: windows(train, i, 8, 32)):
        loss = model(x, y)
        loss.backward()
        watch.step(loss)
        if watch.step_count == 20:
            print("ready", flush=True)
        time.sleep(0.01)
"""


def gone(tmp: Path, period: float = 0.5) -> dict[str, Any]:
    db = f"sqlite:///{tmp / 'sw.db'}"
    (tmp / "loop.py").write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(tmp / "loop.py"), str(tmp / "run"), db, str(REPO / "examples"),
         str(period)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(2 * period)
        proc.send_signal(signal.SIGKILL)
        killed = datetime.now(UTC)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    engine = make_engine(db)
    while True:
        with Session(engine) as s:
            (run,) = store.list_runs(s)
        now = datetime.now(UTC)
        if store.run_state(run, now) == "gone":
            break
        time.sleep(0.02)
        if (now - killed).total_seconds() > 60:
            return {"fault": "gone (SIGKILL)", "detected": False}
    after = (now - killed).total_seconds()
    return {
        "fault": "gone (SIGKILL, heartbeat every 0.5 s)",
        "detected": True,
        "seconds_after_kill": round(after, 3),
        "within_budget": after <= 2 * period + 0.1,  # (the reads here poll every 20 ms)
        "status_in_store": run.status,
    }


def clean(tmp: Path) -> dict[str, Any]:
    out = loop(tmp, 400, clean=True)
    kinds = [e.kind for e in out["events"]]
    return {
        "fault": "none (checkpoints, paused evaluations, a rollback)",
        "stalls": kinds.count("stall"),
        "slowdowns": kinds.count("slowdown"),
        "rollbacks": kinds.count("rollback"),
        "alerts": len(out["alerts"]),
    }


def ranks(tmp: Path, mode: str) -> dict[str, Any]:
    """Two gloo ranks under torchrun (tests/spikewatch/stall_script.py), rank 0's record."""
    from spikewatch.observatory import store
    from spikewatch.observatory.store.db import make_engine

    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc_per_node=2"]  # fmt: skip
    script = str(REPO / "tests/spikewatch/stall_script.py")
    cmd = [*launch, script, str(tmp), *([mode] if mode else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"fault": f"ranks {mode or 'stop'}", "failed": (done.stdout + done.stderr)[-500:]}
    with Session(make_engine(f"sqlite:///{tmp}/runs.db")) as session:
        (run,) = store.list_runs(session)
        events = store.events(session, run_id=run.run_id, kinds=["stall", "slowdown"])
    if mode == "straggle":
        named = [e for e in events if "straggler" in e.data]
        return {
            "fault": "a rank's loader 60 ms a batch (2 gloo ranks)",
            "named": [e.data["rank"] for e in named],
            "at_step": [e.step for e in named],
            "batch_wait_s": [e.data["batch_wait_s"] for e in named],
            "others_s": [e.data["others_batch_wait_s"] for e in named],
        }
    if mode == "fsdp_clean":
        return {
            "fault": "none under FSDP2 (2 gloo ranks, 120 steps)",
            "stalls": sum(e.kind == "stall" for e in events),
            "slowdowns": sum(e.kind == "slowdown" for e in events),
        }
    if mode == "fsdp_slow":
        named = [e for e in events if "straggler" in e.data]
        return {
            "fault": "a rank's forward 60 ms longer under FSDP2 (2 gloo ranks)",
            "named": [e.data["rank"] for e in named],
            "slow_in": [e.data["slow_in"] for e in named],
            "at_step": [e.step for e in named],
            "late_s": [e.data["late_s"] for e in named],
            "others_s": [e.data["others_late_s"] for e in named],
            "median_step_s": [e.data["median_step_s"] for e in named],
        }
    stalls = [e for e in events if e.kind == "stall"]
    return {
        "fault": "a rank's loader asleep 4 s (2 gloo ranks)",
        "stalls": len(stalls),
        "behind": [e.data.get("behind") for e in stalls],
        "past_bound_s": [round(e.data["idle_s"] - e.data["bound_s"], 3) for e in stalls],
    }


CLEAN_RUNS = {  # what a user runs, at its defaults, recorded in the store given
    "demo": ["-m", "spikewatch.trainer.cli", "demo", "--no-serve", "--no-clean-twin"],
    "plain_loop": [str(REPO / "examples" / "plain_loop.py")],
    "dataloader_loop": [str(REPO / "examples" / "dataloader_loop.py")],
    "hf_trainer": [str(REPO / "examples" / "hf_trainer.py")],
    "lightning_module": [str(REPO / "examples" / "lightning_module.py")],
}


def false_alarms(tmp: Path, name: str, *extra: str) -> dict[str, Any]:
    """One of CLEAN_RUNS in a process of its own, its events counted from its store."""
    db = f"sqlite:///{tmp / 'sw.db'}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    args = [*CLEAN_RUNS[name], "--db", db, *extra]
    if name == "demo":
        args += ["--run-dir", str(tmp / "run")]
    else:  # the examples' poisoned region, as their docstrings run them: a rollback
        args += ["--poison-at", "200"]
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, *args], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=3600)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    with Session(make_engine(db)) as s:
        runs = store.list_runs(s)
        kinds = [e.kind for r in runs for e in store.events(s, run_id=r.run_id)]
        steps = sum(r.last_step or 0 for r in runs)
    return {
        "run": name,
        "steps": steps,
        "minutes": round((time.monotonic() - t0) / 60, 1),
        "stalls": kinds.count("stall"),
        "slowdowns": kinds.count("slowdown"),
        "rollbacks": kinds.count("rollback"),
    }


def cost(tmp: Path, steps: int = 300) -> dict[str, Any]:
    """The watchdog's time over the loop's: the plain-loop example's GPT at the demo's size
    (2 x 128, T = 64, B = 8 here), a Watch with the default stall settings."""
    from spikewatch.trainer.core import watchdog as wd

    spent = {"loop": 0.0, "wakes": 0.0}
    n_wakes = [0]

    def timed(fn: Any, key: str, count: bool = False) -> Any:
        def inner(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0
                n_wakes[0] += count

        return inner

    saved = {n: getattr(wd.Watchdog, n) for n in ("beat", "mark", "check", "publish",
                                                  "judge_ranks", "heartbeat")}  # fmt: skip
    for n, fn in saved.items():
        setattr(wd.Watchdog, n, timed(fn, "loop" if n in ("beat", "mark") else "wakes",
                                      count=n == "check"))  # fmt: skip
    try:
        torch.manual_seed(0)
        model = ex.GPT(128, 2, 4, 64)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        train, _ = text_corpus()
        watch = Watch(model, opt, run_dir=tmp / "run", db=f"sqlite:///{tmp / 'sw.db'}",
                      max_steps=steps)  # fmt: skip
        t0 = time.perf_counter()
        for x, y in watch.batches(lambda i: windows(train, i, 8, 64)):
            loss = model(x, y)
            loss.backward()
            watch.step(loss)
        wall = time.perf_counter() - t0
        watch.close()
    finally:
        for n, fn in saved.items():
            setattr(wd.Watchdog, n, fn)
    own = spent["loop"] + spent["wakes"]
    return {
        "steps": steps,
        "ms_per_step": round(wall / steps * 1e3, 2),
        "watchdog_us_per_step_on_the_loop": round(spent["loop"] / steps * 1e6, 1),
        "wakes": n_wakes[0],
        "us_per_wake": round(spent["wakes"] / max(1, n_wakes[0]) * 1e6, 1),
        "share_of_the_loop": round(own / wall, 5),
    }


def replay(path: Path) -> list[dict[str, Any]]:
    """A clean run's step times through the slowdown rule on a clock made of them: the
    slowdowns told at each `slowdown_lasting_s` (each then ends as the rule ends it, when the
    median is back within 1.2x), and the spells (in seconds) from the median's crossing of
    the rule's bar (1.5x the baseline and 5 ms) to that end, longest first."""
    import logging

    from spikewatch.trainer.core.watchdog import StallConfig, Watchdog

    logging.getLogger("spikewatch.trainer.core.watchdog").setLevel(logging.ERROR)  # counted
    durations = json.loads(Path(path).read_text())
    rows = []
    for lasting in (0.0, 5.0, 10.0, 30.0):
        now = [0.0]
        told: list[dict[str, Any]] = []
        dog = Watchdog(StallConfig(slowdown_lasting_s=lasting), lambda i: None,
                       lambda i: None, clock=lambda now=now: now[0],
                       on_slowdown=told.append)  # fmt: skip
        dog._last = 0.0
        spells: list[float] = []
        spell = 0.0
        for step, took in enumerate(durations, 1):
            now[0] += took
            dog.beat(step)
            if lasting == 0.0:  # the spells, measured once (the baseline as the rule keeps it)
                slow = dog._slow is not None or dog._slow_from is not None
                if slow:
                    spell += took
                elif spell:
                    spells.append(spell)
                    spell = 0.0
        row: dict[str, Any] = {
            "steps": len(durations),
            "minutes": round(sum(durations) / 60, 1),
            "median_step_ms": round(1e3 * sorted(durations)[len(durations) // 2], 1),
            "slowdown_lasting_s": lasting,
            "slowdowns_told": len(told),
        }
        if lasting == 0.0:
            spells.sort(reverse=True)
            row["slow_spells"] = len(spells)
            row["longest_spells_s"] = [round(x, 2) for x in spells[:5]]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hang", type=float, default=4.0, help="seconds the batch function sleeps")
    ap.add_argument(
        "--false-alarms",
        action="store_true",
        help="the demo and the examples at their defaults: stall and slowdown events",
    )
    ap.add_argument("--cost", action="store_true", help="the watchdog's share of the loop")
    ap.add_argument("--replay", help="a clean run's step times (JSON) through the slowdown rule")
    args = ap.parse_args()
    if args.replay:
        rows = replay(Path(args.replay))
        for row in rows:
            print(" | ".join(f"{k}: {v}" for k, v in row.items()), flush=True)
        print(json.dumps({"rows": rows}))
        return
    torch.set_num_threads(1)
    rows = []
    faults: Any = (("stall", lambda t: stall(t, args.hang)), ("slowdown", slowdown),
                   ("gone", gone), ("clean", clean), ("rank_stops", lambda t: ranks(t, "")),
                   ("straggler", lambda t: ranks(t, "straggle")),
                   ("straggler_fsdp2", lambda t: ranks(t, "fsdp_slow")),
                   ("clean_fsdp2", lambda t: ranks(t, "fsdp_clean")))  # fmt: skip
    if args.false_alarms:
        faults = [(n, lambda t, n=n: false_alarms(t, n)) for n in CLEAN_RUNS]
    elif args.cost:
        faults = [("cost", cost)]
    for name, fn in faults:
        with tempfile.TemporaryDirectory(prefix=f"stalls-{name}-") as d:
            row = fn(Path(d))
        rows.append(row)
        print(" | ".join(f"{k}: {v}" for k, v in row.items()), flush=True)
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
