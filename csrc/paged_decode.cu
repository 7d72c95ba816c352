// paged_decode: decode / speculative-verify attention over the paged KV cache, checked against
// atlas/reference.py::paged_decode (float32 math; here bf16 tensor-core products, fp32 softmax).
//
//   for sequence b, query token j ∈ [0, q_len), query head h (kv head kvh = h / group,
//   group = nq / nkv), visible positions p ∈ [0, L − q_len + j], L = seq_lens[b]:
//     s_p = softmax_scale · q[b, j, h] · K[p, kvh]        (FP8: K = float(k8) · k_scale[p, kvh])
//     out[b, j, h] = Σ_p softmax(s)_p · V[p, kvh],   lse[b, j, h] = ln Σ_p exp(s_p)
//   K[p] lives at k_cache[block_tables[b, p / bs], p % bs] (any bs: 16, 528, ...).
//
// Decomposition (flash-decoding with the GQA group packed into MMA rows):
//   Grid (units · row_groups, nkv, B); one CTA of 4 warps per (split or split group, kv head,
//   sequence).
//   The CTA's rows are the group·q_len (query token j, head g) pairs that read kv head kvh,
//   row r = j·group + g, at most 64 per CTA (more — group 16 × q_len 8 — go to row_groups
//   CTAs, each re-reading the split's KV); M_TILES = ceil(rows / 16) MMA row tiles. So every KV
//   row a CTA reads serves all of its query rows: KV is read once per kv head, not per q head.
//   Split s of a sequence covers positions [s·chunk, min((s+1)·chunk, L)) (paged_decode_split:
//   a function of L and nkv alone → batch-invariant bits); CTAs past the split count exit.
//   The grid is sized from host-known bounds only (max_blocks · bs), so it is graph-capturable.
//   Two modes, same bits (the canonical merge below): split mode, a CTA per split writing
//   (λ_s, o_s) partials — or, past one wave of resident CTAs (one row tile), a CTA per k
//   consecutive splits, streamed through one pipeline, writing each split's partial (v14);
//   fused mode (one row tile, batches giving ≥ 256 CTAs anyway), one CTA per group of 8
//   consecutive splits that folds them in registers as it goes and writes one partial per
//   group — or the output itself when the sequence has ≤ 8 splits.
//
//   Per KV tile of kTileN positions (BF16 32; FP8 64 since v23 — the same bytes — except with 4
//   row tiles, 32), in shared memory as [kTileN][hd] rows with a 16-byte-chunk XOR swizzle
//   (conflict-free ldmatrix), filled by cp.async 16 B (warp w: its kTileN/4 positions
//   w·kTileN/4 .., one whole row per warp instruction, one block-id lookup per row — per warp
//   where block_size % (kTileN/4) == 0, v21; zero-filled past the split end and for block ids
//   outside [0, num_blocks)), kStages-deep pipeline:
//     score    warp w: S[rows, its kTileN/4 positions] = Q · K^T (1 or 2 n8 tiles), mma.m16n8k16 bf16 → fp32
//              (Q from padded smem via ldmatrix, K via ldmatrix; FP8: f16 MMAs, K converted
//              in registers)
//     scale    s *= softmax_scale·log2e (FP8: · k_scale[p] per score column, · 2^-sq per row),
//              causal mask −inf
//     max      quad shuffles → per-warp row max → smem → every warp forms the same tile max
//     softmax  m' = max(m, tile max); p = 2^(s − m'); α = 2^(m − m'); l = α·l + Σp (per thread,
//              summed over quads and warps only at the end); P → bf16 smem (FP8: P · v_scale[p]
//              · 2^se → f16 smem)
//     pv       warp w owns output columns [w·hd/4, (w+1)·hd/4): O = α·O + P · V, mma bf16 (f16)
//   Three __syncthreads per tile: tile landed / warp row maxima / P written — two with one row
//   tile (v21: a warp's scores read only the K rows it copied, so 'tile landed' is a warp barrier).
//   Lane ownership (g = lane / 4, t = lane % 4, standard mma fragments): score columns
//   w·kTileN/4 + 8·nt + 2t + {0, 1} (n8 tile nt), rows 16·mt + g (+8); O columns per n8 tile 2t + {0, 1} (BF16) or
//   4t + {0, 2} | 4t + {1, 3} (FP8, see below), same rows — so α is already in the registers.
//
//   FP8 (v13): the MMAs run in f16, which holds every e4m3 value exactly, so K and V need one
//   cvt.rn.f16x2.e4m3x2 per byte pair (v1–v12: bf16 MMAs fed by a 5-instruction shift/mask
//   trick per 4 bytes, the loop's largest cost: fp8 at large B was issue-bound). Four K bytes
//   [b0 b1 b2 b3] of lane t become the k-slot pairs (2t, 2t+1) ← hd (4t, 4t+1) and (2t+8, 2t+9)
//   ← hd (4t+2, 4t+3), a permutation of hd inside each 16-chunk that Q is staged with; V's
//   ldmatrix.trans on byte pairs gives lane (g, t) [pos 2t: hd 2g, 2g+1 | pos 2t+1: hd 2g,
//   2g+1], one byte permute (0, 2, 1, 3) from the B columns of the even and odd hd n8 tiles.
//   f16's range is the price, paid by exact powers of two:
//     Q  each row staged f16(q · 2^sq), sq putting the row's max |q| in [2^14, 2^15): every
//        element ≥ 2^-17 of the max stays exact (bf16's 8 bits fit f16's 11 down to its
//        subnormals), so the q·k products are exactly the bf16 query's; 2^-sq joins the row's
//        score multiplier.
//     P  p ∈ [0, 1] times v_scale, any positive float: each tile's P is staged f16(p · v_scale
//        · 2^se) with se putting the tile's max v_scale in [2^14, 2^15) — but never above the
//        split's previous se (O, accumulated in units of 2^se, steps down through α when se
//        drops; 2^-se at the end). Terms below 2^-24 of the split's largest scale go to f16
//        subnormals or zero: P carries 11 significant bits where v1–v12's bf16 P carried 8.
//
//   Canonical merge of a sequence's splits (λ_s = log2-sum-exp, o_s = O / l): a left fold in
//   split order within groups of 8 splits, then over the groups, with every rounding pinned by
//   _rn intrinsics (see Fold). Combine (second kernel, programmatic dependent launch, only when
//   some sequence can leave partials): fused mode and tables of ≤ 16 splits, the flat kernel
//   (a thread per 4 elements of a (sequence, kv head) block, no smem, v3); longer split-mode
//   tables, the grouped kernel (v4: one CTA per 32 elements of a (sequence, kv head) block,
//   a thread per (split group, 4 elements) folds level 1 in registers with all loads in
//   flight, one barrier, then level 2). Single-split sequences are written directly.
//   Output gate (optional, Qwen3-Next gated attention): wherever out is written (the attention
//   kernel for one-split / one-group sequences, else the combine), each element becomes
//   bf16(bf16(o) · sigmoid(gate)) exactly as sigmoid_gate_mul computes it — one launch fewer
//   per decode step; the gate rows are warmed in L2 (or loaded beside the partials) so the
//   store does not wait on a DRAM round trip.
//
// Shared memory (hd 256, bf16, M_TILES 1): 3 stages × (K + V) 32 KB + Q 8.4 KB + P 1.3 KB
//   ≈ 107 KB → 2 CTAs per SM (v2: 190 registers; v6 QREG, rows ≤ 8: 237). FP8 (v23): 64-position
//   tiles of the same 16 KB, 3 stages + scales 1.5 KB + P 2.3 KB ≈ 108.5 KB → 2 CTAs per SM
//   (v13–v22: 32-position tiles, 4 stages, 76.8 KB → 3; 4 row tiles still do).
//
// Floor (bytes moved): Σ_b L_b · nkv · hd · 2 (K and V) · elem (+ 2 · 4 per FP8 scale pair)
//   + partial O when split (split mode: rows · hd · 4 · 2 per 256-position split ≈ 6% of bf16
//   KV at 8 rows, 12% for the 128-position splits of sequences ≤ 2K; fused mode: 1/8 of
//   that). B = 1, L = 32K, nkv = 2, hd = 256, bf16: 67 MB
//   → 15.6 µs at the H200's ≈ 4.3 TB/s copy bandwidth; FP8 34 MB (+0.5 MB scales) → 8.0 µs.
//   Measured fraction: bench/NOTES.md (bench/bench_attention.py).
//
// Versions (H200 numbers in bench/results/bench_attention.md, analysis in bench/NOTES.md):
//   v1  as above. ~25 µs fixed per call (B = 1, L = 1K: 28.8 µs for a 0.5 µs floor), traced
//       in the SASS to serialized round trips on every CTA's critical path: Q staged row by row
//       (a separate loop per row, each waiting on its own loads: 8 DRAM round trips at group
//       8), and each tile's block-table lookups behind branches, one dependent L1/L2 round
//       trip per copied row (8 per bf16 tile) before its cp.async could issue.
//   v2  Q loaded as 16-column units, every load of the CTA issued at once right after the
//       kernel starts (beside the seq_lens load), stored to smem after the first KV copies
//       are queued; tile copies owned row-wise (4 threads per position: one branch-free
//       block-id lookup per thread per tile instead of 8, ~130 instead of ~435 instructions
//       per warp per tile to issue the copies; main loop ~380 instead of ~675 at hd 256 bf16),
//       issued after the score MMAs (one row tile) so the address math hides under their
//       latency; programmatic dependent launch for the attention kernel too (pdl_wait first,
//       then trigger at once so the combine grid launches under the last wave); the combine
//       reads seq_lens before its wait and folds level 1 with 4 threads per column. Same
//       math, same bits. Measured: B = 1 wins from L ≥ 8K (32K bf16 16/2 33.6 µs), large B
//       0.79–0.91 of the floor bf16, 0.63–0.74 fp8, with the per-tile period of a CTA
//       ≈ 2.1–2.3 µs for both dtypes at B = 128 × 32K (fp8 tiles carry half the bytes, 3 CTAs
//       per SM instead of 2): ≥ 17 MB in flight at 3.1–3.8 TB/s, so the memory system's
//       efficiency on this access pattern, not issue or bytes in flight, was the limit.
//   v3  KV copies carry an L2 prefetch-size hint (.L2::256B, or the row size when smaller):
//       v2's 64-byte row pieces (8 rows per warp instruction) were filled from DRAM as
//       separate sector-pair requests per half line; the peers at the floor use .L2::128B.
//       The combine of fused mode and of short tables (≤ 16 splits) runs as a flat kernel
//       (4 elements per thread, no smem or barrier): 8× fewer, smaller CTAs than the staged
//       kernel's 15.5 waves at B = 128 (see paged_decode_combine_flat_kernel). Short
//       sequences split into 128-position splits (≤ 16 of them: L ≤ 4K, see paged_decode.h), so
//       a short sequence's chain is 4 tiles instead of 8. Changes the bits of L ≤ 4K
//       sequences vs v2 (still a function of L alone: batch invariance holds).
//   v4  The staged combine of long split-mode tables (B = 1 × 32K: ~7 µs of 33.1) is replaced
//       by the grouped kernel (see paged_decode_combine_groups_kernel): all partial loads of a
//       CTA in flight at once, level 1 folded in registers by a thread per (group, 4
//       elements), one barrier, level 2 from smem: register chains of 8 + 16 steps instead of
//       ~3500 clk of smem-dependent serial phases, and CTAs small enough (128 threads, 2 KB
//       smem) to become resident beside the attention CTAs under PDL. Same bits.
//   v5  The block ids of a CTA's prologue tiles are prefetched into L1 right after pdl_wait,
//       beside the Q and seq_lens loads, at the positions the two common chunk sizes give
//       (256, 128): the first KV copies then wait two dependent round trips instead of three.
//   v6  bf16 with ≤ 8 rows (QREG): Q held in registers as the score MMAs' A fragments (rows
//       8–15 of the m16 tile are zero padding: 2 registers per 16 hd), so a tile's ldmatrix
//       count per warp drops from 34 to 18 at hd 256 (Q was 16 of them; with the cp.async
//       fills, the tile's smem traffic per CTA ≈ 96 → 64 KB). 237 registers at hd 256, still
//       2 CTAs per SM (smem-bound). Same MMA inputs, same bits.
//   v7  One-wave grids warm L2 with each CTA's prologue K/V rows before pdl_wait (seq_lens and
//       block ids read .cg only to aim sm_90 bulk L2 prefetches; everything used is re-read
//       after the wait), and the combine kernels trigger their dependents before their own
//       wait: at B = 1 the next layer's (or call's) attention CTAs become resident as this
//       grid's CTAs exit and stream their first tiles under this call's drain and combine.
//   v8  QREG for fp8 too where 2 CTAs per SM hold the whole grid (one wave: B = 1 long
//       sequences): Q was 16 of an fp8 tile's 30 ldmatrix per warp. 223 registers at hd 256
//       (2 CTAs/SM); multi-wave fp8 grids keep the 166-register, 3-CTA instance.
//   v9  Optional output gate (sigmoid_gate_mul fused into every store path, bitwise); the
//       combine kernels trigger their dependents after their wait, not before (v7), so o_proj's
//       GEMV is launched once the attention grid is done and places its CTAs evenly.
//   v10 KV copies carry an L2 evict-first cache policy (cp_async_16_kv), and both combines run
//       their post-wait code once before the wait on throwaway loads (a cold-code fix: the
//       grouped combine's wait-to-exit went 2.6–4.9 → 1.8–2.8 µs on the H200). Same bits.
//   v11 v7's L2 warm-up only where the block tables can hold a sequence of full-length splits
//       (≥ kPagedDecodeMinSplitLen positions, L > 3584). Same bits (hints only).
//   v12 Copies own whole rows: warp w copies tile rows 8w..8w+7 with one row (hd 256 bf16:
//       512 B, 4 full lines) per warp instruction, where v2–v11's 4-threads-per-row ownership
//       put 8 half lines in each (twice the L2 requests per byte); block ids looked up once per
//       row by lanes 0–7 and passed by shuffle. And the L2 fill hint drops to one line (128 B).
//       H200 (bench/paged_probe, v11 → v12): B = 1 × 32K bf16 16/2 25.8 → 23.4 µs, 24/4 41.6 →
//       37.3, fp8 21.5 → 20.9; B = 1 × 1K 9.15 → 8.25; B = 32 × 32K 536 → 507. Same bits.
//   v13 FP8 through f16 MMAs (see FP8 above): the hd 256 fp8 tile loop 644 → 516 SASS
//       instructions (the bit trick's LOP3/SHF gone; per tile +1 redux for the P scale, +4
//       FMUL for the row multipliers); one barrier more per fp8 CTA (the rows' 2^-sq). H200
//       (bench/paged_probe, v12 → v13): fp8 B = 32 × 32K 354 → 323 µs, B = 1 × 32K 20.9 → 19.8;
//       ncu at B = 32 × 32K: issue active 60 → 53%, DRAM 66 → 71% of peak. BF16 instances and
//       both combines: SASS unchanged. The fp8 QREG instance also runs wherever its grid needs
//       no more rounds of resident CTAs than the 3-CTA one (B = 8 × 8K: 38.1 → 33.9 µs).
//   v14 Split mode past one wave: where one split per CTA needs more than one round of resident
//       CTAs (and fused mode is not chosen), each CTA takes the fewest consecutive splits that
//       fit the grid in one wave and streams them through its pipeline, writing every split's
//       partial exactly as a one-split CTA does — the running state resets at each split, so
//       the bits are v13's. H200 (bench/paged_probe, v13 → v14): B = 32 × 1K bf16 16/2 28.8 →
//       25.8 µs, fp8 23.6 → 21.6, B = 8 × 8K bf16 44.4 → 40.3, fp8 34.0 → 31.2; unchanged
//       elsewhere. (Measured and not adopted, session 29: a warp-split kernel for ≤ 8 rows,
//       bench/paged_probe/warp_split.patch — see bench/NOTES.md.)
//   v17 Prologue: row → (token, head) and position → block by per-launch FastDivs (group,
//       block_size), the split cap computed once on the host, no row-group division below 4
//       row tiles; the L2 warm-up for BF16 only. H200 (bench/paged_probe, session 30, v14 →
//       v17): B = 1 × 8K fp8 16/2 14.3 → 13.4 µs, B = 32 × 1K bf16 25.8 → 25.5, B = 1 × 512
//       7.9 → 7.8; nowhere slower. Same bits.
//   v18 BF16 one-row-tile scores in 4 accumulator chains (was 2): hd 256's 16 score MMAs per
//       warp and tile as 4 dependent chains of 4. Other bits (the chains' sum order), the same
//       in every BF16 instance. H200 (bench/paged_probe variant ch4, session 30): B = 1 × 8K
//       13.3 → 13.1 µs, × 1K 8.26 → 8.14, 24/4 × 8K 14.1 → 13.85; batched BF16 unchanged.
//   v19 The L2 warm-up only for grids over more than half the SMs (launch_instance).
//   v21 The one-row-tile loop's instruction chain (at B = 1 a tile is its latency, one warp per
//       scheduler): one block-id lookup per warp where block_size % 8 == 0; 'tile landed' a warp
//       barrier, the next copies after the row-maxima barrier; splits as an outer loop (no per-tile
//       % and / to find a split's end); FP8 scores in 4 chains too. bf16 hd 256 QREG: 458 → 384
//       SASS instructions and 3 → 2 CTA barriers per tile, 249 → 233 registers; fp8 538 → 449.
//       H200 (bench/paged_probe variant chainf, session 31, v19 → v21): B = 1 × 512 7.75 → 7.22 µs,
//       × 1K 8.14 → 7.60, fp8 8.70 → 8.22, × 8K 12.88 → 11.67, fp8 13.25 → 12.26, × 32K fp8 19.77
//       → 18.32; fp8 B = 32 × 8K 90.2 → 81.4, B = 32 × 32K 330 → 308; bf16 batched −0.2..0.6%.
//       BF16 bits the same, FP8 bits change (score chain order), alike in every FP8 instance.
//   v22 The split and fused partials stored as the runs a lane owns (store_partial_row): BF16
//       columns 2t, 2t + 1 of an n8 tile as one 8-byte store, FP8 columns 4t .. 4t + 3 of a
//       16-column unit as one 16-byte store; the one-row-tile instances' 108 scalar STG become
//       48 STG.64 + 12 (bf16) or 24 STG.128 + 12 (fp8). out keeps scalar stores (a caller's tensor,
//       2-byte alignment), through one helper for both paths. Same bits. H200 (variant vstore,
//       session 32, v21 → v22): B = 1 × 512 7.23 → 6.87 µs, × 1K 7.61 → 7.28, fp8 8.21 → 7.61,
//       × 8K 11.67 → 11.43, fp8 12.26 → 11.68, × 32K 22.73 → 22.22, fp8 18.27 → 17.30; fp8
//       B = 8 × 8K 28.75 → 26.63, B = 32 × 1K 19.34 → 17.71; bf16 batched −0.4..2.9%.
//   v23 FP8 tiles of 64 positions (one and two row tiles): the same 16 KB per K or V tile as
//       BF16, so a split is half the tiles and each tile's fixed cost (2 barriers, the row-max and
//       softmax bookkeeping, the P round trip through smem, the pipeline step) is paid per 16 KB,
//       not per 8 KB; a warp owns 16 score columns as two n8 tiles (2 chains each, the same 4
//       accumulator chains per warp); FP8 splits are whole 64-position tiles (paged_decode_split's
//       tile template argument: FP8 chunks are multiples of 64, so FP8 bits change, as a function of L
//       alone). 3 stages, 2 CTAs per SM (was 4 stages, 3 CTAs: the same 192 KB in flight per
//       SM). BF16 unchanged in bits. H200 (session 32, probe v22 → v23): fp8 B = 1 × 1K 7.57 →
//       6.79 µs, × 8K 11.61 → 10.02, 24/4 12.43 → 10.89, × 32K 17.27 → 16.31; B = 8 × 8K 26.5 →
//       24.7, B = 32 × 8K 82.4 → 72.0, B = 128 × 8K 347 → 290, B = 32 × 32K 310 → 274.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/checks.h"
#include "common/gate.cuh"
#include "common/pdl.cuh"
#include "common/prefetch.cuh"
#include "paged_decode.h"

