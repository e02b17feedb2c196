"""No host read between backward and the update (ARCHITECTURE.md, "the GPU never waits for the
host"): with a step-factor optimizer, the built-in loop and the Watch read nothing on the host
from the end of the last backward of a step to the start of its optimizer step, on normal,
probed, refused (non-finite) and same-step-refused steps alike. On a GPU each such read would
drain the launch queue; here they are counted, whatever device the tensor is on.

The counter is checked against a loop that does read there (the host path, torch's AdamW)."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook

from spikewatch import AdamW, Watch
from spikewatch.trainer.builtin.loop import build_trainer

from .conftest import tiny_config

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


class HostReads:
    """Counts host reads of tensor values (and torch.cuda.synchronize) made on the loop thread
    while `open`: from the return of a backward to the start of the next optimizer step. (A
    checkpoint's writer thread works meanwhile on host memory: its calls stall no loop.)"""

    def __init__(self) -> None:
        self.open = False
        self.reads: Counter[str] = Counter()
        self.windows = 0  # backward -> step windows closed (optimizer steps taken)
        self.per_window: list[int] = []
        self._in_window = 0

    def _count(self, name: str) -> None:
        if self.open and threading.current_thread() is threading.main_thread():
            self.reads[name] += 1
            self._in_window += 1

    @contextlib.contextmanager
    def installed(self) -> Iterator[HostReads]:
        saved = {name: getattr(torch.Tensor, name) for name in READS}
        backward, synchronize = torch.Tensor.backward, torch.cuda.synchronize

        def counting(name: str, original):  # noqa: ANN001, ANN202
            def read(t, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
                self._count(name)
                return original(t, *args, **kwargs)

            return read

        def after_backward(t, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            out = backward(t, *args, **kwargs)
            self.open = True
            return out

        def sync(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self._count("cuda.synchronize")
            return synchronize(*args, **kwargs)

        def at_step(optimizer, args, kwargs):  # noqa: ANN001, ANN202
            if self.open:
                self.windows += 1
                self.per_window.append(self._in_window)
            self.open, self._in_window = False, 0

        hook = register_optimizer_step_pre_hook(at_step)
        for name, original in saved.items():
            setattr(torch.Tensor, name, counting(name, original))
        torch.Tensor.backward = after_backward  # type: ignore[method-assign]
        torch.cuda.synchronize = sync
        try:
            yield self
        finally:
            hook.remove()
            for name, original in saved.items():
                setattr(torch.Tensor, name, original)
            torch.Tensor.backward = backward  # type: ignore[method-assign]
            torch.cuda.synchronize = synchronize


def test_the_builtin_loop_reads_nothing_between_backward_and_the_update(tmp_path) -> None:
    """160 steps, every probe on, one non-finite step (batch 100) and one batch of shifted
    labels (batch 150) that the same-step tier refuses: 0 reads in every window."""
    cfg = tiny_config(
        "train.max_steps=160",
        "eval.interval=none",
        'faults=[{kind="nan_loss", start=100}, {kind="shifted_labels", start=150}]',
    )
    tr = build_trainer(cfg, run_dir=tmp_path)
    assert not tr.core.host_path
    with HostReads().installed() as reads:
        result = tr.fit()
    kinds = {(i["kind"], i["step"]) for i in result.interventions}
    assert ("skip_update", 101) in kinds and ("skip_update", 151) in kinds  # both were refused
    assert "same-step tier" in next(i["reason"] for i in result.interventions if i["step"] == 151)
    assert reads.windows == 160  # every step's window was seen (refused steps call step too)
    assert sum(reads.reads.values()) == 0, dict(reads.reads)


class _Bigram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 256)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.emb(x).flatten(0, 1), y.flatten())


def _watched_loop(tmp_path, optimizer_class: type, steps: int = 40) -> tuple[Watch, HostReads]:
    torch.manual_seed(0)
    model = _Bigram()
    opt = optimizer_class(model.parameters(), lr=1e-2)
    data = torch.randint(0, 256, (steps + 8, 4, 17))

    def batch_at(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return data[i, :, :-1], data[i, :, 1:]

    watch = Watch(model, opt, max_steps=steps, grad_clip=1.0, run_dir=tmp_path / "run", db="none")
    with HostReads().installed() as reads, watch:
        for x, y in watch.batches(batch_at):
            loss = model(x, y)
            if watch.step_count == 20:
                loss = loss * float("nan")  # a non-finite step, refused on the device
            loss.backward()
            watch.step(loss)
    return watch, reads


def test_the_watch_with_spikewatch_adamw_reads_nothing_before_the_update(tmp_path) -> None:
    watch, reads = _watched_loop(tmp_path, AdamW)
    assert not watch.core.host_path
    assert [(i["kind"], i["step"]) for i in watch.interventions] == [("skip_update", 21)]
    assert reads.windows == 40 and sum(reads.reads.values()) == 0, dict(reads.reads)


def test_the_counter_sees_the_host_path_read(tmp_path) -> None:
    """torch's AdamW takes no step factor: the Watch reads the step's values before the
    update, once a step, and the counter sees exactly that."""
    watch, reads = _watched_loop(tmp_path, torch.optim.AdamW)
    assert watch.core.host_path
    assert [(i["kind"], i["step"]) for i in watch.interventions] == [("skip_update", 21)]
    # one read a step; the refused step calls no optimizer step, so its read and the next
    # step's fall in one window
    assert reads.windows == 39 and reads.reads == Counter(tolist=40)
    assert reads.per_window == [1] * 20 + [2] + [1] * 18
