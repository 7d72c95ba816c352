// moe_experts: routed experts of a sparse MoE block over device-side expert ids, equal to
// atlas/reference.py::moe_experts up to float32 summation order (each bf16 rounding in the same
// place):
//
//   for every pair p = (t, j) = t·k + j, e = ids[t, j] (e outside [0, E): the pair contributes 0):
//     g = bf16(W_gate[e] · x[t]),  u = bf16(W_up[e] · x[t])          (float32 dots)
//     act[p] = bf16(silu(g) · u)                                      (float32 math)
//     d[p] = bf16(W_down[e] · act[p])
//   out[t] = Σ_j weights[t, j] · d[t·k + j]                           (float32 fmaf, j = 0..k−1)
//   with a shared expert: out[t] = bf16(that + sigmoid(shared_gate[t]) · shared[t])  (bf16 out)
//
// Why grouped: routing stays on the device (ids from ops.moe_route), so the host never learns
// which experts run. v3 groups the T·k pairs by expert on the device and runs each expert hit
// ONCE for all its pairs on tensor cores: an expert's weights stream from DRAM once whatever the
// number of tokens that picked it, and its pairs are the n8 columns of the mma (swap-AB, as
// w4a16_gemv: weight rows are the 16-row A operand, activation rows the B operand).
//
// Four launches, all with programmatic dependent launch (common/pdl.cuh):
//   1. group (1 CTA, 256 threads): counting sort of the valid pairs by expert id → num_groups,
//      expert[s] (ascending ids, s < num_groups ≤ G = min(T·k, E)), start[s] .. start[s+1] the
//      group's slice of pairs[] (pair indices p, ascending inside a group: stable). Counts by
//      shared-memory atomics (order-free), one block scan (experts in contiguous runs per thread),
//      then warp 0 scatters the pairs 32 at a time in pair order (__match_any_sync ranks lanes
//      with the same expert), so the lists are deterministic. Fixed grid, buffers sized for the
//      worst case G: no host sync, graph-capturable. Replaces v2's torch argsort "pair sort".
//   2. gate_up: grid (I / 32, G), 256 threads = 2 K groups × 4 tile warps, one 16-row A tile
//      each. CTA (x, s) runs group s (exits at once when s ≥ num_groups): tile warps 2j and
//      2j+1 own the gate and the up rows n = 32x + 16j .. +16, so silu(g)·u fuses in the
//      epilogue (the up warp hands bf16(u) to the gate warp through 2 KB of smem); K group kg
//      computes the 128-k chunks c ≡ kg (mod 2) and the two partials are added acc_0 + acc_1
//      through smem (an order fixed by K alone). One tile per warp and 2 K groups, not (gate,
//      up) per warp: B = 1 has only 9 × 512 / 16 = 288 gate+up tile pairs, and the
//      dequant-bound warps need several per scheduler (528) to keep the H200's issue slots
//      busy: 1152 warps, each an 8-chunk dequant chain instead of 16.
//      Columns = the group's pairs, B row = x[p / k]; MT = ceil(T/8) ≤ 4 n8 tiles
//      (template, picked at launch from T), of which ceil(M/8) are live for a group of M pairs
//      (warp-uniform branch: a 1-pair group issues 1 mma tile, not MT); a group of M > 8·MT
//      pairs (T > 32, or repeated ids in a row) loops over 8·MT-column passes, re-streaming the
//      expert (from L2). Stores act[p, n] = bf16(silu(bf16(g)) · bf16(u)).
//   3. down: grid (ceil(h / 64), G), 4 warps, one 16-row tile of h rows each; B row = act[p];
//      stores d[p, n] = bf16(dot) into a [T·k, h] bf16 scratch.
//   4. combine: grid (ceil(h / 1024), T), 128 threads × 8 columns: out[t] = Σ_j in slot order
//      (skipping out-of-range ids) + the shared-expert term, as v2's down epilogue did.
//
// Grouped GEMV (2, 3) per CTA and 128-k chunk (K = h for gate_up, I for down):
//   A tile: lane (g = lane/4, t = lane%4) holds rows g and g+8 of its warp's tile and the 32
//     contiguous k [32t, 32t+32) of each (NVFP4: one 16-byte smem load + 2 scale bytes
//     per row; BF16: one 16-byte load per word). K permutation, dequant (exact e2m1 · scale ·
//     2^-7 in bf16, the 2^7 and the global scale applied once in f32 on the store) and the
//     m16n8k16 calls are w4a16_gemv's (csrc/w4a16_gemv.cu header, common/nvfp4_mma.cuh): mma
//     step (w, h) pairs physical k (8w+2h, 8w+2h+4) and (8w+2h+1, 8w+2h+5) + 32t; the B
//     fragment is the 16-byte activation unit k 32t+8w .. +8 of row g, permuted by 4 prmt at
//     read time (BF16 weights get the same permutation).
//   pipeline: kStages cp.async stages of one 128-k chunk (Format::stages: NVFP4 down 6 at
//     MT = 1, else 4, gate_up 8 / 6; BF16 4 / 3, 6 / 4; smem for at most K's chunk count), one
//     barrier per step of KG chunks (the K groups compute them side by side). A stage holds 64
//     weight rows × 64 B (NVFP4) | 256 B (BF16), 64 × 8 scale bytes (NVFP4), 8·MT activation
//     rows × 256 B (16-byte units swizzled by bf16_unit_slot: conflict-free fragment loads).
//     Copies: 128 threads × 2 (NVFP4) | 8 (BF16) 16-byte weight pieces per chunk (contiguous
//     per row: conflict-free smem writes) through a table of the CTA's 64 row pointers in smem,
//     8 scale bytes per thread < 64 (K % 128 == 0; else 16-bit loads, synchronous: only odd test
//     shapes take it), one 16-byte unit per live activation row per 16 threads. K tails
//     (K % 32 == 0) zero-fill weights and activations. ptxas: 86–122 registers under
//     __launch_bounds__(128, 4) (down) / (256, 2) (gate_up), no spills.
//   Activation rows ≥ the pass's M are never written (stale smem): they feed only mma columns
//     ≥ M, which are never stored (mma columns are independent dot products).
//   PDL: gate_up waits for the grouping kernel before reading anything. down reads the group
//     tables and prefetches its first kStages − 1 chunks of weights BEFORE griddepcontrol.wait:
//     it is launched only once every gate_up CTA has executed launch_dependents or exited, and
//     every gate_up CTA does either only after its own wait, which returns once the grouping grid
//     has completed. Every CTA of every launch waits before it exits, so each grid's completion
//     implies its predecessors' (the workspace may be reused by the stream's next op).
//
// Batch invariance: a pair's dot is the same bits whatever else is in the batch — its column's
// mma sequence (chunks in order, 8 steps each; gate_up: the even and the odd chunks in two
// partials, then acc_0 + acc_1) depends on K only, not on MT, on the column it lands in, or on
// the pass; the combine sums slots in order j. Tested bitwise (one token alone ==
// that token inside a 32-token batch sharing all its experts).
//
// Versions (bench: python bench/bench_mtp.py --parts; tests: tests/test_moe_route.py,
// csrc/tests/test_mtp_kernels.cu):
//   v1: CUDA cores, one warp per output row, one dot at a time; 2 launches.
//   v2: load phase for all of a warp's dots before the math; pairs sorted by expert by a torch
//       argsort so shared experts re-read from L2; down grid tokens-fastest. H200 (35B-A3B MTP
//       head): 43.8 µs at B = 1 (+ 9.0 sort), 733 µs at B = 32 (+ 20.6 sort).
//   v3 (this): device grouping + tensor-core grouped GEMVs (an expert read once for all its
//       pairs) + combine; 4 launches, no torch sort. BF16 stacks run the same mma kernel (weights
//       straight from smem, no dequant), slower than NVFP4 per byte but correct.
//
// Floor: bytes = (experts hit) · (2·I·h + h·I) · B_w (B_w = 9/16 NVFP4, 2 BF16) + x, act, d, out.
//   35B-A3B (h 2048, I 512, top-8 of 256 + the shared expert as slot 8), NVFP4: B = 1: 9 experts
//   × 1.77 MB = 15.9 MB → 3.8 µs at 4.2 TB/s; B = 32: ≈ 163 distinct experts × 1.77 MB ≈ 289 MB
//   → ≈ 69 µs.
// v3 prediction (graph replay, L2 warm as bench_mtp --parts measures): B = 1 ≈ 9 µs (group ≈ 2,
//   gate_up ≈ 2.5–3: 144 CTAs × 8 warps ≈ 2 warps per scheduler, each an 8-chunk dequant chain
//   (≈ 210 instructions per chunk), 6 chunks = 28 KB in flight per CTA; down ≈ 1.5:
//   its 5.3 MB prefetched under gate_up; combine ≈ 1.5; the rest PDL launch gaps); B = 32 ≈
//   105 µs (≈ 0.7 of copy bandwidth on 289 MB: ≈ 210 warp-instructions per chunk and warp for
//   1152 weight bytes (dequant ≈ 150), ≈ 75% of the H200's issue rate at copy bandwidth, plus
//   the G − num_groups ≈ 95 empty group slots' CTAs).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common/checks.h"
#include "common/nvfp4_mma.cuh"
#include "common/pdl.cuh"
#include "moe_experts.h"

