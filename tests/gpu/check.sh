#!/usr/bin/env bash
# The GPU check: run once on a machine with a CUDA device, from the repository root:
#
#     bash tests/gpu/check.sh            # CUDA tests, then the offload benchmark
#
# It needs torch with CUDA plus this project's dependencies; where `make venv` cannot
# reach a package index it uses the machine's python with wheels from $KVLIFE_WHEELS.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
if [ -n "${KVLIFE_WHEELS:-}" ]; then
  $PY -m pip install --quiet --no-index --find-links "$KVLIFE_WHEELS" transitions graphviz msgspec pytest hypothesis
fi
$PY -m pip install --quiet --no-deps --no-build-isolation -e . --config-settings editable_mode=strict
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
echo "== CUDA tests"
$PY -m pytest -q -m cuda -p no:cacheprovider tests
echo "== offload benchmark"
$PY -m kvlife.offload.bench "$@"
