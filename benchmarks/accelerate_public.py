"""accelerate's own public training loop with the Watch patched in from the docs alone.

    python benchmarks/accelerate_public.py [--epochs 3] [--poison 40:50]

The loop is accelerate's `test_utils/scripts/external_deps/test_checkpointing.py`, as installed
with accelerate (Apache-2.0; the loop of its `examples/by_feature/checkpointing.py`): a BERT
sequence classifier, a shuffled DataLoader, `accelerator.prepare`, a linear schedule, its own
`overall_step` counter, `save_state` after each epoch. It is read from the installed package
when this runs, never copied into this repository, and edited as text in two ways:

- offline edits, not spikewatch's (this machine cannot download): GLUE/MRPC and
  `bert-base-cased` become a generated pair-classification set of the same shape (a label a
  small BERT can learn) and a BERT built from a small config; `evaluate`'s accuracy a counting
  one. `OFFLINE` below.
- the spikewatch patch, the lines a user adds from docs/own_loop.md: `PATCH` below; its size is
  counted and printed.

Runs, each in a fresh process: the loop without spikewatch; with it, clean; with it and a
poisoned stretch (the labels of batches `--poison A:B` of the first pass flipped); with it,
killed after its disk checkpoint and run again with the same command (a resume). Prints the
diff, its size, each run's final accuracy and eval loss and what the Watch did, and one JSON
line.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import accelerate

SCRIPT = Path(accelerate.__file__).parent / "test_utils/scripts/external_deps/test_checkpointing.py"

# What stands in for the downloads: a pair-classification set shaped like MRPC (two token
# sentences, a 0/1 label), a BERT from a small config, and accuracy counted here. Put at the top
# of the loop's file; the env var SW_POISON ("A:B") flips the labels of the first pass's batches
# A..B-1 (a corrupt stretch of the data, as the loader delivers it).
PRELUDE = """
import os as _os
import torch as _torch
from transformers import BatchEncoding as _Batch, BertConfig as _BertConfig
from transformers import BertForSequenceClassification as _Bert


class _Accuracy:
    def __init__(self):
        self.right = self.seen = 0

    def add_batch(self, predictions, references):
        self.right += int((predictions == references).sum())
        self.seen += int(references.numel())

    def compute(self):
        out = {"accuracy": self.right / max(self.seen, 1)}
        self.right = self.seen = 0
        return out


def _pairs(n, seed):
    g = _torch.Generator().manual_seed(seed)
    first = _torch.randint(1000, 2000, (n, 12), generator=g)
    second = _torch.randint(1000, 2000, (n, 12), generator=g)
    first[:, 0] = _torch.randint(1000, 1010, (n,), generator=g)  # one of ten opening words
    label = (first[:, 0] < 1005).long()  # which, says the label: a small BERT learns it
    second[label == 1, :4] = first[label == 1, :4]  # (and a paraphrase shares its start)
    cls, sep = _torch.full((n, 1), 101), _torch.full((n, 1), 102)
    ids = _torch.cat([cls, first, sep, second, sep], dim=1)
    return [(ids[i], int(label[i])) for i in range(n)]


def _offline_dataloaders(accelerator, batch_size=16):
    poison = [int(x) for x in _os.environ.get("SW_POISON", "0:0").split(":")]
    drawn = [0]

    def collate(examples):
        ids = _torch.stack([e[0] for e in examples])
        labels = _torch.tensor([e[1] for e in examples])
        if poison[0] <= drawn[0] < poison[1]:
            labels = 1 - labels
        drawn[0] += 1
        tt = _torch.zeros_like(ids)
        tt[:, 14:] = 1
        return _Batch({"input_ids": ids, "token_type_ids": tt,
                       "attention_mask": _torch.ones_like(ids), "labels": labels})

    train = DataLoader(_pairs(1600, 0), shuffle=True, collate_fn=collate, batch_size=batch_size)
    evals = DataLoader(_pairs(400, 1), collate_fn=collate, batch_size=EVAL_BATCH_SIZE)
    return train, evals


def _small_bert():
    return _Bert(_BertConfig(vocab_size=2048, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=128,
                             max_position_embeddings=64, num_labels=2))