namespace atlas {
namespace {

// ---- workspace --------------------------------------------------------------------------------

// Byte offsets of the scratch buffers inside args.workspace (each 256-byte aligned).
struct Workspace {
  size_t num_groups;   // int32 [1]
  size_t expert;       // int32 [G]       expert id of group s, ascending
  size_t start;        // int32 [G + 1]   group s = pairs[start[s] .. start[s+1])
  size_t pairs;        // int32 [T·k]     valid pair indices p = t·k + j, grouped, ascending per group
  size_t act;          // bf16 [T·k, I]   silu(g)·u per pair (rows of invalid pairs never written)
  size_t d;            // bf16 [T·k, h]   down output per pair (idem)
  size_t bytes;
};

Workspace workspace_layout(int64_t num_tokens, int top_k, int num_experts, int hidden, int inter) {
  auto align = [](size_t v) { return (v + 255) / 256 * 256; };
  const size_t pairs = static_cast<size_t>(num_tokens) * top_k;
  const size_t groups = std::min(pairs, static_cast<size_t>(num_experts));
  Workspace w;
  size_t off = 0;
  w.num_groups = off; off = align(off + sizeof(int32_t));
  w.expert = off;     off = align(off + groups * sizeof(int32_t));
  w.start = off;      off = align(off + (groups + 1) * sizeof(int32_t));
  w.pairs = off;      off = align(off + pairs * sizeof(int32_t));
  w.act = off;        off = align(off + pairs * inter * sizeof(__nv_bfloat16));
  w.d = off;          off = align(off + pairs * hidden * sizeof(__nv_bfloat16));
  w.bytes = off;
  return w;
}

struct GroupTables {
  int32_t* num_groups;   // [1]
  int32_t* expert;       // [G]
  int32_t* start;        // [G + 1]
  int32_t* pairs;        // [T·k]
};

// ---- 1. group the pairs by expert ------------------------------------------------------------

constexpr int kGroupThreads = 256;
constexpr int kGroupStagedIds = 4096;   // ids kept in smem for the scatter warp (beyond: re-read, L2)

// grid (1), block kGroupThreads; dynamic smem (E + min(T·k, kGroupStagedIds)) int32.
__global__ void __launch_bounds__(kGroupThreads) moe_group_kernel(
    const int32_t* __restrict__ ids,   // [T·k]
    int num_pairs,                     // T·k
    int num_experts,                   // E
    GroupTables g) {
  extern __shared__ int32_t group_smem[];
  int32_t* cursor = group_smem;                   // [E]: count, then next free pairs[] index
  int32_t* staged = group_smem + num_experts;     // [min(T·k, kGroupStagedIds)] ids
  __shared__ int32_t warp_total[2][kGroupThreads / 32];   // (pairs, experts hit) per warp
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  pdl_wait();                 // ids come from moe_route
  pdl_launch_dependents();
  for (int e = tid; e < num_experts; e += kGroupThreads) cursor[e] = 0;
  __syncthreads();
  const int num_staged = min(num_pairs, kGroupStagedIds);
  for (int p = tid; p < num_pairs; p += kGroupThreads) {
    const int e = ids[p];
    if (p < num_staged) staged[p] = e;
    if (e >= 0 && e < num_experts) atomicAdd(&cursor[e], 1);
  }
  __syncthreads();

  // exclusive scans of (count, hit) over experts: thread tid owns experts [e0, e1)
  const int per = ceil_div(num_experts, kGroupThreads);
  const int e0 = min(tid * per, num_experts), e1 = min(e0 + per, num_experts);
  int count = 0, hits = 0;
  for (int e = e0; e < e1; ++e) {
    count += cursor[e];
    hits += cursor[e] > 0;
  }
  int count_incl = count, hits_incl = hits;   // inclusive over the warp
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int c = __shfl_up_sync(0xffffffffu, count_incl, off), h = __shfl_up_sync(0xffffffffu, hits_incl, off);
    if (lane >= off) {
      count_incl += c;
      hits_incl += h;
    }
  }
  if (lane == 31) {
    warp_total[0][warp] = count_incl;
    warp_total[1][warp] = hits_incl;
  }
  __syncthreads();
  int next = count_incl - count, slot = hits_incl - hits;
  for (int w = 0; w < warp; ++w) {
    next += warp_total[0][w];
    slot += warp_total[1][w];
  }
  for (int e = e0; e < e1; ++e) {
    const int c = cursor[e];
    if (c > 0) {
      g.expert[slot] = e;
      g.start[slot] = next;
      ++slot;
    }
    cursor[e] = next;
    next += c;
  }
  if (tid == kGroupThreads - 1) {   // its run ends at E: next = valid pairs, slot = groups
    *g.num_groups = slot;
    g.start[slot] = next;
  }
  __syncthreads();

