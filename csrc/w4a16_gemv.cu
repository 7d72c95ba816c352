// w4a16_gemv: y[m, n] = Σ_k a[m, k] · W[n, k],  W = e2m1 · e4m3 block scale (16 along K) · global
// scale (NVFP4, checkpoint layout), a bf16 [M ≤ 32, K], f32 accumulation, y bf16 | f32.
// a = x (plain), bf16(silu(x) · x2) (silu) or bf16(x · sigmoid(x2)) (gated attention output),
// the last two computed from the raw operands as they land in shared memory (GemvAct).
//
// Decomposition (one tensor-core kernel for every M; swap-AB: Y^T = W · X^T)
//   mma.sync.m16n8k16 bf16 → f32 with the WEIGHT as the A operand (16 rows n × 16 k) and the
//   activations as B (16 k × 8 rows of x): M ≤ 32 is 1..4 n8 tiles (template MT = ceil(M/8)).
//   grid  (S, groups): blockIdx.x = split of K (cluster rank when S > 1), blockIdx.y = a group
//         of 16·W weight rows (dual: the groups of weight 0, then those of weight 1).
//   K segments: K is cut into w4a16_gemv_k_splits(K) ≤ 8 segments (a function of K only); a
//         row's result is 0 + p_0 + p_1 + … in segment order (f32), p_j its segment partials.
//         S (per launch, from N) is 1 (one CTA walks every segment, keeping the running sum:
//         large N, e.g. LM heads), segs/2 (2 segments per CTA) or segs (1 per CTA), the fewest
//         giving ≥ 3 four-warp CTAs per SM (2 at two tiles per warp, v3.14). Every S gives the
//         same bits (SplitPlan).
//   block W warps (W = 1, 2 or 4, picked from N so ≥ 2 CTAs per SM exist); warp w owns the
//         16-row tile (group·W + w) and all M columns, over the CTA's contiguous K range (M > 16:
//         tiles (group·W + w)·2 and +1, TPW = 2).
//   lane  (g = lane/4, t = lane%4) holds rows g and g+8 of its tile; per 128-k chunk it owns the
//         32 contiguous k [32t, 32t+32) of each row: one 16-byte smem load per row.
//   K permutation: inside a chunk, mma step (w, h) (w = word 0..3, h = 0..1) feeds logical k
//         pair (2t, 2t+1) with physical k (8w+2h, 8w+2h+4) + 32t and pair (2t+8, 2t+9) with
//         (8w+2h+1, 8w+2h+5) + 32t; the activations are permuted the same way (prmt) once per
//         CTA when their stage lands, so the mma loop reads B fragments as they are.
//         Tiled weights (v3.17) pair k-adjacent codes instead: step (w, h) feeds logical pair
//         (2t, 2t+1) with physical k (8w+4h, 8w+4h+1) + 32t and (2t+8, 2t+9) with (8w+4h+2,
//         8w+4h+3) + 32t, which is the activations' own order — no permutation pass (it cost
//         ≈ 12% of the M = 32 time: bench/NOTES.md, session 20). The two layouts therefore group
//         a row's products into k16 steps differently (equal within f32 rounding, not bitwise).
//         The per-row op order depends on K and the layout only, so a row is bit-identical for every M.
//   dequant: nibbles i and i+4 of a 32-bit word are 16 bits apart, so one shift puts both at
//         bits 12..15 / 28..31, and (v & 0x80008000) | ((v >> 6) & 0x01C001C0) is the bf16x2
//         pair e2m1 · 2^-126 (0.5 is a bf16 subnormal). One exact bf16 multiply by
//         F = bf16(block_scale · 2^119) gives e2m1 · scale · 2^-7 ∈ [2^-17, 21]: normal, exact
//         (≤ 6 significant bits). The 2^7 and the global scale are applied once, in f32, on the
//         store: y = acc · (global_scale · 128). Nothing over- or underflows for any e4m3 scale.
//         19 instructions per word (8 weights), 15 of them bit ops on the 16-lane ALU/IMAD
//         pipes: the sign and the magnitude of a code need different shifts (source offsets
//         differ by 1 bit, bf16 targets by 7) and other codes' bits must be masked, so no
//         shift/mask pair is shared between pairs in the checkpoint layout.
//   pipeline: 4 stages of cp.async (no L2 cache-hint policy: see cp_async8 for the ptxas
//         miscompile that v1's evict-first descriptor triggers in v2's code), one barrier
//         per 128-k chunk. A stage holds W·16 rows × 64 B of packed weight, W·16 × 8 scale
//         bytes and MT·8 rows × 256 B of activations (16-byte units XOR-swizzled so the B
//         fragment loads are bank-conflict free). Activations are converted one stage ahead
//         (plain: the B-fragment permutation, in place; silu / gated: the raw x and x2 rows,
//         2 × MT·8 × 256 B more per stage, → f32 silu(x)·x2 or x·sigmoid(x2), RNE to bf16,
//         permuted). Each thread's copy plan (2 weight pieces, 1 scale piece, its
//         activation units) is fixed per CTA and advanced by a constant per chunk.
//   launch: programmatic dependent launch. Weights are constants (no kernel before this one
//         writes them), so they are requested before griddepcontrol.wait — the staged kernel's
//         prologue copies, the one-row kernel's L2 prefetch (v3.11: its copies follow the
//         activation loads, which had queued behind them) — activations and outputs only after
//         it; launch_dependents after the main loop lets the next kernel's prologue overlap
//         this epilogue.
//   split-K (S > 1): the S CTAs of a cluster store their segment partials [spc][16W, 8MT] f32 in
//         shared memory; rank r sums elements r, r+S·threads, … over all segments in order
//         through distributed shared memory (fixed order: deterministic, no atomics).
//   weight layout: the checkpoint's row-major bytes, or (after NVFP4Weight.prepare_gemv, which
//         the layers call at load) chunk-major ("tiled", csrc/w4a16_gemv.h): chunk c of all rows
//         is one run, so a warp's chunk is 1 KB contiguous and concurrently streamed tiles are
//         neighbours in memory; each thread's copy plan (row_plan), the dequant's bit order and
//         (v3.17) the k pairing of the mma steps differ — the values are the same, the k16
//         grouping of a row's products is not (K permutation above). v2.4: the row-major pattern left DRAM
//         ≈ 50% busy on the LM heads (64 B per row per chunk, rows K/2 bytes apart); v2.4's
//         tile-major runs (40 KB apart per warp) reached 0.68–0.76 of copy bandwidth.
//   M = 1 (v3): w4a16_gemv_m1_kernel — the CTA's activations loaded and permuted once, each
//         warp its own cp.async ring synced by __syncwarp() (no CTA barrier in the loop); the
//         tiled layout's words carry their bits pre-placed (nvfp4.GEMV_WORD_PIECES,
//         dequant_word_tiled, v3.4: 6 masks on the ALU pipe + 5 shifts on the FMA pipe per word
//         instead of 15 shift/mask instructions). Same mma sequence and sums as every M, so the
//         rows stay batch invariant. v3.6: K split over the warps of one CTA (S warps per
//         tile, partials summed in shared memory in segment order: a cluster's bits) wherever
//         the CTA can stage all of K — instead of clusters, and for mid shapes with few long
//         CTAs per SM (launch_w4a16_gemv); v3.12: 8 such warps (one segment each) where the
//         grid still fits one wave. v3.11: a 3-stage ring (was 5), prologue as under launch.
//   M = 2..32: 4-warp CTAs unless N has fewer warp work items (v3.13; the launcher had given
//         small N 1- or 2-warp CTAs).
//   M > 16 (v3.9): two adjacent 16-row tiles per warp (template TPW), each B fragment loaded
//         once for both and the CTA's per-chunk activation staging serving 128 rows (v3.8 had
//         given such CTAs 8 warps of one tile instead: bench/NOTES.md); v3.10: one tile per
//         warp again for plain activations over fewer than 2 tiles per SM (kTpwMinTilesPerSm).
//   M = 2..8 (v3.15): two tiles per warp as well for plain activations on the vector path over
//         ≥ 2 tiles per SM, unless that leaves one split of fewer than 3 CTAs per SM or no split
//         of 2 per SM (launch_w4a16_gemv): the activation bytes each CTA re-reads from L2
//         (K_cta × M × 2 per 64 rows) were ≈ 45% of the weight bytes at M = 8 (bench/NOTES.md,
//         session 17).
//   M = 2..32, plain, tiled weights (v4, w4a16_gemv_xres_kernel): where the launch has more
//         16-row tiles than SMs and x [8·MT, K] fits in shared memory, one persistent CTA per SM
//         stages x whole once and runs the one-row kernel's per-warp rings with MT n8 tiles, the
//         K segments split over warps and summed in segment order (the same bits). Session 23
//         bench_gemv: M = 32 35B q+gate 19.6 → 10.4 µs, 35B LM head 148.9 → 137.0; M = 8 27B
//         q+gate+k+v 20.0 → 15.9, gate_up 39.3 → 32.2, 35B q+gate 8.8 → 6.0 (bench/NOTES.md).
//         v4.1: where x does not fit, K shares over a 2- or 4-CTA cluster (M = 32 27B
//         q+gate+k+v 42.2 → 32.4 µs, M = 16 27B o 15.2 → 12.6, down 29.5 → 25.7).
//   tails: rows ≥ n (the one-row kernel: they read row n − 1 instead) and (generic path) k ≥ K
//         are zero-filled by cp.async; K % 128 == 0 with
//         16-byte-aligned rows takes the vector path, any K % 16 == 0 the generic one.
//         Activation rows ≥ M in the last n8 tile are never written: they feed only output
//         columns ≥ M (mma columns are independent), which are never stored.
//
// Floor: bytes = N·K/2 + N·K/16 (+ M·K·2 + M·N·2); 14336×5120 ⇒ 41.3 MB ⇒ 9.9 µs at the
//   H200's measured 4.19 TB/s copy bandwidth (measured fractions: bench/NOTES.md, results/gemv.md).
// Issue budget at 4.19 TB/s on 132 SMs × 4 schedulers at 1.98 GHz: ≈ 8 thread-instructions per
//   weight + scale byte (one warp-instruction per 144 bytes). Per 128-k chunk and warp
//   (1152 bytes) v1 issued ≈ 420 warp-instructions (≈ 12 per byte: issue-bound, measured 0.42
//   of copy bandwidth on the 715 MB LM head); v2 issues ≈ 280 at M = 1 (152 dequant, 8 mma,
//   14 scale conversion, ≈ 50 copy issue, barrier and loop, ≈ 50 loads and addressing) and
//   ≈ 360 at M = 32 (32 mma); v3's one-row kernel ≈ 226 at M = 1 (ncu: 120 dequant with the tiled
//   bit order), v3.5's ≈ 191 (the tiled dequant's shifts moved to the FMA pipe, no zero-fill
//   predicates, the layout branch out of the loop). Measured v3.5 on the H200 (M = 1): 27B LM
//   head 178 µs = 0.97 of copy bandwidth, 3.5× cuBLAS BF16, within 6% of the memory stream
//   alone; mid shapes 0.39–0.72, most of the rest lost to SMs holding one CTA more than others
//   (bench/gemv_probe; bench/NOTES.md v3.4–v3.5).
#include "w4a16_gemv.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common/checks.h"
#include "common/gate.cuh"
#include "common/nvfp4_mma.cuh"
#include "common/pdl.cuh"
#include "common/prefetch.cuh"

