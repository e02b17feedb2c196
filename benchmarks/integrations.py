"""Step time of the same training with and without spikewatch: a Hugging Face Trainer run, a
Lightning run and a plain PyTorch loop, each on the same tiny Llama (byte-level, made from a
config) with the same AdamW, cosine schedule and clipping at 1.0.

"With" is the whole loop as a user gets it by default: every probe on (per-layer grad norms,
per-head attention maxima through the registered attention function, update ratios and Adam
moments every 10 steps), the detector and policy, the store (SQLite, through the asynchronous
sink) and rollback checkpoints every 25 steps (the plain loop's `Watch`: on disk, fsynced; the
HF and Lightning callbacks: in host memory, their default). Each repetition runs both variants
of all three at every batch size, alternating which goes first. Per step: the median step time
from inside the loop after a warm-up, without over with (throughput with / without; 1.0 =
free). Per run: the whole run's wall time, start-up (store, migrations, run creation) and close
included, without over with. Runs are long enough (default 1,000 steps) for the store's
windows to fill and checkpoints to rotate as in a real run.

`--breakdown` also times the plain loop with one part off at a time (per-head maxima, the
store, checkpoints, every probe), to show where the cost goes. Runs minutes apart drift by a
few percent on a shared 2-core machine, so the plain loop is also measured **interleaved**:
two identical models in one process, one watched, stepping alternately, so that both see the
same machine at every moment (`loop_interleaved_ratio_b*`: the most robust figure here).
`--interleaved` measures HF and Lightning the same way, two runs in two threads taking turns a
step each, in both orientations (the watched run in the main thread, then in the worker).

glibc's malloc is held still by default (`_common.steady_allocator`: it no longer trims its
heap between steps): otherwise each step's activations are faulted in afresh, and how often
depends on allocation order, which moved a step by +-5% in either direction (Lightning at
B=16 looked 7% dearer with spikewatch, the plain loop 2% cheaper). `--glibc-default` leaves
it as it is.

    python benchmarks/integrations.py [--reps 1] [--steps 1000] [--batch-sizes 8,16] [--breakdown]
                                      [--interleaved [--aa]] [--glibc-default]

Last line: {"loop_ratio_b8": r, "hf_ratio_b8": r, "lightning_ratio_b8": r, ..._b16, ...}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402  (after _common set the thread environment)
from _common import allocator_flag, median, plain_step, quiet_one_thread  # noqa: E402

WARM = 5


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=args.d_model,
        intermediate_size=4 * args.d_model,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def _batches(args: argparse.Namespace) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = args.steps + 10
    return [torch.randint(0, 256, (args.batch_size, args.seq_len), generator=g) for _ in range(n)]


def _cosine(steps: int) -> Callable[[int], float]:
    return lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))


def _watch_kwargs(tmp: Path) -> dict:
    return {"db": f"sqlite:///{tmp / 'bench.db'}"}


# the plain loop with one part off (--breakdown): Watch keyword arguments
PARTS: dict[str, dict] = {
    "full": {},
    "no_attn_max": {"settings": {"probes": {"attn_max": False}}},
    "no_store": {"db": "none"},
    "no_checkpoints": {"settings": {"checkpoint": {"interval": None}}},
    "no_probes": {"settings": {"probes": {"enabled": False}}},
}


# -- the plain loop -------------------------------------------------------------------------
def loop_times(
    args: argparse.Namespace, watched: bool, tmp: Path, part: str = "full"
) -> list[float]:
    from spikewatch import Watch
    from spikewatch.hf import attach_attention

    model = _model(args).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine(args.steps))
    batches = _batches(args)
    watch = None
    stamps = [time.perf_counter()]  # the run's start: the Watch's start-up is in the run
    if watched:
        kwargs = {**_watch_kwargs(tmp), **PARTS[part]}
        watch = Watch(model, opt, sched, grad_clip=1.0, run_dir=tmp / f"loop-{part}", **kwargs)
        watch.open()
        attach_attention(model, watch.attn)
    for i in range(args.steps):
        plain_step(model, opt, sched, watch, batches[i], i)
        stamps.append(time.perf_counter())
    if watch is not None:
        watch.close()
    stamps.append(time.perf_counter())
    return stamps


# -- Hugging Face ---------------------------------------------------------------------------
def hf_times(
    args: argparse.Namespace,
    watched: bool,
    tmp: Path,
    baton: Baton | None = None,
    attach: bool | None = None,
) -> list[float]:
    """A Trainer run's [start, step ends..., end]; with a `baton`, the step times (each from
    the step's turn to its end) of a run taking turns with another."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from spikewatch.hf import SpikewatchCallback

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_train_begin(self, *a, **k) -> None:  # noqa: ANN002, ANN003
            if baton is not None:
                baton.start(watched)

        def on_step_end(self, *a, **k) -> None:  # noqa: ANN002, ANN003
            self.t.append(time.perf_counter() if baton is None else baton.turn(watched))

        def on_train_end(self, *a, **k) -> None:  # noqa: ANN002, ANN003
            if baton is not None:
                baton.finish(watched)

    batches = _batches(args)
    rows = [{"input_ids": r, "labels": r} for b in batches for r in b]
    start = time.perf_counter()
    clock = Clock()
    callbacks: list = []
    if watched if attach is None else attach:
        callbacks.append(SpikewatchCallback(**_watch_kwargs(tmp)))
    callbacks.append(clock)  # last: a turn ends after every other callback's step end
    targs = TrainingArguments(
        output_dir=str(tmp / f"hf-{watched}"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3,
        adam_beta2=0.95,
        weight_decay=0.1,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
    )
    Trainer(model=_model(args), args=targs, train_dataset=rows, callbacks=callbacks).train()
    return clock.t if baton is not None else [start, *clock.t, time.perf_counter()]


# -- Lightning ------------------------------------------------------------------------------
def lightning_times(
    args: argparse.Namespace,
    watched: bool,
    tmp: Path,
    baton: Baton | None = None,
    attach: bool | None = None,
) -> list[float]:
    """As `hf_times`, for a Lightning run."""
    import lightning.pytorch as pl

    from spikewatch.lightning import SpikewatchCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model(args)

        def training_step(self, x: torch.Tensor, idx: int) -> torch.Tensor:
            return self.model(input_ids=x, labels=x).loss

        def configure_optimizers(self):  # noqa: ANN202
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3, betas=(0.9, 0.95))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine(args.steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_train_start(self, *a) -> None:  # noqa: ANN002
            if baton is not None:
                baton.start(watched)

        def on_train_batch_end(self, *a) -> None:  # noqa: ANN002
            self.t.append(time.perf_counter() if baton is None else baton.turn(watched))

        def on_train_end(self, *a) -> None:  # noqa: ANN002
            if baton is not None:
                baton.finish(watched)

    start = time.perf_counter()
    clock = Clock()
    callbacks: list = []
    if watched if attach is None else attach:
        callbacks.append(SpikewatchCallback(**_watch_kwargs(tmp)))
    callbacks.append(clock)  # last: a turn ends after every other callback's batch end
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp / f"pl-{watched}"),
        callbacks=callbacks,
    )
    loader = torch.utils.data.DataLoader(_batches(args), batch_size=None)
    trainer.fit(Module(), train_dataloaders=loader)
    return clock.t if baton is not None else [start, *clock.t, time.perf_counter()]


