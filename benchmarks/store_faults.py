"""The store's faults, against real servers: does any of them stall training or lose a point?

    python benchmarks/store_faults.py [--faults pg_stop,...] [--clients builtin,watch] [--json F]

Needs root on a machine with a local PostgreSQL cluster (`pg_ctlcluster`; CI's kind of
machine): it stops and starts the server, changes a role's connection limit, terminates its
backends and mounts small tmpfs file systems for the spool. Nothing is mocked.

For each fault and each client (the built-in trainer, tiny_cpu with a disk checkpoint every 50
steps; a plain PyTorch loop with the Watch, the same cadence), it runs a fault-free reference
and the faulted run on a fresh database and reports:

  lost / dup      points (metric, branch, step) of the reference missing / stored twice
  values          points whose value differs from the reference (timing metrics excluded)
  events          the same events (kind, branch, step) as the reference
  longest extra   max over steps of (step time under the fault - the reference's same step),
                  each less the garbage collector's pauses within it (reported apart)
  total extra     the run's wall time minus the reference's
  ckpt stall      the largest `checkpoint/disk_stall_s` the run recorded
  counted lost    the points the sink counted and said it could not keep (stats["lost_values"])

Faults:
  pg_stop         PostgreSQL stopped at step 100 (`pg_ctlcluster stop -m fast`), back 15 s later
  pg_stop_past    stopped at step 100, started after the run's end; then `spikewatch db upgrade`
                  replays the spool the run left (the row counts after that replay)
  pg_slow         every message to PostgreSQL delayed 20 ms by a proxy on the loopback
  pg_refuse       at step 100 the run's role gets CONNECTION LIMIT 0 (new connections refused) and
                  its open connections are terminated (`pg_terminate_backend`); lifted 10 s later
  sqlite_locked   SQLite held by another writer (BEGIN EXCLUSIVE) for 35 s, past its 30 s busy
                  timeout
  spool_ro        the spool directory a read-only file system, PostgreSQL stopped for 10 s
  spool_full      the spool directory a 16 KiB file system, PostgreSQL stopped for 10 s
  spool_full_past the same, PostgreSQL back only after the run's end: what is lost must be counted
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CLUSTER = ("15", "main")
ROLE = "spikewatch_fault"
PG = "postgresql+psycopg://{user}@127.0.0.1:{port}/{db}"
TIMING = ("time", "_s", "per_s", "tokens_per", "mfu", "throughput", "memory_bytes")


# -- the servers and the faults ------------------------------------------------------------
def _pg(action: str) -> None:
    subprocess.run(
        ["pg_ctlcluster", *CLUSTER, action, *(["-m", "fast"] if action == "stop" else [])],
        check=True,
        capture_output=True,
    )


def _psql(sql: str, db: str = "postgres") -> None:
    subprocess.run(
        ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", db, "-qc", sql],
        check=True,
        capture_output=True,
    )


def _fresh_pg_db(name: str) -> str:
    with contextlib.suppress(subprocess.CalledProcessError):
        _psql(f"CREATE ROLE {ROLE} LOGIN")
    _psql(f"ALTER ROLE {ROLE} CONNECTION LIMIT -1")
    _psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    _psql(f"CREATE DATABASE {name} OWNER {ROLE}")
    return PG.format(user=ROLE, port=5432, db=name)


class DelayProxy:
    """127.0.0.1:<port> -> PostgreSQL, every chunk from the client held `delay` seconds."""

    def __init__(self, delay: float, target: tuple[str, int] = ("127.0.0.1", 5432)) -> None:
        self.delay, self.target = delay, target
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.srv.accept()
            except OSError:
                return
            up = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, up, self.delay), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, client, 0.0), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, delay: float) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if delay:
                    time.sleep(delay)
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.srv.close()


@contextlib.contextmanager
def _mounted(path: Path, options: str) -> Iterator[str]:
    """A tmpfs at `path` (read-only or tiny); where mounting is refused, a file in its place
    (the directory cannot be made, even by root): returns what it did."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    if r.returncode == 0:
        try:
            yield f"tmpfs {options}"
        finally:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        return
    path.rmdir()
    path.write_text("not a directory")
    yield "a file where the directory should be"


