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
// which experts run. The T·k pairs are grouped by expert on the device and each expert hit runs
// ONCE for all its pairs on tensor cores: an expert's weights stream from DRAM once whatever the
// number of tokens that picked it, and its pairs are the n8 columns of the mma (swap-AB, as
// w4a16_gemv: weight rows are the 16-row A operand, activation rows the B operand).
//
// Few pairs (T·k ≤ 36, NVFP4, h and I multiples of 128; indexed_path): three launches through
// w4a16_gemv's one-row kernel, expert-indexed, one slot per pair (launch_indexed: gate+up dual,
// silu down, combine) — the grouped kernels below are latency- or issue-bound there, and their
// sums follow the one-row kernel's K segment order, so the two paths give the same bits. Otherwise
// four launches (three at T·k ≤ 32), all with programmatic dependent launch (common/pdl.cuh):
//   1. group (1 CTA, 256 threads): counting sort of the valid pairs by expert into RECORDS: an
//      expert with c pairs gets ceil(c / C) consecutive records (C = 8·MT columns), record r =
//      {expert, rows = its pairs (1..C)} and pairs[r][0..rows)
//      in ascending pair order; experts in ascending id order; num_records = R. Counts by
//      shared-memory atomics (order-free), one block scan of the records per expert, then warp 0
//      scatters the pairs 32 at a time in pair order (__match_any_sync ranks lanes with the same
//      expert), so the lists are deterministic. Buffers sized for the worst case R ≤ min(T·k, E)
//      + T·k / C + 1: no host sync, graph-capturable. T·k ≤ 32 (B ≤ 3 decode steps at k = 9):
//      not launched; warp 0 of every GEMV CTA builds the same records in shared memory from the
//      ids (lane = pair: __match_any_sync groups, a ballot over the group leaders ranks the
//      experts), one dependent launch and two table round trips fewer.
//   2. gate_up, 3. down: PERSISTENT grouped GEMVs. A job is (record r, row tile x): 64 weight
//      rows of expert e for the record's ≤ C pairs, jobs J = r·tiles + x. The grid is fixed
//      from the host (SMs × resident CTAs per SM, at most the jobs bound); CTA b runs jobs b,
//      b + grid, b + 2·grid, … < R·tiles (so the CTAs running at one time share records: nearby
//      rows of one expert), as ONE stream of 128-k chunks through one cp.async ring: the next
//      jobs' first chunks are in flight while this job's last ones are computed, so a job
//      boundary costs no DRAM round trip and no launch. A job's record (expert, rows,
//      its C pair ids) is loaded into warp 0's registers one job ahead and written to a smem
//      job slot (kSlots in a ring) before the step that first issues its chunks; the
//      expert's global scales follow by cp.async into the slot, landing with its first chunk.
//      gate_up: 128 threads = 4 tile warps, one 16-row A tile each; tiles = I / 32 (T·k ≤ 32:
//      64 threads = 2 tile warps, tiles = I / 16; the job geometry never changes a dot's bits).
//      Tile warps 2j and 2j+1 own the gate and the up rows n = 32x + 16j .. +16, so silu(g)·u
//      fuses in the epilogue (the up warp hands bf16(u) to the gate warp through 2 KB of smem).
//      Every dot is summed as w4a16_gemv sums a row: K cut into w4a16_gemv_k_splits(K) segments,
//      each segment's partial from 0 over its chunks in order, the partials added to 0 in
//      segment order (v5; v3–v4 split gate_up's chunks over two K groups, even and odd, whose
//      partials no GEMV reproduces). Columns = the record's pairs, B
//      row = x[p / k]. Stores act[p, n] = bf16(silu(bf16(g)) · bf16(u)), each 8-element unit of
//      an act row in the mma K order (n0, n4, n1, n5, n2, n6, n3, n7: what permute_unit makes of
//      an activation unit; natural order for stacks in the GEMV word order, below), so down
//      takes its B fragments as loaded (no prmt).
//      down: 128 threads, 4 tile warps; rows n = 64x + 16·tw .. +16, tiles = ceil(h / 64);
//      B row = act[p]; stores d[p, n] = bf16(dot) into a [T·k, h] bf16 scratch.
//      MT (template, from T at launch): 1 for T ≤ 64 (C = 8: the stage is 6.5 KB, so deep rings
//      fit 5 gate_up / 6 down CTAs per SM; an expert hit by c > 8 pairs, at B = 32 only the shared expert,
//      becomes ceil(c/8) records whose jobs run side by side and re-read it from L2), 4 above
//      (C = 32). Of a record's MT n8 tiles ceil(rows/8) are live (warp-uniform branch).
//   2', 3' (v8): NVFP4 at MT = 1 with whole chunks (K % 128 == 0, ≥ 2 chunks: every Qwen3.6
//      MoE at 17..64 tokens) runs the same jobs on moe_warp_gemv_kernel instead — every warp its
//      own job stream and cp.async ring, two 16-row A tiles per warp job (gate + up of the same
//      rows, or two down tiles) on one B fragment, no CTA-wide step; same bits (see there).
//   4. combine: grid (ceil(h / 1024), T), 128 threads × 8 columns: out[t] = Σ_j in slot order
//      (skipping out-of-range ids) + the shared-expert term; 8 slots' row loads in flight at once.
//
// Grouped GEMV (2, 3) per job and 128-k chunk (K = h for gate_up, I for down):
//   A tile: lane (g = lane/4, t = lane%4) holds rows g and g+8 of its warp's tile and the 32
//     contiguous k [32t, 32t+32) of each (NVFP4: one 16-byte smem load + 2 scale bytes
//     per row; BF16: one 16-byte load per word). K permutation, dequant (exact e2m1 · scale ·
//     2^-7 in bf16, the 2^7 and the global scale applied once in f32 on the store) and the
//     m16n8k16 calls are w4a16_gemv's (csrc/w4a16_gemv.cu header, common/nvfp4_mma.cuh): mma
//     step (w, h) pairs physical k (8w+2h, 8w+2h+4) and (8w+2h+1, 8w+2h+5) + 32t; the B
//     fragment is the 16-byte activation unit k 32t+8w .. +8 of row g, permuted by 4 prmt at
//     read time (gate_up; down's act units are stored permuted; BF16 weights get the same
//     permutation). NVFP4 stacks in the GEMV word bit order (gemv_words, v7: ops.moe_experts'
//     [E, N, K/8, 4] form, which atlas's expert banks hold on CUDA) dequantize to k-adjacent
//     pairs (dequant_word_tiled, w4a16_gemv v3.17's words): step h takes k 8w+4h .. +4 of the
//     unit in order, so the activations and act are used and stored as they are (no prmt).
//   pipeline: the CTA's jobs are one flat sequence of positions, ceil(nc / P)·P per job (nc =
//     ceil(K / 128) chunks, P = CW positions per step, CW chunks per warp and step: 2 for
//     NVFP4 at MT = 1, else 1; positions ≥ nc of a job are empty when P ∤ nc); kStages cp.async
//     stages (Format::stages), position q in stage q % kStages; one commit group per position;
//     step s computes positions s·P + w (w < CW, in that order) and issues
//     positions s·P + kStages − P + j (j < P) after one barrier, so the barrier, the cursors and
//     the job-slot reads are paid once per CW chunks. A stage holds 16·TW weight rows × 64 B
//     (NVFP4) | 256 B (BF16),
//     16·TW × 8 scale bytes (NVFP4), 8·MT activation rows × 256 B (16-byte units swizzled by
//     bf16_unit_slot: conflict-free fragment loads). Copies: 16-byte weight pieces (contiguous
//     per row: conflict-free smem writes), 8 scale bytes per thread < 64 (K % 128 == 0; else
//     16-bit loads, synchronous: only odd test shapes take it), one 16-byte unit per live
//     activation row per 16 threads, from per-thread source pointers set once per job; the
//     position, job and stage cursors advance by counters (no integer division in the loop).
//     K tails (K % 32 == 0) zero-fill weights and activations. ptxas (NVFP4, MT = 1, v5): gate_up
//     94 registers under __launch_bounds__(128, 5) (TW = 2: 118 under (64, 5)), down 80 under
//     (128, 6); no spills. SASS of one down step (2 chunks) ≈ 560 instructions: per chunk ≈ 280
//     (dequant 153, mma + fragments ≈ 45, copies ≈ 54, cursors, slot reads, the barrier ≈ 30),
//     ≈ w4a16_gemv v2's ≈ 280–290.
//   Activation rows ≥ the record's rows are zero-filled or stale: they feed only mma
//     columns ≥ rows, which are never stored (mma columns are independent dot products).
//   PDL: gate_up waits for the grouping kernel (local grouping: for the ids' producer) before
//     reading anything. down reads the records (or the ids) and issues its first kStages − CW
//     chunks of weights BEFORE griddepcontrol.wait: it is launched only once every gate_up CTA
//     has executed launch_dependents or exited, and every gate_up CTA does either only after its
//     own wait, which returns once the grouping grid (the ids' producer) has completed. The
//     combine reads ids, weights and the shared-expert inputs before its wait for the same
//     reason. Every CTA of every launch waits before it exits, so each grid's completion
//     implies its predecessors' (the workspace may be reused by the stream's next op).
//
// Batch invariance: a pair's dot is the same bits whatever else is in the batch — its column's
// mma sequence (chunks in order, 8 steps each, the K segment partials summed in order) depends
// on K only, not on MT, on the column or record it lands in, or on the CTA that runs the job —
// and it is w4a16_gemv's, so the one-token path is the same bits; the combine sums slots in
// order j. Tested bitwise (one token alone == that token inside a 32-token batch sharing all
// its experts, and inside an 80-token batch).
//
// Versions (bench: python bench/bench_mtp.py --parts; tests: tests/test_moe_route.py,
// csrc/tests/test_mtp_kernels.cu):
//   v1: CUDA cores, one warp per output row, one dot at a time; 2 launches.
//   v2: load phase for all of a warp's dots before the math; pairs sorted by expert by a torch
//       argsort so shared experts re-read from L2; down grid tokens-fastest. H200 (35B-A3B MTP
//       head): 43.8 µs at B = 1 (+ 9.0 sort), 733 µs at B = 32 (+ 20.6 sort).
//   v3: device grouping + tensor-core grouped GEMVs (an expert read once for all its pairs) +
//       combine; 4 launches, no torch sort; grid (row tiles, G = min(T·k, E) group slots).
//       H200: 22.4 µs at B = 1, 188.5 at B = 32 (0.37 of copy bandwidth): ≈ 95 of the 257
//       slots empty at B = 32 (4500 CTAs that only read the tables), and every CTA paid two
//       dependent table round trips + a cold pipeline fill + a drain for 18 KB (down) or 72 KB
//       (gate_up) of weights.
//   v4: persistent CTAs over (record, row tile) jobs, one chunk stream across jobs; records of
//       ≤ 8·MT pairs from the grouping kernel; MT = 1 up to T = 64. Same bits as v3. H200:
//       23.8 µs at B = 1, 168.9 at B = 32.
//   v5: sums in w4a16_gemv's K segment order (gate_up's two K groups dropped: 4-warp
//       CTAs); one token through the expert-indexed one-row GEMV (3 launches).
//   v6: the indexed path for every T·k ≤ 144 (one slot per pair, x row p / k), not
//       just T = 1: T = 4 / 8 / 16 −21 / −21 / −7% (moe_probe, see indexed_path); the combine
//       keeps 8 slots' loads in flight (T = 1 −0.7 µs, T = 32 −2.6).
//   v7: NVFP4 stacks in the GEMV word bit order (gemv_words, derived once at load by the
//       expert banks): no activation prmt in gate_up, act stored in natural order, and the
//       indexed path's one-row kernel takes its natural-order instance. moe_probe timing of
//       random words (session 21, call 1, µs): T = 1 17.7 → 16.9, 8 61.0 → 56.0, 16 104.8 →
//       94.2, 32 148.1 → 136.2, 64 202.5 → 186.7.
//   v8: the warp-streamed grouped GEMV (2', 3') for NVFP4 records of 8 pairs. moe_probe
//       (session 24, call 6, words, µs): T = 17 99.7 → 77.0, 24 120.5 → 99.5, 32 133.4 → 108.1,
//       64 193.7 → 153.9; ncu T = 32 gate_up 91.1 → 79.7, down 48.7 → 36.6 (cold).
//   v9 (this): (a) the indexed path only up to T·k = 36 (T = 4 at k = 9): with v8 the grouped
//       kernels win from T = 5 (moe_probe, session 25 call 1, µs indexed → grouped: T = 4 32.8 →
//       34.8, 6 44.1 → 40.6, 8 53.4 → 47.5, 16 92.4 → 76.1). (b) tiled stacks (MoeExpertsArgs::
//       tiled, what the expert banks hold on CUDA): each expert chunk-major, so the 8 rows of a
//       copy instruction and the rows of the neighbouring warps' jobs are one contiguous run per
//       chunk instead of 8 rows K/2 bytes apart — the kernels take the two layouts' row and
//       chunk strides at run time (StackStrides), the bits do not change. moe_probe (call 2,
//       µs, words → tiled): T = 1 16.0 → 14.4, 4 32.7 → 30.4, 8 48.3 → 41.8, 16 73.6 → 65.8,
//       32 108.0 → 96.6, 64 148.9 → 134.3 (the probe's random-byte stacks, timing only).
//
// Floor: bytes = (experts hit) · (2·I·h + h·I) · B_w (B_w = 9/16 NVFP4, 2 BF16) + x, act, d, out.
//   35B-A3B (h 2048, I 512, top-8 of 256 + the shared expert as slot 8), NVFP4: B = 1: 9 experts
//   × 1.77 MB = 15.9 MB → 3.8 µs at 4.2 TB/s; B = 32: ≈ 163 distinct experts × 1.77 MB ≈ 289 MB
//   → ≈ 69 µs.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common/checks.h"
#include "common/nvfp4_mma.cuh"
#include "common/pdl.cuh"
#include "common/prefetch.cuh"
#include "moe_experts.h"
#include "w4a16_gemv.h"

