#!/bin/bash
# bench/read_floor/run.sh — on a GPU machine: build and run the bare-read probe (see
# read_floor.cu). Torch-free (nvcc only); ≈ 30 s.
set -euo pipefail
cd "$(dirname "$0")"
tmp=${TMPDIR:-/tmp}/read_floor; mkdir -p "$tmp"
nvcc -std=c++17 -arch=sm_90 -O3 -o "$tmp/read_floor" read_floor.cu
"$tmp/read_floor"
