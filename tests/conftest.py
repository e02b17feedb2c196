from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Triton kernels run on a CPU only through the interpreter, which must be on before any
# @triton.jit function is defined (ARCHITECTURE.md).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--regen-golden",
        action="store_true",
        default=False,
        help="rewrite tests/assets golden files from the current code instead of comparing",
    )


@pytest.fixture
def regen_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--regen-golden"))


@pytest.fixture(autouse=True)
def _in_a_directory_of_its_own(tmp_path_factory, monkeypatch) -> None:
    """Each test runs in a fresh directory: a run recorded by the default rule (runs/spikewatch.db
    where it starts) lands there, never in the checkout, and never in another test's store."""
    monkeypatch.delenv("SPIKEWATCH_DB_URL", raising=False)
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