class Baton:
    """Two framework runs in two threads taking turns a step each (one in the main thread, the
    other in a worker), so that both see the same machine at every moment, as
    `loop_interleaved`'s two models do. `turn` ends a step: it returns the step's time (from
    the start of its turn) and waits for the other run's step. A run that has finished no
    longer takes turns."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.holder: bool | None = None  # whose turn: True = the watched run
        self.arrived: set[bool] = set()
        self.finished: set[bool] = set()
        self.began: dict[bool, float] = {}

    def _wait(self, me: bool) -> None:
        with self.cv:
            self.cv.wait_for(
                lambda: self.holder is None or self.holder == me or (not me) in self.finished
            )
            self.holder = me
        self.began[me] = time.perf_counter()

    def arrive(self, me: bool) -> None:
        with self.cv:
            self.arrived.add(me)
            self.cv.notify_all()

    def wait_for(self, other: bool) -> None:
        """Until `other` is set up (or gone): frameworks share process-wide state (accelerate's
        AcceleratorState), which one run's set-up must not reset under the other's step."""
        with self.cv:
            self.cv.wait_for(lambda: other in self.arrived or other in self.finished)

    def start(self, me: bool) -> None:
        """Set up: wait for the other run to be set up too, then for the turn."""
        self.arrive(me)
        self.wait_for(not me)
        self._wait(me)

    def turn(self, me: bool) -> float:
        took = time.perf_counter() - self.began[me]
        with self.cv:
            self.holder = not me
            self.cv.notify_all()
        self._wait(me)
        return took

    def finish(self, me: bool) -> None:
        with self.cv:
            self.finished.add(me)
            self.holder = not me
            self.cv.notify_all()


def framework_interleaved(
    args: argparse.Namespace, tmp: Path, run: Callable, aa: bool = False
) -> float:
    """A framework's run without spikewatch and with it, taking turns a step each, twice: the
    watched run in the main thread and the other in a worker thread, then the other way round
    (a thread's run against the main thread's differs by 1-3% with spikewatch on neither side,
    and in either direction: the two orientations cancel it). Each orientation's figure is
    the median step time without over the median with; the result is their geometric mean.
    `aa`: both without (the harness's own noise)."""
    ratios = [
        _one_orientation(args, tmp / side, run, aa, watched_in_main)
        for side, watched_in_main in (("main", True), ("worker", False))
    ]
    return math.sqrt(ratios[0] * ratios[1])


def _one_orientation(
    args: argparse.Namespace, tmp: Path, run: Callable, aa: bool, watched_in_main: bool
) -> float:
    baton = Baton()
    out: dict[bool, list[float]] = {}
    for side in ("a", "b"):
        (tmp / side).mkdir(parents=True, exist_ok=True)

    def one(watched: bool) -> None:
        where = tmp / ("b" if watched else "a")
        try:
            out[watched] = run(args, watched, where, baton, False if aa and watched else None)
        finally:
            baton.finish(watched)

    in_thread = not watched_in_main
    thread = threading.Thread(target=one, args=(in_thread,))
    thread.start()
    baton.wait_for(in_thread)  # one set-up at a time
    try:
        one(not in_thread)
    finally:
        thread.join()
    off, on = out[False][WARM:], out[True][WARM:]
    pairs = [a / b for a, b in zip(off, on, strict=False)]  # adjacent steps, one of each
    print(
        f"  {run.__name__} B={args.batch_size}, watched run in the "
        f"{'main' if watched_in_main else 'worker'} thread: median {1e3 * median(off):.1f} ms "
        f"without, {1e3 * median(on):.1f} with (ratio {median(off) / median(on):.3f}); ratio "
        f"of means {sum(off) / sum(on):.3f}, median of adjacent pairs {median(pairs):.3f}",
        flush=True,
    )
    return median(off) / median(on)


def loop_interleaved(args: argparse.Namespace, tmp: Path, part: str = "full") -> float:
    """Plain loop, two identical models stepping alternately, one watched: the median step
    time without over the median with."""
    from spikewatch import Watch
    from spikewatch.hf import attach_attention

    batches = _batches(args)
    loops = []
    for watched in (False, True):
        model = _model(args).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine(args.steps))
        watch = None
        if watched:
            kwargs = {**_watch_kwargs(tmp), **PARTS[part]}
            watch = Watch(model, opt, sched, grad_clip=1.0, run_dir=tmp / f"il-{part}", **kwargs)
            watch.open()
            attach_attention(model, watch.attn)
        loops.append((model, opt, sched, watch, []))
    for i in range(args.steps):
        for model, opt, sched, watch, times in loops if i % 2 else loops[::-1]:
            t0 = time.perf_counter()
            plain_step(model, opt, sched, watch, batches[i], i)
            times.append(time.perf_counter() - t0)
    for *_, watch, _ in loops:
        if watch is not None:
            watch.close()
    off, on = (median(t[WARM:]) for *_, t in loops)
    return off / on


