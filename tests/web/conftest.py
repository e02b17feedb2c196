"""A real server (uvicorn in a thread) over a store holding runs recorded by the CLI, and
Chromium driven by Playwright (Debian's /usr/bin/chromium; never a Playwright browser download)."""

from __future__ import annotations

import shutil

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
FAULT = 'faults=[{kind="shifted_labels", start=150, length=10}]'


@pytest.fixture(scope="session")
def recorded_db(tmp_path_factory) -> str:
    """Three runs: one with a spike that was rolled back, two clean ones (for compare)."""
    from spikewatch.trainer.cli import main

    tmp = tmp_path_factory.mktemp("dash")
    db = f"sqlite:///{tmp / 'sw.db'}"
    common = [
        "--set",
        "train.progress=false",
        "--set",
        "train.max_steps=200",
        "--set",
        "checkpoint.interval=10",
        "--db",
        db,
    ]
    assert (
        main(["train", "tiny_cpu", *common, "--set", FAULT, "--run-dir", str(tmp / "spiky")]) == 0
    )
    for lr in ("1e-3", "1e-2"):
        run = tmp / f"lr{lr}"
        assert (
            main(
                [
                    "train",
                    "tiny_cpu",
                    *common,
                    "--set",
                    f"optim.lr={lr}",
                    "--set",
                    "train.max_steps=60",
                    "--run-dir",
                    str(run),
                ]
            )
            == 0
        )
    return db


@pytest.fixture(scope="session")
def server(recorded_db):
    from spikewatch.observatory.serving import serve_in_thread
    from spikewatch.web.app import create_app
    from spikewatch.web.settings import Settings

    served = serve_in_thread(create_app(Settings(db_url=recorded_db)))
    assert served is not None, "the dashboard did not start"
    yield served.url
    served.stop()


@pytest.fixture(scope="session")
def browser():
    if shutil.which(CHROMIUM) is None:
        pytest.skip("browser tests need Debian's chromium (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()
