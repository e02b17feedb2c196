"""docker-compose.yml validates with Debian's docker-compose (v1), and says what it must."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is missing on CI: .ci/run installs it with apt-get")
        pytest.skip("docker-compose not installed (apt-get install -y docker-compose)")
    return exe


def _config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_compose(), "-f", str(path), "config"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=path.parent,
    )


def test_compose_file_validates_and_wires_the_stack() -> None:
    out = _config(ROOT / "docker-compose.yml")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    services = subprocess.run(
        [_compose(), "-f", str(ROOT / "docker-compose.yml"), "config", "--services"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    assert sorted(services) == ["postgres", "trainer", "web"]
    assert "pg_isready" in text  # the healthcheck
    assert text.count("condition: service_healthy") == 2  # web and trainer wait for it
    assert "spikewatch db upgrade && exec spikewatch serve" in text
    assert "spikewatch db upgrade && exec spikewatch demo" in text
    assert text.count("SPIKEWATCH_DB_URL: postgresql+psycopg://") == 2


def test_an_invalid_compose_file_is_rejected(tmp_path: Path) -> None:
    """The check is real: a wrong key fails validation."""
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(
        "services:\n  web:\n    image: x\n    depends_on:\n      db:\n        condition: soon\n"
    )
    out = _config(bad)
    assert out.returncode != 0
