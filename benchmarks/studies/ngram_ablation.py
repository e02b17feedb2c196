"""OLMo 2's repeated n-gram filter, ablated (issue 39): a corpus with injected repeated-n-gram
documents, trained with and without `spikewatch data-check`'s filter, the spikes counted by
the census, and whether the attribution names the injected documents when they are left in.

The hypothesis is written (with the time) before the first run and printed first; the result
follows, whichever way it goes.

- Corpus: the shipped plays cut into 1 KB documents, plus injected documents (OLMo 2's kind:
  an n-gram of n = 2..13 words of the plays repeated 40-80 times, between two stretches of
  clean text), as one JSON-lines file with an "id" per document.
- Stream: batch i draws 16 documents with a seeded generator and trains a 129-byte window of
  each (a plain loop of the plain-loop example's GPT, d=128, 2 layers, T=128, the Watch with
  every default: detection, rollback, attribution). The injected documents come in bursts (a
  spam site scraped together): `--bursts` bursts of 6 consecutive batches, 5 of 16 rows each.
- Arms, per seed: "left in" (the corpus as it is) and "filtered" (`data-check` on the file;
  its blocklist's documents never drawn, their rows drawn again from the clean ones).
- Measured: the census per arm (loss spikes, gradient spikes, rollbacks), the final validation
  loss, the filter's precision and recall against the injected ids; for every rollback in
  "left in", the named samples (how many are injected documents); and, at each burst's first
  batch in "left in", each row alone as the attribution measures it (loss, gradient norm), the
  injected rows' medians against the clean rows', and what the attribution's rule names there.

    python benchmarks/studies/ngram_ablation.py [--steps 600] [--seeds 0,1] [--bursts 8]

Last line: {"hypothesis", "registered_utc", "filter": {...}, "arms": {...}, "attribution": {...}}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

HYPOTHESIS = (
    "Left in, documents with 40-80 repeats of an n-gram (OLMo 2's kind), in bursts of 5 of 16 "
    "rows, raise the census's loss- and gradient-spike counts above the filtered run's; the "
    "filter removes every injected document and no clean one; where a rollback happens in a "
    "burst, the attribution names injected documents."
)
DOC_BYTES, T, B, BURST_LEN, BURST_ROWS = 1024, 128, 16, 6, 5


def _corpus(path: Path, n_injected: int, seed: int) -> tuple[list[bytes], list[str], set[str]]:
    """The documents, their ids and the injected ids; writes them as JSON lines."""
    from spikewatch.corpus import text_corpus

    train, _ = text_corpus()
    raw = bytes(train.tolist())
    clean = [raw[i : i + DOC_BYTES] for i in range(0, len(raw) - DOC_BYTES, DOC_BYTES)]
    words = raw.decode("utf-8", "replace").split()
    rng = np.random.default_rng(seed)
    injected = []
    for _ in range(n_injected):
        n = int(rng.integers(2, 14))
        start = int(rng.integers(0, len(words) - n))
        gram = " ".join(words[start : start + n]) + " "
        body = gram * int(rng.integers(40, 81))
        a, b = (clean[int(rng.integers(len(clean)))][:200] for _ in range(2))
        injected.append(a + b" " + body.encode() + b + b"\n")
    docs = clean + injected
    ids = [f"doc{i:06d}" for i in range(len(docs))]
    with path.open("w") as f:
        for i, d in zip(ids, docs, strict=True):
            f.write(json.dumps({"id": i, "text": d.decode("utf-8", "replace")}) + "\n")
    return docs, ids, set(ids[len(clean) :])


def _stream(steps: int, docs: int, injected: list[int], bursts: int, seed: int) -> list[list[int]]:
    """Batch i's 16 document indices: clean ones at random, and the bursts' injected ones."""
    rng = np.random.default_rng([seed, 7])
    clean = docs - len(injected)
    plan = [list(rng.integers(0, clean, B)) for _ in range(steps + 64)]
    starts = np.linspace(steps * 0.2, steps * 0.9, bursts).astype(int)
    it = iter(injected)
    for s in starts:
        for i in range(s, s + BURST_LEN):
            for r in rng.choice(B, BURST_ROWS, replace=False):
                plan[i][r] = next(it)
    return plan


def _burst_start(plan: list[list[int]], i: int, injected: list[int]) -> bool:
    has = set(injected)
    return any(d in has for d in plan[i]) and not (i and any(d in has for d in plan[i - 1]))


def _gpt() -> type:
    spec = importlib.util.spec_from_file_location("plain_loop", REPO / "examples/plain_loop.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.GPT


def _arm(name: str, args, docs, ids, plan, blocked: set[str], seed: int, db: str, root) -> dict:
    from spikewatch import AdamW, Watch

    torch.manual_seed(seed)
    model = _gpt()(128, 2, 4, T)
    opt = AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    keep = [k for k, i in enumerate(ids) if i not in blocked]
    refill = np.random.default_rng([seed, 11])
    spare = {}  # a blocked document's replacement, the same every time its batch is drawn

    def batch_at(index: int) -> dict:
        rows = []
        for r, d in enumerate(plan[index]):
            if ids[d] in blocked:
                d = spare.setdefault((index, r), keep[int(refill.integers(len(keep)))])
            doc = docs[d]
            off = int(np.random.default_rng([seed, index, r]).integers(0, len(doc) - T - 1))
            rows.append((d, doc[off : off + T + 1]))
        buf = torch.tensor([list(w) for _, w in rows], dtype=torch.long)
        return {"x": buf[:, :-1], "y": buf[:, 1:], "id": [ids[d] for d, _ in rows]}

    val = [batch_at(len(plan) - 1 - k) for k in range(8)]  # clean: beyond the bursts
    probes = []  # what the attribution sees of a burst's first batch, on the weights then
    with Watch(model, opt, name=f"ngram-{name}-s{seed}", db=db, max_steps=args.steps,
               grad_clip=1.0, warmup_steps=args.steps // 10, checkpoint_every=10, run_root=root,
               tags=["ngram-ablation", name]) as watch:  # fmt: skip
        model.use_recorder(watch.attn)
        for b in watch.batches(batch_at, loss_fn=lambda b: model(b["x"], b["y"])):
            if name == "left_in" and watch.index in args.burst_starts:
                probes.append(_probe(model, opt, b, watch.index, args.injected))
            loss = model(b["x"], b["y"])
            loss.backward()
            watch.step(loss)
        with torch.no_grad():
            model.eval()
            final = float(torch.stack([model(b["x"], b["y"]) for b in val]).mean())
        watch.log_eval(final)
    out = {"run_id": watch.run_id, "val": final, "interventions": watch.interventions}
    return out | {"probes": probes}


def _probe(model, opt, batch: dict, index: int, injected: set[str]) -> dict:
    """Each row's loss and gradient norm alone (as the attribution measures them), and what
    the attribution's rule names: injected rows against clean ones."""
    from spikewatch.trainer.core.attribution import RowStat, name_rows, row_grad_norm

    rows = []
    for r in range(batch["x"].size(0)):
        loss = model(batch["x"][r : r + 1], batch["y"][r : r + 1])
        loss.backward()
        grad = row_grad_norm(model.parameters())
        opt.zero_grad(set_to_none=True)
        rows.append(RowStat(batch=index, row=r, loss=float(loss.detach()), grad_norm=grad,
                            id=batch["id"][r]))  # fmt: skip
    bad = [r for r in rows if r.id in injected]
    good = [r for r in rows if r.id not in injected]
    named = {s["row"] for s in name_rows(rows)["samples"]}

    def med(xs: list[float]) -> float:
        return float(np.median(xs))

    return {
        "batch": index,
        "loss_ratio": med([r.loss for r in bad]) / med([r.loss for r in good]),
        "grad_ratio": med([r.grad_norm for r in bad]) / med([r.grad_norm for r in good]),
        "named": len(named),
        "named_injected": len(named & {r.row for r in bad}),
        "injected": len(bad),
    }