namespace atlas {
namespace {

namespace cg = cooperative_groups;

constexpr int kTileN = 16;                   // weight rows per warp (mma M after swap-AB)
constexpr int kChunkK = 128;                 // K per pipeline stage
constexpr int kRowBytes = kChunkK / 2;       // 64 packed bytes per row per chunk
constexpr int kScaleBytes = kChunkK / 16;    // 8 block scales per row per chunk
constexpr int kXRowBytes = kChunkK * 2;      // 256 activation bytes per row per chunk
constexpr int kXUnits = kXRowBytes / 16;     // 16 units of 8 bf16 per activation row
constexpr int kStages = 4;                   // cp.async pipeline depth. 4, not 5 (v2.1): at M ≤ 8 a
                                             // 4-warp CTA then takes 26.6 KB, so 8 CTAs (32 warps, the
                                             // 64-register limit too) fit an SM instead of 6; ncu on the
                                             // 27B LM head (v2.1) showed 36% warps active, 62% issue
                                             // active, ≈ 9 stall cycles per issue: too few warps to hide
                                             // the dequant's dependency chains. 3 chunks in flight per
                                             // CTA (≈ 110 KB per SM) still cover DRAM latency.
static_assert(kStages >= 3, "activations are converted one stage ahead of the one computed");
constexpr int kMaxWarps = 4;
// Tiles per warp of the staged kernel (template TPW, SplitPlan::tiles_per_warp): M > 16 (MT ≥
// 3) gives each warp two adjacent 16-row tiles, each B fragment loaded once for both (v3.9). At
// M = 32 a warp loads 8 KB of B fragments per chunk against 1152 B of weight per tile, and each
// CTA stages and permutes 8 KB of activations per chunk: shared memory, not DRAM, bounds the
// tile; two tiles per warp halve both per weight row. But they also halve the warp work items:
// v3.9 measured 35B o_proj (128 tiles) 10.8 → 12.7 µs and a 2048×512 expert 7.2 → 9.9 at M =
// 32, so plain activations with fewer than 2 tiles per SM keep one tile per warp (v3.10).
constexpr int kTpwMinTilesPerSm = 2;
constexpr int kMaxSplits = 8;              // cluster size limit (portable)
constexpr int kMaxDevices = 64;             // per-device launch attribute bookkeeping

// Byte offsets inside one pipeline stage.
struct StageLayout {
  int w_off;   // [16·W·TPW rows][64 B] packed weight
  int s_off;   // [16·W·TPW rows][8 B]  e4m3 block scales
  int x_off;   // [8MT rows][256 B]  bf16 activations, swizzled units
  int a_off;   // [8MT rows][256 B]  silu / gated: raw x (linear)
  int b_off;   // [8MT rows][256 B]  silu / gated: raw x2 (linear)
  int bytes;
};

__host__ __device__ inline StageLayout stage_layout(int tiles, int mt, bool raw_operands) {   // tiles = W · TPW
  StageLayout l;
  l.w_off = 0;
  l.s_off = tiles * kTileN * kRowBytes;
  l.x_off = l.s_off + tiles * kTileN * kScaleBytes;
  l.a_off = l.x_off + mt * 8 * kXRowBytes;
  l.b_off = l.a_off + (raw_operands ? mt * 8 * kXRowBytes : 0);
  l.bytes = l.b_off + (raw_operands ? mt * 8 * kXRowBytes : 0);
  return l;
}

// How the K segments of one row group are spread over the CTAs of a launch. The segments are
// fixed by K alone (w4a16_gemv_k_splits(K) of them, seg_chunks chunks each, the last ones
// possibly short or empty), and a row's result is always 0 + p_0 + p_1 + … + p_{S−1} over its
// segment partials p_j in order (f32), so the split below may depend on N: every choice is
// bitwise the same. splits == 1: one CTA walks all segments, keeping the running sum;
// splits > 1: a cluster of `splits` CTAs, each with segs_per_cta (1 or 2) consecutive
// segments, summed through distributed shared memory in segment order.
struct SplitPlan {
  int seg_chunks;     // 128-k chunks per segment
  int segs_per_cta;   // segments one CTA computes (num_segs when splits == 1); with warp_splits
                      // > 1, the segments one warp computes (1 or 2)
  int num_segs;       // w4a16_gemv_k_splits(K)
  int warp_splits = 1;  // one-row kernel only: > 1 = the CTA covers all of K and its warps split
                        // it (warp_splits warps per 16-row tile, summed in shared memory in
                        // segment order, like a cluster's ranks: the same bits, no cluster)
  int tiles_per_warp = 1;  // staged kernel: 16-row tiles per warp (its template TPW: 1 or 2,
                           // chosen by the launcher; see kTpwMinTilesPerSm)
  int prefetch_chunks = 0;  // one-row kernel: chunks (0 | 1 | 2) each warp L2-prefetches before
                            // griddepcontrol.wait (kM1PrefetchMinCtasPerSm)
};

// The fused activation of one element in f32 (rounded once to bf16 by the caller), written
// exactly as the unfused kernels write it so the composition is bitwise the same:
// silu(x)·x2 as reference.silu_mul (w4a16_gemv_silu), x·sigmoid(x2) through the shared
// sigmoid_gate_f32 (common/gate.cuh) that csrc/sigmoid_gate.cu uses.
template <GemvAct kAct>
__device__ __forceinline__ float activation_f32(float x, float x2) {
  static_assert(kAct != GemvAct::kPlain, "plain activations are not converted");
  if constexpr (kAct == GemvAct::kSiluMul) return x / (1.0f + expf(-x)) * x2;
  else return sigmoid_gate_f32(x, x2);
}

// Output column of weight row n: identity, or the q/gate de-interleave of w4a16_gemv_qg.
__device__ __forceinline__ int out_column(int n, int n_total, int qg_head_dim) {
  if (qg_head_dim == 0) return n;
  const int h = n / (2 * qg_head_dim), i = n - h * 2 * qg_head_dim;
  return i < qg_head_dim ? h * qg_head_dim + i : n_total / 2 + h * qg_head_dim + (i - qg_head_dim);
}

__device__ __forceinline__ void store_out(const W4A16GemvWeight& w, DType dt, int m, int n, float v) {
  const int64_t off = static_cast<int64_t>(m) * w.n + out_column(n, w.n, w.qg_head_dim);
  if (dt == DType::kF32) static_cast<float*>(w.out)[off] = v;
  else static_cast<__nv_bfloat16*>(w.out)[off] = __float2bfloat16_rn(v);
}

// Byte offset of weight row n's chunk c_begin and the step per chunk, for `bytes` per row and
// chunk (64 packed, 8 scale): row-major, or chunk-major (tiled, see W4A16GemvWeight).
__device__ __forceinline__ void row_plan(const W4A16GemvWeight& wt, int K, int c_begin, int n, int bytes,
                                         int64_t& off, int& step) {
  if (wt.tiled) {
    off = (static_cast<int64_t>(c_begin) * wt.rows + n) * bytes;
    step = wt.rows * bytes;
  } else {
    off = static_cast<int64_t>(n) * (K / kChunkK) * bytes + static_cast<int64_t>(c_begin) * bytes;
    step = bytes;
  }
}

// A lane's share of its warp's 16-row tile(s) over the K segments of its CTA (SplitPlan; the
// staged kernel's SegmentSums<TPW·MT> holds tile i, n8 tile mt at i·MT + mt): acc is the current
// segment's partial; done is 0 + the finished segments' partials in order (one CTA over all
// segments) or the first segment's partial (2 segments per CTA in a cluster).
template <int MT>
struct SegmentSums {
  float acc[MT][4];
  float done[MT][4];
  int finished = 0;
  __device__ __forceinline__ SegmentSums() {
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][e] = done[i][e] = 0.0f;
    }
  }
  __device__ __forceinline__ void finish_segment(int splits, const SplitPlan& plan) {
    if (splits == 1 || (plan.segs_per_cta == 2 && finished == 0)) {
#pragma unroll
      for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          done[i][e] = splits == 1 ? done[i][e] + acc[i][e] : acc[i][e];
          acc[i][e] = 0.0f;
        }
      }
    }
    ++finished;
  }
};

// One 128-k chunk of a warp's TPW adjacent 16-row tiles on the tensor cores: 4 words × 2 mma
// steps × MT n8 tiles × TPW tiles, each B fragment loaded once for all TPW tiles. w_g / s_g:
// the lane's 16 packed bytes and 2 scale bytes of the first tile's row g (row g + 8 is 8 rows
// further, tile i 16·i rows); xfrag(w, mt): the B fragment (4 words) of word w for n8 tile mt;
// acc[i·MT + mt]: tile i, n8 tile mt. Per output element the mma sequence is the TPW = 1 one.
// kTiledBits: the words are in the tiled layout's bit order (dequant_word_tiled), else the
// checkpoint's.
template <int MT, bool kTiledBits, int TPW = 1, typename XFrag>
__device__ __forceinline__ void mma_chunk(float (&acc)[TPW * MT][4], const uint8_t* w_g, const uint8_t* s_g,
                                          XFrag xfrag) {
  uint32_t wa[TPW][4], wb[TPW][4];
  __nv_bfloat162 fa[TPW], fb[TPW];
#pragma unroll
  for (int i = 0; i < TPW; ++i) {
    const uint8_t* wi = w_g + i * kTileN * kRowBytes;
    const uint8_t* si = s_g + i * kTileN * kScaleBytes;
    const uint4 qa = *reinterpret_cast<const uint4*>(wi);                       // row g
    const uint4 qb = *reinterpret_cast<const uint4*>(wi + 8 * kRowBytes);       // row g+8
    fa[i] = scale_pair_bf16(*reinterpret_cast<const uint16_t*>(si));
    fb[i] = scale_pair_bf16(*reinterpret_cast<const uint16_t*>(si + 8 * kScaleBytes));
    wa[i][0] = qa.x; wa[i][1] = qa.y; wa[i][2] = qa.z; wa[i][3] = qa.w;
    wb[i][0] = qb.x; wb[i][1] = qb.y; wb[i][2] = qb.z; wb[i][3] = qb.w;
  }
#pragma unroll
  for (int w = 0; w < 4; ++w) {            // word w: k = 32t + 8w .. +8, block 2t + w/2
    uint32_t ra[TPW][4], rb[TPW][4];
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
      const __nv_bfloat162 sa = w < 2 ? __low2bfloat162(fa[i]) : __high2bfloat162(fa[i]);
      const __nv_bfloat162 sb = w < 2 ? __low2bfloat162(fb[i]) : __high2bfloat162(fb[i]);
      if constexpr (kTiledBits) {
        dequant_word_tiled(wa[i][w], sa, ra[i]);
        dequant_word_tiled(wb[i][w], sb, rb[i]);
      } else {
        dequant_word(wa[i][w], sa, ra[i]);
        dequant_word(wb[i][w], sb, rb[i]);
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint4 xv = xfrag(w, mt);
#pragma unroll
      for (int i = 0; i < TPW; ++i) {
        // h = 0: k (8w, 8w+4) and (8w+1, 8w+5); h = 1: (8w+2, 8w+6) and (8w+3, 8w+7)
        mma_bf16_16816(acc[i * MT + mt], ra[i][0], rb[i][0], ra[i][1], rb[i][1], xv.x, xv.y);
        mma_bf16_16816(acc[i * MT + mt], ra[i][2], rb[i][2], ra[i][3], rb[i][3], xv.z, xv.w);
      }
    }
  }
}

// The CTA's rows out: y = sum · global_scale · 2^7 (one f32 multiply, one rounding). One CTA
// over all segments stores its running sums; a cluster of `splits` CTAs (split-K) stores the
// segment partials [segs_per_cta][16·W·TPW rows][8MT cols] f32 in shared memory and sums them in
// segment order (rank 0's, then rank 1's, …: deterministic), each rank storing every S-th
// element, the remote loads of an element issued together. Every thread of the CTA calls it.
// Warp w owns tiles w·TPW .. w·TPW + TPW − 1 of the CTA (sums index i·MT + mt, mma_chunk).
template <int MT, int TPW = 1>
__device__ __forceinline__ void store_rows(const W4A16GemvArgs& args, const W4A16GemvWeight& wt,
                                           const SplitPlan& plan, const SegmentSums<TPW * MT>& sums,
                                           int row0, uint8_t* smem) {
  const int tid = threadIdx.x, nthreads = blockDim.x, warps = nthreads / 32, warp = tid / 32;
  const int g = (tid % 32) / 4, t = tid % 4, splits = gridDim.x, split = blockIdx.x;
  const int M = args.m, n_rows = wt.n;
  const float factor = __ldg(wt.global_scale) * kOutBias;
  const int cta_rows = warps * TPW * kTileN;
  if (splits == 1) {
    // Empty trailing segments (K short of the last ones) add +0 in the cluster order too.
    const bool empty_tail = sums.finished < plan.num_segs;
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
      const int row_base = row0 + (warp * TPW + i) * kTileN;
      if (row_base >= n_rows) break;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int m = mt * 8 + 2 * t + (e & 1), n = row_base + g + 8 * (e >> 1);
          const float d = sums.done[i * MT + mt][e];
          const float v = empty_tail ? d + 0.0f : d;
          if (m < M && n < n_rows) store_out(wt, args.out_dtype, m, n, v * factor);
        }
      }
    }
    return;
  }
  cp_async_wait<0>();
  __syncthreads();  // all warps are done with the stage buffers
  constexpr int kCols = MT * 8;
  const int part_stride = cta_rows * kCols;  // floats per segment
  float* part = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < TPW; ++i) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int idx = ((warp * TPW + i) * kTileN + g + 8 * (e >> 1)) * kCols + mt * 8 + 2 * t + (e & 1);
        if (plan.segs_per_cta == 2) {
          part[idx] = sums.done[i * MT + mt][e];
          part[part_stride + idx] = sums.acc[i * MT + mt][e];
        } else {
          part[idx] = sums.acc[i * MT + mt][e];
        }
      }
    }
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  for (int e = split * nthreads + tid; e < cta_rows * M; e += splits * nthreads) {
    const int rl = e / M, m = e % M, n = row0 + rl;
    if (n >= n_rows) continue;
    float v[kMaxSplits][2];
#pragma unroll
    for (int r = 0; r < kMaxSplits; ++r) {
      const float* pr = r < splits ? cluster.map_shared_rank(part, r) + rl * kCols + m : nullptr;
      v[r][0] = pr ? pr[0] : 0.0f;
      v[r][1] = pr && plan.segs_per_cta == 2 ? pr[part_stride] : 0.0f;
    }
    float s = 0.0f;
#pragma unroll
    for (int r = 0; r < kMaxSplits; ++r) {
      if (r < splits) {
        s += v[r][0];
        if (plan.segs_per_cta == 2) s += v[r][1];
      }
    }
    store_out(wt, args.out_dtype, m, n, s * factor);
  }
  cluster.sync();  // keep this CTA's partials alive until every rank has read them
}