namespace atlas {
namespace {

constexpr int kMaxMT = 4;              // n8 tiles: ≤ 32 columns (pairs) per record
constexpr int kMt1MaxTokens = 64;      // T up to which records hold 8 pairs (MT = 1); above: 32

// n8 column tiles per record, a function of T only (the bits never depend on it).
int plan_mt(int64_t num_tokens) { return num_tokens <= kMt1MaxTokens ? 1 : kMaxMT; }

// ---- workspace --------------------------------------------------------------------------------

// Byte offsets of the scratch buffers inside args.workspace (each 256-byte aligned).
struct Workspace {
  size_t num_records;   // int32 [1]       R
  size_t info;          // int2 [R_max]    record r: {expert, rows}
  size_t pairs;         // int32 [R_max, C] pair ids of record r (columns ≥ rows never written)
  size_t act;           // bf16 [T·k, I]   silu(g)·u per pair, units in mma K order (invalid pairs' rows unwritten)
                        //                 (natural order with gemv_words)
  size_t d;             // bf16 [T·k, h]   down output per pair (idem)
  size_t up;            // indexed_path only: bf16 [T·k, I] up · x per pair (act holds gate · x), else 0 bytes
  size_t bytes;
  int mt;               // n8 tiles per record, C = 8·mt columns
  int max_records;      // R_max = min(T·k, E) + T·k / C + 1 ≥ Σ_e ceil(c_e / C)
};

bool indexed_path(int64_t num_tokens, int top_k, int hidden, int inter);   // the one-row GEMV path (below)

Workspace workspace_layout(int64_t num_tokens, int top_k, int num_experts, int hidden, int inter) {
  auto align = [](size_t v) { return (v + 255) / 256 * 256; };
  const int64_t pairs = num_tokens * top_k;
  Workspace w;
  w.mt = plan_mt(num_tokens);
  const int64_t cols = 8 * w.mt;
  w.max_records = static_cast<int>(std::min<int64_t>(pairs, num_experts) + pairs / cols + 1);
  size_t off = 0;
  w.num_records = off;  off = align(off + sizeof(int32_t));
  w.info = off;         off = align(off + static_cast<size_t>(w.max_records) * sizeof(int2));
  w.pairs = off;        off = align(off + static_cast<size_t>(w.max_records) * cols * sizeof(int32_t));
  w.act = off;          off = align(off + static_cast<size_t>(pairs) * inter * sizeof(__nv_bfloat16));
  w.d = off;            off = align(off + static_cast<size_t>(pairs) * hidden * sizeof(__nv_bfloat16));
  const bool indexed = indexed_path(num_tokens, top_k, hidden, inter);
  w.up = off;           off = align(off + (indexed ? static_cast<size_t>(pairs) * inter * sizeof(__nv_bfloat16) : 0));
  w.bytes = off;
  return w;
}

struct Records {
  int32_t* count;   // [1]            R
  int2* info;       // [R_max]        {expert, rows}
  int32_t* pairs;   // [R_max, C]
};

// ---- 1. group the pairs by expert into records -----------------------------------------------

constexpr int kGroupThreads = 256;
constexpr int kGroupStagedIds = 2048;   // ids kept in smem for the scatter warp (beyond: re-read, L2)

// grid (1), block kGroupThreads; dynamic smem (2·E + min(T·k, kGroupStagedIds)) int32.
__global__ void __launch_bounds__(kGroupThreads) moe_group_kernel(
    const int32_t* __restrict__ ids,   // [T·k]
    int num_pairs,                     // T·k
    int num_experts,                   // E
    int cols,                          // C = 8·MT pairs per record
    Records rec) {
  extern __shared__ int32_t group_smem[];
  int32_t* seen = group_smem;                        // [E]: pairs of expert e (count, then scatter cursor)
  int32_t* first_rec = group_smem + num_experts;     // [E]: expert e's first record
  int32_t* staged = group_smem + 2 * num_experts;    // [min(T·k, kGroupStagedIds)] ids
  __shared__ int32_t warp_total[kGroupThreads / 32];   // records per warp
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  pdl_wait();                 // ids come from moe_route
  pdl_launch_dependents();
  for (int e = tid; e < num_experts; e += kGroupThreads) seen[e] = 0;
  __syncthreads();
  const int num_staged = min(num_pairs, kGroupStagedIds);
  for (int p = tid; p < num_pairs; p += kGroupThreads) {
    const int e = ids[p];
    if (p < num_staged) staged[p] = e;
    if (e >= 0 && e < num_experts) atomicAdd(&seen[e], 1);
  }
  __syncthreads();

  // exclusive scan of the records per expert: thread tid owns experts [e0, e1)
  const int per = ceil_div(num_experts, kGroupThreads);
  const int e0 = min(tid * per, num_experts), e1 = min(e0 + per, num_experts);
  int mine = 0;
  for (int e = e0; e < e1; ++e) mine += ceil_div(seen[e], cols);
  int incl = mine;   // inclusive over the warp
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += v;
  }
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  int next = incl - mine;
  for (int w = 0; w < warp; ++w) next += warp_total[w];
  for (int e = e0; e < e1; ++e) {
    const int c = seen[e];
    first_rec[e] = next;
    for (int q = 0; q * cols < c; ++q, ++next) {
      const int rows = min(cols, c - q * cols);
      rec.info[next] = make_int2(e, rows);
    }
    seen[e] = 0;
  }
  if (tid == kGroupThreads - 1) *rec.count = next;   // its run ends at E: next = R
  __syncthreads();

