#!/usr/bin/env bash
# The GPU check, on a machine with a CUDA device, from the repository root:
#
#     bash tests/gpu/check.sh OUTDIR
#
# It runs with the machine's own python3 and its torch as they are; kvlife and the other
# packages it needs come as wheels in $KVLIFE_WHEELS (`make gpu-wheels` builds them into
# build/gpu-wheels), installed into OUTDIR/site, never editable. Everything it produces
# lands in OUTDIR: the CUDA tests' report and log, the benchmark's JSON and log, and
# summary.txt, the table it prints last of what held and what did not. See
# tests/gpu/README.md. Exit status: 0 when everything held, 1 otherwise.
#
# KVLIFE_CHECK_CPU=1 runs the same steps without a GPU (the CUDA tests skip; CI runs it so
# that the script itself is tested); KVLIFE_BENCH_ARGS adds arguments to the benchmark.
set -uo pipefail
OUT=${1:?usage: bash tests/gpu/check.sh OUTDIR}
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
started=$(date +%s)
if [ -n "${KVLIFE_WHEELS:-}" ]; then
  $PY -m pip install --quiet --no-index --no-deps --target "$OUT/site" "$KVLIFE_WHEELS"/*.whl \
    > "$OUT/install.log" 2>&1 || { echo "installing the wheels failed: $OUT/install.log"; exit 1; }
  export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
  if [ -z "${KVLIFE_COMMIT:-}" ] && [ -f "$KVLIFE_WHEELS/COMMIT" ]; then
    KVLIFE_COMMIT=$(cat "$KVLIFE_WHEELS/COMMIT")
    export KVLIFE_COMMIT
  fi
fi
$PY - > "$OUT/environment.txt" 2>&1 <<'PYEOF' || { cat "$OUT/environment.txt"; exit 1; }
import os, kvlife.offload, torch
cpu = os.environ.get("KVLIFE_CHECK_CPU") == "1"
assert cpu or torch.cuda.is_available(), "no CUDA device"
name = "CPU" if cpu else torch.cuda.get_device_name()
print(torch.__version__, torch.version.cuda, name, kvlife.offload.__file__)
PYEOF
cat "$OUT/environment.txt"
# CUDA's default lazy module loading: what an engine gets unless it sets EAGER
unset CUDA_MODULE_LOADING
echo "== CUDA tests (one process, lazy module loading)"
timeout 180 $PY -m pytest -q -m cuda -p no:cacheprovider -p no:benchmark --ignore=tests/engines \
  --junitxml="$OUT/cuda-tests.xml" tests > "$OUT/cuda-tests.log" 2>&1
echo "pytest exit $?" >> "$OUT/cuda-tests.log"
tail -3 "$OUT/cuda-tests.log"
echo "== offload benchmark"
# shellcheck disable=SC2086 # the arguments are words
# five timed rounds a way (the figures are medians; seven would not fit 5 minutes)
timeout 270 $PY -m kvlife.offload.bench --json "$OUT/bench.json" --reps 5 ${KVLIFE_BENCH_ARGS:-} \
  > "$OUT/bench.log" 2>&1
echo "bench exit $?" >> "$OUT/bench.log"
tail -1 "$OUT/bench.log"
echo "== what held ($(( $(date +%s) - started )) s)"
$PY tests/gpu/summary.py "$OUT" | tee "$OUT/summary.txt"