namespace atlas {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxRows = 64;                // query rows per CTA (4 MMA row tiles; O regs bound)
constexpr int kSplitGroup = 8;              // splits per level-1 group of the canonical merge
constexpr int kMaxGroups = kPagedDecodeMaxSplits / kSplitGroup;
static_assert(kPagedDecodeMaxSplits % kSplitGroup == 0, "split groups");
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// FP8 power-of-two bookkeeping (see the header comment, v13): Q rows are staged f16 · 2^sq and
// P tiles f16 · 2^se, so each row's max |q| and each tile's max v_scale land in [2^14, 2^15).
constexpr int kFp8TargetExp = 14;           // the staged maximum's exponent
constexpr int kFp8MaxShift = 126;           // |shift| bound: 2^±shift stays a normal float

template <int HD, bool FP8, int TILE_N>
struct Traits {
  static constexpr int kElemBytes = FP8 ? 1 : 2;
  static constexpr int kRowBytes = HD * kElemBytes;        // one position of one kv head
  static constexpr int kChunks = kRowBytes / 16;           // 16-byte chunks per row: 4..32
  // KV positions per tile (v23: FP8 64, the bytes of a BF16 tile): warp w owns score columns
  // [w·kRowsPerWarp, (w+1)·kRowsPerWarp) — kScoreTiles n8 MMA tiles — and copies those rows.
  static constexpr int kTileN = TILE_N;
  static constexpr int kRowsPerWarp = kTileN / kWarps;     // 8 | 16
  static constexpr int kScoreTiles = kRowsPerWarp / 8;     // 1 | 2
  static constexpr int kPStride = kTileN + 8;              // P smem row stride (16-bit): 80 | 144 B, conflict-free
  static constexpr int kTileBytes = kTileN * kRowBytes;    // one K (or V) tile
  // L2 fill hint (bytes): the row, at most one 128-byte line (v12; v3–v11: at most 256). With
  // whole rows per warp instruction every line of a row is requested at once, so a larger
  // hint only made L2 fetch ahead what the same instruction already asks for.
  static constexpr int kPrefetch = kRowBytes < 128 ? kRowBytes : 128;
  // Stages: ≥ 64 KB of KV in flight per CTA where smem allows 2 CTAs/SM (hd 256 bf16: 3).
  static constexpr int kStages = 2 * kTileBytes >= 32768 ? 3 : 4;
  static constexpr int kColsPerWarp = HD / kWarps;         // O columns per warp: 16, 32, 64
  static constexpr int kVUnits = kColsPerWarp / 16;        // 16-column V units (2 n8 tiles each)
  static constexpr int kQStride = HD + 8;                  // Q smem row stride (bf16), padded
  static_assert(kChunks >= 4, "tile geometry");

