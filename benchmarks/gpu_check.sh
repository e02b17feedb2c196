#!/usr/bin/env bash
# One prepared H200 check (<= 8 minutes): Triton attention vs SDPA flash (correctness and
# fwd+bwd time), probe overhead and MFU of a 124M-class GPT. Writes OUT_DIR/gpu_check.json.
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# The device image has torch and triton but not pydantic: carry its wheels in .whl/ (see the
# device README) and they are installed to /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu_check_out}}
if ! python3 -c "import pydantic" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_check: pydantic is missing and no wheels were carried in .whl/" >&2
    exit 2
  fi
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
timeout 480 python3 benchmarks/gpu_check.py "$out"
