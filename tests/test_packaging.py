"""What a wheel carries: every package of the source tree is listed in pyproject.toml (a new
folder left out would be missing from the wheel only), every import name is spikewatch's own (a
user's trainer.py, web.py or observatory.py beside their script stays theirs), the Alembic
environment travels as spikewatch.observatory.migrations, and no Triton import happens on a
CPU-only install. The wheel itself is built, installed in a fresh venv and run from a user's
directory (holding those three files) by .ci/wheel_check.sh."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

REPO = Path(__file__).parents[1]
ROOT_PACKAGES = ("trainer", "observatory", "web")  # folders at the checkout's root
OURS = ("spikewatch", *ROOT_PACKAGES, "migrations")


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_package_of_the_source_tree_is_in_the_wheel() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {"spikewatch"} | {
        ".".join(("spikewatch", *p.parent.relative_to(REPO).parts))
        for top in ROOT_PACKAGES
        for p in (REPO / top).rglob("__init__.py")
    }
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"
    assert "spikewatch.observatory.migrations" in listed
    for top in ROOT_PACKAGES:  # built from the folders themselves, not through the links
        assert setuptools["package-dir"][f"spikewatch.{top}"] == top


def test_nothing_generic_at_the_top_of_site_packages() -> None:
    """The wheel's top-level import names: spikewatch only; the checkout's links make the same
    names import from the source tree."""
    setuptools = _pyproject()["tool"]["setuptools"]
    tops = {name.split(".")[0] for name in setuptools["packages"]}
    assert tops == {"spikewatch"}
    assert set(setuptools["package-data"]) <= set(setuptools["packages"])
    script = _pyproject()["project"]["scripts"]["spikewatch"]
    assert script.startswith("spikewatch.")
    for top in ROOT_PACKAGES:
        link = REPO / "spikewatch" / top
        assert link.is_symlink() and link.resolve() == (REPO / top).resolve(), link


def test_every_import_of_ours_is_under_spikewatch() -> None:
    """`from trainer.x import y` would import a user's own trainer.py instead (issue 45), in
    the product, its tests, benchmarks and examples alike."""
    bare = []
    for folder in (*OURS, "tests", "benchmarks", "examples"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and not node.level
                    else [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else []
                )
                bare += [
                    f"{path.relative_to(REPO)}:{node.lineno}: {n}"
                    for n in names
                    if n.split(".")[0] in ROOT_PACKAGES
                ]
    assert not bare, "\n".join(bare)


def test_a_users_own_trainer_web_and_observatory_stay_theirs(tmp_path: Path) -> None:
    """From a directory holding a user's trainer.py, web.py and observatory.py (first on
    sys.path), spikewatch, its integrations and its CLI import their own modules, never these."""
    for name in ROOT_PACKAGES:
        (tmp_path / f"{name}.py").write_text(
            f"raise SystemExit('the user\\'s own {name}.py was imported by spikewatch')\n"
        )
    code = (
        "import spikewatch, spikewatch.hf, spikewatch.lightning, spikewatch.corpus\n"
        "from spikewatch import AdamW, Watch, without_blocked\n"
        "from spikewatch.trainer.cli import build_parser\n"
        "from spikewatch.web.app import create_app\n"
        "from spikewatch.observatory.store.db import MIGRATIONS_DIR\n"
        "assert (MIGRATIONS_DIR / 'env.py').is_file()\n"
        "import sys\n"
        "assert not {'trainer', 'web', 'observatory'} & set(sys.modules), 'a bare name imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    cli = subprocess.run(
        [sys.executable, "-m", "spikewatch", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0 and "simulate" in cli.stdout, cli.stderr[-3000:]


def test_the_migrations_travel_inside_the_package() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]
    assert setuptools["package-dir"]["spikewatch.observatory.migrations"] == "migrations"
    data = setuptools["package-data"]["spikewatch.observatory.migrations"]
    assert {"*.py", "*.mako", "versions/*.py"} <= set(data)
    from spikewatch.observatory.store.db import MIGRATIONS_DIR

    assert (MIGRATIONS_DIR / "env.py").is_file()
    assert list((MIGRATIONS_DIR / "versions").glob("*.py"))


def test_no_triton_is_needed_on_a_cpu_only_install() -> None:
    deps = " ".join(_pyproject()["project"]["dependencies"])
    assert "triton" not in deps and "torch==" not in deps  # ranges; CI pins in constraints
    code = (
        "import sys; import spikewatch, spikewatch.hf, spikewatch.trainer.watch, "
        "spikewatch.trainer.cli, spikewatch.web.app; "
        "assert 'triton' not in sys.modules, 'triton imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