// ---- the kernel --------------------------------------------------------------------------
// MT: n8 tiles of x rows (M ≤ 8·MT). TPW: 16-row tiles per warp (1, or 2 at MT ≥ 3). kVec: K % 128 == 0 and 16-byte rows (16-byte weight
// copies, 8-byte scale copies, no K tail); else 8-byte weight copies and byte scale loads.
// kTiled (vector path only): the weight is in the tiled layout — chunk-major rows and words
// whose dequantized pairs are k-adjacent, so the activation stage is used as copied (v3.17).
// kAct: the activation (plain x, or bf16(silu(x) · x2) / bf16(x · sigmoid(x2)) from raw rows).
//
// v2 (instruction diet; v1's per-segment math, sums in segment order): v1 spent ≈ 420 warp-instructions per
// 128-k chunk and warp (≈ 12 per weight byte, above the ≈ 8 the H200 can issue at copy
// bandwidth), of which only ≈ 150 were the dequant: the rest was per-chunk address math
// (generic strided copy loops: ≈ 35 instructions per cp.async, smem fragment addresses and
// swizzles recomputed every chunk). v2 fixes every thread's copy plan once per CTA (two
// 16-byte weight pieces, one 8-byte scale piece, pointers advanced by a constant per chunk),
// keeps the lane's fragment offsets in registers, and walks the stage ring by byte offset.
// kMinBlocks 0 leaves the minimum unstated: an explicit 1 is not the same thing to ptxas — it
// re-allocated every instance (56 → 70, 80 → 96 registers) and cost the 27B o projection 11.3 →
// 13.2 µs at M = 2..8 (session 21 probe).
template <int MT, bool kVec, bool kTiled, GemvAct kAct, int TPW, int kMinBlocks = 0>
__global__ void __launch_bounds__(kMaxWarps * 32, kMinBlocks)
w4a16_gemv_kernel(const __grid_constant__ W4A16GemvArgs args,
                  int groups0,            // row groups of weight 0 (the rest belong to weight 1)
                  SplitPlan plan) {       // segments of K over the CTAs (blockIdx.x)
  constexpr bool kRaw = kAct != GemvAct::kPlain;        // x and x2 staged raw, then combined
  extern __shared__ __align__(16) uint8_t smem[];
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const int warps = nthreads / 32, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;                  // mma groupID / thread-in-group
  const int splits = gridDim.x, split = blockIdx.x;

  const int wi = blockIdx.y < groups0 ? 0 : 1;
  const W4A16GemvWeight& wt = args.w[wi];
  const int group = blockIdx.y - (wi ? groups0 : 0);
  const int K = args.k, M = args.m, n_rows = wt.n;
  static_assert(TPW == 1 || TPW == 2, "two tiles per warp: M > 16, or plain M = 2..8 (launcher)");
  const int tiles_cta = warps * TPW;
  const int row0 = group * tiles_cta * kTileN;          // first weight row of this CTA
  const int num_chunks = (K + kChunkK - 1) / kChunkK;
  const int chunks_per_cta = plan.seg_chunks * plan.segs_per_cta;
  const int c_begin = min(split * chunks_per_cta, num_chunks);
  const int c_end = min(c_begin + chunks_per_cta, num_chunks);
  const StageLayout lay = stage_layout(tiles_cta, MT, kRaw);
  const int ring_bytes = kStages * lay.bytes;           // the stage ring, walked by byte offset
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(args.x);    // [M, K]
  const __nv_bfloat16* x2 = static_cast<const __nv_bfloat16*>(args.x2);  // [M, K] rows x2_stride apart (kRaw)
  const uint32_t smem_base = smem_u32(smem);

  // ---- copy plan (vector path), fixed for the CTA: the 16·W·TPW rows × 4 16-byte pieces of a
  // chunk are 2·TPW·nthreads pieces, p = tid + j·nthreads (row p/4, piece p%4); thread
  // tid < 16·W·TPW (every thread at TPW = 2) also copies row tid's 8 scale bytes. Rows ≥ n
  // zero-fill from a fixed address.
  static_assert(TPW <= 2, "one scale piece per thread covers 32 rows per warp");
  const uint8_t* w_src[2 * TPW];   // [n, K/2] packed: this thread's pieces of the next chunk to issue
  int w_step[2 * TPW];             // 64 bytes per chunk, 0 for rows ≥ n
  uint32_t w_dst[2 * TPW];         // smem offset inside a stage
  const uint8_t* s_src = wt.block_scale;  // [n, K/16] e4m3: row tid's 8 bytes of the next chunk
  int s_step = 0;
  const bool s_issuer = tid < tiles_cta * kTileN;
  if constexpr (kVec) {
#pragma unroll
    for (int j = 0; j < 2 * TPW; ++j) {
      const int p = tid + j * nthreads, rl = p >> 2, u = p & 3, n = row0 + rl;
      const bool ok = n < n_rows;
      int64_t off = 0;
      int step = 0;
      if (ok) row_plan(wt, K, c_begin, n, kRowBytes, off, step);
      w_src[j] = wt.packed + (ok ? off + u * 16 : 0);
      w_step[j] = ok ? step : 0;
      w_dst[j] = lay.w_off + rl * kRowBytes + u * 16;
    }
    const int n = row0 + tid;
    if (s_issuer && n < n_rows) {
      int64_t off = 0;
      row_plan(wt, K, c_begin, n, kScaleBytes, off, s_step);
      s_src = wt.block_scale + off;
    }
  }

  // Stage at byte offset `st_off` ← chunk c's weights and scales (never written by the kernels
  // before this one). Vector path: chunks are issued in order, each call advances the plan.
  auto issue_weights = [&](int st_off, int c) {
    if constexpr (kVec) {
#pragma unroll
      for (int j = 0; j < 2 * TPW; ++j) {
        cp_async16(smem_base + st_off + w_dst[j], w_src[j], w_step[j] ? 16 : 0);
        w_src[j] += w_step[j];
      }
      if (s_issuer) {
        cp_async8(smem_base + st_off + lay.s_off + tid * kScaleBytes, s_src, s_step ? 8 : 0);
        s_src += s_step;
      }
    } else {
      uint8_t* st = smem + st_off;
      const int k0 = c * kChunkK;
      for (int p = tid; p < tiles_cta * kTileN * 8; p += nthreads) {     // 8-byte pieces = 16 k
        const int rl = p >> 3, u = p & 7, n = row0 + rl, kk = k0 + 16 * u;
        const bool ok = n < n_rows && kk < K;
        const uint8_t* src = wt.packed + (ok ? static_cast<int64_t>(n) * (K / 2) + kk / 2 : 0);
        cp_async8(smem_base + st_off + lay.w_off + rl * kRowBytes + u * 8, src, ok ? 8 : 0);
      }
      for (int p = tid; p < tiles_cta * kTileN * 8; p += nthreads) {     // scale bytes, synchronous
        const int rl = p >> 3, j = p & 7, n = row0 + rl, kk = k0 + 16 * j;
        const bool ok = n < n_rows && kk < K;
        st[lay.s_off + rl * kScaleBytes + j] =
            ok ? __ldg(wt.block_scale + static_cast<int64_t>(n) * (K / 16) + kk / 16) : uint8_t(0);
      }
    }
  };

  // Stage at `st_off` ← chunk c's activations (raw x and x2 for silu / gated): the previous
  // kernel's output, M rows × 16 units of 8 bf16 per chunk. Thread tid copies unit
  // x_u = tid % 16 of rows x_r0 = tid / 16, x_r0 + nthreads/16, … (M = 1: threads 0..15, one
  // copy each); the row step is even, so every row of the thread has x_r0's swizzle parity and
  // the destinations differ by a constant. x2 rows are x2_stride apart (a strided gate view).
  static_assert(kXUnits == 16, "tid >> 4 is tid / kXUnits");
  const int x_u = tid & (kXUnits - 1), x_r0 = tid >> 4, x_rstep = nthreads >> 4;
  const int x_dst0 = kRaw ? lay.a_off + x_r0 * kXRowBytes + x_u * 16
                          : lay.x_off + x_r0 * kXRowBytes + bf16_unit_slot(x_r0, x_u) * 16;
  const int64_t x_src_step = static_cast<int64_t>(x_rstep) * K;                 // elements
  const int64_t x_src0 = static_cast<int64_t>(x_r0) * K + 8 * x_u;             // chunk 0, row x_r0
  auto issue_acts = [&](int st_off, int c) {
    if (x_r0 >= M) return;                       // no activation unit for this thread
    const bool ok = kVec || c * kChunkK + 8 * x_u < K;
    const __nv_bfloat16* xs = x + (ok ? x_src0 + c * kChunkK : 0);
    uint32_t dst = smem_base + st_off + x_dst0;
    if constexpr (kRaw) {
      const int64_t x2_step = x_rstep * args.x2_stride;
      const __nv_bfloat16* x2s = x2 + (ok ? x_r0 * args.x2_stride + 8 * x_u + c * kChunkK : 0);
      for (int r = x_r0; r < M; r += x_rstep) {
        cp_async16(dst, xs, ok ? 16 : 0);
        cp_async16(dst + (lay.b_off - lay.a_off), x2s, ok ? 16 : 0);
        xs += ok ? x_src_step : 0;
        x2s += ok ? x2_step : 0;
        dst += x_rstep * kXRowBytes;
      }
    } else {
      for (int r = x_r0; r < M; r += x_rstep) {
        cp_async16(dst, xs, ok ? 16 : 0);
        xs += ok ? x_src_step : 0;
        dst += x_rstep * kXRowBytes;
      }
    }
  };

  // The stage's activations (landed: every thread waited for its copies before the barrier
  // that precedes this call) → B-fragment order, one stage ahead of the compute. Plain: each
  // 16-byte unit (x0..x7) → (x0,x4 | x1,x5 | x2,x6 | x3,x7) in place (the prmt pairs of the K
  // permutation, once per CTA instead of once per warp and tile). silu / gated: each output
  // word (a_j, a_{j+4}) = bf16(activation(x, x2)) of its two elements, from the raw rows, into
  // the swizzled unit. Items go lane-major over the warps (item i → warp i % W), so the math
  // (≈ 25 instructions per element: expf and an IEEE division) is spread over every warp
  // instead of stalling warp 0, which every other warp then waits for at the next barrier
  // (v1: silu down 1.46× plain).
  // Tiled weights (natural word order, v3.17): plain activations are used as copied — no pass —
  // and silu / gated pairs are (a_2j, a_2j+1) instead of (a_j, a_j+4).
  static_assert(kVec || !kTiled, "the tiled layout always takes the vector path");   // a template
  // parameter, not wt.tiled: the runtime choice cost up to 32 registers
  const int cv_first = (tid & 31) * warps + (tid >> 5);   // this thread's first item
  auto convert_stage = [&](int st_off) {
    uint8_t* st = smem + st_off;
    if constexpr (kRaw) {
      const int lo_mul = kTiled ? 2 : 1, hi_add = kTiled ? 1 : 4;
      for (int i = cv_first; i < M * kXUnits * 4; i += nthreads) {
        const int r = i >> 6, u = (i >> 2) & (kXUnits - 1), j = i & 3;
        const __nv_bfloat16* ap = reinterpret_cast<const __nv_bfloat16*>(st + lay.a_off + r * kXRowBytes + u * 16);
        const __nv_bfloat16* bp = reinterpret_cast<const __nv_bfloat16*>(st + lay.b_off + r * kXRowBytes + u * 16);
        const int jl = lo_mul * j, jh = jl + hi_add;
        const float lo = activation_f32<kAct>(__bfloat162float(ap[jl]), __bfloat162float(bp[jl]));
        const float hi = activation_f32<kAct>(__bfloat162float(ap[jh]), __bfloat162float(bp[jh]));
        *reinterpret_cast<__nv_bfloat162*>(st + lay.x_off + r * kXRowBytes + bf16_unit_slot(r, u) * 16 + 4 * j) =
            __floats2bfloat162_rn(lo, hi);
      }
    } else {
      for (int i = cv_first; i < M * kXUnits; i += nthreads) {
        const int r = i >> 4, u = i & (kXUnits - 1);
        uint4* unit = reinterpret_cast<uint4*>(st + lay.x_off + r * kXRowBytes + bf16_unit_slot(r, u) * 16);
        const uint4 a = *unit;
        *unit = make_uint4(prmt(a.x, a.z, 0x5410), prmt(a.x, a.z, 0x7632),
                           prmt(a.y, a.w, 0x5410), prmt(a.y, a.w, 0x7632));
      }
    }
  };

  SegmentSums<TPW * MT> sums;
  const bool warp_has_rows = row0 + warp * TPW * kTileN < n_rows;

  // The lane's fragment offsets inside a stage, fixed for the CTA: weight row g (row g + 8 is
  // 8 rows further), its two scale bytes, and activation row g's unit of word w (the swizzle
  // depends on the row's parity only, so tile mt adds 8·mt rows to the same offsets).
  const int lane_w = lay.w_off + (warp * TPW * kTileN + g) * kRowBytes + t * 16;
  const int lane_s = lay.s_off + (warp * TPW * kTileN + g) * kScaleBytes + 2 * t;
  int lane_x[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) lane_x[w] = lay.x_off + g * kXRowBytes + bf16_unit_slot(g, 4 * t + w) * 16;

  // One chunk on the tensor cores. Activation rows ≥ M are never written (stale shared
  // memory): they only feed output columns ≥ M, which are never stored (mma columns are
  // independent dot products).
  auto compute_stage = [&](int st_off) {
    const uint8_t* st = smem + st_off;
    auto xfrag = [&](int w, int mt) {
      return *reinterpret_cast<const uint4*>(st + lane_x[w] + mt * 8 * kXRowBytes);
    };
    mma_chunk<MT, kTiled, TPW>(sums.acc, st + lane_w, st + lane_s, xfrag);
  };

  // ---- prologue: the first kStages − 1 chunks' weights stream in before the previous kernel
  // is waited for (programmatic dependent launch; a no-op wait without it), then activations.
  // Group 0 holds all prologue weights and chunk 0's activations, group p chunk p's.
#pragma unroll
  for (int p = 0; p < kStages - 1; ++p) {
    if (c_begin + p < c_end) issue_weights(p * lay.bytes, c_begin + p);
  }
  pdl_wait();  // x / x2 and out are now safe
#pragma unroll
  for (int p = 0; p < kStages - 1; ++p) {
    if (c_begin + p < c_end) issue_acts(p * lay.bytes, c_begin + p);
    cp_async_commit();
  }
  if (c_begin < c_end) {
    cp_async_wait<kStages - 2>();   // chunk c_begin's copies (this thread's) landed
    __syncthreads();                // … and everyone's
    if (kRaw || !kTiled) convert_stage(0);
  }
  int cur = 0;                                   // stage offset of chunk c
  int fill = (kStages - 1) * lay.bytes;          // stage offset of chunk c − 1 (refilled at c)
  int seg_left = plan.seg_chunks;                // chunks left in the current segment
  for (int c = c_begin; c < c_end; ++c) {
    const int next = cur + lay.bytes == ring_bytes ? 0 : cur + lay.bytes;
    // chunk c + 1 landed too (converted below, after the barrier: by any thread)
    cp_async_wait<kStages - 3>();
    __syncthreads();  // chunk c visible to all; every warp is done with chunk c − 1's stage
    if (c + kStages - 1 < c_end) {                 // into chunk c − 1's stage
      issue_weights(fill, c + kStages - 1);
      issue_acts(fill, c + kStages - 1);
    }
    cp_async_commit();
    if ((kRaw || !kTiled) && c + 1 < c_end) convert_stage(next);
    if (warp_has_rows) compute_stage(cur);
    if (--seg_left == 0 || c + 1 == c_end) {
      sums.finish_segment(splits, plan);
      seg_left = plan.seg_chunks;
    }
    fill = cur;
    cur = next;
  }
  // The next kernel may start launching (it waits for this whole grid before reading y).
  pdl_launch_dependents();

  store_rows<MT, TPW>(args, wt, plan, sums, row0, smem);
}

