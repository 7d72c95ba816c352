#!/usr/bin/env bash
# One command for a fresh GPU machine: build the extension, run the CUDA tests (also once under
# compute-sanitizer memcheck), run the benches, and print a short table last.
#
#   bench/gpu_check.sh [stages...]     stages: build info test memcheck ctest bench bench-quick peers ncu probe
#   default: build info test memcheck bench
#
# Logs go to $LOGS (/tmp/atlas_gpu_logs) and, packed after every stage with bench/results, to
# $OUT/gpu_check.tgz — one file, so the device tool's limit on returned files (8) never drops a
# log, and a run cut short still returns what it finished. $OUT: the device tool's return
# folder when set, else /tmp/atlas_gpu.
# FlashInfer (peer for bench_attention) is installed from .peers/*.whl when that folder exists.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/atlas_gpu}
LOGS=${LOGS:-/tmp/atlas_gpu_logs}
mkdir -p "$OUT" "$LOGS"
pack() { tar -czf "$OUT/gpu_check.tgz" bench/results -C "$LOGS" .; }
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(build info test memcheck bench)
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
SUMMARY=()
has() { local s; for s in "${STAGES[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
run_stage() {  # name logfile command...
  local name=$1 log=$2; shift 2
  local t0=$(date +%s)
  "$@" >"$LOGS/$log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local last=$(grep -E "passed|failed|error|ERROR SUMMARY|Error" "$LOGS/$log" | tail -1 | cut -c1-90)
  SUMMARY+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$dt" "$last")")
  echo "== $name: rc=$rc (${dt}s) $last"
  pack
  return $rc
}

if has peers || has bench; then
  if ls .peers/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .peers/*.whl \
      && export PYTHONPATH=/tmp/site FLASHINFER_WORKSPACE_BASE=/tmp/fiws
  fi
fi
if has build; then
  run_stage build build.log python3 -m pip install -v -e . --no-build-isolation --no-deps || { tail -40 "$LOGS/build.log"; }
fi
if has info; then
  run_stage info info.log python3 -m atlas info
  cat "$LOGS/info.log" | tail -15
fi
if has test; then
  run_stage test test.log python3 -m pytest -m cuda -q --timeout=180 --durations=15 -p no:cacheprovider
  grep -E "^(FAILED|ERROR)" "$LOGS/test.log" | cut -c1-200 | head -40
fi
if has memcheck; then
  # The whole CUDA suite once under memcheck (slow: the heaviest shapes are marked `slow`).
  run_stage memcheck memcheck.log compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 20 \
    python3 -m pytest -m "cuda and not slow" -q -x --timeout=600 -p no:cacheprovider
  grep -E "ERROR SUMMARY|Invalid|FAILED" "$LOGS/memcheck.log" | head -20
fi
if has ctest; then
  # The torch-free C++ drivers (csrc/tests/*.cu), plain and under memcheck / racecheck.
  run_stage cmake cmake.log bash -c "cmake -S . -B build/cmake -DCMAKE_CUDA_ARCHITECTURES=90 && cmake --build build/cmake -j ${MAX_JOBS}"
  run_stage ctest ctest.log ctest --test-dir build/cmake --output-on-failure
  for t in build/cmake/test_*; do
    run_stage "mc:$(basename "$t" | sed 's/test_//')" "mc_$(basename "$t").log" compute-sanitizer --tool memcheck --error-exitcode 1 "$t"
    run_stage "rc:$(basename "$t" | sed 's/test_//')" "rc_$(basename "$t").log" compute-sanitizer --tool racecheck --error-exitcode 1 "$t"
  done
  cat "$LOGS"/mc_*.log "$LOGS"/rc_*.log > "$LOGS/sanitizer_drivers.log" 2>/dev/null; rm -f "$LOGS"/mc_*.log "$LOGS"/rc_*.log
fi
if has ncu; then
  # Nsight Compute on the key shapes (one cold call each, bench/ncu_targets.py), csv to $LOGS/ncu.csv.
  run_stage ncu ncu.log bash -c "ncu --profile-from-start off --clock-control none --cache-control all --csv \
    --metrics $(tr -d '\n' < bench/ncu_metrics.txt) python3 bench/ncu_targets.py gemv:248320x5120 \
    gemv:14336x5120 gemv:5120x6144 gemv:2048x512 paged:1x32768:16/2:bf16 paged:128x8192:16/2:bf16 moe:1 moe:32 router:1 router:32 > $LOGS/ncu.csv"
fi
if has probe; then
  # The torch-free one-row GEMV probe (bench/gemv_probe): per-shape phase split, per-SM end times,
  # memory-only / no-prologue variants and a (splits, warps) sweep, M = 1.
  run_stage probe probe.log bash bench/gemv_probe/run.sh 1
  grep -vE "^    (phase|per SM)" "$LOGS/probe.log" | head -60
fi
if has bench || has bench-quick; then
  q=""; has bench-quick && q="--quick"
  : >"$LOGS/bench.log"
  for b in bench/bench_*.py; do
    run_stage "$(basename "$b" .py | sed 's/bench_//')" "bench_$(basename "$b" .py).log" python3 "$b" $q
    cat "$LOGS/bench_$(basename "$b" .py).log" >>"$LOGS/bench.log"; rm -f "$LOGS/bench_$(basename "$b" .py).log"
  done
  pack
fi

echo
echo "================ atlas gpu_check summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)) ================"
for line in "${SUMMARY[@]}"; do echo "$line"; done