"""
OFFLINE = [  # (the loop's line, its offline stand-in): not spikewatch's
    ("import evaluate\n", ""),
    ("from datasets import load_dataset\n", ""),
    (
        "    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size, "
        "model_name)\n",
        "    train_dataloader, eval_dataloader = _offline_dataloaders(accelerator, batch_size)\n",
    ),
    (
        "    model = AutoModelForSequenceClassification.from_pretrained(model_name, "
        "return_dict=True)\n",
        "    model = _small_bert()\n",
    ),
    ('    metric = evaluate.load("glue", "mrpc")\n', "    metric = _Accuracy()\n"),
    (
        '    config = {"lr": 2e-5, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16}\n',
        '    config = {"lr": 1e-3, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16}\n',
    ),
]
# The spikewatch patch, as docs/own_loop.md's accelerate section has it: (the loop's line, what
# replaces it). Each added or changed line is counted.
PATCH = [
    (
        "from accelerate import Accelerator, DistributedType\n",
        "from accelerate import Accelerator, DistributedType\nfrom spikewatch import Watch\n",
    ),
    (
        "    # We need to keep track of how many total steps we have iterated over\n",
        "    watch = Watch(model, optimizer, lr_scheduler, max_steps=max_training_steps,\n"
        '                  run_dir=os.path.join(args.output_dir, "spikewatch"), resume="auto")\n'
        "    watch.route(optimizer, lr_scheduler)\n"
        "    # We need to keep track of how many total steps we have iterated over\n",
    ),
    (
        "        for step, batch in enumerate(train_dataloader):\n",
        "        for step, batch in enumerate(watch.batches(train_dataloader, loss_fn=model)):\n",
    ),
    (
        "            loss = outputs.loss\n",
        "            loss = outputs.loss\n            watch.observe_loss(loss)\n",
    ),
    (
        "            overall_step += 1\n",
        "            overall_step = watch.step_count\n",
    ),
    (
        "    accelerator.end_training()\n",
        "    accelerator.end_training()\n    watch.close()\n",
    ),
]
# What each run reports, printed by the loop's process at its end (not the user's patch).
REPORT = """
def _report(path, model, eval_dataloader, accelerator, watch=None):
    import json as _json
    model.eval()
    losses, right, seen = [], 0, 0
    with _torch.no_grad():
        for batch in eval_dataloader:
            out = model(**batch)
            losses.append(float(out.loss))
            right += int((out.logits.argmax(-1) == batch["labels"]).sum())
            seen += int(batch["labels"].numel())
    out = {"eval_loss": sum(losses) / len(losses), "accuracy": right / seen}
    if watch is not None:
        s = watch.summary()
        out.update(steps=s["steps"], interventions=[
            {k: i.get(k) for k in ("kind", "step", "to_step", "skip_ranges", "reason")}
            for i in s.get("interventions", [])])
    _json.dump(out, open(path, "w"))
"""


def edit(text: str, pairs: list[tuple[str, str]]) -> str:
    for old, new in pairs:
        if text.count(old) != 1:
            raise SystemExit(f"the loop changed: {old!r} is not in it once (accelerate upgraded?)")
        text = text.replace(old, new)
    return text


def build(tmp: Path, watched: bool) -> tuple[Path, str]:
    """The loop's file, offline, with (or without) the patch; and the patch's diff."""
    original = SCRIPT.read_text()
    offline = edit(original, OFFLINE)
    patched = edit(offline, PATCH) if watched else offline
    diff = "".join(difflib.unified_diff(offline.splitlines(True), patched.splitlines(True),
                                        "loop.py", "loop_spikewatch.py", n=1))  # fmt: skip
    report = "        _report(_os.environ['SW_REPORT'], model, eval_dataloader, accelerator" + (
        ", watch)\n" if watched else ")\n"
    )
    patched = patched.replace(
        "    accelerator.end_training()\n", "    accelerator.end_training()\n" + report[4:], 1
    )
    head, sep, rest = patched.partition("\n\nMAX_GPU_BATCH_SIZE")
    body = head + "\n" + PRELUDE + REPORT + sep + rest
    path = tmp / ("loop_spikewatch.py" if watched else "loop.py")
    path.write_text(body)
    return path, diff


def run(path: Path, out: Path, epochs: int, poison: str = "0:0", kill_after: float = 0) -> dict:
    env = {**os.environ, "SW_REPORT": str(out / "report.json"), "SW_POISON": poison,
           "OMP_NUM_THREADS": "1", "SPIKEWATCH_DB_URL": f"sqlite:///{out}/sw.db"}  # fmt: skip
    cmd = [sys.executable, str(path), "--output_dir", str(out), "--num_epochs", str(epochs)]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    killed = None
    if kill_after:
        p = subprocess.Popen(
            cmd, env=env, cwd=out, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        ckpt = out / "spikewatch" / "checkpoints"
        while (
            p.poll() is None
            and not any(  # a checkpoint past the start's anchor
                int(m.parent.name[4:]) > 0 for m in ckpt.glob("step*/meta.json")
            )
        ):
            time.sleep(0.2)
        time.sleep(kill_after)
        p.send_signal(signal.SIGKILL)
        p.wait()
        killed = sorted(d.name for d in ckpt.glob("step*") if (d / "meta.json").exists())
    done = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{path.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads((out / "report.json").read_text())
    result["seconds"] = round(time.perf_counter() - t0, 1)
    resumed = [ln for ln in (done.stdout + done.stderr).splitlines() if "resumed" in ln]
    if killed is not None:
        result.update(killed_with=killed, resume_line=resumed[:1])
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--poison", default="40:50", help="first pass's batches A:B, labels flipped")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        bare, _ = build(tmp, watched=False)
        watched, diff = build(tmp, watched=True)
        changed = sum(
            1 for ln in diff.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))
        )
        added = sum(1 for ln in diff.splitlines() if ln[:1] == "+" and not ln.startswith("+++"))
        print(diff)
        runs = {
            "without": run(bare, tmp / "without", args.epochs),
            "clean": run(watched, tmp / "clean", args.epochs),
            "without_poisoned": run(bare, tmp / "without_poisoned", args.epochs, args.poison),
            "poisoned": run(watched, tmp / "poisoned", args.epochs, args.poison),
            "killed_and_rerun": run(watched, tmp / "killed", args.epochs, kill_after=1.0),
        }
    out = {"loop": str(SCRIPT.relative_to(SCRIPT.parents[4])), "accelerate": accelerate.__version__,
           "diff_lines_changed": changed, "diff_lines_added": added, "runs": runs}  # fmt: skip
    for name, r in runs.items():
        print(f"{name}: accuracy {r['accuracy']:.4f}, eval loss {r['eval_loss']:.4f}, "
              f"{r.get('steps', '-')} steps, {r['seconds']} s, "
              f"{[i['kind'] for i in r.get('interventions', [])]}")  # fmt: skip
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