// ---- the one-row kernel (v3: M = 1, vector path) -------------------------------------------
// Decode at batch 1 (and the LM head of a 1-row draft) is the GEMV that must reach the copy
// bandwidth; v2 spent ≈ 293 warp-instructions per 128-k chunk and warp there (≈ 150 of them
// not dequant or mma: the CTA-wide barrier, activation copies and their per-chunk permutation,
// shared copy plans) at ≈ 69% issue utilization. Here every warp runs its own pipeline
// (≈ 191 per chunk at v3.5); measured on the 27B LM head, v2.4 250.9 µs → this kernel 231.8 →
// with the chunk-major layout 215 → with the register-path activations 203–208 → v3.4's dequant
// 192.6 → v3.5's loop 178.2 (0.97 of copy bandwidth; bench/NOTES.md v3–v3.5):
//   - the CTA's whole activation range (K_cta bf16; silu / gated: from x and x2) is loaded once
//     through registers, permuted (or converted) into B-fragment order, behind one barrier;
//   - each warp streams its own 16-row tile through a private kStagesM1-deep ring (lane: two
//     16-byte weight pieces, lanes < 16 one 8-byte scale piece per chunk) and waits on its own
//     cp.async groups with __syncwarp(): no CTA barrier in the main loop, no warp waits for
//     another;
//   - the B fragment of word w is one broadcast 16-byte load of x (unit 4t + w lives in slot
//     4w + t, so the 4 addresses of a load are 4 consecutive slots: conflict-free).
// Same segments, same mma sequence per chunk, same sums and store (mma_chunk, SegmentSums,
// store_rows) as w4a16_gemv_kernel: a row is bitwise the same as in an M > 1 call.
// Shared memory: K_cta·2 + W · kStagesM1 · 1152 B (K = 5120 plain: 10 + 14 KB → 8 four-warp
// CTAs per SM, the 64-register limit too). kStagesM1 = 3 (v3.11; 5 before): two chunks in
// flight per warp, and the deeper rings were slower on every shape of the probe (M = 1 µs at
// depth 5 / 4 / 3 with the v3.11 prologue: 27B q+gate+k+v 19.7 / 16.5 / 15.9, 35B q+gate+k+v
// 8.1 / 7.0 / 6.4, 27B LM head 184 / 183 / 180): fewer CTAs fit an SM, and each CTA's
// activations wait behind more weight requests.
constexpr int kStagesM1 = 3;
constexpr int kWarpStageBytes = kTileN * (kRowBytes + kScaleBytes);   // 1152

struct M1Layout {
  int x_off;      // [chunks][256 B]  activations, unit u of a chunk in slot m1_unit_slot(u)
  int ring_off;   // [W][kStagesM1][16 rows × 64 B packed | 16 rows × 8 B scales]
  int bytes;
};
__host__ __device__ inline M1Layout m1_layout(int warps, int chunks) {
  M1Layout l;
  l.x_off = 0;
  l.ring_off = chunks * kXRowBytes;
  l.bytes = l.ring_off + warps * kStagesM1 * kWarpStageBytes;
  return l;
}
__device__ __forceinline__ int m1_unit_slot(int u) { return 4 * (u & 3) + (u >> 2); }

constexpr int kMaxWarpsM1 = 8;   // warp-split CTAs: 8 warps over one tile's 8 segments
constexpr int kM1MinBlocks = 4;   // plain instances: ≤ 64 registers, so 4 eight-warp CTAs fit an SM

// The K range (in chunks) whose activations one one-row CTA stages.
__host__ __device__ inline int m1_cta_chunks(const SplitPlan& plan, int num_chunks) {
  return plan.warp_splits > 1 ? num_chunks : plan.seg_chunks * plan.segs_per_cta;
}

// kIndexed: an expert-indexed launch (args.slots, W4A16GemvSlots; moe_experts at T·k ≤ 36), whose
// stacks' words are in the GEMV bit order iff kGemvWords (W4A16GemvWeight::gemv_words): a
// compile-time choice, where a runtime one cost the indexed instances spills (session 21, ptxas).
template <GemvAct kAct, bool kIndexed, bool kGemvWords = false>
__global__ void __launch_bounds__((kAct == GemvAct::kPlain ? kMaxWarpsM1 : kMaxWarps) * 32,
                                  kAct == GemvAct::kPlain ? kM1MinBlocks : 0)   // 0: no minimum
w4a16_gemv_m1_kernel(const __grid_constant__ W4A16GemvArgs args,
                     int groups0,            // row groups of weight 0 (the rest belong to weight 1)
                     SplitPlan plan) {       // segments of K over the CTAs (blockIdx.x)
  constexpr bool kRaw = kAct != GemvAct::kPlain;
  extern __shared__ __align__(16) uint8_t smem[];
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const int warps = nthreads / 32, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int splits = gridDim.x, split = blockIdx.x;
  // Expert-indexed launch (W4A16GemvSlots): blockIdx.y = slot · (row groups per slot) + group.
  const int per_slot = kIndexed ? gridDim.y / args.slots.count : gridDim.y;
  const int slot = kIndexed ? blockIdx.y / per_slot : 0;
  const int by = blockIdx.y - slot * per_slot;
  const int wi = by < groups0 ? 0 : 1;
  const int group = by - (wi ? groups0 : 0);
  const __nv_bfloat16* x_row = static_cast<const __nv_bfloat16*>(args.x);
  const __nv_bfloat16* x2_row = static_cast<const __nv_bfloat16*>(args.x2);
  W4A16GemvWeight slot_w;                    // kIndexed: slot `slot`'s expert of args.w[wi]
  const W4A16GemvWeight* wp = &args.w[wi];
  if constexpr (kIndexed) {   // the ids come from an earlier kernel: wait first unless ids_ready
    if (!args.slots.ids_ready) pdl_wait();
    const int e = args.slots.ids[slot];
    if (e < 0 || e >= args.slots.num_experts) {   // CTA-uniform: the slot is skipped
      pdl_wait();   // (every CTA waits before it exits)
      return;
    }
    slot_w = args.w[wi];
    slot_w.packed += e * args.slots.packed_stride[wi];
    slot_w.block_scale += e * args.slots.scale_stride[wi];
    slot_w.global_scale += e;
    slot_w.out = static_cast<uint8_t*>(slot_w.out) +
                 slot * args.slots.out_stride * (args.out_dtype == DType::kF32 ? 4 : 2);
    wp = &slot_w;
    const int64_t x_off = static_cast<int64_t>(slot / args.slots.x_div) * args.slots.x_stride;
    x_row += x_off;
    if constexpr (kRaw) x2_row += x_off;
  }
  const W4A16GemvWeight& wt = *wp;
  // words pair (code 2i, 2i + 1): activations unpermuted (gemv_words: indexed launches only)
  const bool natural = kIndexed ? kGemvWords : wt.tiled;
  const int K = args.k, n_rows = wt.n;
  // Warp split (plan.warp_splits = S > 1): warp w computes tile w / S over segments
  // [(w % S)·spc, (w % S + 1)·spc) (spc = plan.segs_per_cta); the CTA stages all of K.
  const int wsplits = kRaw ? 1 : plan.warp_splits, tiles_per_cta = warps / wsplits;   // silu / gated: never
  const int row0 = group * tiles_per_cta * kTileN;
  const int num_chunks = K / kChunkK;
  const int chunks_per_cta = wsplits > 1 ? num_chunks : plan.seg_chunks * plan.segs_per_cta;   // m1_cta_chunks
  const int c_begin = wsplits > 1 ? 0 : min(split * chunks_per_cta, num_chunks);   // the CTA's range
  const int cta_chunks = min(c_begin + chunks_per_cta, num_chunks) - c_begin;
  const int warp_span = plan.seg_chunks * plan.segs_per_cta;
  const int wc_begin = wsplits > 1 ? min((warp % wsplits) * warp_span, num_chunks) : c_begin;   // the warp's
  const int chunks = wsplits > 1 ? min(wc_begin + warp_span, num_chunks) - wc_begin : cta_chunks;
  const M1Layout lay = m1_layout(warps, chunks_per_cta);
  const uint32_t smem_base = smem_u32(smem);
  const int tile_row0 = row0 + (warp / wsplits) * kTileN;
  const bool warp_has_rows = tile_row0 < n_rows;

  // The warp's copy plan: pieces p = lane, lane + 32 of its tile's 16 rows × 4 (row p / 4,
  // piece p % 4: the stage's [16][64 B] is p · 16 B), lanes < 16 row lane's 8 scale bytes.
  // Rows ≥ n read row n − 1 instead (real memory in both layouts; their mma rows are never
  // stored), so no copy needs a zero-fill predicate; pointers advance by a constant per chunk.
  const uint8_t* w_src[2];
  int64_t w_step = 0;                   // 64-bit: no sign extension per pointer advance
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int p = lane + 32 * j, n = min(tile_row0 + (p >> 2), n_rows - 1);
    int64_t off = 0;
    int step = 0;
    row_plan(wt, K, wc_begin, n, kRowBytes, off, step);
    w_src[j] = wt.packed + off + (p & 3) * 16;
    w_step = step;
  }
  const bool s_issuer = lane < kTileN;
  const uint8_t* s_src;
  int64_t s_step;
  {
    int64_t off = 0;
    int step = 0;
    row_plan(wt, K, wc_begin, min(tile_row0 + lane % kTileN, n_rows - 1), kScaleBytes, off, step);
    s_src = wt.block_scale + off;
    s_step = step;
  }
  // Stages by byte offset in this warp's ring (shared-window addresses).
  const uint32_t ring = smem_base + lay.ring_off + warp * kStagesM1 * kWarpStageBytes;
  const uint32_t ring_end = ring + kStagesM1 * kWarpStageBytes;
  auto issue = [&](uint32_t st) {
    cp_async16(st + lane * 16, w_src[0]);
    cp_async16(st + (lane + 32) * 16, w_src[1]);
    w_src[0] += w_step;
    w_src[1] += w_step;
    if (s_issuer) cp_async8(st + kTileN * kRowBytes + lane * kScaleBytes, s_src);
    s_src += s_step;
  };

  // ---- prologue (v3.11, v3.20). Before the previous kernel is waited for (weights are
  // constants): an L2 prefetch of the warp's first plan.prefetch_chunks (≤ kStagesM1 − 1)
  // chunks (kM1PrefetchMinCtasPerSm). After it: the activations' loads, and only then the ring's
  // copies (L2 hits by now, or merged with the prefetch). Copies issued before the wait queued
  // the activations' L2 hits behind every CTA's weight requests: the probe's activation phase
  // grew with the ring depth (35B q+gate+k+v: 2.9 µs at 5 stages).
  if (warp_has_rows) {
#pragma unroll
    for (int p = 0; p < kStagesM1 - 1; ++p) {
      if (p < plan.prefetch_chunks && p < chunks) {
        prefetch_l2(w_src[0] + p * w_step);
        prefetch_l2(w_src[1] + p * w_step);
        if (s_issuer) prefetch_l2(s_src + p * s_step);
      }
    }
  }
  auto issue_prologue = [&] {
    if (warp_has_rows) {
#pragma unroll
      for (int p = 0; p < kStagesM1 - 1; ++p) {
        if (p < chunks) issue(ring + p * kWarpStageBytes);
        cp_async_commit();
      }
    }
  };
  pdl_wait();  // x / x2 and out are now safe
  // Activations through registers (L2-cached loads, 4 units per thread in flight), permuted or
  // converted, stored to their slots: no cp.async group to wait for, so the weight chunks
  // keep streaming and the main loop starts as soon as its first chunk lands. The ring's
  // copies go right behind the thread's first batch of loads (threads without an activation
  // unit issue them after the loop).
  const uint4* x = reinterpret_cast<const uint4*>(x_row + static_cast<int64_t>(c_begin) * kChunkK);
  const uint4* x2 = kRaw ? reinterpret_cast<const uint4*>(x2_row + static_cast<int64_t>(c_begin) * kChunkK)
                         : nullptr;
  constexpr int kUnitBatch = 4;
  const int units = cta_chunks * kXUnits;                       // unit i: chunk i / 16, unit i % 16
  for (int i0 = tid; i0 < units; i0 += kUnitBatch * nthreads) {
    uint4 a[kUnitBatch], b[kUnitBatch];
#pragma unroll
    for (int j = 0; j < kUnitBatch; ++j) {
      const int i = i0 + j * nthreads;
      if (i < units) {
        a[j] = __ldcg(x + i);
        if constexpr (kRaw) b[j] = __ldcg(x2 + i);
      }
    }
    if (i0 == tid) issue_prologue();
#pragma unroll
    for (int j = 0; j < kUnitBatch; ++j) {
      const int i = i0 + j * nthreads;
      if (i >= units) break;
      uint4* unit = reinterpret_cast<uint4*>(smem + lay.x_off + (i >> 4) * kXRowBytes +
                                             m1_unit_slot(i & (kXUnits - 1)) * 16);
      if constexpr (kRaw) {     // word q = bf16(act(x_q, x2_q), act(x_{q+4}, x2_{q+4})), as convert_stage
        const __nv_bfloat16* ap = reinterpret_cast<const __nv_bfloat16*>(&a[j]);   // (tiled: q → 2q, 2q + 1)
        const __nv_bfloat16* bp = reinterpret_cast<const __nv_bfloat16*>(&b[j]);
        uint32_t wd[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int ql = natural ? 2 * q : q, qh = natural ? 2 * q + 1 : q + 4;
          const float lo = activation_f32<kAct>(__bfloat162float(ap[ql]), __bfloat162float(bp[ql]));
          const float hi = activation_f32<kAct>(__bfloat162float(ap[qh]), __bfloat162float(bp[qh]));
          wd[q] = bf162_bits(__floats2bfloat162_rn(lo, hi));
        }
        *unit = make_uint4(wd[0], wd[1], wd[2], wd[3]);
      } else if (natural) {     // tiled weights: the activations as they are
        *unit = a[j];
      } else {                  // (x0..x7) → (x0,x4 | x1,x5 | x2,x6 | x3,x7)
        *unit = make_uint4(prmt(a[j].x, a[j].z, 0x5410), prmt(a[j].x, a[j].z, 0x7632),
                           prmt(a[j].y, a[j].w, 0x5410), prmt(a[j].y, a[j].w, 0x7632));
      }
    }
  }
  if (tid >= units) issue_prologue();
  __syncthreads();

  // ---- main loop: chunk cc of this warp's tile; stage cc mod kStagesM1 ----
  // Segment by segment (the CTA's range starts on a segment boundary), so the chunk loop only
  // counts; the layout's dequant is chosen once, outside it.
  SegmentSums<1> sums;
  auto run = [&](auto tiled_bits) {
    constexpr bool kTiledBits = decltype(tiled_bits)::value;
    const uint8_t* xs = smem + lay.x_off + (wc_begin - c_begin) * kXRowBytes + t * 16;   // + chunk · 256 + word · 64
    const uint32_t lane_w = g * kRowBytes + t * 16;            // inside a stage
    const uint32_t lane_s = kTileN * kRowBytes + g * kScaleBytes + 2 * t;
    const uint8_t* ring_ptr = smem + (ring - smem_base);
    uint32_t cur = ring, fill = ring + (kStagesM1 - 1) * kWarpStageBytes;
    int cc = 0;
    for (int seg_end = min(plan.seg_chunks, chunks);; seg_end = min(seg_end + plan.seg_chunks, chunks)) {
      for (; cc < seg_end; ++cc) {
        cp_async_wait<kStagesM1 - 2>();   // chunk cc (this lane's pieces) landed
        __syncwarp();                     // … every lane's; the warp is done with chunk cc − 1's stage
        if (cc + kStagesM1 - 1 < chunks) issue(fill);
        cp_async_commit();
        const uint8_t* st = ring_ptr + (cur - ring);
        auto xfrag = [&](int w, int) { return *reinterpret_cast<const uint4*>(xs + cc * kXRowBytes + w * 64); };
        mma_chunk<1, kTiledBits>(sums.acc, st + lane_w, st + lane_s, xfrag);
        fill = cur;
        cur = cur + kWarpStageBytes == ring_end ? ring : cur + kWarpStageBytes;
      }
      sums.finish_segment(wsplits > 1 ? wsplits : splits, plan);
      if (cc == chunks) break;
    }
  };
  if (warp_has_rows && chunks > 0) {
    if (kIndexed ? kGemvWords : wt.tiled) run(std::true_type{});
    else run(std::false_type{});
  }
  pdl_launch_dependents();
  if (wsplits == 1) {
    store_rows<1>(args, wt, plan, sums, row0, smem);
    return;
  }
  if constexpr (!kRaw) {   // silu / gated never split over warps (launch_w4a16_gemv): no epilogue
    // Warp split: each warp's segment partials of output column 0 (lanes t = 0 hold rows g, g + 8)
    // → shared [warp][2][16] f32, then row r of the CTA = 0 + the partials of its tile's warps in
    // segment order (store_rows' cluster order: the same bits as every other split).
    const float factor = __ldg(wt.global_scale) * kOutBias;
    const bool two = plan.segs_per_cta == 2;
    cp_async_wait<0>();
    __syncthreads();                       // every warp is done with its ring
    float* part = reinterpret_cast<float*>(smem);
    if (t == 0) {
      float* pw = part + warp * 2 * kTileN;
      pw[g] = two ? sums.done[0][0] : sums.acc[0][0];
      pw[g + 8] = two ? sums.done[0][2] : sums.acc[0][2];
      pw[kTileN + g] = two ? sums.acc[0][0] : 0.0f;
      pw[kTileN + g + 8] = two ? sums.acc[0][2] : 0.0f;
    }
    __syncthreads();
    for (int r = tid; r < tiles_per_cta * kTileN; r += nthreads) {
      const int n = row0 + r;
      if (n >= n_rows) continue;
      const float* pt = part + (r / kTileN) * wsplits * 2 * kTileN + r % kTileN;
      float acc = 0.0f;
      for (int q = 0; q < wsplits; ++q) {
        acc += pt[q * 2 * kTileN];
        if (two) acc += pt[q * 2 * kTileN + kTileN];
      }
      store_out(wt, args.out_dtype, 0, n, acc * factor);
    }
  }
}

