"""`spikewatch sweep`: the grid variants x learning rates x seeds, one `spikewatch train` per cell.

Each cell is a child process (`python -m spikewatch train ...`), so a cell that crashes or
diverges takes nothing else down and `--jobs N` runs N at once. A cell's run directory is
`ROOT/GROUP/GROUP-<variant>-lr<lr>-s<seed>` (its name is the run id, unique in the store); it
is done when its `summary.json` exists. Running the same command again resumes the sweep: done
cells are not re-run, a cell with checkpoints continues from its newest one (`--resume`), any
other unfinished cell starts over.

The sweep is registered in the store before its first cell (observatory/reports/sweeps.py), with its
grid and the optional pre-registered hypothesis; every run carries the group and the tags
`variant=`, `lr=`, `seed=`. The progress table reads the store, like the dashboard does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from spikewatch.observatory.reports.sweeps import register_sweep
from spikewatch.observatory.store.db import ENV_VAR, resolve_url, upgrade
from spikewatch.observatory.store.queries import list_runs, session_factory
from spikewatch.trainer.config import ConfigError, find_config, load_config, variant_names

__all__ = ["CellSpec", "SweepResult", "parse_floats", "parse_ints", "run_sweep"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CellSpec:
    variant: str
    lr: float
    seed: int

    @property
    def key(self) -> str:
        return f"{self.variant}-lr{self.lr:g}-s{self.seed}"

    @property
    def tags(self) -> list[str]:
        return [f"variant={self.variant}", f"lr={self.lr:g}", f"seed={self.seed}"]


@dataclass
class _Job:
    cell: CellSpec
    run_dir: Path
    proc: subprocess.Popen | None = None
    log_file: IO[bytes] | None = None
    state: str = "pending"  # pending | done (before) | running | resumed | ok | failed
    started: float = 0.0
    elapsed: float = 0.0
    returncode: int | None = None


@dataclass
class SweepResult:
    group: str
    root: Path
    db_url: str
    cells: dict[str, str] = field(default_factory=dict)  # cell key -> done | ok | failed

    @property
    def failed(self) -> list[str]:
        return [k for k, s in self.cells.items() if s == "failed"]


def parse_floats(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise ConfigError(f"{what}: expected positive numbers, got {text!r}")
    return sorted(set(values))


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise ConfigError(f"{what}: expected integers >= 0, got {text!r}")
    return sorted(set(values))


def _cell_overrides(cell: CellSpec) -> list[str]:
    return [f"optim.lr={cell.lr!r}", f"train.seed={cell.seed}", "train.progress=false"]


def run_sweep(
    config: str,
    *,
    variants: Sequence[str],
    lrs: Sequence[float],
    seeds: Sequence[int] = (0,),
    overrides: Sequence[str] = (),
    root: str | Path = "runs",
    group: str | None = None,
    hypothesis: str | None = None,
    db_url: str | None = None,
    jobs: int = 1,
    console: Console | None = None,
) -> SweepResult:
    """Run (or resume) the grid; return what became of each cell."""
    if jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    unknown = [v for v in variants if v not in variant_names()]
    if unknown or not variants:
        raise ConfigError(
            f"unknown variant(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"known: {', '.join(variant_names())}"
        )
    cfg_path = str(find_config(Path(config)).resolve())
    base = load_config(cfg_path, list(overrides))
    cells = [CellSpec(v, lr, s) for v in variants for lr in lrs for s in seeds]
    for cell in cells:  # every cell's config must be valid before anything runs
        load_config(cfg_path, [*overrides, *_cell_overrides(cell)], variants=[cell.variant])
    spec = {
        "config": base.to_dict(),
        "config_path": cfg_path,
        "overrides": list(overrides),
        "variants": list(variants),
        "lrs": list(lrs),
        "seeds": list(seeds),
    }
    digest = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:8]
    group = group or f"{base.name}-sweep-{digest}"
    url = resolve_url(
        db_url or os.environ.get(ENV_VAR) or f"sqlite:///{Path(root).resolve() / 'spikewatch.db'}"
    )
    Path(root).mkdir(parents=True, exist_ok=True)
    upgrade(url)
    sessions = session_factory(url)
    with sessions() as session:
        info = register_sweep(session, name=group, spec=spec, hypothesis=hypothesis)
    log.info("sweep %s: %d cells, %d at a time, store %s", group, len(cells), jobs, url)
    if info.hypothesis:
        at = f"{info.created_at:%Y-%m-%d %H:%M}"
        log.info("hypothesis (registered %s): %s", at, info.hypothesis)
    runner = _Runner(cfg_path, list(overrides), Path(root) / group, group, url, jobs)
    return runner.run(cells, sessions, console or Console(stderr=True))


class _Runner:
    def __init__(
        self, cfg_path: str, overrides: list[str], home: Path, group: str, url: str, jobs: int
    ) -> None:
        self.cfg_path, self.overrides = cfg_path, overrides
        self.home, self.group, self.url, self.jobs = home, group, url, jobs

    def run(self, cells: list[CellSpec], sessions: Any, console: Console) -> SweepResult:
        self.home.mkdir(parents=True, exist_ok=True)
        with sessions() as session:
            stored = {r.run_id for r in list_runs(session, sweep_group=self.group)}
        todo = [_Job(c, self._run_dir(c, stored)) for c in cells]
        for job in todo:
            if job.run_dir.exists() and job.run_dir.name not in stored:
                self._set_aside(job.run_dir)  # from a sweep into another store: not this one's
            elif (job.run_dir / "summary.json").is_file():
                job.state = "done"
        live = Live(console=console, refresh_per_second=2, transient=False)
        use_live = console.is_terminal
        result = SweepResult(self.group, self.home, self.url)
        try:
            if use_live:
                live.start()
            while True:
                for job in todo:
                    self._reap(job)
                running = [j for j in todo if j.state in ("running", "resumed")]
                for job in [j for j in todo if j.state == "pending"][
                    : max(0, self.jobs - len(running))
                ]:
                    self._launch(job)
                if use_live:
                    live.update(self._table(todo, sessions))
                if all(j.state in ("done", "ok", "failed") for j in todo):
                    break
                time.sleep(0.5)
        except KeyboardInterrupt:
            log.warning("interrupted: stopping the running cells (run the command again to resume)")
            for job in todo:
                if job.proc is not None and job.proc.poll() is None:
                    job.proc.send_signal(signal.SIGTERM)
            for job in todo:
                if job.proc is not None:
                    job.proc.wait(timeout=120)
            raise
        finally:
            if use_live:
                live.update(self._table(todo, sessions))
                live.stop()
            for job in todo:
                if job.log_file is not None:
                    job.log_file.close()
        result.cells = {j.cell.key: j.state for j in todo}
        return result

    def _run_dir(self, cell: CellSpec, stored: set[str]) -> Path:
        """ROOT/GROUP/GROUP-<cell>: the directory's name is the run id, which must be unique in
        the store, so it carries the group (two sweeps share cell names). A cell this group
        ran before the group was in the name keeps its directory."""
        legacy = self.home / cell.key
        if legacy.is_dir() and cell.key in stored:
            return legacy
        return self.home / f"{self.group}-{cell.key}"

    @staticmethod
    def _set_aside(run_dir: Path) -> None:
        """Keep (never delete) a run directory whose run this store has never seen, and run
        the cell afresh: skipping it would report a cell done that the store cannot show."""
        n = 1
        while (aside := run_dir.with_name(f"{run_dir.name}.other-store-{n}")).exists():
            n += 1
        run_dir.rename(aside)
        log.warning("%s: not in this store; moved to %s and run again", run_dir.name, aside.name)

    def _command(self, job: _Job) -> list[str]:
        cmd = [sys.executable, "-m", "spikewatch", "train"]
        if job.state == "resumed":
            cmd += ["--resume", str(job.run_dir), "--set", "train.progress=false"]
        else:
            cmd += [self.cfg_path, "--variant", job.cell.variant, "--run-dir", str(job.run_dir)]
            for item in [*self.overrides, *_cell_overrides(job.cell)]:
                cmd += ["--set", item]
        cmd += ["--summary-json", str(job.run_dir / "summary.json"), "--db", self.url]
        cmd += ["--sweep-group", self.group]
        for tag in job.cell.tags:
            cmd += ["--tag", tag]
        return cmd

    def _launch(self, job: _Job) -> None:
        has_ckpt = any((job.run_dir / "checkpoints").glob("step*/meta.json"))
        if job.run_dir.exists() and not has_ckpt:
            shutil.rmtree(job.run_dir)  # an attempt that left nothing to continue from
        job.state = "resumed" if has_ckpt else "running"
        job.run_dir.mkdir(parents=True, exist_ok=True)
        job.log_file = open(job.run_dir / "train.log", "ab")  # noqa: SIM115 - closed in run()
        env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
        job.proc = subprocess.Popen(
            self._command(job), stdout=job.log_file, stderr=subprocess.STDOUT, env=env
        )
        job.started = time.monotonic()
        log.info("%s: %s", job.cell.key, "resumed" if has_ckpt else "started")

    def _reap(self, job: _Job) -> None:
        if job.proc is None or job.state not in ("running", "resumed"):
            return
        rc = job.proc.poll()
        if rc is None:
            job.elapsed = time.monotonic() - job.started
            return
        job.returncode, job.elapsed = rc, time.monotonic() - job.started
        assert job.log_file is not None
        job.log_file.close()
        job.log_file = None
        if rc == 0 and (job.run_dir / "summary.json").is_file():
            job.state = "ok"
            log.info("%s: finished in %.0f s", job.cell.key, job.elapsed)
        else:
            job.state = "failed"
            tail = (job.run_dir / "train.log").read_text(errors="replace").splitlines()[-5:]
            log.error(
                "%s: exited with %s; see %s\n%s",
                job.cell.key,
                rc,
                job.run_dir / "train.log",
                "\n".join(tail),
            )

    def _table(self, jobs: list[_Job], sessions: Any) -> Table:
        runs: dict[str, Any] = {}
        try:
            with sessions() as session:
                for found in list_runs(session, sweep_group=self.group, limit=10_000):
                    key = _key_of(found.tags)
                    if key is not None and key not in runs:  # newest first
                        runs[key] = found
        except Exception as e:  # the table is a view; a busy database must not stop the sweep
            log.debug("progress query failed: %s", e)
        done = sum(j.state in ("done", "ok") for j in jobs)
        table = Table(title=f"sweep {self.group}: {done}/{len(jobs)} cells done", expand=False)
        for col in ("variant", "lr", "seed", "state", "step", "loss", "spikes", "rollbacks", "s"):
            table.add_column(col, justify="left" if col in ("variant", "state") else "right")
        for j in jobs:
            r = runs.get(j.cell.key)
            steps = r.config.get("train", {}).get("max_steps") if r else None
            step = f"{r.last_step}/{steps}" if r and r.last_step is not None else ""
            loss = f"{r.last_loss:.3f}" if r and r.last_loss is not None else ""
            table.add_row(
                j.cell.variant,
                f"{j.cell.lr:g}",
                str(j.cell.seed),
                j.state if not r or j.state != "running" else r.status,
                step,
                loss,
                str(r.spikes) if r else "",
                str(r.rollbacks) if r else "",
                f"{j.elapsed:.0f}" if j.elapsed else "",
            )
        return table


def _key_of(tags: list[str]) -> str | None:
    got = dict(t.split("=", 1) for t in tags if "=" in t)
    try:
        return CellSpec(got["variant"], float(got["lr"]), int(got["seed"])).key
    except (KeyError, ValueError):
        return None