  // scatter in pair order (stable): 32 pairs per step, lanes with the same expert ranked by lane;
  // the i-th pair of expert e goes to record first_rec[e] + i / C, column i % C
  if (warp != 0) return;
  for (int base = 0; base < num_pairs; base += 32) {
    const int p = base + lane;
    const int e = p < num_pairs ? (p < num_staged ? staged[p] : ids[p]) : -1;
    const bool valid = e >= 0 && e < num_experts;
    const unsigned peers = __match_any_sync(0xffffffffu, valid ? e : -1);
    const int leader = __ffs(peers) - 1;
    const int rank = __popc(peers & ((1u << lane) - 1u));
    int pos = valid && lane == leader ? seen[e] : 0;
    pos = __shfl_sync(0xffffffffu, pos, leader);
    if (valid) {
      const int i = pos + rank;
      rec.pairs[static_cast<int64_t>(first_rec[e] + i / cols) * cols + i % cols] = p;
      if (lane == leader) seen[e] = pos + __popc(peers);
    }
    __syncwarp();
  }
}

// ---- 2, 3. persistent grouped GEMV on tensor cores -------------------------------------------

constexpr int kWarps = 4;                                 // tile warps per job (one 16-row A tile each)
constexpr int kLocalGateUpWarps = 2;                      // … gate_up at T·k ≤ 32: jobs of 16 I-rows
constexpr int kTileN = 16;                                // rows of one mma A tile
constexpr int kCtaRows = kWarps * kTileN;                 // 64 weight rows staged per down job
constexpr int kChunkK = 128;                              // K per pipeline stage
constexpr int kXRowBytes = kChunkK * 2;                   // 256 activation bytes per row per chunk
constexpr int kXUnits = kXRowBytes / 16;                  // 16 units of 8 bf16

// (x0..x7) → (x0,x4 | x1,x5 | x2,x6 | x3,x7): the K permutation of one 16-byte bf16 unit, giving
// the B fragment (activations) or the A fragment registers (BF16 weights) of mma steps h = 0, 1.
__device__ __forceinline__ uint4 permute_unit(uint4 a) {
  return make_uint4(prmt(a.x, a.z, 0x5410), prmt(a.x, a.z, 0x7632), prmt(a.y, a.w, 0x5410), prmt(a.y, a.w, 0x7632));
}

// gate_up's store position of act element n (n % 8 = j): its mma K position inside its 8-element
// unit — the order permute_unit gives (x0, x4, x1, x5, …): j → 2j (j < 4) | 2j − 7 — or n itself
// (kNaturalK: stacks in the GEMV word order).
template <bool kNaturalK>
__device__ __forceinline__ int act_position(int n, int j) {
  return kNaturalK ? n : n - j + (j < 4 ? 2 * j : 2 * j - 7);
}

// act = bf16(silu(g) · u), g and u the bf16-rounded gate and up dots as f32 (f32 math).
__device__ __forceinline__ __nv_bfloat16 silu_mul(float g, float u) {
  return __float2bfloat16(g / (1.0f + expf(-g)) * u);
}

// Weight formats: bytes per row per chunk, copy pieces, and the lane's A fragment of word wd.
// kNaturalK: the A fragment registers pair k-adjacent codes (NVFP4 stacks in the GEMV word bit
// order, MoeExpertsArgs::gemv_words): activations feed the mma as loaded and act is stored in
// natural order. Otherwise they pair (k, k + 4) and activations go through permute_unit (x: at
// read time; act: on gate_up's store).
template <bool kGemvWords>
struct Nvfp4Format {
  static constexpr bool kScaled = true;
  static constexpr bool kNaturalK = kGemvWords;
  // Stages: the persistent CTA streams job after job through one ring, kStages − P positions
  // ahead of the step it computes (P = CW chunks per step, CW = 2 at MT = 1). MT = 1 (6.5 KB per
  // stage): 5 — 3 chunks (14 KB of weights) ahead per CTA and 6 CTAs (33 KB smem, ≤ 80
  // registers) = 24 warps per SM: the dequant chains need the warps (w4a16_gemv: ≈ 9 cycles
  // between a warp's issues), and ≈ 80 KB in flight per SM cover DRAM latency.
  // MT = 4 (12.5 KB per stage, 8 KB of it activations; CW = 1): 6.
  __host__ __device__ static constexpr int stages(int mt) { return mt == 1 ? 5 : 6; }
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
    const __nv_bfloat162 sa = wd < 2 ? __low2bfloat162(f.fa) : __high2bfloat162(f.fa);
    const __nv_bfloat162 sb = wd < 2 ? __low2bfloat162(f.fb) : __high2bfloat162(f.fb);
    if constexpr (kGemvWords) {
      dequant_word_tiled(qa[wd], sa, ra);
      dequant_word_tiled(qb[wd], sb, rb);
    } else {
      dequant_word(qa[wd], sa, ra);
      dequant_word(qb[wd], sb, rb);
    }
  }
};

