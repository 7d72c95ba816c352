#!/bin/bash
# bench/gemv_probe/variants.sh — on a GPU machine: the gemv probe (driver.cu, `x` mode: graph-replayed
# µs per shape beside a plain read, and the probed cold call's phases) built against patched copies
# of csrc/w4a16_gemv.cu, to A/B a kernel change without touching the library.
#   base                the current source
#   epi                 m1_epilogue.patch: the one-row kernel's warp-split partials in their own shared
#                       region, so the epilogue's first CTA barrier (which only waited for the x readers)
#                       goes; same bits (session 30, prepared for the ≤ 2.5 µs small shapes)
#   epif                m1_epilogue_factor.patch: epi + the output factor loaded at the kernel's start
# Usage: VARIANTS="base epi epif" M=1 RUNS=2 bash bench/gemv_probe/variants.sh
set -uo pipefail
cd "$(dirname "$0")"
tmp=${TMPDIR:-/tmp}/gemv_variants; mkdir -p "$tmp"
VARIANTS=${VARIANTS:-"base epi epif"}
for v in $VARIANTS; do
  d=$tmp/$v; mkdir -p "$d"; cp ../../csrc/w4a16_gemv.cu "$d/src.cu"
  case $v in
    base) ;;
    epi) patch -s "$d/src.cu" < m1_epilogue.patch || { echo "variants.sh: m1_epilogue.patch did not apply" >&2; exit 1; };;
    epif) patch -s "$d/src.cu" < m1_epilogue_factor.patch || { echo "variants.sh: m1_epilogue_factor.patch did not apply" >&2; exit 1; };;
    *) echo "variants.sh: unknown variant $v" >&2; exit 1;;
  esac
  python3 make_probe.py "$d/src.cu" "$d/probe_kernel.cu" || exit 1
  nvcc -std=c++17 -arch=sm_90 -O3 --expt-relaxed-constexpr -I../../csrc -o "$d/bin" driver.cu "$d/probe_kernel.cu" \
    > "$d/build.log" 2>&1 &
done
wait
for r in $(seq 1 "${RUNS:-1}"); do
  for v in $VARIANTS; do
    echo "=== $v (run $r)"
    [ -x "$tmp/$v/bin" ] || { tail -20 "$tmp/$v/build.log"; continue; }
    timeout 120 "$tmp/$v/bin" x "${M:-1}"
  done
done