  // Byte offset of chunk c of tile row `row`: XOR swizzle so the 8 rows of an ldmatrix
  // (same logical chunk) land in 8 different 16-byte bank groups.
  __device__ static __forceinline__ int swizzle(int row, int c) {
    if constexpr (kChunks >= 8) return row * kRowBytes + ((c ^ (row & 7)) << 4);
    else return row * kRowBytes + ((c ^ ((row >> 1) & 3)) << 4);  // 64-byte rows, 2 per line
  }
};

// n / d for 0 ≤ n < 2^31 and a divisor d ≥ 1 fixed per launch: umulhi(n, mul) >> shr
// (Granlund–Montgomery, as CUTLASS's FastDivmod); mul = 0 marks d = 1.
struct FastDiv {
  uint32_t mul = 0;
  uint32_t shr = 0;
  __device__ __forceinline__ int operator()(int n) const {
    return mul ? (int)(__umulhi((uint32_t)n, mul) >> shr) : n;
  }
};

// Kernel-side problem: the Args plus what the launcher derives once.
struct Problem {
  PagedDecodeArgs a;
  int group;         // nq / nkv
  int rows_total;    // group · q_len: rows per (sequence, kv head)
  int row_groups;    // ceil(rows_total / kMaxRows)
  FastDiv div_bs;    // p / block_size
  FastDiv div_group; // row / group
  int split_cap;     // paged_decode_split_cap(nkv)
  int block_rows;    // 1: block_size % kRowsPerWarp == 0, so a warp's tile rows lie in one block (load_tile)
  float score_mult;  // softmax_scale · log2e
  int splits_per_cta;  // consecutive splits per CTA: kSplitGroup in fused mode, else ≥ 1 (M_TILES == 1
                       // only above 1; see the launcher)
  int fold;            // 1: fused mode (the CTA's group folded in registers); 0: split mode (a partial
                       // per split, whatever splits_per_cta)
  int warm_early;      // 1: the grid is one wave → warm L2 with the prologue tiles before pdl_wait (v7)
};

// A sequence's split count for the combines, which know the cache dtype (the split tile) only
// from the Args.
__device__ __forceinline__ int split_count(const Problem& pb, int seq_len) {
  return pb.a.kv_dtype == DType::kE4M3 ? paged_decode_split<paged_decode_tile_n(true)>(seq_len, pb.split_cap).count
                                       : paged_decode_split<paged_decode_tile_n(false)>(seq_len, pb.split_cap).count;
}

// ---- PTX wrappers ---------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16-byte async copy of a KV row chunk, with an L2 prefetch-size hint of kPrefetch bytes (64 or
// 128: the row's size, at most 128 since v12 — never a neighbouring kv head's row); src_bytes 0
// (position past the split, block id outside the pool) writes zeros and reads nothing, the
// zero-fill form CUTLASS's SM80_CP_ASYNC_CACHEGLOBAL_ZFILL uses with the same hint (one
// LDGSTS with the ignore-source predicate, as v2's; an if/else of a hinted and a plain copy
// compiled to two predicated LDGSTS per chunk).
// v3: the hint is new. v2's copies are 64-byte pieces of 8 rows per warp instruction (4
// threads per row), and without a hint L2 fills from DRAM per requested 32-byte sector pair,
// so each 128-byte line of a row reached DRAM as two separate requests issued at different
// times; the peers that reach the floor (CUTLASS SM80_CP_ASYNC_CACHEGLOBAL under FA2,
// FlashInfer's cp_async kPrefetch) all copy with .L2::128B. v2 at large B ran 0.79–0.91 of the
// floor with ≥ 17 MB in flight (Little: that is ~4–5 µs per request at the achieved 3.1–3.8
// TB/s, i.e. the memory system, not the CTA's issue or its bytes in flight, was the limit).
// v10: the copies also carry an L2 evict-first cache policy. Every KV byte is read once per call
// (one CTA per kv head and split), so nothing is lost by letting it go first, and what the
// stream used to evict survives it: the split partials (written from the first CTAs' ends,
// while ≈ 50 MB more KV still streams at B = 1 × 32K 24/4), the gate rows, the combine's and
// the epilogue's code, the layer's activations. The descriptor is CUTLASS's constant for
// CacheHintSm90::EVICT_FIRST, passed as an immediate: no createpolicy instruction, so not
// the ptxas miscompile that drops one (common/nvfp4_mma.cuh).
constexpr uint64_t kL2EvictFirst = 0x12F0000000000000ull;
template <int kPrefetch>
__device__ __forceinline__ void cp_async_16_kv(uint32_t dst, const void* src, bool valid) {
  static_assert(kPrefetch == 64 || kPrefetch == 128 || kPrefetch == 256, "prefetch size");
  const int src_bytes = valid ? 16 : 0;
  if constexpr (kPrefetch == 256)
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes), "l"(kL2EvictFirst));
  else if constexpr (kPrefetch == 128)
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes), "l"(kL2EvictFirst));
  else
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::64B [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes), "l"(kL2EvictFirst));
}
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
// D += A · B, m16n8k16, fp32 accumulators; inputs bf16 (BF16 KV) or f16 (FP8 KV, v13).
template <bool F16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (F16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 2^x, ~2 ulp; 2^-inf = 0 (masked scores).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
// 2^e as a float, for integer e ∈ [−126, 127] (built from its exponent bits; exact).
__device__ __forceinline__ float exp2_int(int e) { return __uint_as_float((uint32_t)(e + 127) << 23); }
// ---- the canonical split merge (one definition for the attention and combine kernels) -------
// A split s yields λ_s = m + log2 l (log2-sum-exp of its scaled scores) and o_s = O / l. Splits
// merge as a left fold in split order, within groups of kSplitGroup consecutive splits (level 1,
// → λ_g, o_g), then over the groups (level 2): per row  m' = max(m, λ), a = 2^(m − m'),
// c = 2^(λ − m'), L = L·a + c;  per element  acc = acc·a + o·c;  result λ = m + log2 L,
// o = acc · (1 / L). Explicit _rn intrinsics pin every rounding (no FMA contraction), so the
// fused mode (one CTA folds a whole group in registers) and the split mode (the combine kernel
// folds partials read back from memory) produce the same bits.
struct Fold {
  float m = -INFINITY;  // running max of λ
  float L = 0.f;        // Σ 2^(λ − m)
};
__device__ __forceinline__ void fold_coeffs(Fold& f, float lam, float& a, float& c) {
  const float m_new = fmaxf(f.m, lam);
  if (m_new == -INFINITY) {                     // nothing attended yet (and not by λ either)
    a = 0.f;
    c = 0.f;
  } else {
    a = exp2_approx(__fsub_rn(f.m, m_new));     // 2^-inf = 0 for the first finite λ
    c = exp2_approx(__fsub_rn(lam, m_new));
  }
  f.L = __fmaf_rn(f.L, a, c);
  f.m = m_new;
}
__device__ __forceinline__ float fold_elem(float acc, float a, float o, float c) {
  return __fmaf_rn(acc, a, __fmul_rn(o, c));
}
// fold_elem over a 4-wide column slice (the flat combine's float4 of one partial).
__device__ __forceinline__ void fold_elem4(float (&acc)[4], float a, const float4& o, float c) {
  acc[0] = fold_elem(acc[0], a, o.x, c);
  acc[1] = fold_elem(acc[1], a, o.y, c);
  acc[2] = fold_elem(acc[2], a, o.z, c);
  acc[3] = fold_elem(acc[3], a, o.w, c);
}
__device__ __forceinline__ void fold_result(const Fold& f, float& lam, float& inv) {
  lam = f.L > 0.f ? __fadd_rn(f.m, __log2f(f.L)) : -INFINITY;
  inv = f.L > 0.f ? __fdiv_rn(1.f, f.L) : 0.f;
}
// Slots 0 .. n − 1 (of N) of a float4 column slice folded into (f, acc) in order — the step both
// combines' levels share.
template <int N>
__device__ __forceinline__ void fold_slots4(Fold& f, float (&acc)[4], const float (&lam)[N], const float4 (&o)[N],
                                            int n) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (k < n) {
      float ca, cc;
      fold_coeffs(f, lam[k], ca, cc);
      fold_elem4(acc, ca, o[k], cc);
    }
  }
}
// Level 1 of the canonical merge over a float4 column slice (both combines): slots 0 .. n − 1 of
// one split group folded in order → og (unnormalized), the group's λ_g and 1 / L_g.
__device__ __forceinline__ void fold_group4(const float (&lam)[kSplitGroup], const float4 (&o)[kSplitGroup], int n,
                                            float (&og)[4], float& lam_g, float& inv_g) {
  Fold f;
#pragma unroll
  for (int i = 0; i < 4; ++i) og[i] = 0.f;
  fold_slots4(f, og, lam, o, n);
  fold_result(f, lam_g, inv_g);
}

// Four e4m3 bytes [b0 b1 b2 b3] → f16x2 (b0, b1) and (b2, b3), exactly (every e4m3 value is an
// f16): two cvt.rn.f16x2.e4m3x2, the upper byte of each pair to the upper half.
__device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t x, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi) : "r"(x));
}

// FP8 K: within each 16-column chunk, MMA k-slot s holds hd column 4·((s % 8) / 2) + 2·(s / 8) + s % 2
// (what e4m3x4_to_f16x2 of an ldmatrix'd K row gives lane t: slots 2t, 2t+1 ← hd 4t, 4t+1;
// slots 2t+8, 2t+9 ← hd 4t+2, 4t+3). Q is staged in slot order.
__device__ __forceinline__ int fp8_k_slot_column(int slot) {
  const int s = slot & 15;
  return (slot & ~15) + 4 * ((s & 7) >> 1) + 2 * (s >> 3) + (s & 1);
}
// O column (within the warp's kColsPerWarp) of element e ∈ {0, 1} of n8 tile `which` ∈ {0, 1}
// of 16-column V unit u, lane t.
template <bool FP8>
__device__ __forceinline__ int o_column(int u, int which, int e, int t) {
  if constexpr (FP8) return 16 * u + 4 * t + 2 * e + which;  // even / odd hd of the unit
  else return 16 * u + 8 * which + 2 * t + e;
}

// Query token j and head h of row gr of a (sequence, kv head): gr = j·group + (h − kvh·group).
struct RowHead {
  int j, h;
};
__device__ __forceinline__ RowHead row_head(const Problem& pb, int kvh, int gr) {
  const int j = pb.div_group(gr);
  return {j, kvh * pb.group + (gr - j * pb.group)};
}

// Row (b, j, h) of out [B, q_len, nq, hd] and lse [B, q_len, nq].
__device__ __forceinline__ int64_t out_row(const PagedDecodeArgs& a, int b, int j, int h) {
  return ((int64_t)b * a.q_len + j) * a.num_q_heads + h;
}
// Slot (b, kvh, split or group s, row gr) of partial_o [B, nkv, max_splits, rows_total, hd] and
// partial_lse [B, nkv, max_splits, rows_total].
__device__ __forceinline__ int64_t partial_row(const PagedDecodeArgs& a, int rows_total, int b, int kvh, int s,
                                               int gr) {
  return (((int64_t)b * a.num_kv_heads + kvh) * a.max_splits + s) * rows_total + gr;
}
// Output row (b, j, h)'s gate (PagedDecodeArgs::gate), or null for an ungated call.
__device__ __forceinline__ const __nv_bfloat16* gate_row(const PagedDecodeArgs& a, int b, int j, int h) {
  if (a.gate == nullptr) return nullptr;
  return static_cast<const __nv_bfloat16*>(a.gate) + b * a.gate_stride_b + j * a.gate_stride_t +
         h * a.gate_stride_h;
}
__device__ __forceinline__ const __nv_bfloat16* gate_row(const PagedDecodeArgs& a, int b, RowHead rh) {
  return gate_row(a, b, rh.j, rh.h);
}
// One output element from its f32 value v (column c of the row): bf16(v), or gated
// bf16(bf16(v) · sigmoid(gate[c])) through sigmoid_gate_mul's own expression (common/gate.cuh),
// so the fused call is bitwise paged_decode followed by sigmoid_gate_mul.
__device__ __forceinline__ __nv_bfloat16 gate_mul(__nv_bfloat16 o, __nv_bfloat16 g) {
  return __float2bfloat16_rn(sigmoid_gate_f32(__bfloat162float(o), __bfloat162float(g)));
}
__device__ __forceinline__ __nv_bfloat16 out_elem(const __nv_bfloat16* gate, int c, float v) {
  const __nv_bfloat16 o = __float2bfloat16_rn(v);
  return gate == nullptr ? o : gate_mul(o, gate[c]);
}
// A thread's values of one output row, v(u, which, e) for column o_column<FP8>(u, which, e, t) of
// its warp's columns (row and gate, or nullptr, at the warp's first column): scalar bf16 stores,
// as out is a caller's tensor with any 2-byte alignment.
template <bool FP8, int kVUnits, typename V>
__device__ __forceinline__ void store_out_row(__nv_bfloat16* row, const __nv_bfloat16* gate, int t, V v) {
#pragma unroll
  for (int u = 0; u < kVUnits; ++u)
#pragma unroll
    for (int which = 0; which < 2; ++which)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = o_column<FP8>(u, which, e, t);
        row[c] = out_elem(gate, c, v(u, which, e));
      }
}
// A thread's f32 values of one partial row, v(u, which, e) for column o_column<FP8>(u, which, e, t)
// of its warp's columns (row: 16-byte aligned, the workspace's), stored as the runs a lane owns:
// BF16 columns 2t, 2t + 1 of each n8 tile (8 bytes), FP8 columns 4t .. 4t + 3 of each 16-column
// unit (16 bytes) — a half / a quarter of the scalar stores, the same values.
template <bool FP8, int kVUnits, typename V>
__device__ __forceinline__ void store_partial_row(float* row, int t, V v) {
#pragma unroll
  for (int u = 0; u < kVUnits; ++u) {
    if constexpr (FP8) {   // o_column: 16u + 4t + 2e + which
      *reinterpret_cast<float4*>(row + 16 * u + 4 * t) = make_float4(v(u, 0, 0), v(u, 1, 0), v(u, 0, 1), v(u, 1, 1));
    } else {               // o_column: 16u + 8·which + 2t + e
#pragma unroll
      for (int which = 0; which < 2; ++which)
        *reinterpret_cast<float2*>(row + 16 * u + 8 * which + 2 * t) = make_float2(v(u, which, 0), v(u, which, 1));
    }
  }
}

// ---- attention kernel -----------------------------------------------------------------------

// CTAs per SM the register budget must allow: one row tile → 2 (bf16 hd 256, smem-bound) or
// 3 (fp8 hd ≤ 128 without QREG: 3 × ≤ 73 KB smem), i.e. ≤ 170 registers; fp8 hd 256 (v23: 64-
// position tiles, 108.5 KB) and QREG → 2.
// KV positions per tile of an instance: the dtype's (paged_decode_tile_n), except FP8 with 4 row
// tiles, which keeps 32 (v23: a second n8 score tile's 16 accumulators push its 255-register
// instance into 196 B of spills). Splits stay whole tiles either way: the FP8 chunk is a
// multiple of 64.
template <bool FP8, int M_TILES>
constexpr int kKernelTileN = FP8 && M_TILES == 4 ? kPagedDecodeTileN : paged_decode_tile_n(FP8);

template <int HD, bool FP8, int M_TILES, bool QREG>
constexpr int kMinCtasPerSm = M_TILES == 1 ? (FP8 && !QREG && HD < 256 ? 3 : 2) : 1;