@dataclass
class Fault:
    name: str
    backend: str = "pg"  # pg | sqlite
    at: int = 100  # the step it starts
    steps: int = 1200
    start: Callable[[Any], None] = lambda ctx: None
    end_after_s: float | None = None  # None: after the run
    end: Callable[[Any], None] = lambda ctx: None
    spool: str | None = None  # mount options for the spool directory
    after: Callable[[Any], None] = lambda ctx: None  # after the run and the end (a replay)


def _drain(ctx: Any) -> None:
    from spikewatch.trainer.cli import main

    main(["db", "upgrade", "--db", ctx["url"]])


def _refuse(ctx: Any) -> None:
    _psql(f"ALTER ROLE {ROLE} CONNECTION LIMIT 0")
    _psql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{ROLE}'")


def _lock_sqlite(ctx: Any) -> None:
    import sqlite3

    from sqlalchemy.engine import make_url

    conn = sqlite3.connect(
        make_url(ctx["url"]).database, isolation_level=None, timeout=60, check_same_thread=False
    )
    conn.execute("BEGIN EXCLUSIVE")
    ctx["lock"] = conn


def _unlock_sqlite(ctx: Any) -> None:
    ctx["lock"].execute("COMMIT")
    ctx["lock"].close()


def _outage(name: str, after_s: float | None, **kw: Any) -> Fault:
    """PostgreSQL stopped at the fault's step, started `after_s` later (None: after the run)."""
    return Fault(
        name, start=lambda c: _pg("stop"), end_after_s=after_s, end=lambda c: _pg("start"), **kw
    )


FAULTS = {
    "pg_stop": _outage("pg_stop", 15),
    "pg_stop_past": _outage("pg_stop_past", None, after=_drain),
    "pg_slow": Fault("pg_slow", at=0),
    "pg_refuse": Fault(
        "pg_refuse",
        start=_refuse,
        end_after_s=10,
        end=lambda c: _psql(f"ALTER ROLE {ROLE} CONNECTION LIMIT -1"),
    ),
    "sqlite_locked": Fault(
        "sqlite_locked",
        backend="sqlite",
        steps=2600,
        start=_lock_sqlite,
        end_after_s=35,
        end=_unlock_sqlite,
    ),
    "spool_ro": _outage("spool_ro", 10, spool="ro,size=64k"),
    "spool_full": _outage("spool_full", 10, spool="size=16k"),
    "spool_full_past": _outage("spool_full_past", None, spool="size=16k", after=_drain),
}


# -- the two clients -----------------------------------------------------------------------
class _Clock:
    """Wall time between steps, less the garbage collector's pauses within it (Python's gen-2
    collections pause a step by up to 0.1 s in the reference run as much as under a fault,
    at other steps), and the fault's trigger at its step."""

    def __init__(self, at: int | None, trigger: Callable[[], None]) -> None:
        self.at, self.trigger = at, trigger
        self.times: list[float] = []
        self.gc_s = 0.0
        self.gc_total = 0.0
        self._gc_t0 = 0.0
        self.last = time.perf_counter()

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_t0

    def __enter__(self) -> _Clock:
        gc.callbacks.append(self._gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._gc)

    def tick(self, step: int) -> None:
        now = time.perf_counter()
        self.times.append(now - self.last - self.gc_s)
        self.gc_total += self.gc_s
        self.last, self.gc_s = now, 0.0
        if self.at is not None and step == self.at:
            self.trigger()


def run_builtin(url: str, run_dir: Path, steps: int, clock: _Clock) -> int:
    from spikewatch.observatory.store.sink import open_run_sink
    from spikewatch.trainer.builtin.loop import fit
    from spikewatch.trainer.config import load_config
    from spikewatch.trainer.core.callbacks import Callback
    from spikewatch.trainer.core.recorder import Recorder

    class Tick(Callback):
        def on_step(self, state: Any) -> Any:
            clock.tick(state.step)
            return super().on_step(state)

    sink = open_run_sink(run_dir, url)
    cfg = load_config(
        "tiny_cpu",
        [
            f"train.max_steps={steps}",
            "checkpoint.interval=50",
            "train.progress=false",
            "eval.interval=100",
        ],
    )
    fit(cfg, run_dir=run_dir, callbacks=[Recorder(sink), Tick()])
    sink.close(timeout=60)
    return int(getattr(sink, "stats", {}).get("lost_values", 0))


