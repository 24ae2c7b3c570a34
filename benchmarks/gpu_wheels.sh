#!/usr/bin/env bash
# Wheels of pdctl's pure-Python dependencies that a GPU machine without network lacks (its own
# image brings JAX, optax, orbax, typer, rich, safetensors, tokenizers, ...), for Python 3.12
# on x86-64, into .whl/ (add `/.whl/` to .git/info/exclude). gpu_check.sh installs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pydantic pydantic-core annotated-types typing-inspection tomli-w grain array-record \
  cloudpickle dm-tree ml-dtypes
ls .whl