def _census(db: str, run_id: str, steps: int) -> dict:
    from sqlalchemy.orm import Session

    from spikewatch.observatory.reports.census import census_of
    from spikewatch.observatory.store import across_runs as across
    from spikewatch.observatory.store.db import make_engine

    with Session(make_engine(db)) as s:
        run = across.runs_by_key(s, [run_id])[run_id]
        c = census_of(s, [run.id], across.trees(s, [run.id]), {run.id: steps})[run.id]
    return {"loss_spikes": c.loss_spikes, "grad_spikes": c.grad_spikes, "rollbacks": c.rollbacks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--bursts", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    registered = datetime.now(UTC).isoformat(timespec="seconds")
    print(f"hypothesis (registered {registered}, before the first run): {HYPOTHESIS}", flush=True)
    from spikewatch.observatory.reports.datacheck import check

    out: dict = {"hypothesis": HYPOTHESIS, "registered_utc": registered, "arms": {}}
    named_total, named_injected, bursts_rolled = 0, 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.jsonl"
        n_inj = args.bursts * BURST_LEN * BURST_ROWS
        docs, ids, injected = _corpus(path, n_inj, seed=0)
        found = check([path])
        blocked = {str(e["id"]) for e in found["flagged"]}
        out["filter"] = {
            "documents": found["documents"],
            "injected": len(injected),
            "flagged": len(blocked),
            "precision": len(blocked & injected) / max(1, len(blocked)),
            "recall": len(blocked & injected) / len(injected),
            "mb_per_s": round(found["mb_per_s"], 1),
        }
        print("filter:", out["filter"], flush=True)
        inj_idx = [k for k, i in enumerate(ids) if i in injected]
        db = f"sqlite:///{Path(tmp) / 'x.db'}"
        for seed in [int(s) for s in args.seeds.split(",")]:
            plan = _stream(args.steps, len(docs), inj_idx, args.bursts, seed)
            args.injected = injected
            args.burst_starts = {i for i in range(len(plan)) if _burst_start(plan, i, inj_idx)}
            for arm, block in (("left_in", set()), ("filtered", blocked)):
                r = _arm(arm, args, docs, ids, plan, block, seed, db, Path(tmp) / "runs")
                census = _census(db, r["run_id"], args.steps)
                out["arms"].setdefault(arm, []).append({"seed": seed, "val": r["val"], **census})
                print(arm, seed, census, f"val {r['val']:.4f}", flush=True)
                for p in r["probes"]:
                    print("  burst", p, flush=True)
                out.setdefault("probes", []).extend(r["probes"])
                for i in r["interventions"] if arm == "left_in" else ():
                    if i.get("kind") != "rollback":
                        continue
                    names = [s.get("id") for s in i.get("samples", [])]
                    named_total += len(names)
                    named_injected += sum(n in injected for n in names)
                    batch = i.get("batch_index", -1)
                    in_burst = any(plan[batch][r] in set(inj_idx) for r in range(B))
                    bursts_rolled += in_burst
                    print(f"  rollback at step {i['step']} (batch {batch}, in a burst: "
                          f"{in_burst}): {len(names)} named, "
                          f"{sum(n in injected for n in names)} injected")  # fmt: skip
    for arm, rows in out["arms"].items():
        out[f"{arm}_mean"] = {
            k: float(np.mean([r[k] for r in rows]))
            for k in ("loss_spikes", "grad_spikes", "rollbacks", "val")
        }
    probes = out.get("probes", [])
    out["burst_rows"] = {
        "loss_ratio_median": float(np.median([p["loss_ratio"] for p in probes])),
        "grad_ratio_median": float(np.median([p["grad_ratio"] for p in probes])),
        "named": sum(p["named"] for p in probes),
        "named_injected": sum(p["named_injected"] for p in probes),
        "injected": sum(p["injected"] for p in probes),
    }
    out.pop("probes", None)
    out["attribution"] = {
        "rollbacks_in_bursts": bursts_rolled,
        "named": named_total,
        "named_injected": named_injected,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
