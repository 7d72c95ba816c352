#!/bin/bash
# bench/paged_probe/run.sh — on a GPU machine: build the probe variants of the CURRENT
# csrc/paged_decode.cu and print, per config (B=1 × 32K bf16 / fp8 16/2 and bf16 24/4, B=1 × 1K, B=32 × 32K 16/2 bf16 / fp8;
# all hd 256), graph-replayed µs (rotating caches; also with the v7 L2 warm-up off) beside plain and
# paged reads of the same bytes and the floor, then a cold and a chained probed call: launch,
# CTA start / end spread, per-SM end times, phase and per-tile cycles, combine timing. Then the
# same timings with the tile math removed (-DPROBE_NOMATH: the copy pipeline alone).
# Torch-free (nvcc only). See bench/NOTES.md, paged_decode.
set -euo pipefail
cd "$(dirname "$0")"
tmp=${TMPDIR:-/tmp}/paged_probe; mkdir -p "$tmp"
python3 make_probe.py ../../csrc/paged_decode.cu "$tmp/probe_kernel.cu"
build() { nvcc -std=c++17 -arch=sm_90 -O3 --expt-relaxed-constexpr -I../../csrc "${@:2}" -o "$tmp/$1" driver.cu "$tmp/probe_kernel.cu"; }
build base & b1=$!
build nomath -DPROBE_NOMATH -diag-suppress 177 & b2=$!   # 177: helpers the variant leaves unused
wait $b1; wait $b2   # either build failing stops the run (set -e)
echo "=== base"; "$tmp/base" full
echo "=== nomath (tile math removed: the copy pipeline alone)"; "$tmp/nomath" time