// QREG (one row tile, rows ≤ 8 — every q_len-1 decode of a GQA group ≤ 8): Q is held in
// registers as the score MMAs' A fragments, loaded once from its smem staging, instead of 16
// ldmatrix.x4 per warp per tile re-reading it (hd 256: 16 of the tile's 34 ldmatrix for bf16,
// 16 of 30 for fp8; for bf16 ~1/3 of its smem read traffic beside the cp.async fills). Rows
// 8–15 of the m16 tile are zero padding, so their fragment registers (a1, a3) are the constant
// 0: HD/16 × 2 registers (32 at hd 256) instead of × 4. The MMA inputs are the same bits as
// the ldmatrix'd ones (fp8: the permuted, 2^sq-scaled f16 staging), so the results are too.
// bf16 always (v6); fp8 where its grid needs no more rounds of resident CTAs than the 3-CTA
// instance's (v8: one-wave grids; v13: the rule by rounds): its +32 registers cost the third
// CTA per SM, which only a multi-wave grid uses.
template <int HD, bool FP8, int M_TILES, bool QREG>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm<HD, FP8, M_TILES, QREG>)
paged_decode_kernel(const __grid_constant__ Problem pb) {
  using Tr = Traits<HD, FP8, kKernelTileN<FP8, M_TILES>>;
  constexpr int kRows = M_TILES * 16;
  constexpr int kStages = Tr::kStages;
  static_assert(!QREG || M_TILES == 1, "Q in registers: one row tile");
  const PagedDecodeArgs& a = pb.a;

  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* kv_smem = smem;                                                  // [stages][K|V][kTileN rows] swizzled
  float* scale_smem = reinterpret_cast<float*>(smem + kStages * 2 * Tr::kTileBytes);  // [stages][K|V][kTileN]
  __nv_bfloat16* q_smem = reinterpret_cast<__nv_bfloat16*>(
      scale_smem + (FP8 ? kStages * 2 * Tr::kTileN : 0));                   // [kRows][kQStride]
  __nv_bfloat16* p_smem = q_smem + kRows * Tr::kQStride;                    // [kRows][kPStride]
  float* red_max = reinterpret_cast<float*>(p_smem + kRows * Tr::kPStride); // [kWarps][kRows]
  float* red_sum = red_max + kWarps * kRows;                                // [kWarps][kRows]

  // split, or split group (fused); row group (rows_total > kMaxRows only with 4 row tiles)
  const int unit = M_TILES < 4 ? blockIdx.x : blockIdx.x / pb.row_groups;
  const int row0 = M_TILES < 4 ? 0 : (blockIdx.x % pb.row_groups) * kMaxRows;   // first row of this CTA
  const int kvh = blockIdx.y;                                  // kv head
  const int b = blockIdx.z;                                    // sequence
  const int rows = min(kMaxRows, pb.rows_total - row0);        // valid rows, ≤ kRows
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;                        // mma fragment coordinates

  const int capacity = a.max_blocks * a.block_size;
  const int32_t* block_table = a.block_tables + (int64_t)b * a.max_blocks;   // [max_blocks]
  auto block_index = [&](int p) {               // p / bs for 0 ≤ p < 2^31
    return pb.div_bs(p);
  };
  // Pool slot of position `pos` (table entry blk_idx, physical block blk), and the byte offset of
  // its kv head kvh row in a cache pool (bytes per slot, all heads, < 2^25).
  auto cache_position = [&](int blk, int pos, int blk_idx) {
    return (int64_t)blk * a.block_size + (pos - blk_idx * a.block_size);
  };
  auto row_offset = [&](int64_t cache_pos) {
    return (uint64_t)cache_pos * ((uint32_t)a.num_kv_heads * Tr::kRowBytes) + (uint32_t)kvh * Tr::kRowBytes;
  };
  constexpr int kThreadsPerRow = kThreads / Tr::kTileN;        // threads per tile row (warm-up): 4 | 2

  // -- (v7, one-wave grids) warm L2 with this CTA's prologue K/V rows BEFORE pdl_wait, so the
  //    first tiles stream while the previous kernel (the previous layer's or call's combine,
  //    qk_norm_rope) finishes, instead of after it: at B = 1 the prologue is 2 of a CTA's 8
  //    tiles, 16.8 MB of 67 at 32K, started ~2 round trips + the previous kernel's tail late.
  //    Nothing read here decides a result: seq_lens and block ids are loaded .cg (L2 only, so
  //    no L1 line can go stale) and only aim prefetches, which are hints (bounds-checked; a
  //    value the previous kernel is still writing at worst wastes one). Everything the CTA
  //    computes with is (re)read after the wait. Multi-wave grids skip it: their later CTAs
  //    start long after the previous kernel and would only add the two round trips.
  if (pb.warm_early) {
    const int len = min(max(__ldcg(a.seq_lens + b), 0), capacity);
    const PagedDecodeSplit sp = paged_decode_split<paged_decode_tile_n(FP8)>(len, pb.split_cap);
    const int first = unit * pb.splits_per_cta, which = tid % kThreadsPerRow;   // 0: K row, 1: V row
    if (first < sp.count && which < 2) {
      const int begin = first * sp.chunk;
      const int end = min(min(first + pb.splits_per_cta, sp.count) * sp.chunk, len);
      int pos[kStages - 1], blk[kStages - 1];
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {   // all block-id loads first, then the prefetches
        pos[s] = begin + s * Tr::kTileN + tid / kThreadsPerRow;
        blk[s] = pos[s] < end ? __ldcg(block_table + block_index(pos[s])) : -1;
      }
      const uint8_t* pool = static_cast<const uint8_t*>(which == 0 ? a.k_cache : a.v_cache);
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s)
        if ((unsigned)blk[s] < (unsigned)a.num_blocks)
          prefetch_l2_bulk(pool + row_offset(cache_position(blk[s], pos[s], block_index(pos[s]))), Tr::kRowBytes);
    }
  }

  // Programmatic dependent launch: this grid may become resident while the previous kernel
  // (qk_norm_rope, or the previous layer's combine) finishes; nothing global is read before
  // the wait except the hints above. The trigger right after lets the combine grid launch as
  // soon as every CTA of this grid has started (it still waits for this whole grid before
  // reading partials), so its launch latency hides under the last wave instead of following
  // it (v1 triggered at each CTA's end).
  pdl_wait();
  pdl_launch_dependents();

  // -- block ids of the prologue tiles, prefetched into L1 before seq_len is known (v5). The
  //    copies need seq_len → split plan → block id → KV: three dependent round trips before the
  //    first KV byte. Guessing the chunk — kPagedDecodeMinSplitLen, exact for every L in
  //    (4K, 256·cap] (up to 32K at nkv ≤ 2), and kPagedDecodeShortSplitLen, exact for most
  //    L ≤ 2K — puts the block-id fetch beside the seq_lens and Q loads; load_tile's __ldg
  //    then hits L1. A wrong guess costs a wasted prefetch.
  if (tid % (kThreads / Tr::kTileN) == 0) {     // one thread per tile row
    const int row = tid / (kThreads / Tr::kTileN), first = unit * pb.splits_per_cta;
#pragma unroll
    for (int guess = 0; guess < 2; ++guess) {
      const int begin = first * (guess == 0 ? kPagedDecodeMinSplitLen : kPagedDecodeShortSplitLen);
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        const int idx = block_index(begin + s * Tr::kTileN + row);
        if (idx < a.max_blocks) prefetch_l1(block_table + idx);
      }
    }
  }

  // -- Q as 16-column units (unit u: row u / (hd/16), columns 16·(u % (hd/16)) ..+15): every
  //    load of a batch is issued at once, here, beside the seq_lens load; the smem stores come
  //    after the first KV copies are queued. v1 staged Q row by row (a loop per row): 8 rows
  //    at group 8 were 8 dependent DRAM round trips (~6–8 µs) on every CTA's critical path,
  //    the largest part of v1's ~25 µs fixed cost at B = 1.
  constexpr int kQUnitsPerRow = HD / 16;
  constexpr int kQUnits = kRows * kQUnitsPerRow;
  constexpr int kQPerThread = (kQUnits + kThreads - 1) / kThreads;  // 1..8
  // Units held in registers at once: all of them with one row tile (≤ 2: 32 registers, before
  // the O accumulators are live); one per batch with 2–4 row tiles (O already needs ≥ 128).
  constexpr int kQBatch = M_TILES == 1 ? kQPerThread : 1;
  constexpr int kQBatches = kQPerThread / kQBatch;
  static_assert(kQPerThread % kQBatch == 0 && kQBatch <= 2, "Q batches");
  uint16_t q_raw[kQBatch][16];                                 // bf16 bits, columns in order
  const unsigned short* q_base = static_cast<const unsigned short*>(a.query);
  auto load_q = [&](int batch) {
#pragma unroll
    for (int k = 0; k < kQBatch; ++k) {
      const int u = tid + (batch * kQBatch + k) * kThreads, r = u / kQUnitsPerRow;
      const unsigned short* src = nullptr;
      if (u < kQUnits && r < rows) {
        const int gr = row0 + r;
        const auto [j, h] = row_head(pb, kvh, gr);
        src = q_base + b * a.q_stride_b + j * a.q_stride_t + (int64_t)h * HD + 16 * (u % kQUnitsPerRow);
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) q_raw[k][i] = src != nullptr ? __ldg(src + i) : (unsigned short)0;
    }
  };
  // FP8 (f16 MMAs, v13): slot s of a 16-column chunk holds column fp8_k_slot_column(s) (the K
  // permutation), as f16(q · 2^sq) with sq per row putting the row's max |q| in [2^14, 2^15):
  // exact for every element ≥ 2^-17 of it (f16 subnormals), so the scores' products are exactly
  // those of the bf16 query. The row's max gathers over its kQUnitsPerRow consecutive lanes
  // (shuffles: rows never straddle a warp); 2^-sq goes to smem (in the P buffer, unused until
  // the first tile's softmax) for the row's owners. Zero rows up to kRows. Two 16-byte smem
  // stores per unit.
  float* q_row_mult_smem = reinterpret_cast<float*>(p_smem);   // [kRows] FP8: 2^-sq of each row
  auto store_q = [&](int batch) {
#pragma unroll
    for (int k = 0; k < kQBatch; ++k) {
      const int u = tid + (batch * kQBatch + k) * kThreads;
      float q_mult = 1.f;                       // FP8: 2^sq
      if constexpr (FP8) {
        uint32_t mx = 0;                        // max |q| of the row, as bf16 bits
#pragma unroll
        for (int i = 0; i < 16; ++i) mx = max(mx, (uint32_t)(q_raw[k][i] & 0x7FFF));
#pragma unroll
        for (int o = 1; o < kQUnitsPerRow; o *= 2) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const int sq = min(kFp8TargetExp + 127 - (int)(mx >> 7), kFp8MaxShift);   // ∈ [−113, 126]
        q_mult = exp2_int(sq);
        if (u < kQUnits && u % kQUnitsPerRow == 0) q_row_mult_smem[u / kQUnitsPerRow] = exp2_int(-sq);
      }
      if (u >= kQUnits) continue;
      uint32_t w[8];
#pragma unroll
      for (int p = 0; p < 8; ++p) {
        uint32_t half[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const uint32_t raw = q_raw[k][FP8 ? fp8_k_slot_column(2 * p + e) : 2 * p + e];
          if constexpr (FP8) {
            half[e] = __half_as_ushort(__float2half_rn(__uint_as_float(raw << 16) * q_mult));
          } else {
            half[e] = raw;
          }
        }
        w[p] = half[0] | (half[1] << 16);
      }
      uint4* dst = reinterpret_cast<uint4*>(q_smem + (u / kQUnitsPerRow) * Tr::kQStride + 16 * (u % kQUnitsPerRow));
      dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
      dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
  };
  load_q(0);

  const int seq_len = min(max(a.seq_lens[b], 0), capacity);
  const PagedDecodeSplit plan = paged_decode_split<paged_decode_tile_n(FP8)>(seq_len, pb.split_cap);
  const int first_split = unit * pb.splits_per_cta;
  if (first_split >= plan.count) return;                       // whole CTA: no barrier skipped
  const int last_split = min(first_split + pb.splits_per_cta, plan.count);  // exclusive
  const bool fused = pb.fold != 0;
  const int kv_begin = first_split * plan.chunk;
  const int kv_end = min(last_split * plan.chunk, seq_len);    // ≥ kv_begin; splits never share a tile
  const int n_tiles = (kv_end - kv_begin + Tr::kTileN - 1) / Tr::kTileN;
  const int tiles_per_split = plan.chunk / Tr::kTileN;
  // A gated CTA that writes out itself (one split, or a fused sequence of one group) warms L2
  // with its rows' gates now, so the epilogue's gate loads do not add a DRAM round trip.
  if (a.gate != nullptr && tid < rows && (plan.count == 1 || (fused && plan.count <= kSplitGroup))) {
    const int gr = row0 + tid;
    const auto [j, h] = row_head(pb, kvh, gr);
    prefetch_l2_bulk(gate_row(a, b, j, h), HD * 2);
  }

  // Newest visible position of each of this thread's rows (rows ≥ `rows` are padding).
  int last_pos[M_TILES][2];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = mt * 16 + g + 8 * hh;
      const int j = r < rows ? pb.div_group(row0 + r) : a.q_len - 1;
      last_pos[mt][hh] = min(seq_len - a.q_len + j, kv_end - 1);
    }

  // -- load: tile `tile` of this split → stage `stage` (cp.async, zero-filled when invalid).
  //    Copy ownership (v12): warp w copies tile rows R·w .. R·w + R − 1 (R = kRowsPerWarp: 8, FP8
  //    16 since v23 — the rows it scores), each row by kLanesPerRow
  //    consecutive lanes, lane chunk c = lane % kLanesPerRow — so one warp instruction covers
  //    whole rows (hd 256 bf16: one 512-byte row, 4 full 128-byte lines), where v2–v11's
  //    4-threads-per-row ownership covered 8 rows × 64 bytes: 8 half lines, twice the L2
  //    requests per byte (the moe_experts v8 lesson). Lane l < R looks up row R·w + l's block id
  //    (one lookup per tile, as before) and the row's offset reaches the copying lanes by
  //    shuffle. The position is clamped into [0, kv_end) (always inside the table, no branch);
  //    a position past the split end, or whose block id lies outside [0, num_blocks), is
  //    zero-filled (never read; it reads as K = V = 0). For FP8, lane l < R also copies row
  //    R·w + l's K and V scales. The shared-memory image is v11's byte for byte (same swizzle),
  //    so the math and its bits are unchanged.
  constexpr int kRowsPerWarp = Tr::kRowsPerWarp;                           // 8 | 16
  constexpr int kLanesPerRow = Tr::kChunks < 32 ? Tr::kChunks : 32;         // 4 .. 32
  constexpr int kRowsPerCopy = 32 / kLanesPerRow;                           // rows per warp instruction
  static_assert(Tr::kChunks <= 32 && kRowsPerWarp % kRowsPerCopy == 0, "copy ownership");
  const int lane_chunk = lane % kLanesPerRow, lane_row = lane / kLanesPerRow;
  auto load_tile = [&](int tile, int stage) {
    const uint32_t k_dst = smem_addr(kv_smem) + (stage * 2) * Tr::kTileBytes;
    const uint8_t* k_pool = static_cast<const uint8_t*>(a.k_cache);
    const uint8_t* v_pool = static_cast<const uint8_t*>(a.v_cache);
    // v21: one block holds the warp's R rows (tiles start at multiples of kTileN): one broadcast
    // lookup and a row stride, not R lookups + 2R shuffles. The 4-row-tile instances (255 registers) keep
    // the per-row path below, which every block size can take.
    if (M_TILES < 4 && pb.block_rows) {
      const int pos0 = kv_begin + tile * Tr::kTileN + kRowsPerWarp * warp;   // the warp's first row
      const int blk_idx = block_index(min(pos0, kv_end - 1));
      const int blk = __ldg(block_table + blk_idx);              // one address per warp
      const bool blk_ok = (unsigned)blk < (unsigned)a.num_blocks;
      const int64_t cache_pos0 = cache_position(blk, pos0, blk_idx);
      const uint64_t base = blk_ok ? row_offset(cache_pos0) : 0;
      const uint32_t row_stride = (uint32_t)a.num_kv_heads * Tr::kRowBytes;
#pragma unroll
      for (int i = 0; i < kRowsPerWarp / kRowsPerCopy; ++i) {
        const int r = i * kRowsPerCopy + lane_row;             // row within the warp's R
        const bool row_ok = blk_ok && pos0 + r < kv_end;
        const uint64_t off = row_ok ? base + (uint64_t)(r * row_stride + 16 * lane_chunk) : 0;
        const uint32_t dst = k_dst + Tr::swizzle(kRowsPerWarp * warp + r, lane_chunk);
        cp_async_16_kv<Tr::kPrefetch>(dst, k_pool + off, row_ok);
        cp_async_16_kv<Tr::kPrefetch>(dst + Tr::kTileBytes, v_pool + off, row_ok);
      }
      if constexpr (FP8) {
        if (lane < kRowsPerWarp) {                             // row R·w + lane's K and V scales
          const bool ok = blk_ok && pos0 + lane < kv_end;
          const int64_t si = (cache_pos0 + lane) * a.num_kv_heads + kvh;
          float* s_dst = scale_smem + (stage * 2) * Tr::kTileN + kRowsPerWarp * warp + lane;
          cp_async_4(smem_addr(s_dst), ok ? a.k_scale + si : a.k_scale, ok);
          cp_async_4(smem_addr(s_dst + Tr::kTileN), ok ? a.v_scale + si : a.v_scale, ok);
        }
      }
      return;
    }
    // lookup lanes: row R·w + lane (lanes ≥ R look up a valid duplicate and are never asked)
    const int look_row = kRowsPerWarp * warp + (lane % kRowsPerWarp);
    const int pos = kv_begin + tile * Tr::kTileN + look_row;
    const int p = min(pos, kv_end - 1);                        // kv_end > kv_begin here
    const int blk_idx = block_index(p);
    const int blk = __ldg(block_table + blk_idx);
    const bool ok = pos < kv_end && (unsigned)blk < (unsigned)a.num_blocks;
    const int64_t cache_pos = cache_position(blk, pos, blk_idx);
    // Only a valid row's offset is formed (< 2^63: pool bytes), so bit 31 of its high word is
    // free to carry `ok` through the shuffle (a garbage block id's sign must never land there).
    const uint64_t row_off = ok ? row_offset(cache_pos) : 0;
    const uint32_t off_lo = (uint32_t)row_off, off_hi = (uint32_t)(row_off >> 32) | (ok ? 0x80000000u : 0u);
#pragma unroll
    for (int i = 0; i < kRowsPerWarp / kRowsPerCopy; ++i) {
      const int r = i * kRowsPerCopy + lane_row;               // row within the warp's R
      const uint32_t lo = __shfl_sync(0xffffffffu, off_lo, r);
      const uint32_t hi = __shfl_sync(0xffffffffu, off_hi, r);
      const bool row_ok = (hi & 0x80000000u) != 0u;
      const uint64_t off = row_ok ? ((uint64_t)(hi & 0x7fffffffu) << 32 | lo) + 16 * lane_chunk : 0;
      const uint32_t dst = k_dst + Tr::swizzle(kRowsPerWarp * warp + r, lane_chunk);
      cp_async_16_kv<Tr::kPrefetch>(dst, k_pool + off, row_ok);
      cp_async_16_kv<Tr::kPrefetch>(dst + Tr::kTileBytes, v_pool + off, row_ok);
    }
    if constexpr (FP8) {
      if (lane < kRowsPerWarp) {                               // row look_row's K and V scales
        const int64_t si = cache_pos * a.num_kv_heads + kvh;
        float* s_dst = scale_smem + (stage * 2) * Tr::kTileN + look_row;
        cp_async_4(smem_addr(s_dst), ok ? a.k_scale + si : a.k_scale, ok);
        cp_async_4(smem_addr(s_dst + Tr::kTileN), ok ? a.v_scale + si : a.v_scale, ok);
      }
    }
  };

  // -- running state ---------------------------------------------------------------------------
  float o_acc[M_TILES][2 * Tr::kVUnits][4];   // O rows × this warp's columns (scaled, unnormalized)
  float m_run[M_TILES][2], l_run[M_TILES][2]; // running max (log2 units) and this thread's Σp
  int p_exp = kFp8MaxShift;                   // FP8: O is in units of 2^p_exp (the split's P scale)
  auto reset_running = [&]() {                // at the start and after each split of a fused group
    p_exp = kFp8MaxShift;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int n = 0; n < 2 * Tr::kVUnits; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) o_acc[mt][n][i] = 0.f;
      m_run[mt][0] = m_run[mt][1] = -INFINITY;
      l_run[mt][0] = l_run[mt][1] = 0.f;
    }
  };
  reset_running();

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) load_tile(s, s);
    cp_async_commit();                          // empty groups keep the wait counts uniform
  }

  // -- Q → smem (batch 0 was loaded at the top; visible to all warps after the first barrier)
  store_q(0);