  // scatter in pair order (stable): 32 pairs per step, lanes with the same expert ranked by lane
  if (warp != 0) return;
  for (int base = 0; base < num_pairs; base += 32) {
    const int p = base + lane;
    const int e = p < num_pairs ? (p < num_staged ? staged[p] : ids[p]) : -1;
    const bool valid = e >= 0 && e < num_experts;
    const unsigned peers = __match_any_sync(0xffffffffu, valid ? e : -1);
    const int leader = __ffs(peers) - 1;
    const int rank = __popc(peers & ((1u << lane) - 1u));
    int pos = valid && lane == leader ? cursor[e] : 0;
    pos = __shfl_sync(0xffffffffu, pos, leader);
    if (valid) {
      g.pairs[pos + rank] = p;
      if (lane == leader) cursor[e] = pos + __popc(peers);
    }
    __syncwarp();
  }
}

// ---- 2, 3. grouped GEMV on tensor cores ------------------------------------------------------

constexpr int kWarps = 4;                                 // one 16-row A tile each
constexpr int kThreads = 32 * kWarps;
constexpr int kTileN = 16;                                // rows of one mma A tile
constexpr int kCtaRows = kWarps * kTileN;                 // 64 weight rows staged per CTA
constexpr int kGateUpRows = kCtaRows / 2;                 // gate_up: 32 I-rows per CTA (gate and up)
constexpr int kChunkK = 128;                              // K per pipeline stage
constexpr int kXRowBytes = kChunkK * 2;                   // 256 activation bytes per row per chunk
constexpr int kXUnits = kXRowBytes / 16;                  // 16 units of 8 bf16
constexpr int kMaxMT = 4;                                 // n8 tiles: ≤ 32 columns (pairs) per pass
static_assert(kThreads >= kCtaRows, "thread tid < 64 owns the scale bytes and row pointer of local row tid");

// (x0..x7) → (x0,x4 | x1,x5 | x2,x6 | x3,x7): the K permutation of one 16-byte bf16 unit, giving
// the B fragment (activations) or the A fragment registers (BF16 weights) of mma steps h = 0, 1.
__device__ __forceinline__ uint4 permute_unit(uint4 a) {
  return make_uint4(prmt(a.x, a.z, 0x5410), prmt(a.x, a.z, 0x7632), prmt(a.y, a.w, 0x5410), prmt(a.y, a.w, 0x7632));
}

// Weight formats: bytes per row per chunk, copy pieces, and the lane's A fragment of word wd.
struct Nvfp4Format {
  static constexpr bool kScaled = true;
  // Stages (KG = 1, 4 CTAs/SM by registers): MT = 1: 6 (5 chunks = 23 KB of weights in flight
  // per CTA; 40 KB smem). MT > 1: 4 — the 8·MT activation rows (8 KB per stage at MT = 4)
  // dominate the stage, and 6 stages (77 KB) would leave 2 CTAs = 8 warps per SM; 4 stages
  // (51 KB) keep 4 CTAs/SM with 3 × 4.6 KB × 4 = 55 KB in flight. KG = 2 (2 CTAs of 8 warps per
  // SM; KG chunks in compute): 8 / 6 (6 and 4 chunks ahead).
  __host__ __device__ static constexpr int stages(int mt, int kg) {
    return kg == 1 ? (mt == 1 ? 6 : 4) : (mt == 1 ? 8 : 6);
  }
  static constexpr int kRowBytes = kChunkK / 2;      // 64 packed bytes
  static constexpr int kScaleBytes = kChunkK / 16;   // 8 e4m3 block scales
  static constexpr int kPieces = kRowBytes / 16;     // 16-byte copies per row per chunk
  static constexpr int kPieceK = kChunkK / kPieces;  // k per piece
  __host__ __device__ static int64_t row_bytes(int k) { return k / 2; }
  __device__ static int slot(int lr, int u) { return lr * kRowBytes + u * 16; }   // conflict-free unswizzled
  struct Frag {
    uint4 qa, qb;              // rows g, g+8: codes of k [32t, 32t+32)
    __nv_bfloat162 fa, fb;     // their two block scales · 2^119
  };
  __device__ static Frag load(const uint8_t* w, const uint8_t* s, int row0, int g, int t) {
    Frag f;
    f.qa = *reinterpret_cast<const uint4*>(w + slot(row0 + g, t));
    f.qb = *reinterpret_cast<const uint4*>(w + slot(row0 + g + 8, t));
    f.fa = scale_pair_bf16(*reinterpret_cast<const uint16_t*>(s + (row0 + g) * kScaleBytes + 2 * t));
    f.fb = scale_pair_bf16(*reinterpret_cast<const uint16_t*>(s + (row0 + g + 8) * kScaleBytes + 2 * t));
    return f;
  }
  // word wd: k = 32t + 8wd .. +8, block 2t + wd/2
  __device__ static void word(const Frag& f, const uint8_t*, int, int, int, int wd, uint32_t (&ra)[4],
                              uint32_t (&rb)[4]) {
    const uint32_t qa[4] = {f.qa.x, f.qa.y, f.qa.z, f.qa.w}, qb[4] = {f.qb.x, f.qb.y, f.qb.z, f.qb.w};
    dequant_word(qa[wd], wd < 2 ? __low2bfloat162(f.fa) : __high2bfloat162(f.fa), ra);
    dequant_word(qb[wd], wd < 2 ? __low2bfloat162(f.fb) : __high2bfloat162(f.fb), rb);
  }
};

struct Bf16Format {
  static constexpr bool kScaled = false;
  __host__ __device__ static constexpr int stages(int mt, int kg) {     // 4× the bytes per chunk of NVFP4
    return kg == 1 ? (mt == 1 ? 4 : 3) : (mt == 1 ? 6 : 4);
  }
  static constexpr int kRowBytes = kChunkK * 2;      // 256
  static constexpr int kScaleBytes = 0;
  static constexpr int kPieces = kRowBytes / 16;     // 16
  static constexpr int kPieceK = kChunkK / kPieces;  // 8
  __host__ __device__ static int64_t row_bytes(int k) { return static_cast<int64_t>(k) * 2; }
  __device__ static int slot(int lr, int u) { return lr * kRowBytes + bf16_unit_slot(lr, u) * 16; }
  struct Frag {};
  __device__ static Frag load(const uint8_t*, const uint8_t*, int, int, int) { return {}; }
  __device__ static void word(const Frag&, const uint8_t* w, int row0, int g, int t, int wd, uint32_t (&ra)[4],
                              uint32_t (&rb)[4]) {
    const uint4 a = permute_unit(*reinterpret_cast<const uint4*>(w + slot(row0 + g, 4 * t + wd)));
    const uint4 b = permute_unit(*reinterpret_cast<const uint4*>(w + slot(row0 + g + 8, 4 * t + wd)));
    ra[0] = a.x; ra[1] = a.y; ra[2] = a.z; ra[3] = a.w;
    rb[0] = b.x; rb[1] = b.y; rb[2] = b.z; rb[3] = b.w;
  }
};

// Byte offsets inside one pipeline stage.
struct StageLayout {
  int w_off;   // [64 rows][kRowBytes]     weights
  int s_off;   // [64 rows][kScaleBytes]   e4m3 block scales (NVFP4)
  int x_off;   // [8·MT rows][256 B]       bf16 activations, swizzled units
  int bytes;
};

// Pipeline depth; a launch allocates min(stages, chunks of K) of them (the ring only wraps when
// K has more chunks than stages: down at I = 512 has 4 chunks, so 4 stages of smem).
template <class F, int MT, int KG>
__host__ __device__ constexpr int stage_count() { return F::stages(MT, KG); }

template <class F, int MT>
__host__ __device__ constexpr StageLayout stage_layout() {
  return StageLayout{0, kCtaRows * F::kRowBytes, kCtaRows * (F::kRowBytes + F::kScaleBytes),
                     kCtaRows * (F::kRowBytes + F::kScaleBytes) + 8 * MT * kXRowBytes};
}

struct GroupedGemv {
  const __nv_bfloat16* b;   // gate_up: x [T, h]; down: act [T·k, I] — B row of pair p: b + src(p)·K
  ExpertStack a[2];         // gate_up: gate, up [E, I, h]; down: down, down [E, h, I]
  GroupTables groups;
  __nv_bfloat16* out;       // gate_up: act [T·k, I]; down: d [T·k, h]
  int n;                    // N weight rows per expert: I | h
  int k;                    // K: h | I (also the B row length)
  int top_k;
};

// grid (row tiles, G): CTA (x, s) = rows x of group s's expert for all the group's pairs.
// Warp w: tile warp tw = w % 4 (local rows 16·tw .. +16), K group kg = w / 4 (KG K groups: group
// kg computes the chunks c ≡ kg mod KG; the partials are summed acc_0 + acc_1 in that order).
// gate_up: tile tw = 2j is gate rows n = 32x + 16j + (0..15), tw = 2j + 1 the up rows of the same
// n; act[p, n] = bf16(silu(bf16(gate·x)) · bf16(up·x)). down: rows n = 64x + 16·tw + (0..15),
// d[p, n] = bf16(down·act[p]).
template <class F, bool kGateUp, int MT, int KG>
__global__ void __launch_bounds__(kThreads * KG, KG == 1 ? 4 : 2)
    moe_grouped_gemv_kernel(const __grid_constant__ GroupedGemv p) {
  constexpr StageLayout lay = stage_layout<F, MT>();
  constexpr int kStages = stage_count<F, MT, KG>();
  constexpr int kCols = 8 * MT;
  constexpr int kCtaThreads = kThreads * KG;
  static_assert(kStages >= 2 * KG, "a step consumes KG chunks and refills KG stages");
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ const uint8_t* w_rows[kCtaRows];   // local row lr's first byte in the stack; nullptr: n ≥ N
  __shared__ int32_t col_pair[kCols];           // the pair of mma column c in this pass
  __shared__ int64_t col_src[kCols];            // element offset of column c's B row in p.b
  __shared__ float up_s[kGateUp ? kWarps / 2 : 1][kTileN][kCols];   // gate_up: bf16(up) handed to the gate warp
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int tw = warp % kWarps, kg = warp / kWarps;   // tile warp, K group
  const uint32_t smem_base = smem_u32(smem);
  const int s = blockIdx.y, K = p.k, N = p.n;

  if constexpr (kGateUp) {     // the group tables come from the kernel just before
    pdl_wait();
    pdl_launch_dependents();
  }
  // down: the group tables were complete before this grid launched (see the header: PDL).
  // Slot s < G always has table entries (garbage past num_groups, unused): one round trip.
  const int num_groups = *p.groups.num_groups;
  const int e = p.groups.expert[s];
  const int first = p.groups.start[s], count = p.groups.start[s + 1] - first;
  if (s >= num_groups) {
    if constexpr (!kGateUp) pdl_wait();   // every CTA waits before it exits
    return;
  }

  // ---- the CTA's 64 weight rows: local row lr = 16·tw + r (see above); thread tid < 64 sets up
  // local row tid.
  const uint8_t* s_row = nullptr;   // [K/16] e4m3: row tid's block scales (NVFP4), nullptr past N
  if (tid < kCtaRows) {
    const int lr = tid, tile = lr / kTileN;
    const int i = kGateUp ? tile % 2 : 0;
    const int n = kGateUp ? blockIdx.x * kGateUpRows + (tile / 2) * kTileN + lr % kTileN : blockIdx.x * kCtaRows + lr;
    const int64_t row = static_cast<int64_t>(e) * N + n;
    w_rows[lr] = n < N ? static_cast<const uint8_t*>(p.a[i].weight) + row * F::row_bytes(K) : nullptr;
    if constexpr (F::kScaled) s_row = n < N ? p.a[i].block_scale + row * (K / 16) : nullptr;
  }
  const int num_chunks = ceil_div(K, kChunkK);
  const bool k_vec = K % kChunkK == 0;

  // Stage at byte offset st ← chunk c's weights (and scales). Weights are constants: no kernel
  // before this one writes them, so down issues its first chunks before griddepcontrol.wait.
  auto issue_weights = [&](int st, int c) {
    const int k_rem = K - c * kChunkK;
    static_assert(kCtaRows * F::kPieces % kCtaThreads == 0, "whole pieces per thread");
#pragma unroll
    for (int j = 0; j < kCtaRows * F::kPieces / kCtaThreads; ++j) {
      const int q = tid + kCtaThreads * j, lr = q / F::kPieces, u = q % F::kPieces;
      const uint8_t* row = w_rows[lr];
      const bool ok = row != nullptr && u * F::kPieceK < k_rem;
      cp_async16(smem_base + st + lay.w_off + F::slot(lr, u), ok ? row + c * F::kRowBytes + u * 16 : p.a[0].weight,
                 ok ? 16 : 0);
    }
    if constexpr (F::kScaled) {
      if (tid >= kCtaRows) return;
      if (k_vec) {
        cp_async8(smem_base + st + lay.s_off + tid * F::kScaleBytes,
                  s_row != nullptr ? s_row + c * F::kScaleBytes : p.a[0].block_scale, s_row != nullptr ? 8 : 0);
      } else {   // K % 128 != 0: a row's scales are only 2-byte aligned (K/16 even)
        uint16_t* dst = reinterpret_cast<uint16_t*>(smem + st + lay.s_off + tid * F::kScaleBytes);
#pragma unroll
        for (int j = 0; j < F::kScaleBytes / 2; ++j) {
          const bool ok = s_row != nullptr && 32 * j < k_rem;
          dst[j] = ok ? __ldg(reinterpret_cast<const uint16_t*>(s_row + c * F::kScaleBytes) + j) : uint16_t(0);
        }
      }
    }
  };
  // Stage st ← chunk c's activations of the pass's `rows` columns: thread tid copies unit
  // tid % 16 of rows tid / 16, tid / 16 + kCtaThreads / 16, …
  const int x_u = tid % kXUnits, x_r0 = tid / kXUnits;
  constexpr int kXRowStep = kCtaThreads / kXUnits;
  auto issue_acts = [&](int st, int c, int rows) {
    const bool ok = 8 * x_u < K - c * kChunkK;
    for (int r = x_r0; r < rows; r += kXRowStep) {
      const __nv_bfloat16* src = p.b + col_src[r] + c * kChunkK + 8 * x_u;
      cp_async16(smem_base + st + lay.x_off + r * kXRowBytes + bf16_unit_slot(r, x_u) * 16, ok ? src : p.b,
                 ok ? 16 : 0);
    }
  };

  float acc[MT][4];
  const int row0 = tw * kTileN;   // the warp's tile: local rows row0 .. row0 + 15
  // One chunk on the tensor cores: 4 words × 2 mma steps × the live n8 tiles.
  auto compute_stage = [&](int st, int live_mt) {
    const uint8_t* ws = smem + st + lay.w_off;
    const uint8_t* xs = smem + st + lay.x_off;
    const typename F::Frag f = F::load(ws, smem + st + lay.s_off, row0, g, t);
#pragma unroll
    for (int wd = 0; wd < 4; ++wd) {
      uint32_t ra[4], rb[4];
      F::word(f, ws, row0, g, t, wd, ra, rb);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt >= live_mt) break;   // warp-uniform
        const int xr = 8 * mt + g;   // activation row (column of the mma)
        const uint4 xv = permute_unit(
            *reinterpret_cast<const uint4*>(xs + xr * kXRowBytes + bf16_unit_slot(xr, 4 * t + wd) * 16));
        mma_bf16_16816(acc[mt], ra[0], rb[0], ra[1], rb[1], xv.x, xv.y);   // h = 0
        mma_bf16_16816(acc[mt], ra[2], rb[2], ra[3], rb[3], xv.z, xv.w);   // h = 1
      }
    }
  };
  auto stage_of = [&](int c) { return (c % kStages) * lay.bytes; };   // chunk c's stage offset

  // ---- passes of ≤ 8·MT pairs (one pass unless M > 8·MT) ----
  for (int c0 = 0; c0 < count; c0 += kCols) {
    const int rows = min(kCols, count - c0), live_mt = ceil_div(rows, 8);
    if (tid < rows) {
      const int pair = p.groups.pairs[first + c0 + tid];
      col_pair[tid] = pair;
      col_src[tid] = static_cast<int64_t>(kGateUp ? pair / p.top_k : pair) * K;
    }
    __syncthreads();   // w_rows, col_pair, col_src visible; the previous pass is done with the stages
    const bool warp_live = w_rows[row0] != nullptr;   // N % 16 == 0: the tile's rows are all in or all out
    // prologue: chunks 0 .. kStages − KG − 1. Commit group 0 = their weights + chunk 0's
    // activations, group q = chunk q's activations.
#pragma unroll
    for (int q = 0; q < kStages - KG; ++q) {
      if (q < num_chunks) issue_weights(stage_of(q), q);
    }
    if (!kGateUp && c0 == 0) {   // act comes from the gate_up kernel
      pdl_wait();
      pdl_launch_dependents();
    }
#pragma unroll
    for (int q = 0; q < kStages - KG; ++q) {
      if (q < num_chunks) issue_acts(stage_of(q), q, rows);
      cp_async_commit();
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mt][q] = 0.0f;
    }
    // step c: chunks c .. c + KG − 1 (K group kg computes chunk c + kg); commit group q = chunk q
    for (int c = 0; c < num_chunks; c += KG) {
      cp_async_wait<kStages - 2 * KG>();   // this thread's copies of chunks ≤ c + KG − 1 landed
      __syncthreads();                     // … everyone's; every warp is done with step c − KG's stages
#pragma unroll
      for (int j = 0; j < KG; ++j) {       // refill the stages of chunks c − KG .. c − 1
        const int q = c + kStages - KG + j;
        if (q < num_chunks) {
          issue_weights(stage_of(q), q);
          issue_acts(stage_of(q), q, rows);
        }
        cp_async_commit();
      }
      if (warp_live && c + kg < num_chunks) compute_stage(stage_of(c + kg), live_mt);
    }
    cp_async_wait<0>();   // only empty groups are left
    __syncthreads();      // every warp is done with the stages (the K-group sum reuses them)

    // ---- K groups: acc = acc_0 + acc_1 (fixed order: a function of K only) ----
    if constexpr (KG == 2) {
      float* part = reinterpret_cast<float*>(smem);   // [kWarps][MT][4][32 lanes]
      if (kg == 1 && warp_live) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int q = 0; q < 4; ++q) part[((tw * MT + mt) * 4 + q) * 32 + lane] = acc[mt][q];
        }
      }
      __syncthreads();
      if (kg == 0 && warp_live) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[mt][q] += part[((tw * MT + mt) * 4 + q) * 32 + lane];
        }
      }
    }

    // ---- store: y = acc · global_scale · 2^7 (NVFP4) | acc (BF16), rounded once to bf16 ----
    // gate_up: the up warp (odd tw) hands bf16(up) of its tile to the gate warp (even tw) of the
    // same rows through smem; the gate warp stores act = bf16(silu(g) · u).
    const int stack = kGateUp ? tw % 2 : 0;
    const float factor = F::kScaled ? p.a[stack].global_scale[e] * kOutBias : 1.0f;
    if constexpr (kGateUp) {
      if (kg == 0 && stack == 1) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (mt >= live_mt) break;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            up_s[tw / 2][g + 8 * (q >> 1)][8 * mt + 2 * t + (q & 1)] =
                __bfloat162float(__float2bfloat16(acc[mt][q] * factor));
          }
        }
      }
      __syncthreads();
    }
    if (kg == 0 && warp_live && stack == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt >= live_mt) break;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int col = 8 * mt + 2 * t + (q & 1), r = g + 8 * (q >> 1);
          if (col >= rows) continue;
          const int64_t out_row = static_cast<int64_t>(col_pair[col]) * N;
          const float v = __bfloat162float(__float2bfloat16(acc[mt][q] * factor));
          if constexpr (kGateUp) {
            const float u = up_s[tw / 2][r][col];
            p.out[out_row + blockIdx.x * kGateUpRows + (tw / 2) * kTileN + r] =
                __float2bfloat16(v / (1.0f + expf(-v)) * u);
          } else {
            p.out[out_row + blockIdx.x * kCtaRows + tw * kTileN + r] = __float2bfloat16(acc[mt][q] * factor);
          }
        }
      }
    }
    __syncthreads();      // every warp is done with col_pair, up_s and the partials before the next pass
  }
}

