#!/usr/bin/env bash
# The GPU check of the SPD step, as one prepared script (<= 9 minutes on one GPU).
#
# For each of tms (TMS 5-2, batch 4096), resid-mlp (ResidMLP-1, batch 2048) and llama-mlp (the
# byte-level LM, 16 x 64 tokens): train-step compile seconds, step ms, samples/s, one device's
# FLOPs per step, MFU against the device's peak (the table in pdctl/engine/measure.py), XLA's
# memory_analysis() peak per device with and without donating the state, and the pointer reuse
# of the first donating call (benchmarks/spd_step.py). Writes spd_step.json (and the log) under
# $OUT when set, else under ./gpu-check/.
#
# JAX for the GPU: where a package index is reachable, `pip install "jax[cuda12]"` and pdctl;
# where not (a machine with no network, e.g. the `device` tool's H200), the machine's own JAX
# plus pdctl's missing pure-Python dependencies from wheels in .whl/ (fetch them here with
# benchmarks/gpu_wheels.sh, carry .whl along).
#
#     bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

if "$PY" -c 'import jax, sys; sys.exit(0 if jax.default_backend() == "gpu" else 1)' 2>/dev/null; then
  echo "== using this machine's JAX $("$PY" -c 'import jax; print(jax.__version__)') on the GPU"
  if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/pdctl-site .whl/*.whl
    export PYTHONPATH="/tmp/pdctl-site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "== installing jax[cuda12] and pdctl into a fresh virtual environment"
  "$PY" -m venv /tmp/pdctl-gpu-venv
  # shellcheck disable=SC1091
  . /tmp/pdctl-gpu-venv/bin/activate
  PY=python
  python -m pip install -q -e . "jax[cuda12]"
fi
"$PY" -c 'import jax; print("devices:", jax.devices())'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true

timeout 280 "$PY" benchmarks/spd_step.py --configs tms resid-mlp llama-mlp \
  --devices default --steps 50 --json "$OUT/spd_step.json"
echo "== wrote $OUT/spd_step.json"

# Layers as a scan with stacked sites against unrolled (issue 20): compile and step time of a
# tiny Llama at 8 and 32 layers on the GPU (docs/performance.md has the CPU figures).
timeout 240 "$PY" benchmarks/scan_compile.py --layers 8 32 --unrolled-max 32 \
  --json "$OUT/scan_compile.json" || echo "== scan_compile did not finish in its 240 s"

# Sweeps (issue 23): the stacked TMS 5-2 train step per member, batched (vmap, the accelerator
# default) against one after another (map), 1 to 10 members on the one GPU.
timeout 150 "$PY" benchmarks/sweep_step.py --devices 1 > "$OUT/sweep_step.txt" 2>&1 \
  || echo "== sweep_step did not finish in its 150 s"
cat "$OUT/sweep_step.txt" || true