struct Bf16Format {
  static constexpr bool kScaled = false;
  static constexpr bool kNaturalK = false;   // A = permute_unit of the bf16 unit
  __host__ __device__ static constexpr int stages(int mt) { return mt == 1 ? 4 : 3; }   // 4× NVFP4's bytes
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

template <class F, int MT, int TW>
__host__ __device__ constexpr StageLayout stage_layout() {
  constexpr int rows = TW * kTileN;
  return StageLayout{0, rows * F::kRowBytes, rows * (F::kRowBytes + F::kScaleBytes),
                     rows * (F::kRowBytes + F::kScaleBytes) + 8 * MT * kXRowBytes};
}

// Resident CTAs per SM the launch bounds ask for: NVFP4 MT = 1 down 6 × 128 threads (≤ 80
// registers; the smem of 5 stages allows 6), gate_up 5 (≤ 96: at 80 its segment sums spill
// 28 bytes); else 2 (MT = 4's 6 stages of 12.5 KB and BF16's 18 KB stages allow no more).
template <class F>
__host__ __device__ constexpr int min_blocks(int mt, bool gate_up) {
  return F::kScaled && mt == 1 ? (gate_up ? 5 : 6) : 2;
}

// 4-byte async copy (a global scale into a job slot), in the thread's current commit group.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}

// Inside one expert of a stack (the expert at e·N·row_bytes(K) weight bytes, e·N·K/16 scale
// bytes): the bytes between weight rows n and n + 1 and between 128-k chunks c and c + 1 of a row,
// and the same for the scales (moe_experts.h, ExpertStack).
struct StackStrides {
  int w_row, w_chunk, s_row, s_chunk;
};

template <class F>
StackStrides stack_strides(int n, int k, bool tiled) {
  if (tiled) return {F::kRowBytes, n * F::kRowBytes, F::kScaleBytes, n * F::kScaleBytes};   // NVFP4 only
  return {static_cast<int>(F::row_bytes(k)), F::kRowBytes, k / 16, F::kScaleBytes};
}

struct GroupedGemv {
  const __nv_bfloat16* b;    // gate_up: x [T, h]; down: act [T·k, I] — B row of column c: b + src·K
  ExpertStack a[2];          // gate_up: gate, up [E, I, h]; down: down, down [E, h, I]
  const int32_t* num_records;   // [1] R
  const int2* info;          // [R] {expert, rows}
  const int32_t* pairs;      // [R, 8·MT]
  __nv_bfloat16* out;        // gate_up: act [T·k, I]; down: d [T·k, h]
  int n;                     // N weight rows per expert: I | h
  int k;                     // K: h | I (also the B row length)
  int top_k;
  int tiles;                 // row tiles per expert: I / 32 (gate_up) | ceil(h / 64) (down)
  // T·k ≤ kLocalPairs (MT = 1): no grouping launch; every CTA groups the pairs itself
  bool local;
  const int32_t* ids;        // [T·k] expert ids (local)
  int num_pairs;             // T·k
  int num_experts;           // E
  const float* gs[2];        // f32 [E] global scales of a[0], a[1] (NVFP4; down: gs[1] nullptr; BF16: both)
  int seg_chunks;            // 128-k chunks per K segment: w4a16_gemv's (w4a16_gemv_k_splits(K))
  StackStrides strides;      // inside one expert of a[0] and a[1]
};

constexpr int kLocalPairs = 32;   // pairs one warp groups (lane = pair)

// The grouping kernel's records for ≤ 32 pairs, built by one warp (lane = pair p) into shared
// memory, in the same order (ascending expert, its pairs ascending): returns R (all lanes).
__device__ int group_in_warp(const GroupedGemv& p, int cols, int2* info, int32_t* pairs, int lane) {
  const int e = lane < p.num_pairs ? p.ids[lane] : -1;
  const bool valid = e >= 0 && e < p.num_experts;
  const unsigned peers = __match_any_sync(0xffffffffu, valid ? e : -1);
  const int rank = __popc(peers & ((1u << lane) - 1u)), count = __popc(peers);   // i-th of c pairs
  unsigned leaders = __ballot_sync(0xffffffffu, valid && rank == 0);
  int first = 0, total = 0;   // records of the experts below e, of all experts
  while (leaders != 0) {      // warp-uniform
    const int j = __ffs(leaders) - 1;
    leaders &= leaders - 1;
    const int ej = __shfl_sync(0xffffffffu, e, j), rj = ceil_div(__shfl_sync(0xffffffffu, count, j), cols);
    total += rj;
    if (ej < e) first += rj;
  }
  if (valid) {
    const int r = first + rank / cols;
    pairs[r * cols + rank % cols] = lane;
    if (rank % cols == 0) info[r] = make_int2(e, min(cols, count - rank));
  }
  return total;
}

// One job's record in shared memory, written by warp 0 before the step that first issues it.
template <int kCols>
struct JobSlot {
  int32_t e;              // expert
  int32_t rows;           // live columns 1..kCols
  int32_t tile;           // row tile x
  float gs[2];            // global scale of stack a[0], a[1] (NVFP4; cp.async'd by open, landed
                          // with the job's first position)
  int32_t pair[kCols];    // column c's pair p (c < rows): the output row
  int32_t src[kCols];     // column c's B row: p / top_k (gate_up: the token) | p (down)
};

// grid (persistent; see the header), block 32·TW. TW tile warps per job (4; gate_up at
// T·k ≤ 32: 2, jobs of 16 I-rows). Warp w = tile warp tw: local rows 16·tw .. +16, all K, summed
// in K segments (p.seg_chunks chunks each: w4a16_gemv's order; the job geometry never changes a
// dot's bits). gate_up: tile tw = 2j is gate rows
// n = 8·TW·x + 16j + (0..15), tw = 2j + 1 the up rows of the same n; act[p, n] =
// bf16(silu(bf16(gate·x)) · bf16(up·x)). down: rows n = 64x + 16·tw + (0..15),
// d[p, n] = bf16(down·act[p]).
template <class F, bool kGateUp, int MT, int TW>
__global__ void __launch_bounds__(32 * TW, min_blocks<F>(MT, kGateUp))
    moe_grouped_gemv_kernel(const __grid_constant__ GroupedGemv p) {
  constexpr StageLayout lay = stage_layout<F, MT, TW>();
  constexpr int kJobRows = TW * kTileN;   // weight rows per job (gate_up: half gate, half up)
  constexpr int kStages = F::stages(MT);
  // chunks a warp computes per step (NVFP4 MT = 1: 2, halving the per-step barrier, cursor and
  // slot work per chunk; a warp still sums its chunks in ascending order: the bits do not change)
  constexpr int CW = F::kScaled && MT == 1 ? 2 : 1;
  constexpr int kStep = CW;                  // positions per step
  constexpr int kAhead = kStages - kStep;    // positions issued ahead of a step's first
  constexpr int kCols = 8 * MT;
  constexpr int kCtaThreads = 32 * TW;
  static_assert(kCtaThreads >= kJobRows, "thread tid < kJobRows owns the scale bytes of local row tid");
  static_assert(!kGateUp ? TW == kWarps : TW % 2 == 0, "gate_up tiles come in (gate, up) pairs");
  static_assert(kStages >= 2 * kStep, "a step consumes kStep positions and refills kStep stages");
  // Job slots (a ring, power of 2): slot (i mod kSlots) is rewritten for job i only when job
  // i − kSlots's last position (≤ i's first − kSlots) is ≥ 2 steps behind the compute position
  // (≥ i's first − kStages + 1): its readers (issue, compute, epilogue) have passed a barrier since.
  constexpr int kSlots = kStages + 2 * kStep + 1 <= 16 ? 16 : 32;
  static_assert(kSlots >= kStages + 2 * kStep + 1, "job slots outlive their readers");
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ JobSlot<kCols> slots[kSlots];
  __shared__ float up_s[kGateUp ? TW / 2 : 1][kGateUp ? kTileN : 1][kGateUp ? kCols : 1];   // bf16(up)
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int tw = warp;   // tile warp (one 16-row tile per warp)
  const uint32_t smem_base = smem_u32(smem);
  const int K = p.k, N = p.n;
  const int nc = ceil_div(K, kChunkK);            // chunks per job
  const int seg_chunks = p.seg_chunks;            // chunks per K segment (w4a16_gemv's)
  const int nc_pad = ceil_div(nc, kStep) * kStep;   // positions per job
  const bool k_vec = K % kChunkK == 0;

  if constexpr (kGateUp) {     // the records come from the kernel just before
    pdl_wait();
    pdl_launch_dependents();
  }
  // down: the records (or ids) were complete before this grid launched (see the header: PDL).
  const int cta = blockIdx.x, ctas = gridDim.x;
  if (warp == 0 && !p.local) {   // job 0's record into L1 in the round trip of R (fetch(0) reads it;
    const int r0 = cta / p.tiles;   // in bounds whatever R is: the grid is ≤ R_max · tiles)
    prefetch_l1(p.info + r0);
    if (lane < kCols) prefetch_l1(p.pairs + static_cast<int64_t>(r0) * kCols + lane);
  }
  const int2* info = p.info;          // [R] records: the workspace, or …
  const int32_t* pair_tab = p.pairs;  // [R, kCols]
  int num_records;
  if constexpr (MT == 1) {
    __shared__ int2 local_info[kLocalPairs];                // … this CTA's own grouping
    __shared__ int32_t local_pairs[kLocalPairs * kCols];
    __shared__ int32_t local_count;
    if (p.local) {   // CTA-uniform
      if (warp == 0) {
        const int r = group_in_warp(p, kCols, local_info, local_pairs, lane);
        if (lane == 0) local_count = r;
      }
      __syncthreads();
      info = local_info;
      pair_tab = local_pairs;
      num_records = local_count;
    } else {
      num_records = *p.num_records;
    }
  } else {
    num_records = *p.num_records;
  }
  const int num_jobs = num_records * p.tiles;
  const int my_jobs = cta < num_jobs ? ceil_div(num_jobs - cta, ctas) : 0;   // jobs cta + i·ctas

  // local weight row lr (0 .. kJobRows − 1) of row tile x → its row n of the expert, in stack a[i]
  auto row_of = [&](int x, int lr, int& i) {
    const int tile = lr / kTileN;
    i = kGateUp ? tile % 2 : 0;
    return kGateUp ? x * (kJobRows / 2) + (tile / 2) * kTileN + lr % kTileN : x * kJobRows + lr;
  };

  // ---- job records: warp 0 holds job i + 1's in registers while job i's slot is in use ----
  // Job i of this CTA is J = cta + i·ctas = record r·tiles + tile x; (r, x) advance by
  // (ctas / tiles, ctas % tiles) per job (no division per job).
  const int step_r = ctas / p.tiles, step_x = ctas % p.tiles;
  int fetch_r = cta / p.tiles, fetch_x = cta % p.tiles;   // the next job to fetch
  int2 pf_info = make_int2(0, 0);         // its record {expert, rows}
  int pf_pair = 0, pf_tile = 0;            // lane < kCols: its column lane's pair; its tile x
  auto fetch = [&](int i) {                // called for i = 0, 1, 2, … in order
    if (warp == 0 && i < my_jobs) {
      pf_info = info[fetch_r];
      if (lane < kCols) pf_pair = pair_tab[static_cast<int64_t>(fetch_r) * kCols + lane];
      pf_tile = fetch_x;
      fetch_r += step_r;
      fetch_x += step_x;
      if (fetch_x >= p.tiles) {
        fetch_x -= p.tiles;
        ++fetch_r;
      }
    }
  };
  auto open = [&](int i) {     // slot of job i ← the registers; then fetch job i + 1
    if (warp == 0) {
      JobSlot<kCols>& sl = slots[i % kSlots];
      if (lane == 0) {
        sl.e = pf_info.x;
        sl.rows = pf_info.y;
        sl.tile = pf_tile;
      }
      // the expert's global scales: async, in the commit group of a position ≤ job i's first,
      // so they have landed (and a barrier passed) before its epilogue reads them
      if (lane < 2 && p.gs[lane] != nullptr) cp_async4(smem_u32(&sl.gs[lane]), p.gs[lane] + pf_info.x);
      if (lane < kCols) {
        sl.pair[lane] = pf_pair;
        sl.src[lane] = kGateUp ? pf_pair / p.top_k : pf_pair;
      }
    }
    fetch(i + 1);
  };

  // ---- copies. Position cursor: chunk `chunk` (0 .. nc_pad − 1) of job `job`, in stage `stage`
  // (= position mod kStages); advanced by counters, not divisions.
  struct Pos {
    int job, chunk, stage;
  };
  auto advance = [&](Pos& q) {
    if (++q.chunk == nc_pad) {
      q.chunk = 0;
      ++q.job;
    }
    if (++q.stage == kStages) q.stage = 0;
  };
  // The thread's sources for the job the copies are in (set at its chunk 0 by enter): weight
  // piece j = 16 bytes u of local row lr (q = tid + kCtaThreads·j), its scale row (tid < kJobRows),
  // activation unit x_u of rows r = x_r0 + kXRowStep·m < kCols. A weight row ≥ N or an activation
  // row ≥ the job's rows copies 0 source bytes (zero fill) from a valid dummy address, so whole
  // chunks need no test per copy.
  constexpr int kWPieces = kJobRows * F::kPieces / kCtaThreads;
  static_assert(kJobRows * F::kPieces % kCtaThreads == 0, "whole pieces per thread");
  const int x_u = tid % kXUnits, x_r0 = tid / kXUnits;
  constexpr int kXRowStep = kCtaThreads / kXUnits;
  constexpr int kXRows = (kCols + kXRowStep - 1) / kXRowStep;
  const uint8_t* w_src[kWPieces];
  bool w_live[kWPieces];                 // row < N (else zero fill)
  const uint8_t* s_src = p.a[0].block_scale;
  bool s_live = false;
  const __nv_bfloat16* x_src[kXRows];
  bool x_live[kXRows];                   // column < rows
  auto enter = [&](const JobSlot<kCols>& sl) {
    const int64_t row0_e = static_cast<int64_t>(sl.e) * N;
    // No L2 bulk prefetch of the job's rows: up to v6 each job prefetched its weight rows (72 KB
    // per gate_up CTA, ≈ 47 MB over 5 CTAs per SM: the whole L2) and scale rows, and part was
    // evicted before the chunk stream reached it — session 19, moe_probe T = 32: gate_up read
    // 257 MB from DRAM for 186 MB of experts (110.9 µs), 195 MB without the weight prefetch
    // (102.4 µs). Whole calls T = 20 / 32 / 128: 130.8 / 163.1 / 425.6 µs (v6), 119.6 / 152.3 /
    // 418.6 without the weight prefetch, 116.8 / 148.5 / 410.5 without either; prefetching each
    // row in 2, 4 or 8 pieces as the stream reaches them was slower than all three.
#pragma unroll
    for (int j = 0; j < kWPieces; ++j) {
      const int q = tid + kCtaThreads * j, lr = q / F::kPieces, u = q % F::kPieces;
      int i;
      const int n = row_of(sl.tile, lr, i);
      const bool live = kGateUp || n < N;   // gate_up tiles divide I exactly
      w_src[j] = live ? static_cast<const uint8_t*>(i ? p.a[1].weight : p.a[0].weight) +
                            row0_e * F::row_bytes(K) + static_cast<int64_t>(n) * p.strides.w_row + u * 16
                      : static_cast<const uint8_t*>(p.a[0].weight);
      w_live[j] = live;
    }
    if constexpr (F::kScaled) {
      int i;
      const int n = row_of(sl.tile, tid % kJobRows, i);
      const bool live = kGateUp || n < N;
      s_src = live ? (i ? p.a[1].block_scale : p.a[0].block_scale) + row0_e * (K / 16) +
                         static_cast<int64_t>(n) * p.strides.s_row
                   : p.a[0].block_scale;
      s_live = live;
    }
#pragma unroll
    for (int m = 0; m < kXRows; ++m) {
      const int r = x_r0 + kXRowStep * m;
      x_src[m] = r < sl.rows ? p.b + static_cast<int64_t>(sl.src[r]) * K + 8 * x_u : p.b;
      x_live[m] = r < sl.rows;
    }
  };
  auto issue_weights = [&](int st, int c) {
    if (k_vec) {   // whole chunks (CTA-uniform)
#pragma unroll
      for (int j = 0; j < kWPieces; ++j) {
        const int q = tid + kCtaThreads * j, lr = q / F::kPieces, u = q % F::kPieces;
        cp_async16(smem_base + st + lay.w_off + F::slot(lr, u), w_src[j] + c * p.strides.w_chunk, w_live[j] ? 16 : 0);
      }
      if constexpr (F::kScaled) {
        if (tid < kJobRows) {
          cp_async8(smem_base + st + lay.s_off + tid * F::kScaleBytes, s_src + c * p.strides.s_chunk, s_live ? 8 : 0);
        }
      }
      return;
    }
    const int k_rem = K - c * kChunkK;   // K tail (K % 32 == 0): pieces past K zero-filled
#pragma unroll
    for (int j = 0; j < kWPieces; ++j) {
      const int q = tid + kCtaThreads * j, lr = q / F::kPieces, u = q % F::kPieces;
      const bool ok = w_live[j] && u * F::kPieceK < k_rem;
      cp_async16(smem_base + st + lay.w_off + F::slot(lr, u), ok ? w_src[j] + c * p.strides.w_chunk : p.a[0].weight,
                 ok ? 16 : 0);
    }
    if constexpr (F::kScaled) {   // a row's scales are only 2-byte aligned (K/16 even): 16-bit loads
      if (tid >= kJobRows) return;
      uint16_t* dst = reinterpret_cast<uint16_t*>(smem + st + lay.s_off + tid * F::kScaleBytes);
#pragma unroll
      for (int j = 0; j < F::kScaleBytes / 2; ++j) {
        const bool ok = s_live && 32 * j < k_rem;
        dst[j] = ok ? __ldg(reinterpret_cast<const uint16_t*>(s_src + c * p.strides.s_chunk) + j) : uint16_t(0);
      }
    }
  };
  auto issue_acts = [&](int st, int c) {
    const bool k_ok = k_vec || 8 * x_u < K - c * kChunkK;
#pragma unroll
    for (int m = 0; m < kXRows; ++m) {
      const int r = x_r0 + kXRowStep * m;
      if (r >= kCols) break;   // thread-constant
      const bool ok = k_ok && x_live[m];
      cp_async16(smem_base + st + lay.x_off + r * kXRowBytes + bf16_unit_slot(r, x_u) * 16,
                 ok ? x_src[m] + c * kChunkK : p.b, ok ? 16 : 0);
    }
  };
  // position q's copies (none past the CTA's jobs or in a job's padding positions)
  auto issue = [&](const Pos& q, bool weights, bool acts) {
    if (q.job >= my_jobs || q.chunk >= nc) return;
    if (q.chunk == 0) enter(slots[q.job % kSlots]);
    const int st = q.stage * lay.bytes;
    if (weights) issue_weights(st, q.chunk);
    if (acts) issue_acts(st, q.chunk);
  };

  float acc[MT][4];    // the current K segment's partial
  float done[MT][4];   // 0 + the finished segments' partials, in segment order (w4a16_gemv's sum)
  int seg_left = 0;    // chunks left in the current segment
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
        if (mt > 0 && mt >= live_mt) break;   // warp-uniform; rows ≥ 1
        const int xr = 8 * mt + g;   // activation row (column of the mma)
        const uint4 raw = *reinterpret_cast<const uint4*>(xs + xr * kXRowBytes + bf16_unit_slot(xr, 4 * t + wd) * 16);
        // down: act is stored in the mma's K order (permuted by gate_up's store, or natural)
        const uint4 xv = kGateUp && !F::kNaturalK ? permute_unit(raw) : raw;
        mma_bf16_16816(acc[mt], ra[0], rb[0], ra[1], rb[1], xv.x, xv.y);   // h = 0
        mma_bf16_16816(acc[mt], ra[2], rb[2], ra[3], rb[3], xv.z, xv.w);   // h = 1
      }
    }
  };

  // ---- a job's end: y = sum · global_scale · 2^7 (NVFP4) | sum (BF16) rounded once to bf16;
  // gate_up: the up warp (odd tw) hands bf16(up) to the gate warp (even tw) of the same rows,
  // which stores act = bf16(silu(g) · u).
  auto epilogue = [&](const JobSlot<kCols>& sl, bool live, int stack) {
    const int rows = sl.rows, live_mt = ceil_div(rows, 8);
    const float factor = F::kScaled ? sl.gs[stack] * kOutBias : 1.0f;
    if constexpr (kGateUp) {
      if (live && stack == 1) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (mt >= live_mt) break;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            up_s[tw / 2][g + 8 * (q >> 1)][8 * mt + 2 * t + (q & 1)] =
                __bfloat162float(__float2bfloat16(done[mt][q] * factor));
          }
        }
      }
      __syncthreads();
    }
    if (live && stack == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt >= live_mt) break;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int col = 8 * mt + 2 * t + (q & 1), r = g + 8 * (q >> 1);
          if (col >= rows) continue;
          int i;
          const int n = row_of(sl.tile, row0 + r, i);
          const int n_out = kGateUp ? act_position<F::kNaturalK>(n, g) : n;   // n % 8 = g
          __nv_bfloat16* dst = p.out + static_cast<int64_t>(sl.pair[col]) * N + n_out;
          const float v = __bfloat162float(__float2bfloat16(done[mt][q] * factor));
          if constexpr (kGateUp) {
            *dst = silu_mul(v, up_s[tw / 2][r][col]);
          } else {
            *dst = __float2bfloat16(done[mt][q] * factor);
          }
        }
      }
    }
  };

  // ---- prologue: positions 0 .. kAhead − 1 (each job they touch opened first, a barrier making
  // its slot visible). gate_up: commit group q = position q. down: the weights of all of them
  // before griddepcontrol.wait (weights are constants), then the activations, group q = position
  // q's (group 0 also carries the weights).
  fetch(0);
  Pos is{0, 0, 0};   // issue cursor