#pragma unroll 1
  for (int batch = 1; batch < kQBatches; ++batch) {
    load_q(batch);
    store_q(batch);
  }
  // QREG: rows 0–7 of each 16-column chunk as A fragments a0 (columns 2t, 2t+1) and a2 (8 + 2t,
  // 9 + 2t) of row g; one barrier for the staged Q, then a one-off ldmatrix pass. FP8: the same
  // barrier publishes the rows' 2^-sq, read here into each row's score multiplier (before the
  // first tile's softmax reuses the P buffer: all threads pass that tile's barriers first).
  uint32_t q_frag[QREG ? HD / 16 : 1][2];
  if constexpr (FP8 || M_TILES == 1) __syncthreads();   // (Q staged) every warp's Q stores visible (QREG: one row tile)
  float row_score_mult[M_TILES][2];             // softmax_scale · log2e (FP8: · 2^-sq of the row)
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      row_score_mult[mt][hh] = FP8 ? pb.score_mult * q_row_mult_smem[mt * 16 + g + 8 * hh] : pb.score_mult;
  if constexpr (QREG) {
#pragma unroll
    for (int kc = 0; kc < HD / 16; ++kc) {
      uint32_t r[4];
      ldmatrix_x4(r, smem_addr(q_smem + (lane & 15) * Tr::kQStride + kc * 16 + (lane >> 4) * 8));
      q_frag[kc][0] = r[0];                     // rows 0–7, columns 0–7 of the chunk
      q_frag[kc][1] = r[2];                     // rows 0–7, columns 8–15 (r[1], r[3]: rows 8–15, zero)
    }
  }

  // Fused mode: the canonical level-1 fold of this CTA's splits, in registers.
  float f_acc[M_TILES][2 * Tr::kVUnits][4];
  Fold f_row[M_TILES][2];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int n = 0; n < 2 * Tr::kVUnits; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) f_acc[mt][n][i] = 0.f;

  // -- end of split `split`: λ_s, o_s per row; then out (a single-split sequence), the split's
  //    partial (split mode) or the fold (fused mode); reset the running state. One barrier.
  auto finish_split = [&](int split) {
    const float o_mult = FP8 ? exp2_int(-p_exp) : 1.f;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float l = l_run[mt][hh];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (t == 0) red_sum[warp * kRows + mt * 16 + g + 8 * hh] = l;
      }
    __syncthreads();                            // (row sums) all warps' sums in red_sum
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = mt * 16 + g + 8 * hh;
        float l = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) l += red_sum[w * kRows + r];
        const float inv = l > 0.f ? __fdiv_rn(o_mult, l) : 0.f;
        const float lam = l > 0.f ? __fadd_rn(m_run[mt][hh], __log2f(l)) : -INFINITY;  // λ_s
        const int gr = row0 + r;
        const auto [j, h] = row_head(pb, kvh, gr);
        if (plan.count == 1) {                  // the sequence's only split: the output itself
          if (r < rows) {
            const int64_t orow = out_row(a, b, j, h);
            __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out) + orow * HD + warp * Tr::kColsPerWarp;
            const __nv_bfloat16* gate = gate_row(a, b, j, h);
            if (gate != nullptr) gate += warp * Tr::kColsPerWarp;
            store_out_row<FP8, Tr::kVUnits>(out, gate, t, [&](int u, int which, int e) {
              return __fmul_rn(o_acc[mt][2 * u + which][2 * hh + e], inv);
            });
            if (a.lse != nullptr && warp == 0 && t == 0) a.lse[orow] = lam * kLn2;
          }
        } else if (!fused) {                    // split mode: partial (λ_s, o_s) for the combine
          if (r < rows) {
            const int64_t prow = partial_row(a, pb.rows_total, b, kvh, split, gr);
            store_partial_row<FP8, Tr::kVUnits>(a.partial_o + prow * HD + warp * Tr::kColsPerWarp, t,
                [&](int u, int which, int e) { return __fmul_rn(o_acc[mt][2 * u + which][2 * hh + e], inv); });
            if (warp == 0 && t == 0) a.partial_lse[prow] = lam;
          }
        } else if constexpr (M_TILES == 1) {    // fused mode: level-1 fold in registers
          float ca, cc;
          fold_coeffs(f_row[mt][hh], lam, ca, cc);
#pragma unroll
          for (int n = 0; n < 2 * Tr::kVUnits; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& f = f_acc[mt][n][2 * hh + e];
              f = fold_elem(f, ca, __fmul_rn(o_acc[mt][n][2 * hh + e], inv), cc);
            }
        }
      }
    reset_running();
  };

  // One tile of the running state (v21: a lambda, so one-row-tile CTAs can walk splits as an
  // outer loop and tiles as an inner one — with the split's end tested per tile, a runtime % and
  // / per tile plus ≈ 16 register copies merging the finish / no-finish paths sat on B = 1's
  // chain).
  auto run_tile = [&](int tile) {
    cp_async_wait<kStages - 2>();
    // (tile landed) With one row tile (v21) a warp's scores read only the K rows it copied itself,
    // so its own wait + a warp barrier publish them; the other warps' V rows and FP8 scales are
    // published by the row-maxima barrier below, after which the next copies are issued (every
    // warp is then past this tile's scores, so done with stage (tile − 1) % kStages).
    if constexpr (M_TILES == 1) __syncwarp(); else __syncthreads();
                                                // stage (tile − 1) % kStages free again
    // Next copies: with one row tile issued after the row-maxima barrier (below); with 2–4 row
    // tiles here (v1's place): there the live score accumulators would push the 255-register
    // instance into spills (52 B measured).
    constexpr bool kLoadAfterScores = M_TILES == 1;
    if constexpr (!kLoadAfterScores) {
      if (tile + kStages - 1 < n_tiles) load_tile(tile + kStages - 1, (tile + kStages - 1) % kStages);
      cp_async_commit();
    }
    const int stage = tile % kStages;
    const uint8_t* k_tile = kv_smem + (stage * 2) * Tr::kTileBytes;
    const uint8_t* v_tile = k_tile + Tr::kTileBytes;
    const float* k_scale_tile = scale_smem + stage * 2 * Tr::kTileN;
    const float* v_scale_tile = k_scale_tile + Tr::kTileN;
    const int tile_start = kv_begin + tile * Tr::kTileN;

    // score: S[rows, the warp's kRowsPerWarp columns] = Q · K^T, kNT n8 tiles, 64 hd per step.
    // With one row tile an n8 tile's hd/16 MMAs would form one dependent chain; kChains
    // accumulators per n8 tile (k chunk i feeds chain i % kChains) cut it to hd/16 / kChains,
    // summed in chain order. v18: 4 chains for BF16 (B = 1 is this chain's latency, tile after
    // tile); v21: FP8 too; v23: FP8's two n8 tiles × 2 chains (4 independent chains per warp,
    // the same registers). QREG and smem-Q instances of a dtype share the count, so a row's bits
    // never depend on which one ran.
    constexpr int kNT = Tr::kScoreTiles;
    constexpr int kChains = M_TILES == 1 ? 4 / kNT : 1;
    float s_part[kChains][kNT][M_TILES][4];
#pragma unroll
    for (int c = 0; c < kChains; ++c)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
          for (int i = 0; i < 4; ++i) s_part[c][nt][mt][i] = 0.f;
#pragma unroll
    for (int k64 = 0; k64 < HD / 64; ++k64) {
      uint32_t kb[kNT][4][2];                   // B fragments of 4 k16 chunks per n8 tile
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int krow = kRowsPerWarp * warp + 8 * nt + (lane & 7);
        if constexpr (FP8) {                    // one 8×16-byte matrix = 16 hd × 8 positions
          uint32_t r[4];
          ldmatrix_x4(r, smem_addr(k_tile + Tr::swizzle(krow, 4 * k64 + lane / 8)));
#pragma unroll
          for (int i = 0; i < 4; ++i) e4m3x4_to_f16x2(r[i], kb[nt][i][0], kb[nt][i][1]);
        } else {                                // one matrix = 8 hd × 8 positions
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            uint32_t r[4];
            ldmatrix_x4(r, smem_addr(k_tile + Tr::swizzle(krow, 8 * k64 + 4 * h2 + lane / 8)));
            kb[nt][2 * h2][0] = r[0]; kb[nt][2 * h2][1] = r[1];
            kb[nt][2 * h2 + 1][0] = r[2]; kb[nt][2 * h2 + 1][1] = r[3];
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int kc = 4 * k64 + i;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          uint32_t qa[4];
          if constexpr (QREG) {
            qa[0] = q_frag[kc][0]; qa[1] = 0u; qa[2] = q_frag[kc][1]; qa[3] = 0u;
          } else {
            ldmatrix_x4(qa, smem_addr(q_smem + (mt * 16 + (lane & 15)) * Tr::kQStride + kc * 16 + (lane >> 4) * 8));
          }
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) mma_16816<FP8>(s_part[i % kChains][nt][mt], qa, kb[nt][i][0], kb[nt][i][1]);
        }
      }
    }
    float s_acc[kNT][M_TILES][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          s_acc[nt][mt][i] = s_part[0][nt][mt][i];
#pragma unroll
          for (int c = 1; c < kChains; ++c) s_acc[nt][mt][i] += s_part[c][nt][mt][i];
        }

    // scale + causal mask, then this warp's row maxima over its kRowsPerWarp columns
    auto score_col = [&](int nt) { return kRowsPerWarp * warp + 8 * nt + 2 * t; };   // tile column of element 0
    float col_mult[kNT][2];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) col_mult[nt][e] = FP8 ? k_scale_tile[score_col(nt) + e] : pb.score_mult;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& sv = s_acc[nt][mt][2 * hh + e];
            const float mult = FP8 ? col_mult[nt][e] * row_score_mult[mt][hh] : col_mult[nt][e];
            sv = (tile_start + score_col(nt) + e <= last_pos[mt][hh]) ? sv * mult : -INFINITY;
          }
          const float mx_nt = fmaxf(s_acc[nt][mt][2 * hh], s_acc[nt][mt][2 * hh + 1]);
          mx = nt == 0 ? mx_nt : fmaxf(mx, mx_nt);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        if (t == 0) red_max[warp * kRows + mt * 16 + g + 8 * hh] = mx;
      }
    __syncthreads();                            // (row maxima) all warps' maxima in red_max
    // Next copies (one row tile): stage (tile + kStages − 1) % kStages = (tile − 1) % kStages was
    // last read in iteration tile − 1, which every warp has left by now (v21: see "tile landed").
    if constexpr (kLoadAfterScores) {
      if (tile + kStages - 1 < n_tiles) load_tile(tile + kStages - 1, (tile + kStages - 1) % kStages);
      cp_async_commit();
    }

    // online softmax: identical m in every warp; P (FP8: · v_scale · 2^p_exp) → bf16 (f16) smem.
    // FP8: the tile's P scale 2^se puts its largest v_scale in [2^14, 2^15) (p ≤ 1, so every
    // P element < 2^15), taken as the split's new p_exp only when smaller (then O, in units of the
    // old 2^p_exp, steps down by o_step through α; the scale never grows within a split, so the
    // large terms already summed stay exact). Every warp derives the same se (redux over the
    // same kTileN scales).
    float alpha[M_TILES][2];
    float p_mult[kNT][2];
    float o_step = 1.f;                         // FP8: 2^(new p_exp − old p_exp) ≤ 1
    if constexpr (FP8) {
      uint32_t vmax = __float_as_uint(v_scale_tile[lane]);   // scales ≥ 0: uint order = float order
#pragma unroll
      for (int i = 32; i < Tr::kTileN; i += 32) vmax = max(vmax, __float_as_uint(v_scale_tile[lane + i]));
      vmax = __reduce_max_sync(0xffffffffu, vmax);
      const int se = min(p_exp, kFp8TargetExp + 127 - (int)((vmax >> 23) & 0xFF));
      o_step = exp2_int(max(se - p_exp, -127));   // 2^-127 → 0 (bits 0): a step that large
      p_exp = se;                                 // only ever meets an O of zeros
      const float p_scale = exp2_int(se);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) p_mult[nt][e] = v_scale_tile[score_col(nt) + e] * p_scale;
    } else {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) p_mult[nt][0] = p_mult[nt][1] = 1.f;
    }
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = mt * 16 + g + 8 * hh;
        float tile_max = red_max[r];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) tile_max = fmaxf(tile_max, red_max[w * kRows + r]);
        const float m_new = fmaxf(m_run[mt][hh], tile_max);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;   // all masked so far: p = 0
        alpha[mt][hh] = exp2_approx(m_run[mt][hh] - m_use);
        m_run[mt][hh] = m_new;
        float p_sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const float p0 = exp2_approx(s_acc[nt][mt][2 * hh] - m_use);
          const float p1 = exp2_approx(s_acc[nt][mt][2 * hh + 1] - m_use);
          p_sum = nt == 0 ? p0 + p1 : p_sum + (p0 + p1);
          *reinterpret_cast<uint32_t*>(p_smem + r * Tr::kPStride + score_col(nt)) =
              FP8 ? pack_f16x2(p0 * p_mult[nt][0], p1 * p_mult[nt][1]) : pack_bf16x2(p0 * p_mult[nt][0], p1 * p_mult[nt][1]);
        }
        l_run[mt][hh] = l_run[mt][hh] * alpha[mt][hh] + p_sum;
        if constexpr (FP8) alpha[mt][hh] *= o_step;   // after l's update: l counts p alone
      }
    __syncthreads();                            // (P written) P tile complete

    // pv: O[rows, warp's columns] = α·O + P · V
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int n = 0; n < 2 * Tr::kVUnits; ++n) {
        o_acc[mt][n][0] *= alpha[mt][0]; o_acc[mt][n][1] *= alpha[mt][0];
        o_acc[mt][n][2] *= alpha[mt][1]; o_acc[mt][n][3] *= alpha[mt][1];
      }
