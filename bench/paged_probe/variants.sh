#!/bin/bash
# bench/paged_probe/variants.sh — on a GPU machine: the paged_decode probe (driver.cu) built
# against patched copies of csrc/paged_decode.h / paged_decode.cu, to measure launch-shape
# choices without touching the library. Each variant is a directory with the instrumented
# kernel and its own header (found first: quoted includes search the including file's folder).
#   base    the current sources
#   t128    kPagedDecodeTargetCtas 128 (B = 1 × 32K at nkv 2: 64 splits of 512, one CTA per SM)
#   t128s6  t128 + kStages 6 (bf16) / 8 (fp8): one CTA per SM with ≈ 160 KB in flight
#   split64 kPagedDecodeShortSplitLen 64 (L ≤ 1K: up to 16 splits of 64 positions, 2 tiles each)
#   split32 kPagedDecodeShortSplitLen 32 (L ≤ 512: splits of one tile)
#   s4      4 stages at every dtype (bf16 hd 256: one CTA per SM; session 27: slower everywhere)
#   s6      6 bf16 / 8 fp8 stages (one CTA per SM; session 30: slower everywhere, B = 1 × 8K too)
#   rowblk  row_block.patch applied: where block_size % 8 == 0, a warp's 8 tile rows share one block, so
#           load_tile looks it up once (one broadcast load) and steps the rows' offsets instead of
#           8 lookups + 16 shuffles (same smem image, same bits; session 30: prepared, not run)
#   bar1    one_barrier.patch: one row tile without the "tile landed" CTA barrier (a warp's scores read
#           only the K rows it copied: its own wait + __syncwarp; V and FP8 scales are published by
#           the row-maxima barrier, after which the next copies go out); same bits; prepared, not run
#   rbbar1  row_block_one_barrier.patch: rowblk + bar1
#   sloop   split_loop.patch: one-row-tile CTAs walk splits as an outer loop, tiles as an inner one (the
#           per-tile split test was a runtime % and / plus ≈ 16 accumulator copies: 458 → 411 SASS
#           instructions per tile at bf16 hd 256, 249 → 233 registers); same bits; prepared, not run
#   chain   tile_chain.patch: rowblk + bar1 + sloop (384 instructions per tile, 2 barriers)
#   chainf  tile_chain_fp8ch4.patch: chain + FP8 scores in 4 accumulator chains too (with sloop's
#           registers the fp8 3-CTA instance no longer spills with 4: 168 registers; fp8 bits change)
#   pair    kv_pair.patch: bf16 one-row-tile QREG CTAs over two kv heads (8 warps: two 4-warp groups,
#           each its own smem image and named barrier; same bits), so each position's two head rows
#           (1 KB contiguous) go out from one CTA in the same tile step — the probe's pall read beat
#           pread by ≈ 9% at B = 1 × 32K; session 31: correct, B = 1 +25..35%, large B unchanged)
#   cluster cluster_fold.patch: one-wave ≤ 8-row split grids launched in clusters of min(max_splits, 8)
#           CTAs that fold each group of 8 splits through distributed shared memory (no combine
#           for ≤ 8 splits, a flat combine over group partials above; same bits; session 31:
#           correct, B = 1 × 1K 7.61 → 8.38 µs, × 8K 11.66 → 13.36: not adopted)
#   clspread cluster_spread.patch: cluster + the 'spread' cluster scheduling policy (a cluster's CTAs on
#           distinct SMs where the GPC has room; session 31: prepared, not run)
#   cl1     cluster + every instance's smem padded to 120 KB: one CTA per SM, so a cluster's 8 CTAs
#           cannot pack two to an SM (B = 1 points only: it halves every larger grid's residency;
#           session 31: prepared, not run)
#   nocomb  no combine launch (wrong output wherever a sequence has several splits): the combine's
#           share of the call, i.e. what folding the splits inside the attention grid could save
#   vstore  vector_store.patch: the split and fused partials stored as the runs a lane owns (bf16 8-byte,
#           fp8 16-byte stores: 108 scalar STG → 48 STG.64 + 12 / 24 STG.128 + 12 in a one-row-tile
#           instance); same bits (session 32: landed as v22, so the patch no longer applies)
#   emptycomb the combine launched, but every CTA returns after its wait (wrong output wherever a sequence
#           has several splits): with nocomb, splits the combine's cost into the grid boundary
#           (emptycomb − nocomb) and its work after the wait (base − emptycomb)
#   fused512 kFusedMinCtas 512 (fused mode only for grids of ≥ 512 fused CTAs): B = 32 × 8K runs split
#           mode — fp8: 384 CTAs of ≤ 6 splits on the 3-CTA instance instead of 256 fused CTAs of 8
#           at 2 per SM; bf16: 256 CTAs either way (split mode's 8× partials at equal CTAs)
#   w8      eight_warps.patch applied: an 8-warp instance for grids of ≤ 1 CTA per SM (warps w, w + 4
#           the same scores, the P·V columns and copies split over 8; same bits; session 30: B = 1
#           5–24% slower)
#   ch4fp8  FP8 one-row-tile scores in 4 accumulator chains too (v18 gave BF16 4, FP8 kept 2: the
#           fp8 3-CTA instance spills 8 B with 4 and ran B = 32 × 32K ≈ 2% slower, session 30)
#   min128  kPagedDecodeMinSplitLen 128 (sequences of 2K..32K: twice the splits, up to the cap; the
#           one-wave L2 warm-up keeps its 256-position gate)
#   fp8qreg FP8 with Q in registers (QREG, 2 CTAs per SM) at every grid size, not only where its
#           grid needs no more rounds of resident CTAs than the 3-CTA instance (session 28: worse)
#   hot     base built with -DPROBE_HOT: one copy of the KV, so every call reads the same bytes (L2-
#           resident where they fit in the L2: fp8 B = 1 × 32K 34 MB, bf16 B = 1 × 8K 17 MB): does
#           a B = 1 call wait on DRAM or on its own tile chain? (session 33)
#   halfcopy (timing only, wrong output) the one-row-tile copy loop issues half of each warp's rows: what the
#           copy issue (≈ 150 of a bf16 tile's ≈ 384 SASS instructions) costs a chain-bound call (session 33)
#   nobar2  (timing only, wrong output) the 'P written' CTA barrier dropped: what one barrier per tile costs
#           (session 33)
#   tma     tma_copy.patch: v25, a warp's tile rows by one TMA box per K / V tile, mbarriers per (stage, warp),
#           segment-major tile image (session 33: correct, slower everywhere — B = 1 × 8K 11.35 → 13.01 µs)
#   pipe    tile_pipeline.patch: the one-row-tile loop software-pipelined, tile t + 1's score MMAs issued
#           between tile t's P barrier and its P · V (same bits; session 33: ±1% bf16, fp8 +1..2.5%)
#   prev    the kernel source at $PREV_SRC (e.g. a saved copy of the previous version), with the header
#           at $PREV_HDR when given (else the current one)
#   warp    warp_split.patch applied: the ≤ 8-row warp-split kernel of session 29 (2-warp CTAs,
#           each warp an independent split worker, tile math transposed; bench/NOTES.md: not
#           adopted — B = 1 short sequences +10..14%)
#   trim    prologue_trim.patch applied: 16-byte Q loads when the query rows are aligned (the
#           part of session 29's v16 that v17 did not take: B = 1 short sequences +0.2 µs)
#   short64 128-position splits up to cap / 2 splits (64 at nkv 2, 32 at nkv 4), not 16: one
#           sequence's CTAs grow to ≈ 128 before splits lengthen (session 28's min128 without its
#           16K / 24/4 losses; the one-wave warm-up keeps its 256-position gate)
# Session 12 ran these (bench/NOTES.md, paged_decode): neither beat base. Usage:
#   VARIANTS="base t128" MODE=time bash bench/paged_probe/variants.sh     (MODE full | time)
#   CONFIGS=short: B ∈ {1, 8, 32, 128} × L ∈ {512, 1K, 2K} instead of the long-sequence set;
#   CONFIGS=mid: L ∈ {3000, 8K, 16K} (B = 1) and B ∈ {8, 32, 128} × 8K
set -uo pipefail
cd "$(dirname "$0")"
tmp=${TMPDIR:-/tmp}/paged_variants; mkdir -p "$tmp"
VARIANTS=${VARIANTS:-"base t128 t128s6"}
patch_or_die() {  # file sed-expression expected-text
  sed -i "$2" "$1"; grep -q "$3" "$1" || { echo "variants.sh: patch '$2' did not apply to $1" >&2; exit 1; }
}
for v in $VARIANTS; do
  d=$tmp/$v; mkdir -p "$d"
  src=../../csrc/paged_decode.cu; [ "$v" = prev ] && src=${PREV_SRC:?prev needs PREV_SRC}
  case $v in                                   # variants that are a patch of the kernel source
    warp) pf=warp_split.patch;;      trim) pf=prologue_trim.patch;;  w8) pf=eight_warps.patch;;
    rowblk) pf=row_block.patch;;     bar1) pf=one_barrier.patch;;    rbbar1) pf=row_block_one_barrier.patch;;
    sloop) pf=split_loop.patch;;     chain) pf=tile_chain.patch;;    chainf) pf=tile_chain_fp8ch4.patch;;
    pair) pf=kv_pair.patch;;         cluster|cl1) pf=cluster_fold.patch;;  clspread) pf=cluster_spread.patch;;
    vstore) pf=vector_store.patch;;  pipe) pf=tile_pipeline.patch;;  tma) pf=tma_copy.patch;;
    *) pf=;;
  esac
  if [ -n "$pf" ]; then
    cp "$src" "$d/patched.cu" && patch -s "$d/patched.cu" < "$pf" || { echo "variants.sh: $pf did not apply" >&2; exit 1; }
    src=$d/patched.cu
  fi
  python3 make_probe.py "$src" "$d/probe_kernel.cu" || exit 1
  hdr=../../csrc/paged_decode.h; [ "$v" = prev ] && hdr=${PREV_HDR:-$hdr}   # prev: its own header when the API moved
  cp "$hdr" "$d/paged_decode.h"
  case $v in t128*) patch_or_die "$d/paged_decode.h" 's/kPagedDecodeTargetCtas = 256;/kPagedDecodeTargetCtas = 128;/' "TargetCtas = 128;";; esac
  case $v in split64) patch_or_die "$d/paged_decode.h" 's/kPagedDecodeShortSplitLen = 128;/kPagedDecodeShortSplitLen = 64;/' "SplitLen = 64;";; esac
  case $v in split32) patch_or_die "$d/paged_decode.h" 's/kPagedDecodeShortSplitLen = 128;/kPagedDecodeShortSplitLen = 32;/' "SplitLen = 32;";; esac
  case $v in min128) patch_or_die "$d/paged_decode.h" 's/kPagedDecodeMinSplitLen = 256;/kPagedDecodeMinSplitLen = 128;/' "MinSplitLen = 128;"
                    patch_or_die "$d/probe_kernel.cu" 's/\.chunk >= kPagedDecodeMinSplitLen;/.chunk >= 256;/' "chunk >= 256;";; esac
  case $v in short64) patch_or_die "$d/paged_decode.h" 's/s = s < kPagedDecodeShortSplits ? s : kPagedDecodeShortSplits;/const int64_t sc = cap \/ 2 > kPagedDecodeShortSplits ? cap \/ 2 : kPagedDecodeShortSplits; s = s < sc ? s : sc;/' "s = s < sc ? s : sc;"
                     patch_or_die "$d/probe_kernel.cu" 's/\.chunk >= kPagedDecodeMinSplitLen;/.chunk >= 256;/' "chunk >= 256;";; esac
  case $v in emptycomb) patch_or_die "$d/probe_kernel.cu" 's|  if (count <= 1) {                             // the attention kernel wrote out (whole CTA)|  if (true) {   // emptycomb|' "emptycomb"
                       patch_or_die "$d/probe_kernel.cu" 's|  if (count <= 1 \|\| (kFused \&\& groups <= 1) \|\| e0 >= pb.rows_total \* hd) {|  if (true) {   // emptycomb2|' "emptycomb2";; esac
  case $v in halfcopy) patch_or_die "$d/probe_kernel.cu" '0,/for (int i = 0; i < kRowsPerWarp \/ kRowsPerCopy; ++i) {/s//for (int i = 0; i < kRowsPerWarp \/ kRowsPerCopy \/ 2; ++i) {   \/\/ halfcopy/' "halfcopy";; esac
  case $v in nobar2) patch_or_die "$d/probe_kernel.cu" 's|    __syncthreads();                            // (P written) P tile complete|    __syncwarp();   // nobar2|' "nobar2";; esac
  case $v in fused512) patch_or_die "$d/probe_kernel.cu" 's/kFusedMinCtas = 256;/kFusedMinCtas = 512;/' "kFusedMinCtas = 512;";; esac
  case $v in nocomb) patch_or_die "$d/probe_kernel.cu" 's/  if (partials) ATLAS_RETURN_IF_ERROR(launch_combine(pb, stream));/  (void)partials;   \/\/ nocomb/' "nocomb";; esac
  case $v in cl1) patch_or_die "$d/probe_kernel.cu" 's/smem_bytes<HD, FP8, M_TILES>()/((size_t)120 * 1024)/g' "(size_t)120 \* 1024";; esac
  case $v in ch4fp8) patch_or_die "$d/probe_kernel.cu" 's/constexpr int kChains = M_TILES == 1 ? (FP8 ? 2 : 4) : 1;/constexpr int kChains = M_TILES == 1 ? 4 : 1;/' "M_TILES == 1 ? 4 : 1;";; esac
  case $v in fp8qreg) patch_or_die "$d/probe_kernel.cu" 's/if (with_qreg > 0 \&\& without > 0 \&\& (ctas + with_qreg - 1) \/ with_qreg <= (ctas + without - 1) \/ without)/if (with_qreg > 0)/' "if (with_qreg > 0)";; esac
  case $v in s4) patch_or_die "$d/probe_kernel.cu" 's/kStages = 2 \* kTileBytes >= 32768 ? 3 : 4;/kStages = 4;/' "kStages = 4;";; esac
  case $v in *s6) patch_or_die "$d/probe_kernel.cu" 's/kStages = 2 \* kTileBytes >= 32768 ? 3 : 4;/kStages = 2 * kTileBytes >= 32768 ? 6 : 8;/' "? 6 : 8;";; esac
  extra=; [ "$v" = hot ] && extra=-DPROBE_HOT
  nvcc -std=c++17 -arch=sm_90 -O3 --expt-relaxed-constexpr $extra -I"$d" -I../../csrc -o "$d/bin" driver.cu "$d/probe_kernel.cu" \
    > "$d/build.log" 2>&1 &
done
wait
for v in $VARIANTS; do
  echo "=== $v"
  [ -x "$tmp/$v/bin" ] || { tail -20 "$tmp/$v/build.log"; continue; }
  timeout 120 "$tmp/$v/bin" "${MODE:-full}" ${CONFIGS:-} | grep -vE "^      tile  [1-9]|^      tile 1[0-9]"
done
