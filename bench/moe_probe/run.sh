#!/bin/bash
# bench/moe_probe/run.sh — on a GPU machine: build the moe_probe driver against variants of the
# CURRENT csrc/moe_experts.cu and print, per variant and T (the driver's list), graph-replayed µs
# beside the floor. Torch-free (nvcc only).
set -euo pipefail
cd "$(dirname "$0")"
tmp=${TMPDIR:-/tmp}/moe_probe; mkdir -p "$tmp"
# Variants (session 17; the NVFP4 ring depth variants of session 16 changed nothing, see
# results/session17/moe_probe_call2.log): base (as committed); t1g / t1gd: the indexed path
# (T·k ≤ 144 since v6; T = 1 before) cut after its gate+up launch / after its down launch, so
# base − t1gd is what the combine launch adds to the chain and t1gd − t1g the down launch
# (grouped-path rows: unchanged).
g='  ATLAS_RETURN_IF_ERROR(launch_w4a16_gemv(gate_up, stream));'
d='  ATLAS_RETURN_IF_ERROR(launch_w4a16_gemv(down, stream));'
for a in "$g" "$d"; do
  [ "$(grep -cxF "$a" ../../csrc/moe_experts.cu)" = 1 ] || { echo "anchor not found once: $a"; exit 1; }
done
variants=(base t1g t1gd)
cp ../../csrc/moe_experts.cu "$tmp/base.cu"
awk -v a="$g" '{ print } $0 == a { print "  return cudaSuccess;  // probe: gate+up only" }' ../../csrc/moe_experts.cu > "$tmp/t1g.cu"
awk -v a="$d" '{ print } $0 == a { print "  return cudaSuccess;  // probe: no combine" }' ../../csrc/moe_experts.cu > "$tmp/t1gd.cu"
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
