"""The JSON API under schemathesis (every check it has), in-process, over a store holding a
rolled-back run: no 5xx, no status code, content type or body its OpenAPI schema does not
document, no schema-valid request refused. Seeded and bounded, so it is a regression test;
`schemathesis run http://HOST/openapi.json --checks all` against `make demo` is the full fuzz."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")

from hypothesis import HealthCheck, given, settings  # noqa: E402

from spikewatch.web.app import create_app  # noqa: E402
from spikewatch.web.settings import Settings  # noqa: E402

from .conftest import FAULT  # noqa: E402

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


def _app(tmp_path_factory):
    from spikewatch.trainer.cli import main

    tmp = tmp_path_factory.mktemp("fuzz")
    db = f"sqlite:///{tmp / 'sw.db'}"
    args = ["train", "tiny_cpu", "--set", "train.progress=false", "--set", "train.max_steps=200"]
    args += ["--set", "checkpoint.interval=10", "--set", FAULT, "--db", db]
    assert main([*args, "--run-dir", str(tmp / "r1")]) == 0
    return create_app(Settings(db_url=db))


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    loaded = schemathesis.openapi.from_asgi("/openapi.json", _app(tmp_path_factory))
    # the live stream never ends by itself: tests/web/test_browser.py reads it in a browser
    return loaded.exclude(path_regex="/stream$")


def test_the_api_keeps_its_schema(api_schema) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 12
    for op in operations:

        @given(case=op.as_strategy())
        @settings(
            max_examples=15,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case) -> None:
            case.call_and_validate(timeout=180)  # /api/goodput simulates: seconds, not ms

        check()
