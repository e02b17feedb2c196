#!/usr/bin/env bash
# The prepared H200 check of issue 38 (<= 9 minutes): benchmarks/gpu_check.py (host syncs in the
# backward-update window, MFU of a compiled 124M GPT with / without spikewatch, the Triton
# attention against SDPA, the host-memory tier's stall for a 1B model), then the HF example on
# CUDA, whose probed steps run the Triton attention path. Writes OUT_DIR/gpu_check.json and
# OUT_DIR/hf_summary.json.
#   bash benchmarks/gpu_wheels.sh                # here, first: the wheels the image lacks
#   device run, carry [".whl"]:  bash benchmarks/gpu_check.sh "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
out=${1:-${OUT:-gpu_check_out}}
mkdir -p "$out"
if ! python3 -c "import pydantic, sqlalchemy, alembic, zstandard" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_check: pydantic/sqlalchemy/alembic missing and no wheels in .whl/ (run benchmarks/gpu_wheels.sh here)" >&2
    exit 2
  fi
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false
timeout 420 python3 benchmarks/gpu_check.py "$out" || echo "gpu_check.py exited $?"
(cd "$out" && timeout 100 python3 "$repo/examples/hf_trainer.py" --steps 150 --poison-at 100 \
  --poison-len 14 --db none --output-dir hf_run --summary-json hf_summary.json >hf_log.txt 2>&1 \
  && python3 -c "import json; s=json.load(open('hf_summary.json')); print('hf', [(i['kind'], i.get('onset_step'), i.get('to_step')) for i in s['interventions']], s['final_val_loss'])") \
  || echo "hf example failed: see $out/hf_log.txt"