// ---- 4. combine -------------------------------------------------------------------------------

constexpr int kCombineThreads = 128;
constexpr int kCombineVec = 8;   // columns per thread (one 16-byte load per slot)

// grid (ceil(h / (8·128)), T): out[t, n .. n+8] = Σ_j weights[t, j] · d[t·k + j, n .. n+8] over
// the in-range slots in order (f32 fmaf), then the shared-expert term or the output rounding.
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(
    const __nv_bfloat16* __restrict__ d,       // [T·k, h]
    const int32_t* __restrict__ ids,           // [T, k]
    const float* __restrict__ weights,         // [T, k]
    const __nv_bfloat16* __restrict__ shared,        // [T, h] or nullptr
    const __nv_bfloat16* __restrict__ shared_gate,   // [T] (stride shared_gate_stride)
    int64_t shared_gate_stride,
    bool out_bf16,
    void* __restrict__ out,                    // [T, h] f32 | bf16 (shared or out_bf16)
    int top_k, int num_experts, int hidden) {
  __shared__ float w_s[kMoeExpertsMaxTopK];      // weight of slot j
  __shared__ bool valid_s[kMoeExpertsMaxTopK];   // ids[t, j] in [0, E): d row written
  const int64_t t = blockIdx.y;
  const int n0 = (blockIdx.x * kCombineThreads + threadIdx.x) * kCombineVec;
  pdl_wait();                  // d comes from the down kernel
  pdl_launch_dependents();
  if (threadIdx.x < top_k) {
    const int e = ids[t * top_k + threadIdx.x];
    valid_s[threadIdx.x] = e >= 0 && e < num_experts;
    w_s[threadIdx.x] = weights[t * top_k + threadIdx.x];
  }
  __syncthreads();
  if (n0 >= hidden) return;
  float acc[kCombineVec] = {};
#pragma unroll 4
  for (int j = 0; j < top_k; ++j) {
    if (!valid_s[j]) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(d + (t * top_k + j) * hidden + n0);
    const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < kCombineVec / 2; ++i) {
      const float2 f = __bfloat1622float2(v2[i]);
      acc[2 * i] = fmaf(w_s[j], f.x, acc[2 * i]);
      acc[2 * i + 1] = fmaf(w_s[j], f.y, acc[2 * i + 1]);
    }
  }
  const int64_t o = t * hidden + n0;
  if (shared != nullptr) {   // element loads: `shared` may be any contiguous bf16 view (2-byte aligned)
    const float sg = __bfloat162float(shared_gate[t * shared_gate_stride]);
    __align__(16) __nv_bfloat16 r[kCombineVec];
#pragma unroll
    for (int i = 0; i < kCombineVec; ++i) {
      r[i] = __float2bfloat16(acc[i] + __bfloat162float(shared[o + i]) / (1.0f + expf(-sg)));
    }
    *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(out) + o) = *reinterpret_cast<const uint4*>(r);
  } else if (out_bf16) {
    __align__(16) __nv_bfloat16 r[kCombineVec];
#pragma unroll
    for (int i = 0; i < kCombineVec; ++i) r[i] = __float2bfloat16(acc[i]);
    *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(out) + o) = *reinterpret_cast<const uint4*>(r);
  } else {
    float4* dst = reinterpret_cast<float4*>(static_cast<float*>(out) + o);
    dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
}