// ---- the x-resident kernel (v4: M = 2..32, plain activations, tiled weights) ----------------
// Decode of a small batch and the MTP head's batched drafts: the staged kernel above re-copies
// the activation chunk of every 128-k step into every CTA (the 35B-A3B LM head at M = 32: 1940
// CTAs × 128 KB of x through L2 → shared, ≈ 250 MB, as much as the weights), waits at a CTA
// barrier per chunk, and for short N spreads K over 8-CTA clusters (35B q+gate at M = 32: 512
// CTAs of 2 chunks each and a DSMEM reduction, 19 µs for 9.4 MB). Here the one-row kernel's
// structure carries all M rows:
//   - one CTA per SM (persistent over row groups: CTA c takes groups c, c + CTAs, …) stages x
//     [M, K] bf16 whole, once (≤ 8·MT·K·2 B: K ≤ 2560 at M = 32, 5120 at 16, 10240 at 8), with
//     cp.async into the staged kernel's swizzled B-fragment rows ([chunk][8·MT rows][256 B],
//     bf16_unit_slot), rows ≥ M never written (they feed only unstored mma columns);
//   - warp w computes 16-row tile slot w / S of the current group over K span w % S (S =
//     plan.warp_splits warps per tile, each over segs / S consecutive segments of
//     w4a16_gemv_k_splits(K)), streaming its weight chunks through a private kStagesM1-deep
//     cp.async ring synced by __syncwarp() only; the ring keeps streaming across groups (the
//     next group's first chunks are in flight during this group's epilogue);
//   - S = 1: the warp walks every segment keeping the running sum (done += segment partial) and
//     stores from its registers; S > 1: each warp's segment partials → shared memory, a named
//     barrier per tile slot (S·32 threads), and 0 + p_0 + p_1 + … in segment order, summed by
//     the slot's warps element by element — the cluster's and the one-row kernel's order, so a
//     row is bitwise the same as in every other path (and for every M: mma columns are
//     independent).
//   - v4.1, x too large for one SM (M ≥ 9 at K ≥ 5120): a cluster of C = 2 or 4 CTAs per row
//     group, rank r staging and computing only its K share (segs / C segments); the partials of
//     all ranks are summed in segment order (rank-major) through distributed shared memory, with
//     two cluster barriers per group — so only where a CTA has ≤ 2 groups (kXresMaxClusterRounds).
// Per chunk and warp: 8 words dequantized (as M = 1) and 8 · MT mma (MT n8 tiles of x rows);
// the B fragment of word w, n8 tile mt is one conflict-free 16-byte shared load.
// Floor: as the GEMV (weight + scale bytes / copy bandwidth) plus x's L2 → shared trip
// (8·MT·K·2 B per SM, ≈ 0.5–1 µs at M = 32, K = 2048) and, at M = 32, the mma issue:
// 2·M·N·K / ≈ 610 TFLOP/s (mma.sync bf16 on the H200: bench/wgmma_probe) — 35B LM head 53 µs,
// under its 68 µs of weight stream.
constexpr int kXresMaxWarps = 16;       // MT ≥ 2: 512 threads, ≤ 128 registers
constexpr int kXresMaxWarpsMt1 = 24;    // MT = 1: 768 threads, ≤ 85 registers (79, no spill)
constexpr int kXresWideWarpsMt1 = 28;   // MT = 1, the wide instance: ≤ 73 registers (12 B of spill,
                                        // ≈ 2% on the 27B o at M = 8: only for plans of > 24 warps)
constexpr int kXresMaxSlots = 15;       // named barriers 1..15 (0 is __syncthreads)
constexpr int kXresMaxCluster = 4;      // K shares of x over a cluster's CTAs (x too large for one)
constexpr int kXresMaxClusterRounds = 2;   // two cluster barriers per round: session 23 (M = 32, 4 ranks)
                                           // 27B q+gate+k+v 2 rounds 42.2 → 32.4 µs, but gate_up 5 rounds
                                           // 68.1 → 77.4 and the 27B LM head 30 rounds 367 → 498
constexpr int kXresMinWarps = 12;       // fewer leave an SM latency-bound (plan_xres; session 23:
                                        // 27B o at M = 16 with 8 warps × 3 rounds, 15.8 µs vs 15.3)

struct XresLayout {
  int x_off;      // [chunks][8·MT rows][256 B] activations, swizzled units (bf16_unit_slot)
  int ring_off;   // [W][kStagesM1][16 rows × 64 B packed | 16 rows × 8 B scales]
  int part_off;   // S · C > 1: [W][spw · 4·MT][32 lanes] f32 segment partials
  int bytes;
};
// chunks: the K chunks one CTA stages; producers: partial sums per tile (S · C; 1 = running sum).
__host__ __device__ inline XresLayout xres_layout(int mt, int chunks, int warps, int producers, int segs_per_warp) {
  XresLayout l;
  l.x_off = 0;
  l.ring_off = chunks * mt * 8 * kXRowBytes;
  l.part_off = l.ring_off + warps * kStagesM1 * kWarpStageBytes;
  l.bytes = l.part_off + (producers > 1 ? warps * segs_per_warp * 4 * mt * 32 * 4 : 0);
  return l;
}