#pragma unroll
    for (int kc = 0; kc < Tr::kTileN / 16; ++kc) {
      uint32_t pa[M_TILES][4];
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
        ldmatrix_x4(pa[mt], smem_addr(p_smem + (mt * 16 + (lane & 15)) * Tr::kPStride + kc * 16 + (lane >> 4) * 8));
      const int vrow = 16 * kc + (lane & 7) + 8 * ((lane >> 3) & 1);  // positions 0-7 | 8-15
#pragma unroll
      for (int u = 0; u < Tr::kVUnits; ++u) {
        const int col0 = warp * Tr::kColsPerWarp + 16 * u;             // first hd of the unit
        uint32_t vb[2][2];                                             // [n8 tile][b0|b1]
        if constexpr (FP8) {                    // 16 hd bytes = one chunk; even/odd hd tiles
          uint32_t r[2];
          ldmatrix_x2_trans(r, smem_addr(v_tile + Tr::swizzle(vrow, col0 / 16)));
          // lane (g, t) holds bytes [pos 2t: hd 2g, 2g+1 | pos 2t+1: hd 2g, 2g+1] (positions
          // 0–7, then 8–15 of the chunk); bytes (0, 2, 1, 3) pair them as each tile's B column
          e4m3x4_to_f16x2(__byte_perm(r[0], 0, 0x3120), vb[0][0], vb[1][0]);
          e4m3x4_to_f16x2(__byte_perm(r[1], 0, 0x3120), vb[0][1], vb[1][1]);
        } else {                                // 16 hd = two chunks; hd col0..+7 | col0+8..+15
          uint32_t r[4];
          ldmatrix_x4_trans(r, smem_addr(v_tile + Tr::swizzle(vrow, col0 / 8 + (lane >> 4))));
          vb[0][0] = r[0]; vb[0][1] = r[1]; vb[1][0] = r[2]; vb[1][1] = r[3];
        }
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          mma_16816<FP8>(o_acc[mt][2 * u], pa[mt], vb[0][0], vb[0][1]);
          mma_16816<FP8>(o_acc[mt][2 * u + 1], pa[mt], vb[1][0], vb[1][1]);
        }
      }
    }
  };
  if constexpr (M_TILES == 1) {                 // fused or streamed splits end inside the CTA's range
    for (int tile = 0, split = first_split; tile < n_tiles; ++split) {
      for (const int end = min(tile + tiles_per_split, n_tiles); tile < end; ++tile) run_tile(tile);
      finish_split(split);
    }
    if (n_tiles == 0) finish_split(first_split);  // seq_len 0: out 0, lse −inf
  } else {
    for (int tile = 0; tile < n_tiles; ++tile) run_tile(tile);
    finish_split(first_split);                  // split mode only: one split per CTA
  }
  cp_async_wait<0>();                           // no copy may outlive the CTA (none pending here)

  // -- fused mode: this CTA's group result (λ_g, o_g); the final output when the sequence has
  //    a single group (level 2 of one group, as the combine would do it), else a group partial
  if constexpr (M_TILES == 1) {
    if (fused && plan.count > 1) {
      const int group = unit;                   // splits [group·kSplitGroup, ...)
      const bool single = plan.count <= kSplitGroup;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = g + 8 * hh;
        if (r >= rows) continue;
        float lam_g, inv_g;
        fold_result(f_row[0][hh], lam_g, inv_g);
        float lam = lam_g, inv = 1.f, ca = 0.f, cc = 0.f;
        if (single) {
          Fold top;
          fold_coeffs(top, lam_g, ca, cc);
          fold_result(top, lam, inv);
        }
        const int gr = row0 + r;
        const auto [j, h] = row_head(pb, kvh, gr);
        const int64_t orow = out_row(a, b, j, h);
        const int64_t prow = partial_row(a, pb.rows_total, b, kvh, group, gr);
        __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out) + orow * HD + warp * Tr::kColsPerWarp;
        const __nv_bfloat16* gate = single ? gate_row(a, b, j, h) : nullptr;
        if (gate != nullptr) gate += warp * Tr::kColsPerWarp;
        auto o_g = [&](int u, int which, int e) { return __fmul_rn(f_acc[0][2 * u + which][2 * hh + e], inv_g); };
        if (single) {
          store_out_row<FP8, Tr::kVUnits>(out, gate, t, [&](int u, int which, int e) {
            return __fmul_rn(fold_elem(0.f, ca, o_g(u, which, e), cc), inv);
          });
        } else {
          store_partial_row<FP8, Tr::kVUnits>(a.partial_o + prow * HD + warp * Tr::kColsPerWarp, t, o_g);
        }
        if (warp == 0 && t == 0) {
          if (single) {
            if (a.lse != nullptr) a.lse[orow] = lam * kLn2;
          } else {
            a.partial_lse[prow] = lam_g;
          }
        }
      }
    }
  }
}

// ---- grouped combine (v4): long split-mode tables ---------------------------------------------
// Grid (rows_total · hd / kGcCols, nkv, B), max(groups_max · kGcLanes, kGcCols) threads
// (groups_max = ceil(max_splits / kSplitGroup) ∈ [3, 16]). The CTA owns kGcCols = 32
// consecutive elements of the flattened [rows_total, hd] block of one (sequence, kv head) —
// one row's columns, as 32 divides hd — and thread (gi = tid / kGcLanes, lane = tid %
// kGcLanes) owns split group gi of its 4 elements 4·lane ..+3:
//   level 1  every thread issues its group's ≤ 8 (λ, float4) loads at once — so every partial
//            the CTA needs is in flight together, one round trip — folds them in registers in
//            split order (fold_coeffs / fold_elem4), and leaves o_g = acc · (1/L_g) in smem,
//            λ_g too (lane 0). One barrier.
//   level 2  threads tid < kGcCols fold element tid over the ≤ 16 groups in order, each
//            redoing the row's 16-step λ recurrence on the smem λ_g (no second barrier).
// Same operations in the same order per element as the flat kernel and the fused mode, so the
// same bits (test_kernel_batch_invariant: a fused batch through the flat kernel vs the
// sequence alone through this one).
// Why (v4): v3's staged kernel (one 256-thread CTA per (sequence, kv head, row, 64 columns),
// all ≤ 128 slots staged in smem, then 3 barrier-separated serial phases: thread gi's 8-step
// λ recurrence, thread 0's 16-step one, 4 threads per column folding 4 groups × 8 splits, then
// 16 more steps — every step a dependent smem load: ~3500 clk of chains after the load round
// trip) cost ~7 µs of B = 1 × 32K's 33.1 (ncu: 8.1 µs cold). Here the only dependent chains are
// the register folds (8 + 16 steps of fmax, ex2, FMA: ~1000 clk in all, every smem operand
// loaded before the level-2 chain starts). And the CTAs are small (128 threads, 2.1 KB smem,
// 48 registers, 56 since v9's gate load): beside two bf16 attention CTAs of 190 registers
// (217 KB smem, 48K registers) they fit and are resident before the attention grid drains
// (PDL); beside the QREG instance (237 registers, v6) or fp8's three CTAs they are placed as
// attention CTAs exit.
// The alternative weighed: level 1 folded inside the attention kernel by the last CTA of each
// 8-split group to finish (arrival counter + threadfence): at B = 1 the grid is one wave that
// finishes together, so that fold sits on the critical path behind a fence, an atomic and a
// load round trip (≥ 3 round trips before the combine's own one), and it needs persistent,
// self-resetting counters that concurrent streams would share.
constexpr int kGcLanes = 8;                                     // threads per split group
constexpr int kGcCols = 4 * kGcLanes;                           // elements per CTA (one row)
constexpr int kGcMaxThreads = kMaxGroups * kGcLanes;            // 128
static_assert(64 % kGcCols == 0, "a CTA's elements lie in one row for every head dim");