// ---- launchers --------------------------------------------------------------------------------

constexpr int kMaxDevices = 64;   // per-device opt-in bookkeeping

// K groups per CTA: gate_up 2 (8 warps; B = 1 has 144 gate_up CTAs, so 1152 warps instead of
// 576 for 528 schedulers: a warp's 16-chunk dequant chain halves), down 1 (its B = 1 grid already
// has 288 CTAs × 4 warps, and I = 512 is only 4 chunks). A function of the role only, never of
// T: the K order of a dot must not depend on the batch.
constexpr int kGateUpKGroups = 2;
constexpr int kDownKGroups = 1;

template <class F, bool kGateUp, int MT>
cudaError_t launch_grouped_gemv(const GroupedGemv& p, dim3 grid, cudaStream_t stream) {
  constexpr int kg = kGateUp ? kGateUpKGroups : kDownKGroups;
  auto kernel = moe_grouped_gemv_kernel<F, kGateUp, MT, kg>;
  constexpr int smem = stage_count<F, MT, kg>() * stage_layout<F, MT>().bytes;   // opt-in: the most a launch uses
  // Opt in above the default 48 KB once per device and instance (later calls, e.g. under graph
  // capture, make no attribute call).
  if constexpr (smem > 48 * 1024) {
    static bool opted_in[kMaxDevices] = {};
    int dev = 0;
    ATLAS_RETURN_IF_ERROR(cudaGetDevice(&dev));
    if (dev < 0 || dev >= kMaxDevices) return cudaErrorInvalidDevice;
    if (!opted_in[dev]) {
      ATLAS_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      opted_in[dev] = true;
    }
  }
  // the K-group partials ([4 warps][MT][4][32] f32) reuse the first stage
  static_assert(kWarps * MT * 4 * 32 * 4 <= stage_layout<F, MT>().bytes, "partials fit one stage");
  const int stages = std::min(stage_count<F, MT, kg>(), ceil_div(p.k, kChunkK));
  return launch_pdl(kernel, grid, dim3(kThreads * kg), static_cast<size_t>(stages) * stage_layout<F, MT>().bytes,
                    stream, p);
}

