#!/bin/bash
# bench/moe_probe/run.sh — on a GPU machine: build the moe_probe driver against variants of the
# CURRENT csrc/moe_experts.cu (the NVFP4 ring depth at MT = 1 and MT = 4) and print, per
# variant and T ∈ {1, 8, 32}, graph-replayed µs beside the floor. Torch-free (nvcc only).
#   variants: base (as committed), and sNM = stages(mt) → mt == 1 ? N : M
set -euo pipefail
cd "$(dirname "$0")"
tmp=${TMPDIR:-/tmp}/moe_probe; mkdir -p "$tmp"
line='  __host__ __device__ static constexpr int stages(int mt) { return mt == 1 ? 5 : 6; }'
grep -qF "$line" ../../csrc/moe_experts.cu || { echo "anchor not found: $line"; exit 1; }
variants=(base s46 s66 s86)
for v in "${variants[@]}"; do
  if [ "$v" = base ]; then cp ../../csrc/moe_experts.cu "$tmp/$v.cu"; continue; fi
  n=${v:1:1}; m=${v:2:1}
  sed "s/return mt == 1 ? 5 : 6; }/return mt == 1 ? $n : $m; }/" ../../csrc/moe_experts.cu > "$tmp/$v.cu"
done
pids=()
for v in "${variants[@]}"; do
  rm -f "$tmp/$v"
  nvcc -std=c++17 -arch=sm_90 -O3 --expt-relaxed-constexpr -I../../csrc -o "$tmp/$v" driver.cu "$tmp/$v.cu" \
    ../../csrc/w4a16_gemv.cu > "$tmp/build_$v.log" 2>&1 &
  pids+=($!)
done
for i in "${!variants[@]}"; do
  wait "${pids[$i]}" || { echo "build ${variants[$i]} failed"; tail -20 "$tmp/build_${variants[$i]}.log"; }
done
for v in "${variants[@]}"; do
  echo "=== $v"
  [ -x "$tmp/$v" ] && { "$tmp/$v" || echo "run $v rc=$?"; }
done
