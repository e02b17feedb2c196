"""A loop we did not write, taken as it is: examples/nanogpt/train.py (nanoGPT's train.py in
shape: its own iter_num driving the LR, a random-window sampler on torch's global RNG, bad data
keyed by the stream's position, accumulation 2 with the next batch fetched inside the
micro-step loop, its GradScaler, unscale_, clip, scaler.step and zero_grad) against
train_spikewatch.py, the same loop with the Watch in a few marked lines."""

from __future__ import annotations

import difflib
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spikewatch import Watch
from spikewatch.trainer.core.callbacks import Callback, StepState

REPO = Path(__file__).resolve().parents[2]
LOOP = REPO / "examples" / "nanogpt"


def _changed(a: list[str], b: list[str]) -> int:
    return sum(1 for d in difflib.ndiff(a, b) if d[:2] in ("- ", "+ "))


def test_the_loop_takes_the_watch_in_a_few_lines_and_keeps_its_shape() -> None:
    plain = (LOOP / "train.py").read_text().splitlines()
    watched = (LOOP / "train_spikewatch.py").read_text().splitlines()
    raw = _changed(plain, watched)
    stripped = _changed(
        [x.strip() for x in plain if x.strip()], [x.strip() for x in watched if x.strip()]
    )
    assert raw <= 20 and stripped <= 14, (raw, stripped)
    kept = [x for x in plain if any(k in x for k in ("clip_grad_norm_", "scaler.", "zero_grad"))]
    assert kept and all(x in watched for x in kept)  # its clip, scaler and zero_grad lines
    added = [d[2:] for d in difflib.ndiff(plain, watched) if d.startswith("+ ")]
    assert all("# spikewatch" in x for x in added), added


def _run(script: str, tmp: Path, *args: str) -> tuple[dict[str, Any], str]:
    env = {**os.environ, "SPIKEWATCH_DB_URL": f"sqlite:///{tmp / 'runs.db'}"}
    out = subprocess.run(
        [sys.executable, str(LOOP / script), *args], capture_output=True, text=True, env=env,
        cwd=tmp, timeout=600, check=False,
    )  # fmt: skip
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    return (json.loads(lines[-1]) if lines else {"returncode": out.returncode}), out.stderr


@pytest.mark.e2e
def test_a_clean_run_ends_exactly_as_the_loop_without_spikewatch(tmp_path) -> None:
    """The loop's clip goes through the Watch's measuring clip (the same arithmetic), the
    update through the gate: the same weights, bit for bit, at the same iteration."""
    args = ("--max_iters=30", "--eval_interval=15")
    plain, _ = _run("train.py", tmp_path, *args, f"--out_dir={tmp_path / 'a'}")
    watched, _ = _run("train_spikewatch.py", tmp_path, *args, f"--out_dir={tmp_path / 'b'}")
    assert plain == watched and plain["iter_num"] == 31, (plain, watched)


class _Steps(Callback):
    def __init__(self) -> None:
        self.steps: list[StepState] = []
        self.rolled_back_at: list[int] = []

    def post_step(self, state: StepState) -> None:
        self.steps.append(state)

    def on_rollback(self, step: int, record: dict) -> None:
        self.rolled_back_at.append(len(self.steps))


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("iters", "at", "length"),
    # the 10-batch case: slow (the 40-batch case takes the same path, and two rollbacks)
    [pytest.param(100, 40, 10, marks=pytest.mark.slow), (200, 120, 40)],
)
def test_a_corrupt_stretch_of_the_stream_is_rolled_back_once_and_never_trained_on(
    tmp_path, monkeypatch, iters: int, at: int, length: int
) -> None:
    """Ten (or forty) iterations' batches from a corrupt stretch (random bytes: loss ~9
    against ~3): one rollback, and after it no update on a corrupt batch, though the loop's
    sampler knows nothing of skips (its batches in the skip range are refused as they come,
    and the rest of a longer stretch, which the stream gives after the skip range, is refused
    by the same-step tier: the weights just restored are known good); no LR cut (the cause was
    the data); the loop ends at its own last iteration, and better than without spikewatch."""
    seen = _Steps()
    init = Watch.__init__

    def with_steps(self, *a: Any, **kw: Any) -> None:  # noqa: ANN001
        kw["callbacks"] = [*kw.get("callbacks", []), seen]
        init(self, *a, **kw)

    monkeypatch.setattr(Watch, "__init__", with_steps)
    monkeypatch.setenv("SPIKEWATCH_DB_URL", f"sqlite:///{tmp_path / 'runs.db'}")
    monkeypatch.syspath_prepend(str(LOOP))
    monkeypatch.chdir(tmp_path)
    args = [f"--max_iters={iters}", "--eval_interval=50", f"--poison_at={at}",
            f"--poison_len={length}"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["train_spikewatch.py", *args, f"--out_dir={tmp_path}/w"])
    out = runpy.run_path(str(LOOP / "train_spikewatch.py"), run_name="__main__")
    watch = out["watch"]
    rollbacks = [i for i in watch.interventions if i["kind"] == "rollback"]
    assert len(rollbacks) == 1, watch.interventions
    assert watch.core.run.lr_scale == 1.0
    after = seen.steps[seen.rolled_back_at[0] :]
    trained = [s for s in after if s.applied]
    assert trained and max(s.loss for s in trained) < 5.0  # corrupt batches: ~8-9
    assert out["iter_num"] == iters + 1 and watch.step_count == iters + 1
    monkeypatch.setattr(Watch, "__init__", init)
    plain, _ = _run("train.py", tmp_path, *args, f"--out_dir={tmp_path / 'p'}")
    assert out["fixed_val_loss"]() < plain["fixed_val_loss"]