#pragma unroll 1
  for (int n = 0; n < kAhead; ++n, advance(is)) {
    if (is.job < my_jobs && is.chunk == 0) {   // CTA-uniform
      open(is.job);
      __syncthreads();
    }
    issue(is, true, kGateUp);
    if constexpr (kGateUp) cp_async_commit();
  }
  if constexpr (!kGateUp) {   // act comes from the gate_up kernel
    pdl_wait();
    pdl_launch_dependents();
    Pos q{0, 0, 0};
#pragma unroll 1
    for (int n = 0; n < kAhead; ++n, advance(q)) {
      issue(q, false, true);
      cp_async_commit();
    }
  }

  // ---- steps: compute positions cs + d (d < CW), issue positions is + j (j < kStep),
  // is = cs + kAhead ----
  Pos cs{0, 0, 0};   // compute cursor (chunk a multiple of kStep)
  while (cs.job < my_jobs) {
    {   // jobs first issued in this step: their slots before the barrier
      Pos q = is;
#pragma unroll
      for (int j = 0; j < kStep; ++j, advance(q)) {
        if (q.job < my_jobs && q.chunk == 0) open(q.job);
      }
    }
    cp_async_wait<kStages - 2 * kStep>();   // this thread's copies of positions ≤ cs + kStep − 1 landed
    __syncthreads();                        // … everyone's; every warp is done with the last step's stages
#pragma unroll
    for (int j = 0; j < kStep; ++j, advance(is)) {   // refill the stages of the last step's positions
      issue(is, true, true);
      cp_async_commit();
    }
    const JobSlot<kCols>& sl = slots[cs.job % kSlots];
    int stack;
    const bool live = row_of(sl.tile, row0, stack) < N;   // N % 16 == 0: a tile is all in or all out
    if (cs.chunk == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[mt][q] = done[mt][q] = 0.0f;
      }
      seg_left = seg_chunks;
    }
#pragma unroll
    for (int d = 0; d < CW; ++d) {   // the step's chunks, ascending
      const int st = cs.stage + d < kStages ? cs.stage + d : cs.stage + d - kStages;
      if (live && cs.chunk + d < nc) {
        compute_stage(st * lay.bytes, ceil_div(sl.rows, 8));
        if (--seg_left == 0 || cs.chunk + d + 1 == nc) {   // a K segment ends: done += its partial
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              done[mt][q] += acc[mt][q];
              acc[mt][q] = 0.0f;
            }
          }
          seg_left = seg_chunks;
        }
      }
    }
    const bool last = cs.chunk + kStep == nc_pad;   // CTA-uniform: the job's last step
    if (last) epilogue(sl, live, stack);
    cs.chunk = last ? 0 : cs.chunk + kStep;
    cs.job += last;
    cs.stage = cs.stage + kStep < kStages ? cs.stage + kStep : cs.stage + kStep - kStages;
  }
  cp_async_wait<0>();   // only empty groups are left
}

