#!/bin/bash
# bench/gemv_probe/variants.sh — on a GPU machine: the gemv probe (driver.cu, `x` mode: graph-replayed
# µs per shape beside a plain read, and the probed cold call's phases) built against patched copies
# of csrc/w4a16_gemv.cu, to A/B a kernel change without touching the library.
#   base                the current source
#   epi                 m1_epilogue.patch: the one-row kernel's warp-split partials in their own shared
#                       region, so the epilogue's first CTA barrier (which only waited for the x readers)
#                       goes; same bits (session 30, prepared for the ≤ 2.5 µs small shapes)
#   epif                m1_epilogue_factor.patch: epi + the output factor loaded at the kernel's start
#   nohint              no .L2::256B prefetch size on any GEMV cp.async (common/nvfp4_mma.cuh): the
#                       tiled layout's warp chunk is 1 KB contiguous, so the hint only re-asks L2 for
#                       lines the same instruction requests (session 34: bench/read_floor's ring
#                       read 5–7% faster without it). Measured in the kernel: within ±1% (not kept)
#   nohintw / nohints   the hint dropped from the 16-byte weight copies only / the 8-byte scale copies only
#   ring4 / ring5       the one-row kernel's ring 4 / 5 chunks deep (kStagesM1; 3 since v3.11): bench/read_floor's
#                       ring study (session 34) read 27B down's bytes in 16.4 µs through a 3-deep ring,
#                       13.4 through 4, 12.6 through 5 (the bare read: 12.5). Measured in the kernel:
#                       slower on every shape (down 19.7 → 20.5 / 21.6; not kept)
#   evict               weight copies with an L2 evict-first policy (the immediate descriptor
#                       paged_decode's KV copies use) instead of the prefetch size: within ±1% (not kept)
# Usage: VARIANTS="base epi epif" M=1 RUNS=2 bash bench/gemv_probe/variants.sh
set -uo pipefail
cd "$(dirname "$0")"
tmp=${TMPDIR:-/tmp}/gemv_variants; mkdir -p "$tmp"
VARIANTS=${VARIANTS:-"base epi epif"}
for v in $VARIANTS; do
  d=$tmp/$v; rm -rf "$d"; mkdir -p "$d"; cp -r ../../csrc "$d/csrc"; cp ../../csrc/w4a16_gemv.cu "$d/src.cu"
  h=$d/csrc/common/nvfp4_mma.cuh
  case $v in
    base) ;;
    nohint) sed -i 's/\.L2::256B//' "$h";;
    nohintw) sed -i '/shared.global.L2::256B \[%0\], \[%1\], 16/s/\.L2::256B//' "$h";;
    nohints) sed -i '/shared.global.L2::256B \[%0\], \[%1\], 8/s/\.L2::256B//' "$h";;
    ring4|ring5) sed -i "s/^constexpr int kStagesM1 = 3;/constexpr int kStagesM1 = ${v#ring};/" "$d/src.cu"
           grep -q "kStagesM1 = ${v#ring};" "$d/src.cu" || { echo "variants.sh: $v edit did not apply" >&2; exit 1; };;
    evict) sed -i 's|"cp.async.cg.shared.global.L2::256B \[%0\], \[%1\], 16;\\n" :: "r"(dst), "l"(src)|"cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\\n" :: "r"(dst), "l"(src), "l"(0x12F0000000000000ull)|' "$h"
           grep -q cache_hint "$h" || { echo "variants.sh: evict edit did not apply" >&2; exit 1; };;
    epi) patch -s "$d/src.cu" < m1_epilogue.patch || { echo "variants.sh: m1_epilogue.patch did not apply" >&2; exit 1; };;
    epif) patch -s "$d/src.cu" < m1_epilogue_factor.patch || { echo "variants.sh: m1_epilogue_factor.patch did not apply" >&2; exit 1; };;
    *) echo "variants.sh: unknown variant $v" >&2; exit 1;;
  esac
  python3 make_probe.py "$d/src.cu" "$d/probe_kernel.cu" || exit 1
  nvcc -std=c++17 -arch=sm_90 -O3 --expt-relaxed-constexpr -diag-suppress 177 -I"$d/csrc" -o "$d/bin" driver.cu "$d/probe_kernel.cu" \
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
