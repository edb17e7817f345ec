#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh installs on the GPU machine, fetched here into .whl/ (ignored by
# git, carried to the device with the working tree). That machine has Python 3.12, torch with CUDA,
# triton, transformers, lightning, numpy, pytest, hypothesis, pyyaml; it cannot download. It lacks
# what this package and its GPU checks import beyond those: omegaconf (and antlr4, which omegaconf
# parses its interpolations with) and megatron-core. One version of each, for CPython 3.12 on
# manylinux x86_64; antlr4-python3-runtime 4.9.3 exists only as a source archive, so its (pure
# Python) wheel is built here. TRL is not in the set: it needs datasets, hence pyarrow (55 MB) and
# pandas (12 MB): 67 MB of wheels for CPython 3.12, past the 64 MiB the device run may carry.
#
#   bash scripts/gpu_wheels.sh [DEST]      # default .whl
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
mkdir -p "$dest"
pip download --quiet --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" omegaconf==2.3.0 megatron-core==0.16.1
pip wheel --quiet --no-deps -w "$dest" antlr4-python3-runtime==4.9.3
ls -1 "$dest"/*.whl
du -ch "$dest"/*.whl | tail -1