def run_watch(url: str, run_dir: Path, steps: int, clock: _Clock) -> int:
    import torch
    import torch.nn.functional as F

    from spikewatch import Watch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(256, 64),
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 256),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (steps + 1, 16, 65), generator=g)

    def batch_at(i: int) -> torch.Tensor:
        return data[i % len(data)]

    with Watch(
        model,
        opt,
        name="faults-watch",
        db=url,
        run_dir=run_dir,
        max_steps=steps,
        grad_clip=1.0,
        checkpoint_every=50,
    ) as watch:
        for batch in watch.batches(batch_at):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            watch.step(loss)
            clock.tick(watch.step_count)
    return int(getattr(watch.sink, "stats", {}).get("lost_values", 0))


CLIENTS = {"builtin": run_builtin, "watch": run_watch}
PACE = {"builtin": 1.0, "watch": 3.5}  # the Watch's tiny loop steps ~3.5x as fast: as long a run


# -- one run, and its comparison -----------------------------------------------------------
def _store(kind: str, name: str, root: Path) -> str:
    if kind == "sqlite":
        from spikewatch.observatory.store.db import upgrade

        url = f"sqlite:///{root}/{name}.db"
        upgrade(url)
        return url
    from spikewatch.observatory.store.db import upgrade

    url = _fresh_pg_db(name)
    upgrade(url)
    return url


def one(client: str, fault: Fault | None, backend: str, steps: int, root: Path, tag: str) -> dict:
    gc.collect()
    gc.freeze()  # the harness's own heap (earlier runs' points) out of the run's collections
    name = f"swf_{client}_{tag}"
    url = _store(backend, name, root)
    ctx: dict[str, Any] = {"url": url}
    proxy = None
    if fault is not None and fault.name == "pg_slow":
        proxy = DelayProxy(0.02)
        url = PG.format(user=ROLE, port=proxy.port, db=name)
    run_dir = root / name
    timers: list[threading.Timer] = []

    def begin() -> None:
        assert fault is not None
        fault.start(ctx)
        if fault.end_after_s is not None:
            t = threading.Timer(fault.end_after_s, fault.end, (ctx,))
            t.start()
            timers.append(t)

    def trigger() -> None:  # off the training thread: stopping a server takes a second
        t = threading.Thread(target=begin)
        t.start()
        timers.append(t)

    clock = _Clock(None if fault is None else fault.at, trigger)
    spool_cm = (
        _mounted(run_dir / "spool", fault.spool)
        if fault is not None and fault.spool
        else contextlib.nullcontext("-")
    )
    t0 = time.perf_counter()
    with spool_cm as how:
        if fault is not None and fault.at == 0:
            trigger()
        with clock:
            lost = CLIENTS[client](url, run_dir, steps, clock)
        wall = time.perf_counter() - t0
        for t in list(timers):
            t.join()
        for t in list(timers):
            t.join()
        if fault is not None and fault.end_after_s is None:
            fault.end(ctx)
        if fault is not None:
            fault.after(ctx)  # before the spool's file system goes away
    if proxy is not None:
        proxy.close()
    got = _read(ctx["url"])
    return {
        "times": clock.times,
        "gc_s": clock.gc_total,
        "wall": wall,
        "lost_counted": lost,
        "spool": how,
        **got,
    }


