#!/bin/bash
# bench/argmax_probe/run.sh [variant.cu ...] — on a GPU machine: build the argmax_probe driver
# against the CURRENT csrc/argmax.cu (base) and each given variant of that file, and print the
# graph-replayed µs per call of each. Torch-free (nvcc only).
set -euo pipefail
cd "$(dirname "$0")"
tmp=${TMPDIR:-/tmp}/argmax_probe; mkdir -p "$tmp"
srcs=(../../csrc/argmax.cu "$@")
for i in "${!srcs[@]}"; do
  nvcc -std=c++17 -arch=sm_90 -O3 --expt-relaxed-constexpr -I../../csrc -o "$tmp/v$i" driver.cu "${srcs[$i]}" \
    > "$tmp/build_$i.log" 2>&1 &
done
wait
for i in "${!srcs[@]}"; do
  echo "=== ${srcs[$i]}"
  [ -x "$tmp/v$i" ] && "$tmp/v$i" || tail -5 "$tmp/build_$i.log"
done
