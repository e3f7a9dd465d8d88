#!/usr/bin/env bash
# One prepared GPU check for a machine with torch, Triton and CuPy installed but
# no network: install ecoffload without dependencies, run the `gpu` tests and
# the benchmark, and leave every log in OUT_DIR. Finishes in a few minutes.
#
#   bash profiling/gpu_check.sh OUT_DIR [--quick]
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [--quick]}
quick=${2:-}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  "$py" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  "$py" -c 'import cupy; print("cupy", cupy.__version__)' 2>&1
  df -h /dev/shm 2>&1 | tail -1
} > "$out/environment.txt" 2>&1
cat "$out/environment.txt"

"$py" -m pip install --no-deps --no-build-isolation -q -e . > "$out/install.log" 2>&1 \
  || { echo "install failed:"; tail -20 "$out/install.log"; exit 1; }

status=0
timeout 180 "$py" -m pytest -m gpu -q -p no:cacheprovider tests/ 2>&1 | tee "$out/pytest-gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 240 "$py" -m ecoffload.profiling.bench --out "$out" $quick 2>&1 | tee "$out/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
