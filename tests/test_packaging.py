"""What a wheel carries: every package of the source tree is listed in pyproject.toml (a new
folder left out would be missing from the wheel only), the Alembic environment travels as
observatory.migrations, and no Triton import happens on a CPU-only install. The wheel itself is
built, installed in a fresh venv and run from outside the checkout by .ci/wheel_check.sh."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).parents[1]


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_package_of_the_source_tree_is_in_the_wheel() -> None:
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for top in ("spikewatch", "trainer", "observatory", "web")
        for p in (REPO / top).rglob("__init__.py")
    }
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"
    assert "observatory.migrations" in listed


def test_the_migrations_travel_inside_the_package() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]
    assert setuptools["package-dir"]["observatory.migrations"] == "migrations"
    data = setuptools["package-data"]["observatory.migrations"]
    assert {"*.py", "*.mako", "versions/*.py"} <= set(data)
    from observatory.store.db import MIGRATIONS_DIR

    assert (MIGRATIONS_DIR / "env.py").is_file()
    assert list((MIGRATIONS_DIR / "versions").glob("*.py"))


def test_no_triton_is_needed_on_a_cpu_only_install() -> None:
    deps = " ".join(_pyproject()["project"]["dependencies"])
    assert "triton" not in deps and "torch==" not in deps  # ranges; CI pins in constraints
    code = (
        "import sys; import spikewatch, spikewatch.hf, trainer.watch, trainer.cli, web.app; "
        "assert 'triton' not in sys.modules, 'triton imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
