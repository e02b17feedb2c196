"""An accelerate loop as such loops are written (`accelerator.prepare`, a shuffled DataLoader,
`accelerator.accumulate`, `backward`, its own step counter), with the Watch added in a few lines:
`watch.route(optimizer, scheduler)` and `watch.batches(train_dataloader, accumulate=k)`."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from .conftest import example

accelerate = pytest.importorskip("accelerate", reason="the hf extra is not installed")

from spikewatch import Watch  # noqa: E402
from spikewatch.corpus import text_corpus  # noqa: E402

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

ACCUM = 2


def _fresh() -> Any:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)


def _loop(run_dir: Any, steps: int, *, watched: bool, crash_at: int | None = None,
          poison: range = range(0), fused: bool = False,
          own: Any = None) -> dict[str, Any]:  # fmt: skip
    """The loop; what it fed (window ids per micro-batch), each micro-batch's loss, the end."""
    ex = example("dataloader_loop")
    train, _ = text_corpus()
    torch.manual_seed(0)
    accelerator = _fresh()
    model = example("plain_loop").GPT(32, 2, 4, 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=fused)
    data = ex.Stream(train, 32, 4, poison) if poison else ex.Windows(train, 32)
    loader = DataLoader(data, batch_size=4, shuffle=not poison)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + 0.01 * s))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    fed: list[list[int]] = []
    losses: list[float] = []
    completed = 0
    watch = None
    batches: Any = loader
    if watched:
        # `own`: the loop keeps its own checkpoints there (accelerate's save_state every 10
        # steps, the Watch's state among them) and the Watch keeps none on disk
        disk = None if own is not None else 10
        settings = {"checkpoint": {"memory_interval": 10, "interval": disk, "async_save": False}}
        watch = Watch(model, optimizer, scheduler, run_dir=run_dir, db="none", max_steps=steps,
                      resume="auto", settings=settings)  # fmt: skip
        watch.open()
        watch.route(optimizer, scheduler)
        if own is not None:
            accelerator.register_for_checkpointing(watch)
            saved = sorted(own.glob("step*"), key=lambda p: int(p.name[4:]))
            if saved:
                accelerator.load_state(str(saved[-1]))
        batches = watch.batches(loader, accumulate=ACCUM, loss_fn=lambda b: model(b[0], b[1]))
        completed = watch.step_count
    try:
        for x, y, ids in batches:
            if crash_at is not None and completed == crash_at:
                raise KeyboardInterrupt  # a kill: no final checkpoint
            with accelerator.accumulate(model):
                loss = model(x, y)
                if watch is not None:
                    watch.observe_loss(loss)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            fed.append(ids.tolist())
            losses.append(float(loss.detach()))
            if accelerator.sync_gradients:  # the loop's counter follows the Watch's
                completed = completed + 1 if watch is None else watch.step_count
                if own is not None and completed % 10 == 0:
                    accelerator.save_state(str(own / f"step{completed}"))
                if completed >= steps:
                    break
    except KeyboardInterrupt:
        return {"fed": fed}  # killed: nothing closed, no final checkpoint
    if watch is not None:
        watch.close()
    return {"fed": fed, "losses": losses, "model": model, "watch": watch, "done": completed}