// MT = n8 column tiles = ceil(T / 8) clamped to [1, 4]: a group holds ≤ T pairs when a row's ids
// are distinct (moe_route's are); more pairs (T > 32, repeated ids) loop over passes.
template <class F, bool kGateUp>
cudaError_t launch_grouped_gemv_mt(int mt, const GroupedGemv& p, dim3 grid, cudaStream_t stream) {
  switch (mt) {
    case 1: return launch_grouped_gemv<F, kGateUp, 1>(p, grid, stream);
    case 2: return launch_grouped_gemv<F, kGateUp, 2>(p, grid, stream);
    case 3: return launch_grouped_gemv<F, kGateUp, 3>(p, grid, stream);
    default: return launch_grouped_gemv<F, kGateUp, kMaxMT>(p, grid, stream);
  }
}

template <class F>
cudaError_t launch_typed(const MoeExpertsArgs& a, const GroupTables& groups, const Workspace& ws, cudaStream_t stream) {
  uint8_t* base = static_cast<uint8_t*>(a.workspace);
  auto* act = reinterpret_cast<__nv_bfloat16*>(base + ws.act);
  auto* d = reinterpret_cast<__nv_bfloat16*>(base + ws.d);
  const int64_t pairs = a.num_tokens * a.top_k;
  const unsigned max_groups = static_cast<unsigned>(std::min<int64_t>(pairs, a.num_experts));
  const int mt = static_cast<int>(std::min<int64_t>(kMaxMT, ceil_div<int64_t>(a.num_tokens, 8)));

  GroupedGemv gate_up{static_cast<const __nv_bfloat16*>(a.x), {a.gate, a.up}, groups, act, a.inter, a.hidden, a.top_k};
  const dim3 gate_up_grid(static_cast<unsigned>(a.inter / kGateUpRows), max_groups);
  ATLAS_RETURN_IF_ERROR((launch_grouped_gemv_mt<F, true>(mt, gate_up, gate_up_grid, stream)));
  GroupedGemv down{act, {a.down, a.down}, groups, d, a.hidden, a.inter, a.top_k};
  const dim3 down_grid(static_cast<unsigned>(ceil_div(a.hidden, kCtaRows)), max_groups);
  ATLAS_RETURN_IF_ERROR((launch_grouped_gemv_mt<F, false>(mt, down, down_grid, stream)));
  return launch_pdl(moe_combine_kernel,
                    dim3(static_cast<unsigned>(ceil_div(a.hidden, kCombineThreads * kCombineVec)),
                         static_cast<unsigned>(a.num_tokens)),
                    dim3(kCombineThreads), 0, stream, static_cast<const __nv_bfloat16*>(d), a.ids, a.weights,
                    static_cast<const __nv_bfloat16*>(a.shared), static_cast<const __nv_bfloat16*>(a.shared_gate),
                    a.shared_gate_stride, a.out_bf16, a.out, a.top_k, a.num_experts, a.hidden);
}