__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// grid (CTAs ≤ SMs), block W = S · P warps (P = tile slots per group, a group = 16·P rows of one
// weight; dual: weight 0's groups, then weight 1's). plan.segs_per_cta = segments per warp.
// kMaxWarps: the launch bound (xres_max_warps).
__host__ __device__ constexpr int xres_max_warps(int mt, bool wide) {
  return mt > 1 ? kXresMaxWarps : wide ? kXresWideWarpsMt1 : kXresMaxWarpsMt1;
}
// kCluster (MT ≥ 2 only): launched in clusters of C CTAs, each staging its K share of x (a
// template flag, so the cluster-free instances keep their registers: 126 vs 128 + spill at MT 4).
template <int MT, bool kWide = false, bool kCluster = false>
__global__ void __launch_bounds__(xres_max_warps(MT, kWide) * 32, 1)
w4a16_gemv_xres_kernel(const __grid_constant__ W4A16GemvArgs args,
                       int groups0,            // row groups of weight 0
                       int groups,             // row groups of both weights
                       SplitPlan plan) {
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int kRows = 8 * MT;           // staged activation rows per chunk
  constexpr int kElems = 4 * MT;          // accumulator elements per lane
  const int tid = threadIdx.x, nthreads = blockDim.x, warps = nthreads / 32, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int S = plan.warp_splits, spw = plan.segs_per_cta;
  const int P = warps / S, slot = warp / S, q = warp % S;
  const int K = args.k, M = args.m, num_chunks = K / kChunkK;
  // Cluster of C CTAs (C = 1 without one): rank r holds K chunks [r·cta_span, (r + 1)·cta_span).
  cg::cluster_group cluster = cg::this_cluster();
  const int C = kCluster ? static_cast<int>(cluster.num_blocks()) : 1;
  const int rank = kCluster ? static_cast<int>(cluster.block_rank()) : 0;
  const int span = plan.seg_chunks * spw, cta_span = S * span;
  const int cta_begin = min(rank * cta_span, num_chunks), cta_chunks = min(cta_begin + cta_span, num_chunks) - cta_begin;
  const int wc_begin = min(cta_begin + q * span, num_chunks);
  const int chunks = min(wc_begin + span, num_chunks) - wc_begin;   // this warp's, per group
  const int cid = blockIdx.x / C, clusters = gridDim.x / C;          // groups cid, cid + clusters, …
  const XresLayout lay = xres_layout(MT, C > 1 ? cta_span : num_chunks, warps, S * C, spw);
  const uint32_t smem_base = smem_u32(smem);

  // Group gi → its weight and this warp's tile row.
  auto locate = [&](int gi, int& wi, int& row) {
    wi = gi < groups0 ? 0 : 1;
    row = (gi - (wi ? groups0 : 0)) * P * kTileN + slot * kTileN;
  };

  // ---- the warp's copy stream: chunks wc_begin .. + chunks of group blockIdx.x, then of group
  // + gridDim.x, … (pieces as the one-row kernel's; rows ≥ n read row n − 1: real memory).
  // A chunk step of the scales is 1/8 of the packed one in both layouts (8 vs 64 B per row).
  const uint8_t* w_src[2];
  const uint8_t* s_src;
  int step = 0;                                               // packed bytes per chunk
  int i_group = chunks > 0 ? cid : groups, i_cc = 0;          // the next chunk to issue
  auto plan_group = [&](int gi) {
    int wi, row;
    locate(gi, wi, row);
    const W4A16GemvWeight& wt = args.w[wi];
    int64_t off = 0;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int p = lane + 32 * j;
      row_plan(wt, K, wc_begin, min(row + (p >> 2), wt.n - 1), kRowBytes, off, step);
      w_src[j] = wt.packed + off + (p & 3) * 16;
    }
    int s_step = 0;
    row_plan(wt, K, wc_begin, min(row + lane % kTileN, wt.n - 1), kScaleBytes, off, s_step);
    s_src = wt.block_scale + off;
  };
  if (i_group < groups) plan_group(i_group);
  const bool s_issuer = lane < kTileN;
  auto issue_next = [&](uint32_t st) {
    if (i_group >= groups) return;
    cp_async16(st + lane * 16, w_src[0]);
    cp_async16(st + (lane + 32) * 16, w_src[1]);
    if (s_issuer) cp_async8(st + kTileN * kRowBytes + lane * kScaleBytes, s_src);
    w_src[0] += step;
    w_src[1] += step;
    s_src += step >> 3;
    if (++i_cc == chunks) {
      i_cc = 0;
      i_group += clusters;
      if (i_group < groups) plan_group(i_group);
    }
  };
  const uint32_t ring = smem_base + lay.ring_off + warp * kStagesM1 * kWarpStageBytes;
  const uint32_t ring_end = ring + kStagesM1 * kWarpStageBytes;

  // ---- prologue: L2 prefetch of the warp's first chunks before the previous kernel is waited
  // for (weights are constants); then x (cp.async, group 0) and the ring's first chunks.
  if (i_group < groups) {
#pragma unroll
    for (int p = 0; p < kStagesM1 - 1; ++p) {
      if (p < plan.prefetch_chunks && p < chunks) {
        prefetch_l2(w_src[0] + p * step);
        prefetch_l2(w_src[1] + p * step);
        if (s_issuer) prefetch_l2(s_src + p * (step >> 3));
      }
    }
  }
  pdl_wait();  // x and out are now safe
  {
    const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(args.x) + cta_begin * kChunkK;   // [M, K]
    const int row_units = cta_chunks * kXUnits;                            // 16-byte units per row
    for (int i = tid; i < M * row_units; i += nthreads) {
      const int r = i / row_units, u = i - r * row_units, c = u >> 4, uu = u & (kXUnits - 1);
      cp_async16(smem_base + lay.x_off + (c * kRows + r) * kXRowBytes + bf16_unit_slot(r, uu) * 16,
                 x + static_cast<int64_t>(r) * K + 8 * u);
    }
    cp_async_commit();
  }
#pragma unroll
  for (int p = 0; p < kStagesM1 - 1; ++p) {
    issue_next(ring + p * kWarpStageBytes);
    cp_async_commit();
  }
  cp_async_wait<kStagesM1 - 1>();   // this thread's x copies landed
  __syncthreads();                  // … and everyone's

  // The lane's fragment offsets: weight row g (+ 8 rows: mma_chunk), its scale pair, and x row
  // g's unit 4t + w (n8 tile mt: + 8·mt rows, the same swizzle parity).
  const uint32_t lane_w = g * kRowBytes + t * 16;
  const uint32_t lane_s = kTileN * kRowBytes + g * kScaleBytes + 2 * t;
  int lane_x[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) lane_x[w] = g * kXRowBytes + bf16_unit_slot(g, 4 * t + w) * 16;
  const uint8_t* xs = smem + lay.x_off + (wc_begin - cta_begin) * kRows * kXRowBytes;
  const uint8_t* ring_ptr = smem + (ring - smem_base);
  float* part = reinterpret_cast<float*>(smem + lay.part_off);
  uint32_t cur = ring, fill = ring + (kStagesM1 - 1) * kWarpStageBytes;

  for (int gi = cid; gi < groups; gi += clusters) {
    SegmentSums<MT> sums;
    int cc = 0;
    for (int seg_end = min(plan.seg_chunks, chunks);; seg_end = min(seg_end + plan.seg_chunks, chunks)) {
      for (; cc < seg_end; ++cc) {
        cp_async_wait<kStagesM1 - 2>();   // chunk cc (this lane's pieces) landed
        __syncwarp();                     // … every lane's; the warp is done with chunk cc − 1's stage
        issue_next(fill);
        cp_async_commit();
        const uint8_t* st = ring_ptr + (cur - ring);
        const uint8_t* xc = xs + cc * kRows * kXRowBytes;
        auto xfrag = [&](int w, int mt) {
          return *reinterpret_cast<const uint4*>(xc + mt * 8 * kXRowBytes + lane_x[w]);
        };
        mma_chunk<MT, true>(sums.acc, st + lane_w, st + lane_s, xfrag);
        fill = cur;
        cur = cur + kWarpStageBytes == ring_end ? ring : cur + kWarpStageBytes;
      }
      sums.finish_segment(S * C, plan);   // S · C = 1: the running sum
      if (cc >= chunks) break;
    }
    if (gi + clusters >= groups) pdl_launch_dependents();

    int wi, row;
    locate(gi, wi, row);
    const W4A16GemvWeight& wt = args.w[wi];
    const float factor = __ldg(wt.global_scale) * kOutBias;
    if (S == 1 && C == 1) {   // the running sum over every segment (empty trailing ones add +0, as store_rows)
      const bool empty_tail = sums.finished < plan.num_segs;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int m = mt * 8 + 2 * t + (e & 1), n = row + g + 8 * (e >> 1);
          const float d = sums.done[mt][e];
          if (m < M && n < wt.n) store_out(wt, args.out_dtype, m, n, (empty_tail ? d + 0.0f : d) * factor);
        }
      }
      continue;
    }
    // S > 1 (or C > 1): partials [warp][spw · kElems][lane], then element j of the slot's lanes
    // summed over the C ranks' S warps in segment order (rank-major) by rank and warp j % (C·S),
    // reading the other ranks' partials through distributed shared memory.
    float* pw = part + warp * spw * kElems * 32;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = mt * 4 + e;
        if (spw == 2) {
          pw[j * 32 + lane] = sums.done[mt][e];
          pw[(kElems + j) * 32 + lane] = sums.acc[mt][e];
        } else {
          pw[j * 32 + lane] = sums.acc[mt][e];
        }
      }
    }
    if (C == 1) named_barrier(1 + slot, S * 32);
    else cluster.sync();
    const int slot_off = slot * S * spw * kElems * 32;
    for (int j = rank * S + q; j < kElems; j += C * S) {
      const int mt = j >> 2, e = j & 3;
      const int m = mt * 8 + 2 * t + (e & 1), n = row + g + 8 * (e >> 1);
      float a = 0.0f;
      for (int rr = 0; rr < C; ++rr) {
        const float* ps = (C == 1 ? part : cluster.map_shared_rank(part, rr)) + slot_off;
        for (int qq = 0; qq < S; ++qq) {
          const float* pq = ps + qq * spw * kElems * 32;
          a += pq[j * 32 + lane];
          if (spw == 2) a += pq[(kElems + j) * 32 + lane];
        }
      }
      if (m < M && n < wt.n) store_out(wt, args.out_dtype, m, n, a * factor);
    }
    // The partials are read before the next group's (and, in a cluster, before any rank exits).
    if (C == 1) named_barrier(1 + slot, S * 32);
    else cluster.sync();
  }
  cp_async_wait<0>();
}

// Split-K partials in shared memory (store_rows) for a launch of `splits` CTAs per row group.
int partial_bytes(dim3 grid, const SplitPlan& plan, int tiles, int mt) {
  return (grid.x > 1 ? plan.segs_per_cta : 0) * tiles * kTileN * mt * 8 * static_cast<int>(sizeof(float));
}

// The device's id, and `kernel`'s dynamic shared memory opted in above 48 KB once per device
// (`opted_in`: the first call is normally eager; later ones, e.g. under graph capture, make no
// attribute call).
template <typename Kernel>
cudaError_t prepare_launch(Kernel kernel, int (&opted_in)[kMaxDevices], int smem, int& dev) {
  ATLAS_RETURN_IF_ERROR(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) return cudaErrorInvalidDevice;
  if (smem > 48 * 1024 && smem > opted_in[dev]) {
    ATLAS_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    opted_in[dev] = smem;
  }
  return cudaSuccess;
}

// Launches go through common/pdl.cuh's launch_pdl(cfg, cluster, ...): clusters of `cluster` CTAs
// along x with programmatic dependent launch — the prologue's weight loads overlap the previous
// kernel's tail (the kernel waits for it before touching activations or outputs).