def test_a_clean_accelerate_loop_ends_bitwise_as_without_spikewatch(tmp_path) -> None:
    bare = _loop(None, 30, watched=False)
    watched = _loop(tmp_path / "w", 30, watched=True)
    watch = watched["watch"]
    assert watched["fed"] == bare["fed"] and len(bare["fed"]) == 60  # 2 micro-batches a step
    assert watch.step_count == watched["done"] == 30
    for a, b in zip(bare["model"].parameters(), watched["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    # the step's loss: the mean of its micro-batches' (the first step's, as the run recorded it)
    (first,) = [loss for s, loss in watch.core.run.history if s == 1]
    assert first == pytest.approx(sum(watched["losses"][:2]) / 2, rel=1e-6)


def test_a_kill_and_the_same_command_resume_in_the_uninterrupted_order(tmp_path, caplog) -> None:
    clean = _loop(tmp_path / "clean", 30, watched=True)
    killed = _loop(tmp_path / "run", 30, watched=True, crash_at=25)
    with caplog.at_level(logging.INFO, logger="spikewatch"):
        resumed = _loop(tmp_path / "run", 30, watched=True)
    assert killed["fed"] == clean["fed"][:50]
    assert resumed["fed"] == clean["fed"][40:]  # from the checkpoint at step 20
    assert "fast-forwarded past" in caplog.text and "resum" in caplog.text
    for a, b in zip(clean["model"].parameters(), resumed["model"].parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_poisoned_stretch_is_fed_once_and_never_after_the_rollback(tmp_path) -> None:
    poison = range(120, 140)  # micro-batches: 10 updates
    clean = _loop(tmp_path / "clean", 200, watched=True, poison=range(10_000, 10_001))
    hit = _loop(tmp_path / "hit", 200, watched=True, poison=poison)
    rollbacks = [i for i in hit["watch"].interventions if i["kind"] == "rollback"]
    assert rollbacks, hit["watch"].interventions
    spoilt = {i for b in poison for i in range(b * 4, b * 4 + 4)}
    fed = [set(f) & spoilt for f in hit["fed"]]
    ids = [i for f in hit["fed"] for i in f]
    assert len(ids) == len(set(ids))  # no micro-batch fed twice
    first = 2 * rollbacks[0]["from_step"]  # micro-batches fed by the detection
    assert not any(fed[first:]), [k for k, f in enumerate(fed) if f]
    assert hit["watch"].step_count == clean["watch"].step_count == 200
    ex, (_, val) = example("dataloader_loop"), text_corpus()
    shape = SimpleNamespace(seq_len=32, batch_size=4)
    hit_val, clean_val = (ex.evaluate(r["model"], val, shape) for r in (hit, clean))
    assert hit_val <= clean_val + 0.01, (hit_val, clean_val)


def test_the_host_path_line_names_the_optimizer_inside_accelerates(tmp_path, caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="spikewatch"):  # a warning on a GPU
        _loop(tmp_path / "a", 2, watched=True)
    assert "AdamW (inside AcceleratedOptimizer) takes no step factor" in caplog.text


def test_a_fused_adamw_under_prepare_keeps_the_device_path(tmp_path) -> None:
    run = _loop(tmp_path / "a", 4, watched=True, fused=True)
    assert not run["watch"].core.host_path and run["watch"].step_count == 4


def test_the_loops_own_checkpoints_carry_the_watch_and_its_data_position(tmp_path) -> None:
    """`accelerator.register_for_checkpointing(watch)` and the Watch's disk tier off: a kill at
    step 25 and `accelerator.load_state` of the loop's own checkpoint at step 20 resume the
    Watch (its step, its guard) and the loader's position with the weights, in the
    uninterrupted order, bitwise."""
    clean = _loop(tmp_path / "clean", 30, watched=True, own=tmp_path / "own-clean")
    _loop(tmp_path / "run", 30, watched=True, own=tmp_path / "own", crash_at=25)
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").glob("step*[1-9]*")
    )  # the Watch wrote no checkpoint of its own past its anchor
    resumed = _loop(tmp_path / "run", 30, watched=True, own=tmp_path / "own")
    assert resumed["watch"].step_count == 30
    assert resumed["fed"] == clean["fed"][40:]  # from the loop's checkpoint at step 20
    for a, b in zip(clean["model"].parameters(), resumed["model"].parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_loader_loop_benchmark_runs_small() -> None:
    """benchmarks/loader_loop.py's smoke run (the figure is the benchmark's, not a test's)."""
    import importlib.util

    from .conftest import REPO

    spec = importlib.util.spec_from_file_location("loader_loop", REPO / "benchmarks/loader_loop.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--smoke"])
    assert out["ratio"] > 0 and out["bare_ms"] > 0 and out["watched_ms"] > 0


def test_accelerates_own_loop_takes_the_documented_patch(tmp_path) -> None:
    """benchmarks/accelerate_public.py edits accelerate's installed checkpointing loop as text:
    each line it replaces is there once (an accelerate that changed the loop fails here, not
    mid-benchmark), the spikewatch patch adds 6 lines and changes 2 (docs/own_loop.md), and the
    loops it writes compile. Its runs are the benchmark's, not a test's."""
    import importlib.util

    from .conftest import REPO

    path = REPO / "benchmarks/accelerate_public.py"
    spec = importlib.util.spec_from_file_location("accelerate_public", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bare, _ = bench.build(tmp_path, watched=False)
    watched, diff = bench.build(tmp_path, watched=True)
    body = [ln for ln in diff.splitlines() if not ln.startswith(("+++", "---"))]
    assert sum(ln.startswith("+") for ln in body) == 8
    assert sum(ln.startswith("-") for ln in body) == 2
    for loop in (bare, watched):
        compile(loop.read_text(), str(loop), "exec")
    assert "watch.batches(train_dataloader, loss_fn=model)" in watched.read_text()