def _steps(stamps: list[float]) -> list[float]:
    """Step times after the warm-up, from [run start, step ends..., run end]."""
    ends = stamps[1:-1]
    return [b - a for a, b in zip(ends[WARM:], ends[WARM + 1 :], strict=False)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-sizes", default="8,16", help="comma-separated: one shape each")
    ap.add_argument("--only", default="loop,hf,lightning")
    ap.add_argument("--breakdown", action="store_true", help="the plain loop, one part off")
    ap.add_argument(
        "--interleaved",
        action="store_true",
        help="with and without in one process, taking turns a step each (the robust figures)",
    )
    ap.add_argument(
        "--aa",
        action="store_true",
        help="with --interleaved: HF and Lightning without spikewatch on both sides (noise)",
    )
    allocator_flag(ap)
    args = ap.parse_args()
    quiet_one_thread(args)
    print(f"shape: d={args.d_model}, {args.layers} layers, T={args.seq_len}, {args.steps} steps")
    everything = {"loop": loop_times, "hf": hf_times, "lightning": lightning_times}
    runners = {k: everything[k] for k in args.only.split(",")}
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.interleaved:
        out = {}
        with tempfile.TemporaryDirectory() as tmp:
            for b in sizes:
                shaped = argparse.Namespace(**{**vars(args), "batch_size": b})
                for name, run in runners.items():
                    for part in PARTS if args.breakdown and name == "loop" else ["full"]:
                        where = Path(tmp) / f"b{b}-{name}-{part}"
                        if name == "loop":
                            r = loop_interleaved(shaped, where, part)
                        else:
                            r = framework_interleaved(shaped, where, run, args.aa)
                        key = "" if part == "full" else f"_{part}"
                        out[f"{name}_interleaved{key}_ratio_b{b}"] = round(r, 4)
                        print(f"B={b} {name} interleaved, {part}: ratio {r:.3f}", flush=True)
        print(json.dumps(out))
        return
    runs: dict[tuple, list[list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.reps):
            for b in sizes:
                shaped = argparse.Namespace(**{**vars(args), "batch_size": b})
                for name, run in runners.items():
                    for watched in (False, True) if r % 2 == 0 else (True, False):
                        where = Path(tmp) / f"r{r}-b{b}-{name}-{watched}"
                        runs.setdefault((name, b, watched), []).append(run(shaped, watched, where))
                if args.breakdown:
                    for part in PARTS:
                        where = Path(tmp) / f"r{r}-b{b}-part-{part}"
                        key = ("loop", b, part)
                        runs.setdefault(key, []).append(loop_times(shaped, True, where, part))
    out: dict[str, float] = {}
    for b in sizes:
        for name in runners:
            off, on = runs[name, b, False], runs[name, b, True]
            step_off = median([t for s in off for t in _steps(s)])
            step_on = median([t for s in on for t in _steps(s)])
            run_off = median([s[-1] - s[0] for s in off])
            run_on = median([s[-1] - s[0] for s in on])
            out[f"{name}_ratio_b{b}"] = round(step_off / step_on, 4)
            out[f"{name}_run_ratio_b{b}"] = round(run_off / run_on, 4)
            out[f"{name}_step_ms_without_b{b}"] = round(1e3 * step_off, 2)
            out[f"{name}_step_ms_with_b{b}"] = round(1e3 * step_on, 2)
            print(
                f"B={b} {name}: {1e3 * step_off:.1f} ms/step without, {1e3 * step_on:.1f} with "
                f"(ratio {step_off / step_on:.3f}); run {run_off:.1f} s vs {run_on:.1f} s "
                f"(ratio {run_off / run_on:.3f})"
            )
        if args.breakdown:
            base = median([t for s in runs["loop", b, False] for t in _steps(s)])
            for part in PARTS:
                step = median([t for s in runs["loop", b, part] for t in _steps(s)])
                out[f"loop_{part}_ratio_b{b}"] = round(base / step, 4)
                print(f"B={b} loop, {part}: ratio {base / step:.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
