#!/usr/bin/env bash
# The one GPU check: for a machine with torch (CUDA), Triton, CuPy and pytest installed
# but no network. It checks its tools, installs ecoffload without dependencies (or, when
# the image's build tooling cannot, puts this checkout on PYTHONPATH), runs the `gpu`
# tests and every kernel test compiled for the GPU (`-m "gpu or kernel"`), records
# whether the arena registered and which copy path runs, runs the quick benchmark, and
# writes OUT_DIR/gpu_check.json whatever fails. Finishes in under 5 minutes.
#
#   bash profiling/gpu_check.sh OUT_DIR [--dry-run] [--full]
#
#   --dry-run  needs no GPU: prints the exact pytest command with the test ids it
#              collects, and the benchmark command, then stops.
#   --full     the full benchmark (program sweep included); may exceed 5 minutes.
set -uo pipefail

out="" dry_run=0 bench_mode=--quick
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    --full) bench_mode="" ;;
    --quick) bench_mode=--quick ;;  # the default; kept for old callers
    -*) echo "gpu_check.sh: unknown option $arg" >&2; exit 2 ;;
    *) out=$arg ;;
  esac
done
[ -n "$out" ] || { echo "usage: gpu_check.sh OUT_DIR [--dry-run] [--full]" >&2; exit 2; }
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 2
repo=$(pwd)
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
# Kernel tests must run compiled wherever CUDA is: never under the interpreter.
unset TRITON_INTERPRET
start=$(date +%s)
budget_s=285  # everything, the benchmark last: it gets what is left

# Recorded in gpu_check.json (plain words, no quotes).
tools="" missing="" cuda="unknown" install="not attempted" ecoffload_from="" pytest_rc="not run"
arena_rc="not run" bench_rc="not run" status="incomplete"

log() { echo "gpu_check: $*" | tee -a "$out/gpu_check.log"; }

write_summary() {
  local elapsed=$(( $(date +%s) - start ))
  GC_OUT="$out" GC_DRY="$dry_run" GC_TOOLS="$tools" GC_MISSING="$missing" GC_CUDA="$cuda" \
  GC_INSTALL="$install" GC_FROM="$ecoffload_from" GC_PYTEST="$pytest_rc" GC_ARENA="$arena_rc" \
  GC_BENCH="$bench_rc" GC_STATUS="$status" GC_ELAPSED="$elapsed" "$py" - <<'EOF' 2>>"$out/gpu_check.log" \
  || printf '{"status": "%s", "elapsed_s": %s, "note": "python could not write the full summary"}\n' \
       "$status" "$elapsed" > "$out/gpu_check.json"
import json, os, xml.etree.ElementTree as ET
e, out = os.environ, os.environ["GC_OUT"]
summary = {k: e["GC_" + k.upper()] for k in
           ("status", "dry", "tools", "missing", "cuda", "install", "from", "pytest", "arena", "bench")}
summary["elapsed_s"] = int(e["GC_ELAPSED"])
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
junit = os.path.join(out, "pytest.xml")
if os.path.exists(junit):
    try:
        suites = ET.parse(junit).getroot()
        suites = [suites] if suites.tag == "testsuite" else list(suites)
        summary["tests"] = {k: sum(int(s.get(k, 0)) for s in suites)
                            for k in ("tests", "failures", "errors", "skipped")}
    except ET.ParseError as exc:
        summary["tests"] = f"unreadable junit xml: {exc}"
summary["arena_check"] = load("arena.json")
bench = load("bench.json")
if bench is not None:
    rows = bench.get("rows", [])
    summary["bench_summary"] = {
        "error": bench.get("error"),
        "arena_registered": bench.get("environment", {}).get("arena_registered"),
        "mover_path": bench.get("environment", {}).get("mover_path"),
        "rows": len(rows), "rows_with_errors": sum(1 for r in rows if r.get("error")),
    }
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=1)
EOF
  log "status $status after ${elapsed}s; summary in $out/gpu_check.json"
}
trap write_summary EXIT

: > "$out/gpu_check.log"
log "checkout $repo, results in $out"

# 1. Tools ------------------------------------------------------------------------------
probe() {  # name, python statement printing a version
  local v
  if v=$("$py" -c "$2" 2>>"$out/gpu_check.log"); then
    tools="$tools $1=$v"
  else
    missing="$missing $1"
  fi
}
if ! "$py" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null; then
  missing="python>=3.10 ($py)"; status="missing tools"; log "no usable python at $py"; exit 1
fi
probe python 'import platform; print(platform.python_version())'
probe torch 'import torch; print(torch.__version__)'
probe triton 'import triton; print(triton.__version__)'
probe cupy 'import cupy; print(cupy.__version__)'
probe pytest 'import pytest; print(pytest.__version__)'
probe hypothesis 'import hypothesis; print(hypothesis.__version__)'
cuda=$("$py" -c 'import torch; print(torch.cuda.is_available() and torch.cuda.get_device_name(0).replace(" ", "_"))' 2>>"$out/gpu_check.log" || echo unknown)
log "tools:$tools; missing:${missing:- none}; CUDA device: $cuda"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
  df -h /dev/shm 2>&1 | tail -1
} > "$out/environment.txt" 2>&1
for required in torch triton pytest; do
  case " $missing " in *" $required "*) status="missing tools"; log "$required is required"; exit 1 ;; esac
