"""What one simulated run is: its size, how it fails, how it spikes, where its checkpoints live.

Defaults are the published record where there is one, and a stated assumption where there is not:

- Failures: Llama 3 405B, 16,384 H100s, 419 unexpected interruptions in a 54-day snapshot
  (arXiv 2407.21783, section 3.3.4, Table 5): 419 / (16,384 x 54) = 4.74e-4 per GPU-day, one
  every 3.1 h at that size. The causes and their counts are Table 5's. The paper gives no time to
  recover per cause; every cause restarts in `restart_s` (an assumption), and the causes that take
  the host down (host maintenance, power supply, chassis, CPU, system memory, SSD, IO board) also
  take its host-memory snapshots unless the tier keeps replicas on other hosts (Gemini's design).
- Spikes: PaLM 540B saw about 20 spikes in ~255k steps, fixed by restarting about 100 steps before
  the spike and skipping 200-500 batches (arXiv 2204.02311, section 5.1): 0.08 per 1k steps, the
  rollback target at least 100 steps before the detection, 350 batches skipped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = [
    "LLAMA3_CAUSES",
    "LLAMA3_MAINTENANCE_EVERY_S",
    "LLAMA3_PER_GPU_DAY",
    "LLAMA3_SDC_PER_GPU_DAY",
    "Cause",
    "Corruption",
    "Failures",
    "Maintenance",
    "Scenario",
    "Spikes",
    "Tier",
    "expected_events",
]


@dataclasses.dataclass(frozen=True)
class Cause:
    """One root cause of an interruption: its share of them, and what recovering costs."""

    name: str
    share: float  # of all interruptions
    restart_s: float | None = None  # None: the scenario's restart_s
    host_lost: bool = False  # the host's memory is lost with it


# Table 5 of the Llama 3 paper: component, interruptions in 54 days (419 in all), host lost.
_TABLE5 = [
    ("Faulty GPU", 148, False),
    ("GPU HBM3 memory", 72, False),
    ("Software bug", 54, False),
    ("Network switch/cable", 35, False),
    ("Host maintenance", 32, True),
    ("GPU SRAM memory", 19, False),
    ("GPU system processor", 17, False),
    ("NIC", 7, False),
    ("NCCL watchdog timeouts", 7, False),
    ("Silent data corruption", 6, False),
    ("GPU thermal interface + sensor", 6, False),
    ("SSD", 3, True),
    ("Power supply", 3, True),
    ("Server chassis", 2, True),
    ("IO expansion board", 2, True),
    ("Dependency", 2, False),
    ("CPU", 2, True),
    ("System memory", 2, True),
]
LLAMA3_CAUSES = tuple(Cause(name, n / 419, None, lost) for name, n, lost in _TABLE5)
LLAMA3_PER_GPU_DAY = 419 / (16_384 * 54)


@dataclasses.dataclass(frozen=True)
class Failures:
    """Interruptions: a Poisson process in wall time at `per_gpu_day` x GPUs, split by cause."""

    per_gpu_day: float = LLAMA3_PER_GPU_DAY
    causes: tuple[Cause, ...] = LLAMA3_CAUSES
    # a restart or restore can fail too, at the same rate (the job holds its GPUs throughout):
    # the attempt's time is lost and recovery starts over
    during_recovery: bool = False

    def __post_init__(self) -> None:
        if not (self.per_gpu_day >= 0 and math.isfinite(self.per_gpu_day)):
            raise ValueError(f"the failure rate must be >= 0 per GPU-day, got {self.per_gpu_day}")
        if not self.causes:
            raise ValueError("at least one failure cause is needed")
        total = sum(c.share for c in self.causes)
        if any(c.share < 0 for c in self.causes) or not math.isclose(total, 1.0, rel_tol=1e-6):
            raise ValueError(f"cause shares must be >= 0 and sum to 1, they sum to {total:.6g}")
        for c in self.causes:
            if c.restart_s is not None and c.restart_s < 0:
                raise ValueError(f"cause {c.name!r}: restart_s must be >= 0")


@dataclasses.dataclass(frozen=True)
class Spikes:
    """Loss spikes: a Poisson process in trained steps. Each is handled by a rollback to the
    newest retained checkpoint at least `back` steps before its detection (`back` drawn from
    `back_steps`, e.g. a run's measured detection-to-onset distances), skipping `skip` batches."""

    per_1k_steps: float = 20 / 255  # PaLM 540B
    back_steps: tuple[int, ...] = (100,)
    skip: int = 350
    # the chance that a rolled-back spike comes back when the run reaches its step again (the
    # optimizer state's, not the data's): 0 in our fault runs (docs/recovery.md)
    repeat: float = 0.0

    def __post_init__(self) -> None:
        if not (self.per_1k_steps >= 0 and math.isfinite(self.per_1k_steps)):
            raise ValueError(f"the spike rate must be >= 0 per 1k steps, got {self.per_1k_steps}")
        if not self.back_steps or min(self.back_steps) < 0:
            raise ValueError("back_steps needs at least one distance, each >= 0")
        if self.skip < 0:
            raise ValueError(f"skip must be >= 0, got {self.skip}")
        if not 0 <= self.repeat < 1:
            raise ValueError(f"the repeat chance must be in [0, 1), got {self.repeat}")


# Llama 3 (arXiv 2407.21783, section 3.3.4): of 466 job interruptions in 54 days, 47 were planned
# (automated maintenance, firmware upgrades, operator-initiated updates); Table 5: 6 of the 419
# unexpected ones were silent data corruption
LLAMA3_MAINTENANCE_EVERY_S = 54 * 86_400 / 47
LLAMA3_SDC_PER_GPU_DAY = 6 / (16_384 * 54)


@dataclasses.dataclass(frozen=True)
class Maintenance:
    """Planned stops, every `every_s` of wall time (None: none): the job saves to disk and waits
    for the write, stops for `window_s`, restarts (the scenario's `restart_s`) and restores from
    that save; host memory does not survive it (the hosts are serviced)."""

    every_s: float | None = None
    window_s: float = 1_800.0  # assumed: Llama 3 gives the count, not the length

    def __post_init__(self) -> None:
        if self.every_s is not None and not self.every_s > 0:
            raise ValueError(f"maintenance every must be > 0 s, got {self.every_s}")
        if self.window_s < 0:
            raise ValueError(f"the maintenance window must be >= 0 s, got {self.window_s}")


@dataclasses.dataclass(frozen=True)
class Corruption:
    """Silent data corruption: a Poisson process in trained steps at `per_gpu_day` x GPUs; the
    state is wrong from then on, and every checkpoint saved after it is poisoned, until it is
    detected `detect_steps` trained steps later: the run then rolls back to the newest retained
    checkpoint from before the corruption (a failure or a rollback to before it cures it)."""

    per_gpu_day: float = 0.0
    detect_steps: int = 1_000  # assumed: found by the loss or a check within ~1.7 h of 6 s steps

    def __post_init__(self) -> None:
        if not (self.per_gpu_day >= 0 and math.isfinite(self.per_gpu_day)):
            raise ValueError(f"the SDC rate must be >= 0 per GPU-day, got {self.per_gpu_day}")
        if self.detect_steps < 1:
            raise ValueError(f"detect_steps must be >= 1, got {self.detect_steps}")


@dataclasses.dataclass(frozen=True)
class Tier:
    """Where rollback targets live. `interval` in steps; `stall_s` blocks training per save;
    `write_s` is the background write after it (a save is durable only once written, and a save
    that comes while the last write is still going waits for it, as DCP's async save does); the
    retention is the disk tier's exponential rule (`spikewatch.observatory.retention.keep`) or
    keep-last-k; `max_kept` caps the count (a memory budget). A host-memory tier survives a
    failure that takes a host down only if `replicas` >= 2."""

    name: str  # "memory" or "disk"
    interval: int
    stall_s: float
    restore_s: float
    write_s: float = 0.0
    retention: str = "exponential"  # or "last"
    keep_last: int = 2
    max_kept: int | None = None
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.name not in ("memory", "disk"):
            raise ValueError(f"a tier is 'memory' or 'disk', not {self.name!r}")
        if self.interval < 1:
            raise ValueError(f"tier {self.name}: interval must be >= 1 step, got {self.interval}")
        if min(self.stall_s, self.restore_s, self.write_s) < 0:
            raise ValueError(f"tier {self.name}: times must be >= 0")
        if self.retention not in ("exponential", "last"):
            raise ValueError(f"tier {self.name}: retention is 'exponential' or 'last'")
        if self.keep_last < 1 or (self.max_kept is not None and self.max_kept < self.keep_last):
            raise ValueError(f"tier {self.name}: keep_last >= 1 and max_kept >= keep_last")
        if self.name == "memory" and self.write_s:
            raise ValueError("a host-memory snapshot is whole once copied: its cost is stall_s")
        if self.replicas < 1:
            raise ValueError(f"tier {self.name}: replicas must be >= 1")


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One run: `steps` of `step_s` seconds on `gpus` GPUs, its failures, spikes and tiers.
    `restart_s` is what every interruption costs before the restore (detection, scheduling,
    initialisation, warm-up) unless its cause says otherwise."""

    gpus: int = 16_384
    step_s: float = 6.0
    steps: int = 777_600  # 54 days of 6 s steps
    restart_s: float = 300.0
    failures: Failures = Failures()
    spikes: Spikes = Spikes()
    maintenance: Maintenance = Maintenance()
    corruption: Corruption = Corruption()
    straggler: float = 0.0  # every step this much slower on average: a slow rank slows all
    tiers: tuple[Tier, ...] = (
        Tier("memory", 50, stall_s=1.0, restore_s=30.0, replicas=2),
        Tier("disk", 500, stall_s=6.3, restore_s=180.0, write_s=150.0),
    )

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.steps < 1 or not self.step_s > 0 or self.restart_s < 0:
            raise ValueError("gpus and steps must be >= 1, step_s > 0 and restart_s >= 0")
        if not (self.straggler >= 0 and math.isfinite(self.straggler)):
            raise ValueError(f"the straggler slowdown must be >= 0, got {self.straggler}")
        names = [t.name for t in self.tiers]
        if "disk" not in names or len(set(names)) != len(names):
            raise ValueError(f"tiers must hold one disk tier and at most one memory tier: {names}")

    def tier(self, name: str) -> Tier | None:
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def mtbf_s(self) -> float:
        rate = self.failures.per_gpu_day * self.gpus / 86_400
        return math.inf if rate == 0 else 1 / rate

    def replace(self, **changes: object) -> Scenario:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def with_tier(self, name: str, **changes: object) -> Scenario:
        """The scenario with one tier's fields changed."""
        tiers: Sequence[Tier] = [
            dataclasses.replace(t, **changes) if t.name == name else t  # type: ignore[arg-type]
            for t in self.tiers
        ]
        return dataclasses.replace(self, tiers=tuple(tiers))


def expected_events(sc: Scenario) -> float:
    """Failures, spikes, planned stops and corruptions a run is expected to meet."""
    run_s = sc.steps * sc.step_s * (1 + sc.straggler)
    stops = run_s * 1.5 / sc.maintenance.every_s if sc.maintenance.every_s else 0.0
    sdc = sc.corruption.per_gpu_day * sc.gpus * run_s / 86_400
    spikes = sc.steps * sc.spikes.per_1k_steps / 1000 / (1 - sc.spikes.repeat)
    return run_s * 1.5 / sc.mtbf_s + spikes + stops + 2 * sdc