bool sizes_ok(int64_t num_tokens, int top_k, int num_experts, int hidden, int inter) {
  auto dim_ok = [](int v) { return v >= 32 && v % 32 == 0 && v <= kMoeExpertsMaxHidden; };
  return dim_ok(hidden) && dim_ok(inter) && num_tokens >= 1 && top_k >= 1 && top_k <= kMoeExpertsMaxTopK &&
         num_tokens * top_k <= kMoeExpertsMaxPairs && num_experts >= 1 && num_experts <= kMoeExpertsMaxExperts;
}

}  // namespace

size_t moe_experts_workspace_bytes(int64_t num_tokens, int top_k, int num_experts, int hidden, int inter) {
  if (!sizes_ok(num_tokens, top_k, num_experts, hidden, inter)) return 0;
  return workspace_layout(num_tokens, top_k, num_experts, hidden, inter).bytes;
}

cudaError_t launch_moe_experts(const MoeExpertsArgs& a, cudaStream_t stream) {
  if (!sizes_ok(a.num_tokens, a.top_k, a.num_experts, a.hidden, a.inter) || a.x == nullptr || a.ids == nullptr ||
      a.weights == nullptr || a.workspace == nullptr || a.out == nullptr ||
      (a.shared != nullptr && a.shared_gate == nullptr)) {
    return cudaErrorInvalidValue;
  }
  auto aligned = [](const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; };
  // 16-byte cp.async of x / act rows and weight pieces, 8-byte of scale pieces, 16-byte stores of out
  if (!aligned(a.x, 16) || !aligned(a.out, 16) || !aligned(a.workspace, 256)) return cudaErrorInvalidValue;
  for (const ExpertStack* s : {&a.gate, &a.up, &a.down}) {
    if (s->weight == nullptr || !aligned(s->weight, 16) ||
        (a.nvfp4 && (s->block_scale == nullptr || !aligned(s->block_scale, 8) || s->global_scale == nullptr))) {
      return cudaErrorInvalidValue;
    }
  }
  const Workspace ws = workspace_layout(a.num_tokens, a.top_k, a.num_experts, a.hidden, a.inter);
  uint8_t* base = static_cast<uint8_t*>(a.workspace);
  auto table = [&](size_t off) { return reinterpret_cast<int32_t*>(base + off); };
  const GroupTables groups{table(ws.num_groups), table(ws.expert), table(ws.start), table(ws.pairs)};
  const int pairs = static_cast<int>(a.num_tokens * a.top_k);
  const size_t group_smem = static_cast<size_t>(a.num_experts + std::min(pairs, kGroupStagedIds)) * sizeof(int32_t);
  ATLAS_RETURN_IF_ERROR(launch_pdl(moe_group_kernel, dim3(1), dim3(kGroupThreads), group_smem, stream, a.ids, pairs,
                                   a.num_experts, groups));
  return a.nvfp4 ? launch_typed<Nvfp4Format>(a, groups, ws, stream) : launch_typed<Bf16Format>(a, groups, ws, stream);
}

}  // namespace atlas