done
case " $missing " in *" hypothesis "*) log "hypothesis missing: its property tests are not collected" ;; esac
case " $missing " in *" cupy "*) log "CuPy missing: the arena cannot register; gpu tests needing it skip" ;; esac
if [ "$dry_run" = 0 ] && [ "$cuda" = "False" -o "$cuda" = "unknown" ]; then
  status="no CUDA"; log "torch sees no CUDA device: nothing to check (use --dry-run on CPU)"; exit 1
fi

# 2. ecoffload importable from this checkout ----------------------------------------------
from_here() {
  ecoffload_from=$("$py" -c 'import ecoffload.kernels as k, os; print(os.path.dirname(os.path.realpath(k.__file__)))' 2>/dev/null)
  [ "$ecoffload_from" = "$(realpath "$repo/kernels")" ]
}
if from_here; then
  install="already installed from this checkout"
elif [ "$dry_run" = 0 ] && "$py" -m pip install --no-deps --no-build-isolation -q -e . \
      > "$out/install.log" 2>&1 && from_here; then
  install="editable install (pip -e, no dependencies)"
else
  # e.g. setuptools without `wheel` ("invalid command 'bdist_wheel'"), or a dry run:
  # a generated ecoffload package whose sub-packages are this checkout's folders.
  [ "$dry_run" = 0 ] && log "editable install failed (tail of install.log below); using PYTHONPATH" \
    && tail -5 "$out/install.log" | tee -a "$out/gpu_check.log"
  pkg="$out/pythonpath/ecoffload"
  mkdir -p "$pkg"
  for sub in kernels engine connector testing profiling tools; do ln -sfn "$repo/$sub" "$pkg/$sub"; done
  export PYTHONPATH="$out/pythonpath${PYTHONPATH:+:$PYTHONPATH}"
  if from_here; then
    install="PYTHONPATH fallback ($out/pythonpath)"
  else
    install="failed"; status="install failed"
    log "ecoffload does not import from this checkout (found: ${ecoffload_from:-nothing})"; exit 1
  fi
fi
log "ecoffload: $install; imported from $ecoffload_from"

# 3. Tests: the gpu tests and every kernel test, compiled ------------------------------------
pytest_args=(-m "gpu or kernel" -p no:cacheprovider -q -rs tests/)
bench_cmd=("$py" -m ecoffload.profiling.bench --out "$out" $bench_mode)
host_cmd=("$py" -m ecoffload.profiling.bench_host --repeat 50)
if [ "$dry_run" = 1 ]; then
  echo "pytest command: $(printf '%q ' "$py" -m pytest "${pytest_args[@]}" --junitxml="$out/pytest.xml")"
  "$py" -m pytest --collect-only "${pytest_args[@]}" 2>&1 | tee "$out/collected.txt"
  pytest_rc=${PIPESTATUS[0]}
  echo "host-cost command: $(printf '%q ' timeout 40 "${host_cmd[@]}")> $out/bench_host.md"
  echo "benchmark command: $(printf '%q ' timeout "${budget_s}" "${bench_cmd[@]}")(timeout: what is left of ${budget_s}s)"
  status="dry run"
  [ "$pytest_rc" = 0 ] || status="dry run: collection failed"
  exit 0
fi
timeout 150 "$py" -m pytest "${pytest_args[@]}" --junitxml="$out/pytest.xml" 2>&1 \
  | tee "$out/pytest.log"
pytest_rc=${PIPESTATUS[0]}
log "pytest exit status $pytest_rc"

# 4. Registration and path, as the engine sees them -----------------------------------------
timeout 60 "$py" - "$out/arena.json" <<'EOF' 2>&1 | tee -a "$out/gpu_check.log"
import json, os, sys, tempfile, time
import torch
from ecoffload.engine.arena.arena import Arena
from ecoffload.engine.transfer import BlockMover
info = {"cuda": torch.cuda.is_available(), "attempts": []}
for directory in ("/dev/shm", tempfile.gettempdir()):
    try:
        with Arena.create(f"ecoffload-gpu-check-{os.getpid()}", block_bytes=1 << 16,
                          num_blocks=64, directory=directory, processes=1) as arena:
            info.update(directory=directory, arena_registered=arena.registered)
            t0 = time.perf_counter()
            mover = BlockMover(arena)  # on CUDA with a registered arena: compiles every variant
            info.update(mover_path=mover.path, mover_device=str(mover.device),
                        mover_create_s=round(time.perf_counter() - t0, 2))
        break
    except Exception as exc:
        info["attempts"].append(f"{directory}: {type(exc).__name__}: {exc}"[:400])
print("arena registered:", info.get("arena_registered"), "| path:", info.get("mover_path"),
      "| mover created (warm-up included) in", info.get("mover_create_s"), "s")
with open(sys.argv[1], "w") as f:
    json.dump(info, f, indent=1)
EOF
arena_rc=${PIPESTATUS[0]}

# 5. Host cost per step (before/after issue 10) and the stall test behind queued matmuls ------
timeout 40 "${host_cmd[@]}" 2>&1 | tee "$out/bench_host.md"
log "bench_host exit status ${PIPESTATUS[0]}"

# 6. Benchmark (writes bench.json even when parts fail or the timeout hits) -------------------
left=$(( budget_s - ($(date +%s) - start) ))
[ "$left" -lt 30 ] && left=30
log "benchmark: ${bench_cmd[*]} (timeout ${left}s)"
timeout "$left" "${bench_cmd[@]}" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}

if [ "$pytest_rc" = 0 ] && [ "$arena_rc" = 0 ] && [ "$bench_rc" = 0 ]; then
  status="passed"; exit 0
fi
status="failed"
exit 1