// ---- 2', 3'. warp-streamed grouped GEMV (NVFP4, records of ≤ 8 pairs, K % 128 == 0) ------------
//
// The same jobs and the same bits as moe_grouped_gemv_kernel at MT = 1, without its CTA-wide
// steps: every WARP is a persistent stream of its own jobs through its own cp.async ring (what
// w4a16_gemv's one-row kernel does for dense rows), so no barrier ties a warp to the CTA's
// slowest warp, and the per-chunk bookkeeping a CTA step paid (job-slot opens, the issue and
// compute cursors, the stage select, the barrier: ≈ 95 of the ≈ 270 SASS instructions per warp
// and chunk of the CTA kernel's gate_up at T = 32, session 24) shrinks to pointer steps.
//
// Warp job (record r, tile x): 32 weight rows × all K for the record's ≤ 8 pairs (n8 columns).
//   gate_up: A tile 0 = gate rows n = 16x .. +16, A tile 1 = the up rows of the same n, so
//     silu(bf16(g)) · bf16(u) is formed in the lane that holds both (no exchange); tiles = I / 16.
//   down: A tiles 0, 1 = rows n = 32x .. +16, 32x + 16 .. +16 (h % 32 == 0); tiles = h / 32.
//   Both tiles take the same B fragment (one activation load per word for two mma pairs).
// Warp w of CTA b is stream gw = w · grid + b and runs jobs gw, gw + W, gw + 2W, … (W = all
// warps): the tiles of one record run on different SMs at once, and every SM's warps hold
// about the same number of jobs.
// Ring: kWarpStages stages per warp of [32 rows × 64 B] codes, [32 × 8 B] scales, [8 rows ×
// 256 B] activations; position q = (job i, chunk c) of the warp's flat sequence sits in stage
// q mod S; step q waits for q's group, issues q + S − 1 into the stage step q − 1 read (every
// lane is past __syncwarp), computes q. A job has ≥ S − 1 chunks (the launcher's rule), so the
// copies run at most one job ahead of the math: the warp holds three records — cur (computed),
// iss (copied), pf (loaded one job ahead, so its global reads are in flight for a whole job).
// Copies: each copy instruction moves whole 32-byte sectors, as the CTA kernel's do — codes:
// copy i, lane l → 16-byte piece l % 4 of row l / 4 + 8i (8 rows × 64 contiguous bytes); scales:
// lane l → row l's 8 bytes; activations: copy i, lane l → unit l % 16 of row l / 16 + 2i (2 rows ×
// 256 bytes), rows < the record's rows only. (A first form gave lane l all 4 pieces of code row
// l, 32 rows × 16 bytes per instruction, to save address math: it doubled the L2 requests and
// ran 22% slower than the CTA kernel, session 24 calls 3 and 6.) Shared addresses: the stage
// base + a lane constant + an immediate; global: per-row pointers stepped one chunk per copy.
// Sums: per tile, as moe_grouped_gemv_kernel (w4a16_gemv's segment order), so every g, u, act
// and d is bitwise the CTA kernel's and the one-row kernel's (tests: indexed == grouped batch,
// one token alone == inside 32 / 80-token batches).
constexpr int kWarpStages = 3;        // 3 × 4352 B per warp: 4 CTAs of 4 warps per SM (≤ 128 registers)
constexpr int kWarpCtaWarps = 4;
constexpr int kWarpJobRows = 32;      // two 16-row A tiles per warp job
constexpr int kWarpScalesOff = kWarpJobRows * 64;                      // 2048: after the codes
constexpr int kWarpXOff = kWarpScalesOff + kWarpJobRows * 8;           // 2304
constexpr int kWarpStageBytes = kWarpXOff + 8 * kXRowBytes;            // 4352
constexpr int kWarpCtasPerSm = kWarpStages == 3 ? 4 : 3;

// The warp kernel's launch rule: records of 8 pairs (MT = 1), whole chunks, ≥ S − 1 chunks per job.
bool warp_gemv_fits(int k) { return k % kChunkK == 0 && k / kChunkK >= kWarpStages - 1; }

// A record as a warp holds it: broadcast fields, and lane < 8 holding column lane's pair.
struct WarpJob {
  int e, rows, tile, pair;
  float f0, f1;   // global scale · 2^7 of tile 0's and tile 1's stack (the epilogue's factors)
};

template <class F, bool kGateUp>
__global__ void __launch_bounds__(32 * kWarpCtaWarps, kWarpCtasPerSm)
    moe_warp_gemv_kernel(const __grid_constant__ GroupedGemv p) {
  static_assert(F::kScaled, "NVFP4 stacks only");
  extern __shared__ __align__(16) uint8_t warp_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int K = p.k, N = p.n, nc = K / kChunkK, seg_chunks = p.seg_chunks;
  const uint32_t ring = smem_u32(warp_smem) + warp * (kWarpStages * kWarpStageBytes);
  const uint8_t* ring_ptr = warp_smem + warp * (kWarpStages * kWarpStageBytes);

  if constexpr (kGateUp) {   // the records come from the kernel just before
    pdl_wait();
    pdl_launch_dependents();
  }
  // down: the records were complete before this grid launched (moe_grouped_gemv_kernel's PDL note)
  const int streams = gridDim.x * kWarpCtaWarps, gw = warp * gridDim.x + blockIdx.x;
  const int num_jobs = *p.num_records * p.tiles;
  const int my_jobs = gw < num_jobs ? (num_jobs - gw + streams - 1) / streams : 0;

  // ---- records: fetch(i) loads job i's into pf (called for i = 0, 1, 2, … in order) ----
  const int step_r = streams / p.tiles, step_x = streams % p.tiles;
  int fetch_r = gw / p.tiles, fetch_x = gw % p.tiles;
  WarpJob pf{}, iss{}, cur{};
  auto fetch = [&](int i) {
    if (i >= my_jobs) return;
    const int2 info = p.info[fetch_r];
    pf.e = info.x;
    pf.rows = info.y;
    pf.tile = fetch_x;
    pf.pair = lane < 8 ? p.pairs[static_cast<int64_t>(fetch_r) * 8 + lane] : 0;
    fetch_r += step_r;
    fetch_x += step_x;
    if (fetch_x >= p.tiles) {
      fetch_x -= p.tiles;
      ++fetch_r;
    }
  };

  // ---- copies of the issue job (see the header): copy i of a chunk moves 8 rows × 64 contiguous
  // bytes (codes: lane l → piece l % 4 of row l / 4 + 8i) or 2 rows × 256 bytes (activations: lane
  // l → unit l % 16 of row l / 16 + 2i), whole sectors, like the CTA kernel's copies ----
  const uint32_t w_dst = 16 * lane, s_dst = kWarpScalesOff + 8 * lane;
  const int x_u = lane % 16;
  const uint32_t x_dst = kWarpXOff + (lane / 16) * kXRowBytes + bf16_unit_slot(lane / 16, x_u) * 16;   // + 512·i
  const int64_t eight_rows = 8 * p.strides.w_row;
  const uint8_t* w_src[2] = {nullptr, nullptr};   // tile 0 | 1: row l / 4, piece l % 4, at the issue chunk
  const uint8_t* s_src = nullptr;                 // scale row l at the issue chunk
  const __nv_bfloat16* x_src[4];                  // activation row l / 16 + 2i, unit l % 16, at the issue chunk
  bool x_live[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x_src[i] = p.b;
    x_live[i] = false;
  }
  auto enter = [&]() {   // iss ← pf (the issue cursor's new job): the lane's source pointers at chunk 0
    iss = pf;
    const int64_t e_row = static_cast<int64_t>(iss.e) * N;
    const int n0 = kGateUp ? 16 * iss.tile : 32 * iss.tile, n1 = kGateUp ? n0 : n0 + 16;   // tiles' first rows
    const ExpertStack& s1 = p.a[kGateUp ? 1 : 0];
    const int64_t w_e = e_row * (K / 2) + 16 * (lane % 4), s_e = e_row * (K / 16);
    w_src[0] = static_cast<const uint8_t*>(p.a[0].weight) + w_e + static_cast<int64_t>(n0 + lane / 4) * p.strides.w_row;
    w_src[1] = static_cast<const uint8_t*>(s1.weight) + w_e + static_cast<int64_t>(n1 + lane / 4) * p.strides.w_row;
    s_src = lane < 16 ? p.a[0].block_scale + s_e + static_cast<int64_t>(n0 + lane) * p.strides.s_row
                      : s1.block_scale + s_e + static_cast<int64_t>(n1 + lane - 16) * p.strides.s_row;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = lane / 16 + 2 * i;
      const int pr = __shfl_sync(0xffffffffu, iss.pair, r);
      x_live[i] = r < iss.rows;
      x_src[i] = p.b + static_cast<int64_t>(kGateUp ? pr / p.top_k : pr) * K + 8 * x_u;
    }
    iss.f0 = p.gs[0][iss.e] * kOutBias;
    iss.f1 = kGateUp ? p.gs[1][iss.e] * kOutBias : iss.f0;
  };
  // the issue chunk's codes and scales | activations into the stage at ring offset st; then the
  // pointers step one chunk
  auto issue_weights = [&](uint32_t st) {
    const uint32_t d = st + w_dst;
    cp_async16(d, w_src[0]);
    cp_async16(d + 512, w_src[0] + eight_rows);
    cp_async16(d + 1024, w_src[1]);
    cp_async16(d + 1536, w_src[1] + eight_rows);
    cp_async8(st + s_dst, s_src);
    w_src[0] += p.strides.w_chunk;
    w_src[1] += p.strides.w_chunk;
    s_src += p.strides.s_chunk;
  };
  auto issue_acts = [&](uint32_t st) {
    const uint32_t d = st + x_dst;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (x_live[i]) cp_async16(d + 512 * i, x_src[i]);
      x_src[i] += kChunkK;
    }
  };

  // ---- prologue: positions 0 .. S − 2, all in job 0 (nc ≥ S − 1); down: their weights before
  // griddepcontrol.wait, the activations after it (group 0 also carries the weights) ----
  fetch(0);
  if (my_jobs > 0) enter();   // warp-uniform
  fetch(1);
#pragma unroll
  for (int n = 0; n < kWarpStages - 1; ++n) {
    if (my_jobs > 0) issue_weights(ring + n * kWarpStageBytes);
    if constexpr (kGateUp) {
      if (my_jobs > 0) issue_acts(ring + n * kWarpStageBytes);
      cp_async_commit();
    }
  }
  if constexpr (!kGateUp) {   // act comes from the gate_up kernel
    pdl_wait();
    pdl_launch_dependents();
#pragma unroll
    for (int n = 0; n < kWarpStages - 1; ++n) {
      if (my_jobs > 0) issue_acts(ring + n * kWarpStageBytes);
      cp_async_commit();
    }
  }
  int is_job = 0, is_chunk = kWarpStages - 1, is_stage = kWarpStages - 1;   // issue cursor
  cur = iss;

  // ---- steps ----
  float acc[2][4], done[2][4];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[i][r] = done[i][r] = 0.0f;
  }
  int seg_left = seg_chunks, c_chunk = 0, c_stage = 0;
  const int positions = my_jobs * nc;
