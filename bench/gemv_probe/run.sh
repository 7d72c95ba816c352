#!/bin/bash
# bench/gemv_probe/run.sh [M] — on a GPU machine: build the probe variants of the CURRENT
# csrc/w4a16_gemv.cu and print, per shape, graph-replayed µs (rotating weights) beside a plain
# read of the same bytes, the probed cold call's phase split, per-SM end times, and a
# (splits, warps) sweep. Torch-free (nvcc only). See bench/NOTES.md, w4a16_gemv v3.4.
set -euo pipefail
cd "$(dirname "$0")"
M=${1:-1}
tmp=${TMPDIR:-/tmp}/gemv_probe; mkdir -p "$tmp"
python3 make_probe.py ../../csrc/w4a16_gemv.cu "$tmp/probe_kernel.cu"
build() { nvcc -std=c++17 -arch=sm_90 -O3 --expt-relaxed-constexpr -I../../csrc "${@:2}" -o "$tmp/$1" driver.cu "$tmp/probe_kernel.cu"; }
build base & build nocompute -DPROBE_NOCOMPUTE & build noact -DPROBE_NOACT & wait
echo "=== base (sweep)"; "$tmp/base" sweep "$M"
echo "=== nocompute"; "$tmp/nocompute" x "$M" | grep -v "^    "
echo "=== noact"; "$tmp/noact" x "$M" | grep -v "^    "