// One launch of a GEMV kernel (staged or one-row): the S splits of a row group form a cluster.
template <typename Kernel>
cudaError_t launch_kernel(Kernel kernel, int (&opted_in)[kMaxDevices], const W4A16GemvArgs& a, dim3 grid,
                          int warps, int groups0, SplitPlan plan, int smem, cudaStream_t stream) {
  int dev = 0;
  ATLAS_RETURN_IF_ERROR(prepare_launch(kernel, opted_in, smem, dev));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(warps * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  return launch_pdl(cfg, static_cast<int>(grid.x), kernel, a, groups0, plan);
}

template <int MT, bool kVec, bool kTiled, GemvAct kAct, int TPW, int kMinBlocks = 0>
cudaError_t launch_instance(const W4A16GemvArgs& a, dim3 grid, int warps, int groups0,
                            SplitPlan plan, cudaStream_t stream) {
  const int tiles_cta = warps * TPW;
  const StageLayout lay = stage_layout(tiles_cta, MT, kAct != GemvAct::kPlain);
  static int opted_in[kMaxDevices] = {};
  return launch_kernel(w4a16_gemv_kernel<MT, kVec, kTiled, kAct, TPW, kMinBlocks>, opted_in, a, grid, warps, groups0, plan,
                       std::max(kStages * lay.bytes, partial_bytes(grid, plan, tiles_cta, MT)), stream);
}

// The one-row kernel's shared memory (0: it does not apply — M > 1, the generic path, or a
// K range too long to hold; those take w4a16_gemv_kernel).
constexpr int kM1MaxSmem = 160 * 1024;
// The one-row kernel L2-prefetches each warp's first chunk before griddepcontrol.wait where its
// grid has more CTAs than SMs, its first kStagesM1 − 1 = 2 (v3.11's prologue) otherwise (v3.20).
// Session 21 probe (M = 1 µs, prefetching 2 → 1 → 0 chunks, two runs; 4 / 8 or a deeper ring
// were slower everywhere): grids of > 132 CTAs gain most with 1 — 27B o 8.9 → 8.3 (8.5 at 0),
// 35B q+gate+k+v 6.45 → 6.01 (6.24), down 20.1 → 19.7 (19.9); the probe favoured 0 for grids of
// ≤ 132 (35B o 4.5 → 4.10), but bench_gemv disagreed (v3.19 = 0 there: 35B o 4.13 → 4.29, shared
// expert 2.71 → 2.80, expert gate_up 2.77 → 2.87 µs), so those keep 2 — except expert-indexed
// launches (moe_experts T ≤ 16), which keep 0: session 22 call 1, moe_probe 0 → 2 chunks, T = 1
// 15.6 → 16.0 µs, T = 8 53.4 → 53.8, T = 16 91.5 → 92.0, while bench_gemv took the plain small
// shapes back to call 5 (35B o 4.29 → 4.15, shared expert 2.80 → 2.69, expert gate_up 2.87 →
// 2.77, expert down 2.59 → 2.53).
constexpr int kM1PrefetchMinCtasPerSm = 1;
// The tiled MT = 1, TPW = 2 instance (plain M = 2..8) takes 108 registers (4 CTAs per SM); bounded
// to 5 CTAs per SM it takes 92 without spilling. Session 21 probe (call 2, µs, M = 2 / 8): 35B
// q+gate+k+v 9.3 → 7.8 / 9.5 → 8.0, 35B LM head 83.7 → 79.8 / 86.4 → 83.1; unguarded it also cost
// 27B q+gate+k+v (K = 5120) 18.1 → 19.6 / 18.9 → 21.0, so only up to K = 2048 (every 35B-A3B shape
// that gains; the 27B shapes keep today's instance, unchanged in the probe).
constexpr int kBoundedMaxK = 2048;
constexpr int kBoundedBlocks = 5;
constexpr int kWarpSplitActBytes = 40 * 1024;   // K ≤ 20480: warp split instead of a cluster
constexpr int kWarpSplitMaxTilesPerSm = 24;     // one split, but a few long CTAs per SM: warp split
constexpr int kIndexedWarpSplitMaxTilesPerSm = 6;   // the same for expert-indexed launches (moe T = 1)
constexpr int kWarpSplitMinChunks = 4;          // chunks per warp below which 8 warps per tile lose
int m1_smem(const W4A16GemvArgs& a, bool vec, dim3 grid, int warps, const SplitPlan& plan) {
  if (a.m != 1 || !vec) return 0;
  const int bytes = std::max(m1_layout(warps, m1_cta_chunks(plan, a.k / kChunkK)).bytes,
                             partial_bytes(grid, plan, warps, 1));
  return bytes <= kM1MaxSmem ? bytes : 0;
}

template <GemvAct kAct>
cudaError_t launch_m1(const W4A16GemvArgs& a, dim3 grid, int warps, int groups0, SplitPlan plan, int smem,
                      cudaStream_t stream) {
  if (a.slots.ids != nullptr) {   // expert-indexed: plain (gate+up) and silu (down) only
    if constexpr (kAct == GemvAct::kSigmoidGate) {
      return cudaErrorInvalidValue;
    } else {
      static int opted_in[2][kMaxDevices] = {};
      return a.w[0].gemv_words
                 ? launch_kernel(w4a16_gemv_m1_kernel<kAct, true, true>, opted_in[1], a, grid, warps, groups0, plan,
                                 smem, stream)
                 : launch_kernel(w4a16_gemv_m1_kernel<kAct, true, false>, opted_in[0], a, grid, warps, groups0, plan,
                                 smem, stream);
    }
  }
  static int opted_in[kMaxDevices] = {};
  return launch_kernel(w4a16_gemv_m1_kernel<kAct, false>, opted_in, a, grid, warps, groups0, plan, smem, stream);
}

template <int MT, GemvAct kAct>
cudaError_t launch_act(const W4A16GemvArgs& a, bool vec, dim3 grid, int warps, int groups0,
                       SplitPlan plan, cudaStream_t stream) {
  if constexpr (MT == 1) {
    const int smem = m1_smem(a, vec, grid, warps, plan);
    if (smem > 0) return launch_m1<kAct>(a, grid, warps, groups0, plan, smem, stream);
  }
  if (plan.warp_splits > 1) return cudaErrorInvalidValue;   // only the one-row kernel splits warps
  auto run = [&](auto tpw) {
    constexpr int TPW = decltype(tpw)::value;
    if (!vec) return launch_instance<MT, false, false, kAct, TPW>(a, grid, warps, groups0, plan, stream);
    if constexpr (MT == 1 && TPW == 2 && kAct == GemvAct::kPlain) {
      if (a.w[0].tiled && a.k <= kBoundedMaxK) {   // M = 2..8, short K: 5 CTAs per SM (≤ 102 registers)
        return launch_instance<1, true, true, kAct, 2, kBoundedBlocks>(a, grid, warps, groups0, plan, stream);
      }
    }
    return a.w[0].tiled ? launch_instance<MT, true, true, kAct, TPW>(a, grid, warps, groups0, plan, stream)
                        : launch_instance<MT, true, false, kAct, TPW>(a, grid, warps, groups0, plan, stream);
  };
  // M > 16: two tiles per warp; one for plain activations where the launcher picks it (silu /
  // gated at M > 16 always take two: no one-tile instance of them). Plain M = 2..8 on the
  // vector path: two where the launcher picks it (v3.15), else one.
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  if constexpr (MT >= 3 && kAct != GemvAct::kPlain) {
    return plan.tiles_per_warp == 2 ? run(Two{}) : cudaErrorInvalidValue;
  } else if constexpr (MT >= 3) {
    if (plan.tiles_per_warp == 2) return run(Two{});
    return plan.tiles_per_warp == 1 ? run(One{}) : cudaErrorInvalidValue;
  } else if constexpr (kAct == GemvAct::kPlain) {   // M = 2..8: two where the launcher picks it (v3.15)
    if (plan.tiles_per_warp == 2 && vec) return run(Two{});
    return plan.tiles_per_warp == 1 ? run(One{}) : cudaErrorInvalidValue;
  } else {
    return plan.tiles_per_warp == 1 ? run(One{}) : cudaErrorInvalidValue;
  }
}

template <int MT>
cudaError_t launch_mt(const W4A16GemvArgs& a, bool vec, dim3 grid, int warps, int groups0,
                      SplitPlan plan, cudaStream_t stream) {
  switch (a.act) {
    case GemvAct::kSiluMul: return launch_act<MT, GemvAct::kSiluMul>(a, vec, grid, warps, groups0, plan, stream);
    case GemvAct::kSigmoidGate: return launch_act<MT, GemvAct::kSigmoidGate>(a, vec, grid, warps, groups0, plan, stream);
    default: return launch_act<MT, GemvAct::kPlain>(a, vec, grid, warps, groups0, plan, stream);
  }
}

// The x-resident kernel's launch (v4), or warps = 0 where it does not apply: M = 2..32, plain
// activations, every weight tiled, not expert-indexed, more tiles than SMs, x [8·MT, K] (or, in a
// cluster of C = 2 | 4, its K share: v4.1) in shared memory beside the rings. C, S (warps per
// tile: segs / (C · segments per warp), one warp over all of K only at C = 1) and P (tile slots
// per group) minimize the busiest CTA's time in chunk steps: rounds × (span + e) × max(V, W) — a
// warp's serial chain (span chunks per group, + e = 1 for the partials' exchange when S > 1, 2
// for the cluster's two barriers)
// times the SM's share when its W warps are more than V (24 at MT = 1, 16 above) can overlap;
// at least kXresMinWarps warps. Session 23 (bench_gemv, M = 8) fits the work term: 27B gate_up
// 6 rounds × 24 warps × 5 chunks 32.0 µs vs 3 × 28 × 10 38.2; q+gate+k+v 3 × 24 × 5 19.7 vs
// 1 × 28 × 10 16.2; LM heads 5 rounds of 24 vs 28 warps (16 chunks) 77.2 vs 91.5 (35B). Ties:
// the shorter chain, then more CTAs, then more warps. Not when fewer than half the SMs get a CTA.
struct XresPlan {
  int warps = 0, warp_splits = 1, segs_per_warp = 1, cluster = 1, groups0 = 0, groups = 0, ctas = 0, smem = 0;
};
XresPlan plan_xres(const W4A16GemvArgs& a, int segs, int seg_chunks, int sms, int smem_limit) {
  XresPlan best;
  const int mt = ceil_div(a.m, 8), chunks = a.k / kChunkK;
  const int max_warps = xres_max_warps(mt, true);
  int tiles = 0;
  for (int i = 0; i < a.num_weights; ++i) tiles += ceil_div(a.w[i].n, kTileN);
  // More tiles than SMs only: with one tile or less per SM, every CTA would stage all of x for
  // a single tile, where the staged kernel's clusters stage only their K range each (session 23,
  // bench_gemv at M = 32: shared expert 4.02 → 5.91 µs, expert gate_up 4.93 → 5.93, expert down
  // 5.79 → 6.12; at M = 8, 35B o 5.23 → 6.01, shared expert 3.30 → 3.44).
  if (tiles <= sms) return best;
  int64_t best_cost = INT64_MAX, best_chain = INT64_MAX;
  const int overlap = xres_max_warps(mt, false);   // warps an SM overlaps (24 | 16)
  // C = 1 (no cluster) wherever x fits; else the cheapest of C = 2, 4 ranks, each staging its K
  // share (M ≤ 8 never clusters: x fits for K ≤ 13k).
  for (int c = 1; c <= (mt > 1 ? kXresMaxCluster : 1) && c <= segs && !(c > 1 && best.cluster == 1 && best.warps > 0);
       c *= 2) {
    for (const int spw_try : {0, 2, 1}) {   // 0: one warp over all of K (C = 1 only)
      const int spw = spw_try == 0 ? segs : spw_try;
      if ((spw_try == 0 && c > 1) || (spw_try != 0 && (segs / c) % spw != 0) || (spw_try == 2 && segs == 2 && c == 1)) continue;
      const int s = segs / (c * spw);   // warps per tile
      if (s < 1 || s > max_warps) continue;
      const int span = std::min(spw * seg_chunks, chunks), e = s * c > 1 ? (c > 1 ? 2 : 1) : 0;
      const int p_max = std::min(max_warps / s, c == 1 && s > 1 ? kXresMaxSlots : max_warps);   // named barriers
      for (int p = 1; p <= p_max; ++p) {
        const int smem = xres_layout(mt, c > 1 ? s * spw * seg_chunks : chunks, s * p, s * c, spw).bytes;
        if (smem > smem_limit) break;
        int groups0 = ceil_div(a.w[0].n, p * kTileN), groups = groups0;
        if (a.num_weights == 2) groups += ceil_div(a.w[1].n, p * kTileN);
        const int clusters = std::min(groups, sms / c), rounds = ceil_div(groups, clusters);
        if (2 * clusters * c < sms) continue;   // half the SMs idle: the staged kernel's clusters use them all
        if (c > 1 && rounds > kXresMaxClusterRounds) continue;
        const int64_t chain = static_cast<int64_t>(rounds) * (span + e);
        const int64_t cost = chain * std::max(overlap, s * p);
        if (s * p < kXresMinWarps) continue;
        const bool tie_break = chain < best_chain || (chain == best_chain && (clusters * c > best.ctas ||
                                                                           (clusters * c == best.ctas && s * p > best.warps)));
        if (cost < best_cost || (cost == best_cost && tie_break)) {
          best_cost = cost;
          best_chain = chain;
          best.warps = s * p;
          best.warp_splits = s;
          best.segs_per_warp = spw;
          best.cluster = c;
          best.groups0 = groups0;
          best.groups = groups;
          best.ctas = clusters * c;
          best.smem = smem;
        }
      }
    }
  }
  return best;
}

template <int MT, bool kWide = false, bool kCluster = false>
cudaError_t launch_xres(const W4A16GemvArgs& a, const XresPlan& xp, SplitPlan plan, cudaStream_t stream) {
  if constexpr (MT == 1 && !kWide) {
    if (xp.warps > kXresMaxWarpsMt1) return launch_xres<1, true>(a, xp, plan, stream);
  }
  if constexpr (MT > 1 && !kCluster) {
    if (xp.cluster > 1) return launch_xres<MT, false, true>(a, xp, plan, stream);
  }
  if (xp.cluster > 1 && !kCluster) return cudaErrorInvalidValue;
  static int opted_in[kMaxDevices] = {};
  auto kernel = w4a16_gemv_xres_kernel<MT, kWide, kCluster>;
  int dev = 0;
  ATLAS_RETURN_IF_ERROR(prepare_launch(kernel, opted_in, xp.smem, dev));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(xp.ctas);
  cfg.blockDim = dim3(xp.warps * 32);
  cfg.dynamicSmemBytes = xp.smem;
  cfg.stream = stream;
  if constexpr (kCluster) {   // persistent clusters: no more than fit at once (a GPC's SMs hold whole clusters)
    const int clusters = std::min(xp.ctas / xp.cluster, max_active_clusters(kernel, dev, xp.cluster, xp.warps * 32, xp.smem, dim3(xp.ctas)));
    if (clusters < 1) return cudaErrorInvalidConfiguration;
    cfg.gridDim = dim3(clusters * xp.cluster);
  }
  return launch_pdl(cfg, xp.cluster, kernel, a, xp.groups0, xp.groups, plan);
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

int w4a16_gemv_k_splits(int k) {
  // ≥ 2 chunks (256 k) per segment, at most 8 segments (portable cluster size): K = 512 → 2,
  // 1024 → 4, ≥ 2048 → 8. v1 kept ≥ 4 chunks per CTA for the cluster barrier's sake; small-N
  // shapes (experts: one 1-warp CTA per SM) are bound by one warp's serial chunk latency
  // (≈ 0.3 µs per chunk), and since v2 large N no longer pays for segments (splits chosen
  // from N, 2 segments per CTA or one CTA over all of K), shorter segments only cost there a
  // few f32 adds.
  const int chunks = (k + kChunkK - 1) / kChunkK;
  int s = 1;
  while (s < kMaxSplits && 2 * s * 2 <= chunks) s *= 2;
  return s;
}

int w4a16_gemv_segment_chunks(int k) {
  const int chunks = (k + kChunkK - 1) / kChunkK, segs = w4a16_gemv_k_splits(k);
  return (chunks + segs - 1) / segs;
}

cudaError_t launch_w4a16_gemv(const W4A16GemvArgs& a, cudaStream_t stream) {
  if (a.m < 1 || a.m > kW4A16GemvMaxRows || a.k < 16 || a.k % 16 != 0) return cudaErrorInvalidValue;
  if (a.num_weights != 1 && a.num_weights != 2) return cudaErrorInvalidValue;
  if (a.out_dtype != DType::kBF16 && a.out_dtype != DType::kF32) return cudaErrorInvalidValue;
  const bool raw = a.act != GemvAct::kPlain;
  if (a.act != GemvAct::kPlain && a.act != GemvAct::kSiluMul && a.act != GemvAct::kSigmoidGate) {
    return cudaErrorInvalidValue;
  }
  if (a.x == nullptr || raw != (a.x2 != nullptr)) return cudaErrorInvalidValue;
  if (raw && a.x2_stride != 0 && (a.x2_stride < a.k || a.x2_stride % 8 != 0)) return cudaErrorInvalidValue;
  if (!aligned(a.x, 16) || (raw && !aligned(a.x2, 16))) return cudaErrorMisalignedAddress;
  bool vec = a.k % kChunkK == 0;
  for (int i = 0; i < a.num_weights; ++i) {
    const W4A16GemvWeight& w = a.w[i];
    if (w.packed == nullptr || w.block_scale == nullptr || w.global_scale == nullptr ||
        w.out == nullptr || w.n < 1) return cudaErrorInvalidValue;
    if (w.qg_head_dim < 0 || (w.qg_head_dim > 0 && w.n % (2 * w.qg_head_dim) != 0)) return cudaErrorInvalidValue;
    if (!aligned(w.packed, 8)) return cudaErrorMisalignedAddress;
    vec = vec && aligned(w.packed, 16) && aligned(w.block_scale, 8);
    if (w.tiled && (a.k % kChunkK != 0 || w.rows < w.n || static_cast<int64_t>(w.rows) * kRowBytes > INT32_MAX)) {
      return cudaErrorInvalidValue;
    }
    if (w.tiled && !(aligned(w.packed, 16) && aligned(w.block_scale, 8))) return cudaErrorMisalignedAddress;
  }
  if (a.num_weights == 2 && a.w[0].tiled != a.w[1].tiled) return cudaErrorInvalidValue;   // one instance: one layout
  const bool indexed = a.slots.ids != nullptr;
  for (int i = 0; i < a.num_weights; ++i) {   // the one-row kernel of an indexed launch only
    if (a.w[i].gemv_words && (!indexed || !vec)) return cudaErrorInvalidValue;
    if (indexed && a.w[i].tiled && !a.w[i].gemv_words) return cudaErrorInvalidValue;   // its words: GEMV order
  }
  if (a.num_weights == 2 && a.w[0].gemv_words != a.w[1].gemv_words) return cudaErrorInvalidValue;
  if (indexed) {   // the one-row kernel only (checked again once the plan is made)
    if (a.m != 1 || a.slots.count < 1 || a.slots.num_experts < 1 || a.slots.x_stride < 0 || a.slots.x_div < 1 ||
        a.slots.out_stride < 0 || a.slots.x_stride % 8 != 0) {
      return cudaErrorInvalidValue;
    }
    for (int i = 0; i < a.num_weights; ++i) {
      if (a.slots.packed_stride[i] % 16 != 0 || a.slots.scale_stride[i] % 8 != 0 ||
          a.slots.packed_stride[i] < 0 || a.slots.scale_stride[i] < 0) {
        return cudaErrorInvalidValue;
      }
    }
  }
  const int segs = w4a16_gemv_k_splits(a.k);
  const int chunks = (a.k + kChunkK - 1) / kChunkK;
  const int seg_chunks = w4a16_gemv_segment_chunks(a.k);

  // Splits and warps (16-row tiles) per CTA; numerics depend on neither (SplitPlan). Splits:
  // the fewest of 1 (no cluster: one CTA streams all of K, its setup amortized over up to 40
  // chunks at K = 5120, where v1's 8-way clusters gave each CTA 5), segs / 2 or segs that
  // still gives ≥ 3 four-warp CTAs per SM (132 SMs on the H200). Warps: see below.
  static int sm_count[kMaxDevices] = {}, sm_smem[kMaxDevices] = {}, cta_smem_reserved[kMaxDevices] = {};
  int dev = 0;
  ATLAS_RETURN_IF_ERROR(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) return cudaErrorInvalidDevice;
  if (sm_count[dev] == 0) {
    ATLAS_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sm_smem[dev], cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
    ATLAS_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&cta_smem_reserved[dev], cudaDevAttrReservedSharedMemoryPerBlock, dev));
    ATLAS_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sm_count[dev], cudaDevAttrMultiProcessorCount, dev));
  }
  int tiles = 0;   // of the whole launch (every slot)
  for (int i = 0; i < a.num_weights; ++i) tiles += ceil_div(a.w[i].n, kTileN);
  if (indexed) tiles *= a.slots.count;
  const int sms = sm_count[dev];
  if (a.m > 1 && !raw && vec && !indexed && a.w[0].tiled) {   // the x-resident kernel where x fits (v4)
    const XresPlan xp = plan_xres(a, segs, seg_chunks, sms, sm_smem[dev] - cta_smem_reserved[dev]);
    if (xp.warps > 0) {
      SplitPlan plan{seg_chunks, xp.segs_per_warp, segs};
      plan.warp_splits = xp.warp_splits;
      plan.prefetch_chunks = kStagesM1 - 1;
      switch (ceil_div(a.m, 8)) {
        case 1: return launch_xres<1>(a, xp, plan, stream);
        case 2: return launch_xres<2>(a, xp, plan, stream);
        case 3: return launch_xres<3>(a, xp, plan, stream);
        default: return launch_xres<4>(a, xp, plan, stream);
      }
    }
  }
  // The staged kernel's tiles per warp (kTpwMinTilesPerSm): two at M > 16, except plain
  // activations over fewer than 2 tiles per SM, where halving the warp work items costs more.
  // Splits: the fewest giving ≥ min_ctas_per_sm CTAs per SM — 3 at one tile per warp, 2 at two
  // (TPW = 2: 168-register CTAs at M > 16, 3 resident per SM). v3.14, from the probe's M = 32
  // sweep (session 16, call 10; 4 warps): gate_up s1 79 µs vs s4 92, 35B q+gate+k+v s4 19 vs s8
  // 20.5; every other shape's pick unchanged (27B q+gate+k+v keeps s4, 48 µs, where s8 read 44).
  auto pick_splits = [&](int units, int min_ctas_per_sm) {
    int sp = segs;
    for (const int s : {1, segs / 2}) {
      if (s >= 1 && s < sp && ceil_div(units, kMaxWarps) * s >= min_ctas_per_sm * sms) { sp = s; break; }
    }
    return sp;
  };
  const bool many_tiles = tiles >= kTpwMinTilesPerSm * sms;
  int tpw = a.m > 16 && (raw || many_tiles) ? 2 : 1;
  // v3.15: plain M = 2..8 on the vector path take two tiles per warp too (each B fragment and
  // the CTA's activation stage then serve twice the weight rows: the staged kernel's L2 traffic
  // for activations, CTAs × K_cta × M × 2 B, was ≈ 45% of the weight bytes at M = 8 on 64-row
  // CTAs) — except where that leaves one split of long CTAs at fewer than 3 per SM (gate_up at
  // M = 8: 272 CTAs of 40 chunks, 48.5 µs vs 43.2) or where no split gives 2 per SM (27B o and
  // down, 320 CTAs at every split: 13.1 vs 12.0 and 25.8 vs 24.8 µs). The probe and bench at
  // M = 8 (session 17, bench/NOTES.md): LM heads −6 / −8%, q+gate+k+v −2 / −11%; at M = 16 the
  // probe was mixed (LM heads −10%, 35B q+gate+k+v and 27B o +7%), so M = 9..16 keep one.
  if (a.m > 1 && a.m <= 8 && !raw && vec && many_tiles) {
    const int s2 = pick_splits(ceil_div(tiles, 2), 2);
    if ((s2 > 1 && s2 < segs) || ceil_div(ceil_div(tiles, 2), kMaxWarps) >= 3 * sms) tpw = 2;
  }
  const int units = ceil_div(tiles, tpw);                 // warp work items
  int splits = pick_splits(units, tpw == 2 ? 2 : 3);
  // Warps (tiles per CTA): 4 for the staged kernel (M > 1), fewer only where N has fewer warp
  // work items. v3.13: the probe's sweep of every (splits, warps) at M = 8 and 32 (session 16)
  // found 4 warps best or within 4% on every shape; the rules below (now M = 1 only), which
  // gave small and mid shapes 1- or 2-warp CTAs, cost up to 35% there (M = 8: 35B q+gate+k+v
  // 12.7 µs vs 9.4, gate_up 49.7 vs 43.4; M = 32: shared expert 6.1 vs 4.2).
  int warps = kMaxWarps;
  while (warps > 1 && warps / 2 >= units) warps /= 2;
  if (a.m == 1) {   // silu / gated, and plain M = 1 off the vector path (the vector plain ones
                    // are re-planned below): the earlier rule
    while (warps > 1 && ceil_div(units, warps) * splits < 2 * sms) warps /= 2;
    // Balance: a grid of a few long CTAs per SM ends with the SM holding the most, so of W = 4
    // and 2 take the one whose CTAs per SM fall closest below a whole number.
    if (warps == kMaxWarps) {
      auto used = [&](int w) {
        const double per_sm = double(ceil_div(tiles, w) * splits) / sms;
        return per_sm / std::ceil(per_sm);
      };
      if (used(kMaxWarps / 2) > used(kMaxWarps) + 0.05) warps = kMaxWarps / 2;
    }
  }
  // M = 1 on the vector path (the one-row kernel): 4 warps per CTA and the fewest splits that
  // give every SM a CTA. v3.4's sweep of every (splits, warps) on the H200 (bench/NOTES.md) found
  // this best or within 2% of best on 8 of 10 shapes — the rule above loses up to 22% (35B
  // q+gate+k+v: 4-CTA clusters of 2-warp CTAs run in two waves, 12.2 µs vs 9.5 with one
  // 144-CTA wave) — and ≤ 7% behind on the other two (27B o, q+gate+k+v). Plain activations
  // only: the silu / gated prologue (expf and a division per element) wants the shorter K
  // ranges of the rule above (v3.4 run: gated 27B o_proj 12.7 µs with this rule, 11.2 in v3.1).
  int warp_splits = 1;
  if (a.m == 1 && vec && a.act == GemvAct::kPlain) {
    warps = kMaxWarps;
    while (warps > 1 && warps / 2 >= tiles) warps /= 2;
    splits = segs;
    for (const int s : {1, segs / 2}) {
      if (s >= 1 && s < splits && ceil_div(tiles, warps) * s >= sms) { splits = s; break; }
    }
    // K split S ways inside the CTA (S warps per tile, max(1, 4 / S) tiles per CTA, shared-memory
    // sum in segment order: the same bits as a cluster's ranks) whenever the CTA can stage all of
    // K (≤ 40 KB: K ≤ 20480, every projection of the models here):
    //  - instead of a cluster of S CTAs when one split leaves SMs idle. The probe (v3.5) measured
    //    the cluster's sync + DSMEM reduction at 1.6–2 µs of a 3 µs small-shape GEMV, and
    //    clusters of 4 or 8 leave 8 SMs idle;
    //  - S = segs / 2 over one-tile CTAs when one split already fills the SMs but the grid is a
    //    few long CTAs per SM (≤ 24 tiles per SM): 4× the CTAs, each a quarter as long, so the
    //    hardware balances the tail. The v3.6 probe sweep on the H200: 27B q+gate+k+v 18.7 µs vs
    //    20.1 with one split, 35B q+gate+k+v 8.0 vs 9.0, 27B down 21.7 vs 25.6 (4-CTA clusters),
    //    gate_up even (34.6 vs 34.9); the LM heads (117 tiles per SM) lose 11–28% (each CTA
    //    stages all of K for one tile), so they keep one split. Expert-indexed launches
    //    (moe_experts gate+up: K = 2048, 64 tiles per slot, 9 slots per token) only up to
    //    kIndexedWarpSplitMaxTilesPerSm (session 19 moe_probe: T = 1, 4.4 tiles per SM, 17.8 µs
    //    vs 18.5 without; T = 2..5, 8–20 tiles per SM, 1.6–3.6 µs slower with it: T = 4 39.3
    //    vs 36.5);
    const bool stage_all_k = chunks * kXRowBytes <= kWarpSplitActBytes;
    const int ws_max_tiles = (indexed ? kIndexedWarpSplitMaxTilesPerSm : kWarpSplitMaxTilesPerSm) * sms;
    int ws = splits > 1 ? splits : (tiles <= ws_max_tiles ? segs / 2 : 1);
    //  - S = segs (eight warps, one segment each) instead of segs / 2 where a segment holds
    //    ≥ kWarpSplitMinChunks chunks on average (the last may be shorter) and the one-tile CTAs
    //    all fit at once (v3.12: twice the warps on the same SMs; probe: 27B down 21.4 → 19.7 µs,
    //    27B o 9.3 → 9.15; 35B q+gate+k+v, 2 chunks per warp, 6.7 → 9.2 and 27B q+gate+k+v, two
    //    waves, 15.9 → 16.7 are kept out by the two conditions).
    if (ws == segs / 2 && ws > 1 && chunks >= kWarpSplitMinChunks * segs) {
      const int cta_smem = m1_layout(segs, chunks).bytes + cta_smem_reserved[dev];
      const int per_sm = std::min(kM1MinBlocks, sm_smem[dev] / cta_smem);
      if (tiles <= per_sm * sms) ws = segs;
    }
    if (stage_all_k && ws > 1) {
      warp_splits = ws;
      warps = std::max(1, kMaxWarps / ws) * ws;
      splits = 1;
    }
  }
  // Expert-indexed (moe_experts at T = 1): no cluster — a slot's few tiles per SM are latency-
  // bound, and the cluster's sync is ≈ 1.6 µs (v3.5 probe); one CTA over all of K instead.
  if (indexed && splits > 1) splits = 1;
  SplitPlan plan{seg_chunks, splits == 1 ? segs : segs / splits, segs};
  plan.tiles_per_warp = tpw;
  if (warp_splits > 1) {
    plan.segs_per_cta = segs / warp_splits;
    plan.warp_splits = warp_splits;
  }
  const int cta_rows = warps / warp_splits * tpw * kTileN;
  const int groups0 = ceil_div(a.w[0].n, cta_rows);
  const int groups = (groups0 + (a.num_weights == 2 ? ceil_div(a.w[1].n, cta_rows) : 0)) *
                     (indexed ? a.slots.count : 1);
  if (groups > 65535) return cudaErrorInvalidValue;
  const dim3 grid(splits, groups);
  if (indexed && m1_smem(a, vec, grid, warps, plan) == 0) return cudaErrorInvalidValue;
  plan.prefetch_chunks = static_cast<int64_t>(splits) * groups > kM1PrefetchMinCtasPerSm * sms ? 1
                        : indexed                                                             ? 0
                                                                                              : kStagesM1 - 1;

  W4A16GemvArgs args = a;
  if (raw && args.x2_stride == 0) args.x2_stride = a.k;   // contiguous rows
  switch (ceil_div(a.m, 8)) {
    case 1: return launch_mt<1>(args, vec, grid, warps, groups0, plan, stream);
    case 2: return launch_mt<2>(args, vec, grid, warps, groups0, plan, stream);
    case 3: return launch_mt<3>(args, vec, grid, warps, groups0, plan, stream);
    default: return launch_mt<4>(args, vec, grid, warps, groups0, plan, stream);
  }
}

}  // namespace atlas