#pragma unroll 1
  for (int q = 0; q < positions; ++q) {
    cp_async_wait<kWarpStages - 2>();   // this lane's copies of position q landed
    __syncwarp();                        // … every lane's; all lanes are past step q − 1's reads
    if (is_chunk == nc) {                // the issue cursor enters the next job
      is_chunk = 0;
      if (++is_job < my_jobs) {
        enter();
        fetch(is_job + 1);
      }
    }
    if (is_job < my_jobs) {
      const uint32_t st = ring + is_stage * kWarpStageBytes;
      issue_weights(st);
      issue_acts(st);
    }
    cp_async_commit();
    ++is_chunk;
    is_stage = is_stage + 1 == kWarpStages ? 0 : is_stage + 1;

    {   // position q: 4 words × 2 mma steps × 2 A tiles on one B fragment
      const uint8_t* ws = ring_ptr + c_stage * kWarpStageBytes;
      const uint8_t* xs = ws + kWarpXOff;
      const uint8_t* ss = ws + kWarpScalesOff;
      const typename F::Frag f[2] = {F::load(ws, ss, 0, g, t), F::load(ws, ss, kTileN, g, t)};
#pragma unroll
      for (int wd = 0; wd < 4; ++wd) {
        const uint4 raw = *reinterpret_cast<const uint4*>(xs + g * kXRowBytes + bf16_unit_slot(g, 4 * t + wd) * 16);
        const uint4 xv = kGateUp && !F::kNaturalK ? permute_unit(raw) : raw;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          uint32_t ra[4], rb[4];
          F::word(f[i], ws, 16 * i, g, t, wd, ra, rb);
          mma_bf16_16816(acc[i], ra[0], rb[0], ra[1], rb[1], xv.x, xv.y);
          mma_bf16_16816(acc[i], ra[2], rb[2], ra[3], rb[3], xv.z, xv.w);
        }
      }
    }
    c_stage = c_stage + 1 == kWarpStages ? 0 : c_stage + 1;
    const bool last = ++c_chunk == nc;
    if (--seg_left == 0 || last) {   // a K segment ends: done += its partial
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          done[i][r] += acc[i][r];
          acc[i][r] = 0.0f;
        }
      }
      seg_left = seg_chunks;
    }
    if (!last) continue;

    // ---- the job's end: lane (g, t) holds rows g, g + 8 × columns 2t, 2t + 1 of both tiles ----
    const int pair_lo = __shfl_sync(0xffffffffu, cur.pair, 2 * t);
    const int pair_hi = __shfl_sync(0xffffffffu, cur.pair, 2 * t + 1);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int col = 2 * t + (r & 1), row = g + 8 * (r >> 1);
      if (col < cur.rows) {
        const int64_t out_row = static_cast<int64_t>(r & 1 ? pair_hi : pair_lo) * N;
        if constexpr (kGateUp) {
          const int n = 16 * cur.tile + row;
          const int n_out = act_position<F::kNaturalK>(n, g);   // n % 8 = g
          const float v = __bfloat162float(__float2bfloat16(done[0][r] * cur.f0));
          const float u = __bfloat162float(__float2bfloat16(done[1][r] * cur.f1));
          p.out[out_row + n_out] = silu_mul(v, u);
        } else {
          const int n = 32 * cur.tile + row;
          p.out[out_row + n] = __float2bfloat16(done[0][r] * cur.f0);
          p.out[out_row + n + 16] = __float2bfloat16(done[1][r] * cur.f1);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int r = 0; r < 4; ++r) done[i][r] = 0.0f;
    }
    c_chunk = 0;
    cur = iss;   // the issue cursor is at most one job ahead (nc ≥ S − 1)
  }
  cp_async_wait<0>();   // only empty groups are left
}

// ---- 4. combine -------------------------------------------------------------------------------

