"""The built-in trainer's step with the deferred read against the host path (issue 38): the
same run twice in one process, stepping alternately. One reads the step's values after the
update (spikewatch's AdamW takes the step factor, nothing is read before the update); the other
is forced onto the host path (a callback that decides before the update, as every step did
before), so it reads them between backward and the update. Same model, data, arithmetic.

On a CPU nothing is asynchronous, so the order costs nothing either way: the figure says the
deferred read adds no work (goal: not slower, ratio >= 1.0 within noise). On a GPU the host
path drains the launch queue each step; benchmarks/gpu/gpu_check.py measures that.

    python benchmarks/deferred_read.py [--steps 400] [--config tiny_cpu] [--aa]

Last line: {"deferred_over_host_path": r, "deferred_ms": t, "host_path_ms": t}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402,F401  (after _common set the thread environment)
from _common import allocator_flag, median, quiet_one_thread  # noqa: E402

WARM = 20


def main() -> None:
    from spikewatch.trainer.builtin.loop import build_trainer
    from spikewatch.trainer.config import load_config
    from spikewatch.trainer.core.actions import Continue
    from spikewatch.trainer.core.callbacks import Callback

    class BeforeUpdate(Callback):
        """Decides before the update: the step core takes the host path."""

        def pre_update(self, state):  # noqa: ANN001, ANN202
            return Continue()

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--config", default="tiny_cpu")
    ap.add_argument("--aa", action="store_true", help="both runs deferred: the harness's noise")
    allocator_flag(ap)
    args = ap.parse_args()
    quiet_one_thread(args)
    over = [f"train.max_steps={args.steps}", "train.progress=false", "eval.interval=none"]
    cfg = load_config(args.config, over)
    times: dict[str, list[float]] = {"deferred": [], "host_path": []}
    with tempfile.TemporaryDirectory() as tmp:
        deferred = build_trainer(cfg, run_dir=Path(tmp) / "deferred")
        other = [] if args.aa else [BeforeUpdate()]
        host = build_trainer(cfg, run_dir=Path(tmp) / "host", callbacks=other)
        assert not deferred.core.host_path and host.core.host_path != args.aa
        runs = [("deferred", deferred), ("host_path", host)]
        for _, tr in runs:
            tr.core.start()
        for i in range(args.steps):
            for name, tr in runs if i % 2 else runs[::-1]:
                t0 = time.perf_counter()
                tr._train_step()
                tr.core.save_if_due()
                times[name].append(time.perf_counter() - t0)
        for _, tr in runs:
            tr.core.finish("completed")
        same = deferred.core.run.history == host.core.run.history
    d, h = median(times["deferred"][WARM:]), median(times["host_path"][WARM:])
    print(f"deferred {d * 1e3:.2f} ms, host path {h * 1e3:.2f} ms a step; same losses: {same}")
    print(
        json.dumps(
            {
                "deferred_over_host_path": h / d,
                "deferred_ms": d * 1e3,
                "host_path_ms": h * 1e3,
                "same_losses": same,
            }
        )
    )


if __name__ == "__main__":
    main()