__global__ void __launch_bounds__(kGcMaxThreads)
paged_decode_combine_groups_kernel(const __grid_constant__ Problem pb) {
  const PagedDecodeArgs& a = pb.a;
  const int hd = a.head_dim, kvh = blockIdx.y, b = blockIdx.z;
  const int gi = threadIdx.x / kGcLanes, lane = threadIdx.x % kGcLanes;
  const int e_cta = blockIdx.x * kGcCols;                      // row · hd + first column
  const int gr = e_cta / hd, col0 = e_cta % hd;
  // seq_lens before the wait: this grid launches only once every attention CTA has passed its
  // own pdl_wait (then triggered), so whatever wrote seq_lens has completed and is visible;
  // only the partials need the wait. The trigger comes after the wait (v9; v7 triggered first,
  // so the next call's attention CTAs could warm L2 under this grid): in a model the dependent
  // is o_proj's GEMV, and a GEMV grid launched while the attention grid drains lands its CTAs
  // on the SMs that free up first, unevenly (H200, gated 27B layer step at B = 1 × 32K: 77.9 µs
  // with the early trigger, 73.5 with this one).
  const int seq_len = min(max(__ldg(a.seq_lens + b), 0), a.max_blocks * a.block_size);
  // Gated: level-2 thread c's gate element, also before the wait (written, like seq_lens, before
  // the attention grid's own wait returned; .cg: L2 only, no stale L1 line). After the wait it
  // was a DRAM round trip on the critical path — the KV stream has evicted the q_proj output
  // from L2 — that cost the layer step more than the sigmoid_gate_mul launch it saves.
  const __nv_bfloat16* gate = gate_row(a, b, row_head(pb, kvh, gr));
  unsigned short gate_c = 0;
  if (gate != nullptr && threadIdx.x < kGcCols)
    gate_c = __ldcg(reinterpret_cast<const unsigned short*>(gate) + col0 + threadIdx.x);
  const int count = split_count(pb, seq_len);
  if (count <= 1) {                             // the attention kernel wrote out (whole CTA)
    pdl_wait();                                 // (every CTA waits: the grid's end implies the attention's)
    pdl_launch_dependents();
    return;
  }
  const int groups = (count + kSplitGroup - 1) / kSplitGroup;  // ≤ blockDim.x / kGcLanes
  __shared__ __align__(16) float og_s[kMaxGroups][kGcCols];     // level-1 results o_g
  __shared__ float lam_s[kMaxGroups];                           // λ_g (one row per CTA)
  // Two passes over ONE copy of the code (v10): pass 0 runs before the wait on throwaway loads
  // of one fixed partial line (L2 only: no L1 line of a buffer being written can go stale) and
  // stores nothing global, so the instructions that matter after the wait are already in the
  // SM's instruction caches. The probe measured 2.8–4.9 µs from the wait to the exit of this
  // kernel (1.8 µs for the flat one with a single group): the post-wait code was fetched cold,
  // behind the wait, in sequential misses.
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    const bool live = pass == 1;
    if (live) {
      pdl_wait();                               // attention grid done, partials visible
      pdl_launch_dependents();
    }
    if (gi < groups) {                          // level 1: group gi, elements 4·lane ..+3
      const int s0 = gi * kSplitGroup, n = min(count - s0, kSplitGroup);
      const int64_t prow0 =
          live ? partial_row(a, pb.rows_total, b, kvh, s0, gr) : 0;
      const int64_t prow_step = live ? pb.rows_total : 0;
      const int o_col = live ? col0 + 4 * lane : 0;
      float lam[kSplitGroup];
      float4 o[kSplitGroup];
#pragma unroll
      for (int k = 0; k < kSplitGroup; ++k) {
        if (k < n) {
          const int64_t prow = prow0 + (int64_t)k * prow_step;
          lam[k] = __ldcg(a.partial_lse + prow);
          o[k] = __ldcg(reinterpret_cast<const float4*>(a.partial_o + prow * hd + o_col));  // 16-byte aligned
        }
      }
      float og[4], lam_g, inv_g;
      fold_group4(lam, o, n, og, lam_g, inv_g);
      *reinterpret_cast<float4*>(&og_s[gi][4 * lane]) =
          make_float4(__fmul_rn(og[0], inv_g), __fmul_rn(og[1], inv_g), __fmul_rn(og[2], inv_g), __fmul_rn(og[3], inv_g));
      if (lane == 0) lam_s[gi] = lam_g;
    }
    __syncthreads();                            // (level 1) every group's o_g, λ_g in smem

    if (threadIdx.x < kGcCols) {                // level 2: element threadIdx.x over the groups
      const int c = threadIdx.x;
      float lam_g[kMaxGroups], o_g[kMaxGroups]; // all smem loads first, then the chain
#pragma unroll
      for (int g2 = 0; g2 < kMaxGroups; ++g2) {
        if (g2 < groups) {
          lam_g[g2] = lam_s[g2];
          o_g[g2] = og_s[g2][c];
        }
      }
      Fold top;
      float acc = 0.f;
#pragma unroll
      for (int g2 = 0; g2 < kMaxGroups; ++g2) {
        if (g2 < groups) {
          float ta, tc;
          fold_coeffs(top, lam_g[g2], ta, tc);
          acc = fold_elem(acc, ta, o_g[g2], tc);
        }
      }
      float top_lam, top_inv;
      fold_result(top, top_lam, top_inv);
      const auto [j, h] = row_head(pb, kvh, gr);
      const int64_t orow = out_row(a, b, j, h);
      const __nv_bfloat16 o = __float2bfloat16_rn(__fmul_rn(acc, top_inv));
      if (live) {
        static_cast<__nv_bfloat16*>(a.out)[orow * hd + col0 + c] =
            gate == nullptr ? o : gate_mul(o, __ushort_as_bfloat16(gate_c));
        if (a.lse != nullptr && col0 == 0 && c == 0) a.lse[orow] = top_lam * kLn2;
      }
    }
    __syncthreads();                            // pass 0's level 2 is done with og_s / lam_s
  }
}

// ---- flat combine (v3) ----------------------------------------------------------------------
// Grid (ceil(rows_total · hd / 512), nkv, B), 128 threads: thread i of CTA x owns the 4
// consecutive elements e0 = 512·x + 4·i of the flattened [rows_total, hd] block of one
// (sequence, kv head) — one float4 of every partial slot (a slot's rows are contiguous) — and
// runs the canonical merge for those 4 alone. Every thread redoes its row's λ recurrences
// (≤ 16 fold_coeffs steps per level: ~0.3 µs of fmax / ex2), so there is no shared memory and
// no barrier, and all loads of one fold level are in flight together.
//   kFused (fused mode: the slots hold group results): level 2 over ≤ 16 slots, one round trip.
//   split mode: level 1 per group of ≤ 8 splits (one round trip per group), then level 2;
//   chosen by the launcher for max_splits ≤ kFlatMaxSplits (≤ 2 groups); longer tables go to
//   the grouped kernel above, which has all ≤ 128 slots in flight at once (B = 1, L = 32K: one
//   round trip there instead of 16).
// Why: v2's staged kernel's grid was one 256-thread CTA per (sequence, kv head, row, 64
// columns), 4 resident per SM (57 registers): at B = 128, 16/2, hd 256 that is 8192 CTAs,
// 15.5 waves of ~1.5–2 µs dependent chains (seq_lens, partials, 3 barriers, the folds): an
// estimated 25–30 µs of v2's 612 µs at L = 8K (floor 510), ~7 µs of 161 at B = 32 (2048 CTAs;
// B = 32, L = 1K split mode the same). Here 1024 CTAs of 128 threads at B = 128: ≈ 2 waves.
// Same operations in the same order per element as the grouped kernel, so the same bits (the
// batch-invariance test compares a fused batch, combined here, with the sequence alone, whose
// table of > 16 splits is combined by the grouped kernel).
constexpr int kFlatThreads = 128;
constexpr int kFlatElems = 4 * kFlatThreads;                 // flattened elements per CTA
constexpr int kFlatMaxSplits = 2 * kSplitGroup;              // split mode: ≤ 2 dependent trips

template <bool kFused>
__global__ void __launch_bounds__(kFlatThreads)
paged_decode_combine_flat_kernel(const __grid_constant__ Problem pb) {
  const PagedDecodeArgs& a = pb.a;
  const int hd = a.head_dim, kvh = blockIdx.y, b = blockIdx.z;
  const int e0 = blockIdx.x * kFlatElems + 4 * threadIdx.x;  // row · hd + column, column % 4 == 0
  // seq_lens before the wait, the trigger after it: as in the grouped kernel.
  const int seq_len = min(max(__ldg(a.seq_lens + b), 0), a.max_blocks * a.block_size);
  // Gated: warm L2 with this thread's 4 gate elements (like seq_lens, written before the
  // attention grid's wait returned); they are loaded after the fold — loading them here
  // would change ptxas' schedule of the split loop (71 → 128 registers).
  if (a.gate != nullptr && e0 < pb.rows_total * hd) {
    const int gr = e0 / hd;
    prefetch_l2(gate_row(a, b, row_head(pb, kvh, gr)) + e0 % hd);
  }
  const int count = split_count(pb, seq_len);
  const int groups = (count + kSplitGroup - 1) / kSplitGroup;
  // count ≤ 1, or a fused sequence of one group: the attention kernel wrote out (see there)
  if (count <= 1 || (kFused && groups <= 1) || e0 >= pb.rows_total * hd) {
    pdl_wait();                                 // (every CTA waits: the grid's end implies the attention's)
    pdl_launch_dependents();
    return;
  }
  const int gr = e0 / hd, col = e0 % hd;
  const auto [j, h] = row_head(pb, kvh, gr);
  // Two passes over one copy of the code, pass 0 before the wait on throwaway loads of one
  // fixed partial line, storing nothing: as in the grouped kernel (v10).
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    const bool live = pass == 1;
    if (live) {
      pdl_wait();                               // attention grid done, partials visible
      pdl_launch_dependents();
    }
    const int64_t slot0 = live ? ((int64_t)b * a.num_kv_heads + kvh) * a.max_splits : 0;   // slot 0's index
    const int64_t slot_rows = live ? pb.rows_total : 0;
    const int row = live ? gr : 0, o_col = live ? col : 0;
    auto load = [&](int slot, float& lam, float4& o) {
      const int64_t prow = (slot0 + slot) * slot_rows + row;
      lam = __ldcg(a.partial_lse + prow);
      o = __ldcg(reinterpret_cast<const float4*>(a.partial_o + prow * hd + o_col));   // 16-byte aligned
    };
    Fold top;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (kFused) {
      float lam[kMaxGroups];
      float4 o[kMaxGroups];
#pragma unroll
      for (int gi = 0; gi < kMaxGroups; ++gi)
        if (gi < groups) load(gi, lam[gi], o[gi]);
      fold_slots4(top, acc, lam, o, groups);
    } else {
#pragma unroll 1
      for (int gi = 0; gi < groups; ++gi) {
        const int s0 = gi * kSplitGroup, n = min(count - s0, kSplitGroup);
        float lam[kSplitGroup];
        float4 o[kSplitGroup];
#pragma unroll
        for (int k = 0; k < kSplitGroup; ++k)
          if (k < n) load(s0 + k, lam[k], o[k]);
        float og[4], lam_g, inv_g;              // level 1: this group's splits, in order
        fold_group4(lam, o, n, og, lam_g, inv_g);
        float ta, tc;                           // level 2: the group into the sequence's fold
        fold_coeffs(top, lam_g, ta, tc);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] = fold_elem(acc[i], ta, __fmul_rn(og[i], inv_g), tc);
      }
    }
    float top_lam, top_inv;
    fold_result(top, top_lam, top_inv);
    if (live) {
      const __nv_bfloat16* gate = gate_row(a, b, j, h);
      uint2 gate4{};
      if (gate != nullptr) gate4 = *reinterpret_cast<const uint2*>(gate + col);   // 8-byte aligned: rows are 16
      const int64_t orow = out_row(a, b, j, h);
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out) + orow * hd + col;
      const __nv_bfloat16* g4 = reinterpret_cast<const __nv_bfloat16*>(&gate4);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const __nv_bfloat16 o = __float2bfloat16_rn(__fmul_rn(acc[i], top_inv));
        out[i] = gate == nullptr ? o : gate_mul(o, g4[i]);
      }
      if (a.lse != nullptr && col == 0) a.lse[orow] = top_lam * kLn2;
    }
  }
}

// Combine launch: programmatic dependent launch (see above); a plain launch where refused.
// The flat kernel for fused mode and for short tables, the grouped one for long split-mode
// tables (small batches of long sequences, and verify groups of > 16 rows).
cudaError_t launch_combine(const Problem& pb, cudaStream_t stream) {
  const bool fused = pb.fold != 0;
  if (fused || pb.a.max_splits <= kFlatMaxSplits) {
    const dim3 grid((pb.rows_total * pb.a.head_dim + kFlatElems - 1) / kFlatElems, pb.a.num_kv_heads, pb.a.batch);
    return fused ? launch_pdl(paged_decode_combine_flat_kernel<true>, grid, dim3(kFlatThreads), 0, stream, pb)
                 : launch_pdl(paged_decode_combine_flat_kernel<false>, grid, dim3(kFlatThreads), 0, stream, pb);
  }
  // a thread per (group, 4 elements), at least kGcCols of them for level 2 (groups_max 3: 32)
  const int groups_max = (pb.a.max_splits + kSplitGroup - 1) / kSplitGroup;   // 3..16 here
  const int threads = max(groups_max * kGcLanes, kGcCols);
  const dim3 grid(pb.rows_total * pb.a.head_dim / kGcCols, pb.a.num_kv_heads, pb.a.batch);
  return launch_pdl(paged_decode_combine_groups_kernel, grid, dim3(threads), 0, stream, pb);
}