constexpr int kCombineThreads = 128;
constexpr int kCombineVec = 8;   // columns per thread (one 16-byte load per slot)
constexpr int kCombineBatch = 8;   // slots whose loads are in flight together

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
  const int64_t o = t * hidden + n0;
  // ids, weights and the shared-expert inputs come from ops before moe_experts, complete before
  // this grid launched (header: PDL): read before the wait, so only d's round trip follows it
  if (threadIdx.x < top_k) {
    const int e = ids[t * top_k + threadIdx.x];
    valid_s[threadIdx.x] = e >= 0 && e < num_experts;
    w_s[threadIdx.x] = weights[t * top_k + threadIdx.x];
  }
  float shared_term[kCombineVec] = {};   // sigmoid(shared_gate[t]) · shared[t, n0 .. n0+8]
  if (shared != nullptr && n0 < hidden) {   // element loads: `shared` may be any contiguous bf16 view
    const float sg = __bfloat162float(shared_gate[t * shared_gate_stride]);
#pragma unroll
    for (int i = 0; i < kCombineVec; ++i) shared_term[i] = __bfloat162float(shared[o + i]) / (1.0f + expf(-sg));
  }
  pdl_wait();                  // d comes from the down kernel
  pdl_launch_dependents();
  __syncthreads();
  if (n0 >= hidden) return;
  // 8 slots' rows in flight at a time: every in-range slot's row is loaded (a skipped slot's is
  // unwritten workspace, read but never used), then folded in slot order
  float acc[kCombineVec] = {};
  const __nv_bfloat16* d_t = d + t * top_k * hidden + n0;
  for (int j0 = 0; j0 < top_k; j0 += kCombineBatch) {
    uint4 v[kCombineBatch];
#pragma unroll
    for (int i = 0; i < kCombineBatch; ++i) {
      if (j0 + i < top_k) v[i] = *reinterpret_cast<const uint4*>(d_t + (j0 + i) * hidden);
    }
#pragma unroll
    for (int i = 0; i < kCombineBatch; ++i) {
      if (j0 + i >= top_k || !valid_s[j0 + i]) continue;
      const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&v[i]);
#pragma unroll
      for (int c = 0; c < kCombineVec / 2; ++c) {
        const float2 f = __bfloat1622float2(v2[c]);
        acc[2 * c] = fmaf(w_s[j0 + i], f.x, acc[2 * c]);
        acc[2 * c + 1] = fmaf(w_s[j0 + i], f.y, acc[2 * c + 1]);
      }
    }
  }
  if (shared != nullptr) {
    __align__(16) __nv_bfloat16 r[kCombineVec];
#pragma unroll
    for (int i = 0; i < kCombineVec; ++i) r[i] = __float2bfloat16(acc[i] + shared_term[i]);
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

// T·k ≤ 32 pairs (MT = 1): each GEMV CTA groups them in one warp, no grouping launch (B ≤ 3 at
// k = 9: one dependent launch and two table round trips fewer on every decode step's MoE).
bool local_grouping(int64_t num_tokens, int top_k) {
  return num_tokens * top_k <= kLocalPairs && plan_mt(num_tokens) == 1;
}


constexpr int kMaxDevices = 64;   // per-device bookkeeping

// Persistent grids: every CTA that fits the device at once (SMs × resident CTAs per SM for the
// instance and its smem), at most ctas_bound, launched with PDL. Queried once per device and
// instance (the caller's `resident` cache: later calls, e.g. under graph capture, make no
// attribute call).
template <class Kernel>
cudaError_t launch_persistent(Kernel kernel, int (&resident)[kMaxDevices], int threads, int smem, int ctas_bound,
                              const GroupedGemv& p, cudaStream_t stream) {
  int dev = 0;
  ATLAS_RETURN_IF_ERROR(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) return cudaErrorInvalidDevice;
  if (resident[dev] == 0) {
    if (smem > 48 * 1024) {   // opt in above the default 48 KB
      ATLAS_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    int per_sm = 0, sms = 0;
    ATLAS_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    ATLAS_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    resident[dev] = std::max(1, per_sm) * std::max(1, sms);
  }
  const int grid = std::max(1, std::min(resident[dev], ctas_bound));
  return launch_pdl(kernel, dim3(static_cast<unsigned>(grid)), dim3(threads), static_cast<size_t>(smem), stream, p);
}

template <class F, bool kGateUp, int MT, int TW>
cudaError_t launch_grouped_gemv(const GroupedGemv& p, int jobs_bound, cudaStream_t stream) {
  static int resident[kMaxDevices] = {};   // CTAs of this instance the device holds at once
  return launch_persistent(moe_grouped_gemv_kernel<F, kGateUp, MT, TW>, resident, 32 * TW,
                           F::stages(MT) * stage_layout<F, MT, TW>().bytes, jobs_bound, p, stream);
}

// The warp-streamed kernel: every warp the device holds at once (4 per CTA), at most one per job.
template <class F, bool kGateUp>
cudaError_t launch_warp_gemv(const GroupedGemv& p, int jobs_bound, cudaStream_t stream) {
  static int resident[kMaxDevices] = {};
  return launch_persistent(moe_warp_gemv_kernel<F, kGateUp>, resident, 32 * kWarpCtaWarps,
                           kWarpCtaWarps * kWarpStages * kWarpStageBytes, ceil_div(jobs_bound, kWarpCtaWarps), p,
                           stream);
}

// 4. out[t] = Σ_j weights[t, j] · d[t·k + j] (+ the shared-expert term).
cudaError_t launch_combine(const MoeExpertsArgs& a, const __nv_bfloat16* d, cudaStream_t stream) {
  return launch_pdl(moe_combine_kernel,
                    dim3(static_cast<unsigned>(ceil_div(a.hidden, kCombineThreads * kCombineVec)),
                         static_cast<unsigned>(a.num_tokens)),
                    dim3(kCombineThreads), 0, stream, d, a.ids, a.weights,
                    static_cast<const __nv_bfloat16*>(a.shared), static_cast<const __nv_bfloat16*>(a.shared_gate),
                    a.shared_gate_stride, a.out_bf16, a.out, a.top_k, a.num_experts, a.hidden);
}

// Few pairs (T·k ≤ kIndexedMaxPairs: decode and MTP batches), NVFP4, h and I multiples of 128:
// every pair p = t·k + j through w4a16_gemv's one-row kernel, expert-indexed (W4A16GemvSlots:
// slot p runs expert ids[p], read on the device, over x row t = p / k) — gate and up as one dual
// launch (g → act, u → up), down as its silu variant over (g_p, u_p) → d — then the combine.
// Three launches with no grouping. An expert hit by several pairs is streamed once per pair,
// but its later reads hit L2, and the one-row kernel's per-warp pipelines stream an 18k-tile
// launch (T = 32) near the copy bandwidth, where the grouped kernels' CTA-wide steps and
// per-weight dequant for 1–2 columns were issue-bound (bench/NOTES.md); at one token the grouped
// jobs were latency-bound (9 experts of 35B-A3B: 23.8 µs vs the 7 µs a 576-tile one-row GEMV
// takes). Same bits as the grouped path: the grouped GEMVs sum in the one-row kernel's segment
// order and store g, u, act and d with the same roundings (tested: one token alone == inside a
// batch of 80). The bound also keeps the grid's row groups (≤ ceil(max(2I, h) / 16) per slot)
// within 65535. Where it stops paying (bench/moe_probe, 35B-A3B MTP head, H200, µs indexed →
// grouped): against v7's grouped kernels (session 18) T = 4 40.0 → 50.7, 16 106.1 → 114.2, 32
// 195.8 → 167.9; against v8's warp-streamed ones (session 25, call 1, GEMV-word stacks) T = 3
// 26.2 → 28.6, 4 32.8 → 34.8, 6 44.1 → 40.6, 8 53.4 → 47.5, 16 92.4 → 76.1 (the pair streams
// re-read the L2-resident experts more than the grouped jobs cost). Not re-measured on tiled
// stacks, which speed both sides (T = 4 indexed 30.4, T = 5 grouped 36.5 µs).
constexpr int64_t kIndexedMaxPairs = 36;   // T = 4 at k = 9
bool indexed_path(int64_t num_tokens, int top_k, int hidden, int inter) {
  const int64_t pairs = num_tokens * top_k;
  return pairs <= kIndexedMaxPairs && hidden % kChunkK == 0 && inter % kChunkK == 0 &&
         pairs * ceil_div(std::max(2 * inter, hidden), 16) <= 65535;
}

cudaError_t launch_indexed(const MoeExpertsArgs& a, const Workspace& ws, cudaStream_t stream) {
  uint8_t* base = static_cast<uint8_t*>(a.workspace);
  auto* g = reinterpret_cast<__nv_bfloat16*>(base + ws.act);   // [T·k, I]
  auto* u = reinterpret_cast<__nv_bfloat16*>(base + ws.up);    // [T·k, I]
  auto* d = reinterpret_cast<__nv_bfloat16*>(base + ws.d);     // [T·k, h]
  const int64_t h = a.hidden, inter = a.inter;
  auto weight = [&a](const ExpertStack& s, void* out, int n) {
    W4A16GemvWeight w;
    w.packed = static_cast<const uint8_t*>(s.weight);
    w.block_scale = s.block_scale;
    w.global_scale = s.global_scale;
    w.gemv_words = a.gemv_words;
    w.tiled = a.tiled;
    w.rows = n;
    w.out = out;
    w.n = n;
    return w;
  };
  W4A16GemvArgs gate_up;
  gate_up.x = a.x;
  gate_up.m = 1;
  gate_up.k = a.hidden;
  gate_up.num_weights = 2;
  gate_up.w[0] = weight(a.gate, g, a.inter);
  gate_up.w[1] = weight(a.up, u, a.inter);
  gate_up.slots.ids = a.ids;
  gate_up.slots.count = static_cast<int>(a.num_tokens * a.top_k);
  gate_up.slots.x_stride = a.num_tokens > 1 ? h : 0;   // pair p reads token p / k
  gate_up.slots.x_div = a.top_k;
  gate_up.slots.num_experts = a.num_experts;
  gate_up.slots.packed_stride[0] = gate_up.slots.packed_stride[1] = inter * h / 2;
  gate_up.slots.scale_stride[0] = gate_up.slots.scale_stride[1] = inter * h / 16;
  gate_up.slots.out_stride = inter;
  ATLAS_RETURN_IF_ERROR(launch_w4a16_gemv(gate_up, stream));
  W4A16GemvArgs down;
  down.x = g;
  down.x2 = u;
  down.act = GemvAct::kSiluMul;
  down.m = 1;
  down.k = a.inter;
  down.w[0] = weight(a.down, d, a.hidden);
  down.slots = gate_up.slots;
  down.slots.packed_stride[0] = h * inter / 2;
  down.slots.scale_stride[0] = h * inter / 16;
  down.slots.x_stride = inter;
  down.slots.x_div = 1;
  down.slots.out_stride = h;
  down.slots.ids_ready = true;   // gate_up's CTAs trigger only after waiting for the ids' producer
  ATLAS_RETURN_IF_ERROR(launch_w4a16_gemv(down, stream));
  return launch_combine(a, d, stream);
}

template <class F>
cudaError_t launch_typed(const MoeExpertsArgs& a, const Records& rec, const Workspace& ws, cudaStream_t stream) {
  uint8_t* base = static_cast<uint8_t*>(a.workspace);
  auto* act = reinterpret_cast<__nv_bfloat16*>(base + ws.act);
  auto* d = reinterpret_cast<__nv_bfloat16*>(base + ws.d);
  const int pairs = static_cast<int>(a.num_tokens * a.top_k);
  const bool local = local_grouping(a.num_tokens, a.top_k);   // implies MT = 1
  const int gate_up_warps = local ? kLocalGateUpWarps : kWarps;   // tile warps per gate_up job
  const int gate_up_tiles = a.inter / (gate_up_warps * kTileN / 2), down_tiles = ceil_div(a.hidden, kCtaRows);

  // NVFP4 records of 8 pairs with whole chunks: the warp-streamed kernel (same bits, its own tiles)
  const bool warp_gate_up = F::kScaled && ws.mt == 1 && !local && warp_gemv_fits(a.hidden);
  const bool warp_down = F::kScaled && ws.mt == 1 && !local && warp_gemv_fits(a.inter);

  const GroupedGemv gate_up{static_cast<const __nv_bfloat16*>(a.x), {a.gate, a.up}, rec.count, rec.info,
                            rec.pairs, act, a.inter, a.hidden, a.top_k,
                            warp_gate_up ? a.inter / kTileN : gate_up_tiles,
                            local, a.ids, pairs, a.num_experts,
                            {F::kScaled ? a.gate.global_scale : nullptr, F::kScaled ? a.up.global_scale : nullptr},
                            w4a16_gemv_segment_chunks(a.hidden), stack_strides<F>(a.inter, a.hidden, a.tiled)};
  const int gate_up_jobs = ws.max_records * gate_up.tiles;
  if constexpr (F::kScaled) {
    if (warp_gate_up) ATLAS_RETURN_IF_ERROR((launch_warp_gemv<F, true>(gate_up, gate_up_jobs, stream)));
  }
  if (!warp_gate_up) {
    ATLAS_RETURN_IF_ERROR((local ? launch_grouped_gemv<F, true, 1, kLocalGateUpWarps>(gate_up, gate_up_jobs, stream)
                           : ws.mt == 1 ? launch_grouped_gemv<F, true, 1, kWarps>(gate_up, gate_up_jobs, stream)
                                        : launch_grouped_gemv<F, true, kMaxMT, kWarps>(gate_up, gate_up_jobs, stream)));
  }
  const GroupedGemv down{act, {a.down, a.down}, rec.count, rec.info, rec.pairs, d, a.hidden, a.inter, a.top_k,
                         warp_down ? a.hidden / kWarpJobRows : down_tiles, local, a.ids, pairs, a.num_experts,
                         {F::kScaled ? a.down.global_scale : nullptr, nullptr}, w4a16_gemv_segment_chunks(a.inter),
                         stack_strides<F>(a.hidden, a.inter, a.tiled)};
  const int down_jobs = ws.max_records * down.tiles;
  if constexpr (F::kScaled) {
    if (warp_down) ATLAS_RETURN_IF_ERROR((launch_warp_gemv<F, false>(down, down_jobs, stream)));
  }
  if (!warp_down) {
    ATLAS_RETURN_IF_ERROR((ws.mt == 1 ? launch_grouped_gemv<F, false, 1, kWarps>(down, down_jobs, stream)
                                      : launch_grouped_gemv<F, false, kMaxMT, kWarps>(down, down_jobs, stream)));
  }
  return launch_combine(a, d, stream);
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
      (a.shared != nullptr && a.shared_gate == nullptr) || (a.gemv_words && !a.nvfp4) ||
      (a.tiled && !(a.gemv_words && a.hidden % kChunkK == 0 && a.inter % kChunkK == 0))) {
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
  if (a.nvfp4 && indexed_path(a.num_tokens, a.top_k, a.hidden, a.inter)) return launch_indexed(a, ws, stream);
  uint8_t* base = static_cast<uint8_t*>(a.workspace);
  const Records rec{reinterpret_cast<int32_t*>(base + ws.num_records),
                    reinterpret_cast<int2*>(base + ws.info),
                    reinterpret_cast<int32_t*>(base + ws.pairs)};
  const int pairs = static_cast<int>(a.num_tokens * a.top_k);
  if (!local_grouping(a.num_tokens, a.top_k)) {
    const size_t group_smem =
        static_cast<size_t>(2 * a.num_experts + std::min(pairs, kGroupStagedIds)) * sizeof(int32_t);
    ATLAS_RETURN_IF_ERROR(launch_pdl(moe_group_kernel, dim3(1), dim3(kGroupThreads), group_smem, stream, a.ids,
                                     pairs, a.num_experts, 8 * ws.mt, rec));
  }
  if (!a.nvfp4) return launch_typed<Bf16Format>(a, rec, ws, stream);
  return a.gemv_words ? launch_typed<Nvfp4Format<true>>(a, rec, ws, stream)
                      : launch_typed<Nvfp4Format<false>>(a, rec, ws, stream);
}

}  // namespace atlas
