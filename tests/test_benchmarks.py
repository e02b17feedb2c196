"""Every benchmark and study under benchmarks/ still imports against today's code (in a process
of its own: they set up paths and logging as scripts do). A rename in the product that a
benchmark reached for (`DbSink._q` once) fails here at import, not the next time someone runs
it; the ones with a smoke run are run by their own tests (host_cost, store, store_scale,
loader_loop, genuine_spikes, the public loops)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import importlib.util, sys, pathlib
failed = []
for f in sorted(pathlib.Path(sys.argv[1]).rglob("*.py")):
    spec = importlib.util.spec_from_file_location(f"bench_{f.parent.name}_{f.stem}", f)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException as e:
        failed.append(f"{f.name}: {e!r}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_benchmark_imports() -> None:
    names = sorted(p.name for p in (REPO / "benchmarks").rglob("*.py"))
    assert len(names) > 40  # the folder as it is: a glob that found nothing proves nothing
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO / "benchmarks")], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