// ---- launcher -------------------------------------------------------------------------------

// ceil(log2(d)) for d ≥ 1.
int ceil_log2(uint32_t d) {
  int s = 0;
  while ((1ull << s) < d) ++s;
  return s;
}
// FastDiv for d ≥ 1: mul = ceil(2^p / d), p = 31 + ceil(log2 d), exact for 0 ≤ n < 2^31.
FastDiv fast_div(int d) {
  FastDiv f;
  if (d > 1) {
    const int p = 31 + ceil_log2((uint32_t)d);
    f.mul = (uint32_t)(((1ull << p) + d - 1) / d);
    f.shr = p - 32;
  }
  return f;
}

constexpr int kMaxDevices = 64;

template <int HD, bool FP8, int M_TILES>
size_t smem_bytes() {
  using Tr = Traits<HD, FP8, kKernelTileN<FP8, M_TILES>>;
  constexpr int kRows = M_TILES * 16;
  return (size_t)Tr::kStages * 2 * Tr::kTileBytes + (FP8 ? Tr::kStages * 2 * Tr::kTileN * sizeof(float) : 0) +
         (size_t)kRows * Tr::kQStride * 2 + (size_t)kRows * Tr::kPStride * 2 + 2 * kWarps * kRows * sizeof(float);
}

// The attention grid: (split units · row groups, kv heads, sequences), from host-known bounds.
dim3 attention_grid(const Problem& pb) {
  const int units = (pb.a.max_splits + pb.splits_per_cta - 1) / pb.splits_per_cta;  // per sequence
  return dim3(units * pb.row_groups, pb.a.num_kv_heads, pb.a.batch);
}
int64_t grid_ctas(const dim3& g) { return (int64_t)g.x * g.y * g.z; }

// The instance's shared-memory opt-in (> 48 KB must be opted into, once per device), the
// number of its CTAs the current device holds at once and (sm_count) its SMs (cached; host
// calls only, graph-safe).
template <int HD, bool FP8, int M_TILES, bool QREG>
cudaError_t instance_resident(int64_t& resident_ctas, int* sm_count = nullptr) {
  const size_t smem = smem_bytes<HD, FP8, M_TILES>();
  auto kernel = paged_decode_kernel<HD, FP8, M_TILES, QREG>;
  static bool opted_in[kMaxDevices] = {};
  static int64_t resident[kMaxDevices] = {};
  static int sm_counts[kMaxDevices] = {};
  int device = 0;
  ATLAS_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (!opted_in[device]) {  // a race only sets the attributes twice
    ATLAS_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    // All of the unified L1/smem as smem: 2 (bf16 hd 256) or 3 (fp8 hd 256: 3 × 76.8 KB) CTAs
    // per SM need it; L1 only caches block-table reads (KV goes through cp.async.cg).
    ATLAS_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                               (int)cudaSharedmemCarveoutMaxShared));
    int per_sm = 0, sms = 0;                    // host queries, no stream work (graph-safe)
    ATLAS_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
    ATLAS_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    resident[device] = (int64_t)per_sm * sms;
    sm_counts[device] = sms;
    opted_in[device] = true;
  }
  resident_ctas = resident[device];
  if (sm_count != nullptr) *sm_count = sm_counts[device];
  return cudaSuccess;
}

template <int HD, bool FP8, int M_TILES, bool QREG>
cudaError_t launch_instance(const Problem& pb, cudaStream_t stream) {
  const size_t smem = smem_bytes<HD, FP8, M_TILES>();
  auto kernel = paged_decode_kernel<HD, FP8, M_TILES, QREG>;
  int64_t resident = 0;
  int sms = 0;
  ATLAS_RETURN_IF_ERROR((instance_resident<HD, FP8, M_TILES, QREG>(resident, &sms)));
  Problem p = pb;
  // Split mode past one wave (v14): each CTA streams the fewest consecutive splits that fit the
  // grid in one wave of resident CTAs, writing each split's partial as a one-split CTA would
  // (the running state resets at every split: the same bits). A CTA's prologue and drain then
  // happen once per k splits, and its pipeline runs on across split boundaries, where v13 ran
  // ceil(CTAs / resident) rounds of 4- or 8-tile CTAs (B = 32 × 1K 16/2: 512 CTAs, 2 rounds).
  if (M_TILES == 1 && !p.fold && pb.a.max_splits > 1) {
    const int64_t seqs = (int64_t)pb.a.batch * pb.a.num_kv_heads;
    int k = 1;
    while (k < pb.a.max_splits && seqs * ((pb.a.max_splits + k - 1) / k) > resident) ++k;
    p.splits_per_cta = k;
  }
  const dim3 grid = attention_grid(p);
  // One wave (v7), and tables that can hold a sequence of full-length splits (v11: shorter ones
  // are a chain of a few round trips, which the warm-up's block-id round trip lengthened — session
  // 22 probe, B = 1 × 512 / 1K bf16 16/2: 9.3 → 8.3 / 9.8 → 9.0 µs; the gate is the launcher's
  // alone: the same test in the kernel, on the sequence's own length, cost B = 32 × 32K 1.5%
  // with the warm-up off there). BF16 only (v17): FP8's prologue tiles are half the bytes, and
  // the warm-up never paid for them — session 30 probe (two runs, µs on → off): B = 1 × 8K 16/2
  // 14.3 → 13.4, 24/4 14.5 → 13.8, B = 8 × 8K 31.4 → 31.0; B = 1 × 32K 19.8 either way; still so
  // with v23's 64-position FP8 tiles (session 33, off → on: 24/4 B = 1 × 8K 10.89 → 11.86). And
  // (v19) only for grids over more than half the SMs: below that DRAM is far from busy, so an
  // early prefetch buys nothing and its block-id round trip before the wait is pure latency —
  // B = 1 × 8K 16/2 (64 CTAs) 13.17 → 12.87 µs without it, while 128 CTAs (24/4 × 8K, × 16K)
  // gained 0.3–0.5 µs from it and 256 (× 32K) 1.4.
  const int capacity = pb.a.max_blocks * pb.a.block_size;
  const bool long_splits =
      paged_decode_split<paged_decode_tile_n(FP8)>(capacity, pb.split_cap).chunk >= kPagedDecodeMinSplitLen;
  p.warm_early = !FP8 && long_splits && grid_ctas(grid) <= resident && 2 * grid_ctas(grid) > sms ? 1 : 0;
  return launch_pdl(kernel, grid, dim3(kThreads), smem, stream, p);   // see pdl_wait in the kernel
}

template <int HD, bool FP8>
cudaError_t launch_rows(const Problem& pb, int m_tiles, cudaStream_t stream) {
  switch (m_tiles) {
    case 1:
      if (pb.rows_total <= 8) {                 // Q in registers (see QREG)
        if constexpr (!FP8) return launch_instance<HD, FP8, 1, true>(pb, stream);
        // fp8: where QREG's registers cost a CTA per SM (v13–v22 hd 256, 2 instead of 3; since
        // v23 only hd ≤ 128: at hd 256 smem holds 2 either way) it runs where its grid needs no
        // more rounds of resident CTAs than the smem-Q instance's: one wave (v8), and e.g.
        // 397..528 CTAs on 132 SMs (session 28: B = 8 × 8K fp8 16/2, 512 CTAs, 38.1 → 33.9 µs;
        // at 1024 CTAs, 4 rounds against 3, it loses 5%). Same bits either way.
        int64_t with_qreg = 0, without = 0;
        ATLAS_RETURN_IF_ERROR((instance_resident<HD, FP8, 1, true>(with_qreg)));
        ATLAS_RETURN_IF_ERROR((instance_resident<HD, FP8, 1, false>(without)));
        const int64_t ctas = grid_ctas(attention_grid(pb));
        if (with_qreg > 0 && without > 0 && (ctas + with_qreg - 1) / with_qreg <= (ctas + without - 1) / without)
          return launch_instance<HD, FP8, 1, true>(pb, stream);
      }
      return launch_instance<HD, FP8, 1, false>(pb, stream);
    case 2: return launch_instance<HD, FP8, 2, false>(pb, stream);
    default: return launch_instance<HD, FP8, 4, false>(pb, stream);  // 3 and 4 row tiles
  }
}

}  // namespace

cudaError_t launch_paged_decode(const PagedDecodeArgs& args, cudaStream_t stream) {
  const PagedDecodeArgs& a = args;
  const bool fp8 = a.kv_dtype == DType::kE4M3;
  if (a.query == nullptr || a.k_cache == nullptr || a.v_cache == nullptr || a.block_tables == nullptr ||
      a.seq_lens == nullptr || a.out == nullptr || (fp8 && (a.k_scale == nullptr || a.v_scale == nullptr)) ||
      (a.kv_dtype != DType::kBF16 && !fp8) || a.batch < 1 || a.batch > 65535 || a.q_len < 1 ||
      a.q_len > kPagedDecodeMaxQLen || a.num_kv_heads < 1 || a.num_kv_heads > 65535 ||
      a.num_q_heads < 1 || a.num_q_heads % a.num_kv_heads != 0 ||
      (a.head_dim != 64 && a.head_dim != 128 && a.head_dim != 256) || a.block_size < 1 ||
      a.num_blocks < 0 || a.max_blocks < 1 || (int64_t)a.max_blocks * a.block_size > (1ll << 31) - 1 ||
      a.max_splits != paged_decode_max_splits((int64_t)a.max_blocks * a.block_size, a.num_kv_heads) ||
      (a.max_splits > 1 && (a.partial_o == nullptr || a.partial_lse == nullptr)) ||
      !(a.softmax_scale > 0.f) || a.softmax_scale == INFINITY)
    return cudaErrorInvalidValue;
  // The gate's rows are read 16 bytes aligned (bulk L2 prefetch, 8-byte loads).
  if (a.gate != nullptr && (reinterpret_cast<uintptr_t>(a.gate) % 16 != 0 || a.gate_stride_b % 8 != 0 ||
                            a.gate_stride_t % 8 != 0 || a.gate_stride_h % 8 != 0 || a.gate_stride_b < 0 ||
                            a.gate_stride_t < 0 || a.gate_stride_h < 0))
    return cudaErrorMisalignedAddress;
  // The partials are stored and loaded as 8 / 16-byte runs (store_partial_row, the combines).
  if (a.max_splits > 1 && reinterpret_cast<uintptr_t>(a.partial_o) % 16 != 0) return cudaErrorMisalignedAddress;

  Problem pb{};
  pb.a = a;
  pb.group = a.num_q_heads / a.num_kv_heads;
  pb.rows_total = pb.group * a.q_len;
  pb.row_groups = (pb.rows_total + kMaxRows - 1) / kMaxRows;
  if ((int64_t)a.max_splits * pb.row_groups > (1ll << 31) - 1) return cudaErrorInvalidValue;
  pb.div_bs = fast_div(a.block_size);
  pb.div_group = fast_div(pb.group);
  pb.split_cap = paged_decode_split_cap(a.num_kv_heads);
  pb.block_rows = a.block_size % (paged_decode_tile_n(fp8) / kWarps) == 0 ? 1 : 0;
  pb.score_mult = a.softmax_scale * kLog2e;
  const int m_tiles = (min(pb.rows_total, kMaxRows) + 15) / 16;
  // Fused mode (one CTA per group of kSplitGroup splits, folded in registers: partial-O traffic
  // / 8, and none at all for sequences of ≤ 8 splits) once the batch alone gives ≥ kFusedMinCtas
  // CTAs; below that, split mode (a CTA per split, or per k splits past one wave: see
  // launch_instance) keeps small batches spread over the SMs. Same bits
  // either way (the canonical merge), so the choice may depend on B. One row tile only: the
  // fold's registers (+32 at hd 256) do not fit beside 2–4 row tiles of O.
  constexpr int64_t kFusedMinCtas = 256;        // ≈ one wave at 2 CTAs per SM on 132 SMs
  const int64_t groups_max = (a.max_splits + kSplitGroup - 1) / kSplitGroup;
  pb.fold = (m_tiles == 1 && a.max_splits > 1 &&
             (int64_t)a.batch * a.num_kv_heads * groups_max >= kFusedMinCtas) ? 1 : 0;
  pb.splits_per_cta = pb.fold ? kSplitGroup : 1;  // split mode: the instance's launch may stream more

  cudaError_t err;
  switch (a.head_dim) {
    case 64: err = fp8 ? launch_rows<64, true>(pb, m_tiles, stream) : launch_rows<64, false>(pb, m_tiles, stream); break;
    case 128: err = fp8 ? launch_rows<128, true>(pb, m_tiles, stream) : launch_rows<128, false>(pb, m_tiles, stream); break;
    default: err = fp8 ? launch_rows<256, true>(pb, m_tiles, stream) : launch_rows<256, false>(pb, m_tiles, stream); break;
  }
  ATLAS_RETURN_IF_ERROR(err);
  const bool partials = pb.fold ? groups_max > 1 : a.max_splits > 1;
  if (partials) ATLAS_RETURN_IF_ERROR(launch_combine(pb, stream));
  return cudaSuccess;
}

}  // namespace atlas