# slow tier (~38 s): make test keeps a kill and the same command resuming bitwise in the
# examples (tests/spikewatch/test_examples.py) and nano-gpt's loop (test_nano_gpt.py)
@pytest.mark.slow
@pytest.mark.e2e
def test_a_kill_and_the_same_command_resume_where_the_uninterrupted_run_goes(tmp_path) -> None:
    """Killed at iteration 110 (its last file: 100), the same command resumes from 100: one
    line says so, iter_num (and so the LR) follows the Watch's step, and the run ends at its
    own last iteration within 0.01 of the uninterrupted run (the batch it had fetched ahead
    went with the process)."""
    args = ("--max_iters=130", "--eval_interval=65")
    whole, _ = _run("train_spikewatch.py", tmp_path, *args, f"--out_dir={tmp_path / 'a'}")
    killed, _ = _run("train_spikewatch.py", tmp_path, *args, f"--out_dir={tmp_path / 'b'}",
                     "--kill_at=110")  # fmt: skip
    assert killed == {"returncode": 1}
    again, err = _run("train_spikewatch.py", tmp_path, *args, f"--out_dir={tmp_path / 'b'}")
    resumed = [x for x in err.splitlines() if "resum" in x.lower()]
    assert len(resumed) == 1 and "100" in resumed[0], err
    assert again["iter_num"] == whole["iter_num"] == 131
    assert abs(again["fixed_val_loss"] - whole["fixed_val_loss"]) < 0.01, (again, whole)


def test_the_model_itself_is_the_loss_fn_its_logits_loss_tuple_read(tmp_path, monkeypatch) -> None:
    """`loss_fn=model` for a model that returns (logits, loss), as nanoGPT's does: the replay
    that tells the spike's cause and the naming of its rows call the model with the batch's
    items and take the loss from its tuple (no hand-written loss_fn)."""
    import torch

    from spikewatch import AdamW
    from spikewatch.corpus import text_corpus, windows

    monkeypatch.syspath_prepend(str(LOOP))
    from model import GPT  # examples/nanogpt/model.py

    torch.manual_seed(0)
    model = GPT(2, 4, 32, 32)
    train, _ = text_corpus()
    settings = {"checkpoint": {"memory_interval": 10, "interval": None}}
    watch = Watch(model, AdamW(model.parameters(), lr=3e-3), run_dir=tmp_path, db="none",
                  max_steps=130, settings=settings)  # fmt: skip

    def batch_at(i: int) -> tuple[Any, Any]:
        x, y = windows(train, i, 8, 32)
        if 90 <= i < 100:  # rows 0-2 of ten batches: random labels
            y = y.clone()
            y[:3] = torch.randint(0, 256, y[:3].shape, generator=torch.Generator().manual_seed(i))
        return x, y

    with watch:
        for x, y in watch.batches(batch_at, loss_fn=model):
            logits, loss = model(x, y)
            loss.backward()
            watch.step(loss)
    (rb,) = [i for i in watch.interventions if i["kind"] == "rollback"]
    assert rb["cause"] != "unknown" and rb["replay_steps"] > 0, rb
    named = {(s["batch"], s["row"]) for s in rb["samples"]}
    assert named and all(90 <= b < 100 and r < 3 for b, r in named), named


def test_what_a_loss_fn_returns_is_read_for_its_loss() -> None:
    import torch

    from spikewatch.trainer.watch_loss import as_loss, loss_function

    loss = torch.tensor(2.5)
    assert as_loss((torch.zeros(2, 3), loss)) is loss  # nanoGPT: (logits, loss)
    assert as_loss({"loss": loss, "logits": torch.zeros(1)}) is loss  # a dict output
    assert as_loss(type("Out", (), {"loss": loss})()) is loss  # Hugging Face's ModelOutput
    with pytest.raises(TypeError, match="no loss"):
        as_loss((torch.zeros(2, 3),))

    class Two(torch.nn.Module):
        def forward(self, x, y):  # noqa: ANN001, ANN201
            return x, (x - y).square().mean()

    fn = loss_function(Two())
    assert float(fn((torch.ones(2), torch.zeros(2)))) == 1.0
    assert float(fn({"x": torch.ones(2), "y": torch.zeros(2)})) == 1.0