def _read(url: str) -> dict:
    from sqlalchemy import text

    from spikewatch.observatory.store.chunks import decode
    from spikewatch.observatory.store.db import make_engine

    engine = make_engine(url)
    points: dict[tuple[str, int, int], float] = {}
    dup = 0
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT m.name, s.branch, s.layer, s.head, w.win, w.first_step, w.last_step, w.n, "
                "w.steps, w.vals FROM point_windows w JOIN series s ON s.id = w.series_id "
                "JOIN metric_names m ON m.id = s.metric_id"
            )
        )
        for name, branch, layer, head, win, first, last, n, st, vals in rows:
            steps, values = decode(win, first, last, n, st, vals)
            for s, v in zip(steps.tolist(), values.tolist(), strict=True):
                key = (f"{name}/{layer}/{head}", branch, s)
                dup += key in points
                points[key] = v
        events = sorted(conn.execute(text("SELECT kind, branch, step FROM events")).all(), key=str)
        stall = [v for (n, _, _), v in points.items() if n.startswith("checkpoint/disk_stall_s")]
    engine.dispose()
    return {
        "points": points,
        "dup": dup,
        "events": [tuple(e) for e in events],
        "ckpt_stall": max(stall, default=float("nan")),
    }


def compare(ref: dict, got: dict) -> dict:
    keys_ref, keys_got = set(ref["points"]), set(got["points"])
    differ = sum(
        1
        for k in keys_ref & keys_got
        if not any(t in k[0] for t in TIMING) and ref["points"][k] != got["points"][k]
    )
    n = min(len(ref["times"]), len(got["times"]))
    extra = [got["times"][i] - ref["times"][i] for i in range(1, n)]
    worst = max(range(len(extra)), key=extra.__getitem__) + 1 if extra else 0
    return {
        "points": len(keys_ref),
        "lost": len(keys_ref - keys_got),
        "dup": got["dup"] + len(keys_got - keys_ref),
        "values_differ": differ,
        "events_equal": ref["events"] == got["events"],
        "longest_extra_s": max(extra, default=0.0),
        "longest_extra_at": worst,
        "total_extra_s": got["wall"] - ref["wall"],
        "gc_s": got["gc_s"],
        "ref_gc_s": ref["gc_s"],
        "wall": got["wall"],
        "ckpt_stall_s": got["ckpt_stall"],
        "ref_ckpt_stall_s": ref["ckpt_stall"],
        "lost_counted": got["lost_counted"],
        "spool": got["spool"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR, format="  %(levelname)s %(name)s: %(message)s")
    if os.geteuid() != 0:
        sys.exit("store_faults.py stops PostgreSQL and mounts file systems: run it as root")
    rows = []
    refs: dict[tuple[str, str, int], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for fname in args.faults.split(","):
            fault = FAULTS[fname]
            for client in args.clients.split(","):
                steps = int(fault.steps * PACE[client])
                key = (client, fault.backend, steps)
                if key not in refs:
                    ref_tag = f"ref_{fault.backend}_{steps}"
                    refs[key] = one(client, None, fault.backend, steps, root, ref_tag)
                got = one(client, fault, fault.backend, steps, root, fname)
                row = {"fault": fname, "client": client, **compare(refs[key], got)}
                rows.append(row)
                print(_line(row), flush=True)
    print()
    print(
        "| fault | client | points | lost | dup | values differ | events equal | longest "
        "extra stall (s) | total extra (s) | max ckpt stall (s) (ref) | counted lost |"
    )
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['fault']} | {r['client']} | {r['points']} | {r['lost']} | {r['dup']} | "
            f"{r['values_differ']} | {'yes' if r['events_equal'] else 'NO'} | "
            f"{r['longest_extra_s']:.3f} (step {r['longest_extra_at']}) | "
            f"{r['total_extra_s']:+.2f} | {r['ckpt_stall_s']:.3f} ({r['ref_ckpt_stall_s']:.3f})"
            f" | {r['lost_counted']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))


def _line(r: dict) -> str:
    return (
        f"{r['fault']:>16} {r['client']:>7} ({r['wall']:.0f} s): lost {r['lost']} "
        f"dup {r['dup']} differ "
        f"{r['values_differ']} events {'=' if r['events_equal'] else '!='} longest extra "
        f"{r['longest_extra_s']:.3f}s total {r['total_extra_s']:+.2f}s ckpt stall "
        f"{r['ckpt_stall_s']:.3f}s counted lost {r['lost_counted']} ({r['spool']})"
    )


if __name__ == "__main__":
    main()
