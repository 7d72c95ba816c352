// moe_router: the MoE router in one launch, equal to atlas/reference.py::moe_router — logits to
// the float32 summation order (one bf16 rounding each), ids and weights bitwise what moe_route
// computes from those logits (the same device code, common/route.cuh).
//
//   logits[t, r] = bf16(Σ_k x[t, k] · gates[r, k])   (float32 sums), r ∈ [0, R), R ∈ {E, E + 1}
//   ids, weights = moe_route(logits[:, :E]) (+ the shared slot (E, sigmoid(logits[t, E])))
//
// Why one kernel: the unfused path is a cuBLAS GEMM (no programmatic dependent launch, so its
// launch gap and the next kernel's are exposed) and then moe_route; on the decode chain that is
// 2.9 + 3.1 µs at T = 1 and 8.0 + 3.2 µs at T = 32 (35B-A3B, bench_mtp --parts, H200) for ≈ 1 MB
// of gate rows.
//
// Decomposition: a cluster of C = 16 CTAs (8 where the device cannot place 16; grid.x = cluster
//   rank) per tile of 16 tokens (grid.y). Gate rows are cut into tiles of 8 (the n8 of
//   mma.m16n8k16: tokens are M, gate rows N); CTA rank c owns the tiles_per_cta consecutive
//   tiles from c · tiles_per_cta (35B-A3B: R = 257 → 33 tiles, 3 per CTA; 5 with C = 8), i.e. the contiguous rows [c · cols, (c + 1) · cols), cols =
//   8 · tiles_per_cta. Its 8 warps split h into 32-wide k steps (warp w: steps [w·⌈S/8⌉, ...));
//   each warp accumulates up to 5 tiles (a group) at once over its k range, the loads of 8 steps
//   in flight together (5 tiles × 8 + 16 activation units of 16 B per lane: 255 registers, so one
//   CTA per SM).
//   Fragments straight from global memory, no shared-memory staging: the sum over k is the same
//   set of products in any k order, so lane (g = lane / 4, q = lane % 4) loads the 16 bytes at
//   k = 32·s + 8q of gate row 8·tile + g and of tokens g and g + 8, and feeds them to two mmas as
//   logical k {2q, 2q+1, 2q+8, 2q+9} ← physical {8q..8q+3}, then {8q+4..8q+7} — A and B use the
//   same map, so each mma sums true products. A warp instruction reads 8 rows × 64 contiguous
//   bytes. Partial sums of the 8 warps meet in shared memory and are added in warp order (the
//   bits depend on h alone, not on T or the token's tile: batch invariant) and rounded to bf16
//   once.
//   Routing: each logit is pushed (a distributed-shared-memory store) into the inbox of the CTA
//   that routes its token — token j of the tile: warp j / C of rank j % C — so after one
//   cluster barrier each routing warp runs route_token on local shared memory, while the other
//   warps store the routed tokens' logit rows to `logits` (whole rows, after the barrier: its
//   release does not wait on global stores). The only remote accesses are those pushes: a
//   relaxed arrive at the start and its wait before the first push ("every CTA started"), an
//   arrive.release / wait.acquire after the last; no barrier before exiting.
//   Programmatic dependent launch: before waiting for the previous kernel each warp loads its
//   first batch of gate fragments into registers and warp 0 bulk-prefetches the CTA's later
//   tile groups into L2 (the gates do not depend on it); x is read after the wait.
//
// Floor: R·h·2 bytes of gates + T·h·2 of x (+ T·R·2 logits out): 35B-A3B (R = 257, h = 2048)
//   1.05 MB → 0.25 µs at 4.2 TB/s. Latency-bound by design at decode sizes: after the wait, the
//   activation loads (an L2 round trip), the mma chains, the warp reduction, the cluster barrier
//   and route_token's k dependent rounds.
//
// Versions (H200, bench/router_probe: graph-replayed µs per call, 35B-A3B R = 257 T = 1 / 32,
// Qwen3-Next R = 513 T = 1; bench/NOTES.md has the phase stamps):
//   v1  logits read back by the routing warps through distributed shared memory, 4 k steps per
//       batch, gates only L2-prefetched before the wait: 8.81 / 9.41 / 14.7 (cuBLAS F.linear +
//       moe_route: 6.5 / 11.0 / 8.5).
//   v2  first batch of gate fragments in registers before the wait, 8 k steps per batch, the
//       global logit stores after the cluster barrier: 6.83 / 7.27 / 12.6.
//   v3  logits pushed to the routing CTA's inbox (v2's remote reads took 1.3 µs of a 3.6 µs
//       route), route_token's probabilities off its rounds' chain: 5.53 / 5.75 / 10.7.
//   v4  clusters of 16 CTAs (non-portable) where the device places them: 5.24 / 5.52 / 7.21.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/checks.h"
#include "common/nvfp4_mma.cuh"
#include "common/pdl.cuh"
#include "common/prefetch.cuh"
#include "common/route.cuh"
#include "moe_router.h"

namespace atlas {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarps = 8;          // per CTA; they split h
constexpr int kThreads = kWarps * 32;
constexpr int kTileTokens = 16;    // mma M
constexpr int kTileRows = 8;       // mma N: gate rows per tile
constexpr int kGroupTiles = 5;     // tiles a warp accumulates in one pass over its k range
constexpr int kBatchSteps = 8;     // 32-wide k steps whose loads are in flight together
constexpr int kTileElems = kTileTokens * kTileRows;
constexpr int kRedFloats = kWarps * kGroupTiles * kTileElems;   // per-warp partials, 20 KB

// Cluster barrier halves (sm_90): arrive with release semantics (this thread's prior writes,
// distributed shared memory included, become visible to the cluster) or without ordering (only
// "this CTA has started"), and wait with acquire semantics.
__device__ __forceinline__ void cluster_arrive_release() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait_acquire() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }

__device__ __forceinline__ uint4 load16(const __nv_bfloat16* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// grid (kCluster, ceil(T / 16)), clusters of kCluster (16, or the portable 8) along x, block kThreads.
template <int kPerLane, int kCluster>
__global__ void __launch_bounds__(kThreads, 1) moe_router_kernel(const MoeRouterArgs a, const int tiles_per_cta) {
  extern __shared__ float smem[];
  const int cols = tiles_per_cta * kTileRows;
  constexpr int kRouteWarps = kTileTokens / kCluster;   // tokens each CTA routes (warps 0 (, 1))
  float* red = smem;                  // [kWarps][kGroupTiles][16 tokens][8 rows] partial sums
  float* inbox = smem + kRedFloats;   // [kRouteWarps][R]: every logit of tokens rank, rank + 8 of the
                                      // tile (bf16 values), pushed here by the cluster's CTAs

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int h = a.hidden, num_rows = a.rows;
  const auto* gates = static_cast<const __nv_bfloat16*>(a.gates);   // [R, h]
  const auto* x = static_cast<const __nv_bfloat16*>(a.x);           // [T, h]
  auto* logits = static_cast<__nv_bfloat16*>(a.logits);             // [T, R]
  const int64_t tok0 = static_cast<int64_t>(blockIdx.y) * kTileTokens;
  const int tokens = static_cast<int>(min(static_cast<int64_t>(kTileTokens), a.num_tokens - tok0));
  const int row0 = rank * cols;       // this CTA's first gate row

  const int steps = ceil_div(h, 32), per_warp = ceil_div(steps, kWarps);
  const int s_begin = warp * per_warp, s_end = min(steps, s_begin + per_warp);
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  // gate fragments of tiles [t0, t0 + kGroupTiles) at steps [s0, s0 + kBatchSteps) (lane: row
  // 8·tile + g, k = 32·step + 8q; zeros past the CTA's tiles, R or the warp's steps)
  uint4 w[kGroupTiles][kBatchSteps];
  const auto load_gates = [&](int t0, int s0) {
#pragma unroll
    for (int j = 0; j < kGroupTiles; ++j) {
      const int r = row0 + (t0 + j) * kTileRows + g;
      const __nv_bfloat16* row = (t0 + j < tiles_per_cta && r < num_rows) ? gates + static_cast<int64_t>(r) * h : nullptr;
#pragma unroll
      for (int i = 0; i < kBatchSteps; ++i) {
        const int k = (s0 + i) * 32 + 8 * q;
        w[j][i] = row && s0 + i < s_end && k < h ? load16(row + k) : zero;
      }
    }
  };

  // Before the wait (the gates do not depend on the previous kernel): the first batch of
  // fragments into registers, and the CTA's other gate rows into L2 (one bulk prefetch per tile
  // past the first group, lane j of warp 0: tile kGroupTiles + j).
  load_gates(0, s_begin);
  cluster_arrive_relaxed();           // "started": the inbox pushes below wait for every CTA of the cluster
  if (warp == 0) {
    for (int j = kGroupTiles + lane; j < tiles_per_cta; j += 32) {
      const int r0 = row0 + j * kTileRows, n = min(kTileRows, num_rows - r0);
      if (n > 0) prefetch_l2_bulk(gates + static_cast<int64_t>(r0) * h, static_cast<uint32_t>(n) * h * 2);
    }
  }
  pdl_wait();                         // x is the previous kernel's output
  pdl_launch_dependents();

  const __nv_bfloat16* xa = g < tokens ? x + (tok0 + g) * h : nullptr;           // mma rows g, g + 8
  const __nv_bfloat16* xb = g + 8 < tokens ? x + (tok0 + g + 8) * h : nullptr;
  for (int t0 = 0; t0 < tiles_per_cta; t0 += kGroupTiles) {
    const int group = min(kGroupTiles, tiles_per_cta - t0);
    float acc[kGroupTiles][4] = {};
    for (int s0 = s_begin; s0 < s_end; s0 += kBatchSteps) {
      if (t0 > 0 || s0 > s_begin) load_gates(t0, s0);   // the first batch came before the wait
      uint4 va[kBatchSteps], vb[kBatchSteps];
#pragma unroll
      for (int i = 0; i < kBatchSteps; ++i) {
        const int k = (s0 + i) * 32 + 8 * q;
        const bool in = s0 + i < s_end && k < h;
        va[i] = in && xa ? load16(xa + k) : zero;
        vb[i] = in && xb ? load16(xb + k) : zero;
      }
#pragma unroll
      for (int i = 0; i < kBatchSteps; ++i)
#pragma unroll
        for (int j = 0; j < kGroupTiles; ++j) {
          if (j < group) {
            mma_bf16_16816(acc[j], va[i].x, vb[i].x, va[i].y, vb[i].y, w[j][i].x, w[j][i].y);
            mma_bf16_16816(acc[j], va[i].z, vb[i].z, va[i].w, vb[i].w, w[j][i].z, w[j][i].w);
          }
        }
    }
    // accumulator (standard m16n8 layout): acc[j] = D[token g | g + 8][row 2q, 2q + 1] of tile j
    float* mine = red + warp * kGroupTiles * kTileElems;
#pragma unroll
    for (int j = 0; j < kGroupTiles; ++j) {
      if (j < group) {
        float* d = mine + j * kTileElems;
        d[g * kTileRows + 2 * q] = acc[j][0];
        d[g * kTileRows + 2 * q + 1] = acc[j][1];
        d[(g + 8) * kTileRows + 2 * q] = acc[j][2];
        d[(g + 8) * kTileRows + 2 * q + 1] = acc[j][3];
      }
    }
    __syncthreads();
    if (t0 == 0) cluster_wait_acquire();   // every CTA of the cluster runs: its inbox may be written
    for (int i = threadIdx.x; i < group * kTileElems; i += kThreads) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += red[w * kGroupTiles * kTileElems + i];   // warp order
      const int tok = (i % kTileElems) / kTileRows;
      const int col = (t0 + i / kTileElems) * kTileRows + i % kTileRows;
      if (tok < tokens && row0 + col < num_rows) {   // into the inbox of the CTA routing the token
        float* dst = cluster.map_shared_rank(inbox, tok % kCluster);
        dst[(tok / kCluster) * num_rows + row0 + col] = __bfloat162float(__float2bfloat16_rn(s));
      }
    }
    __syncthreads();                  // red is rewritten by the next group
  }

  cluster_arrive_release();           // every inbox filled (the only distributed shared memory
  cluster_wait_acquire();             // accesses: no barrier is needed before exiting)
  if (warp < kRouteWarps) {
    const int j = warp * kCluster + rank;   // the tile's token this warp routes
    if (j < tokens) {
      const int64_t t = tok0 + j;
      const int out_k = a.top_k + (a.shared_slot ? 1 : 0);
      const float* row = inbox + warp * num_rows;
      route_token<kPerLane>([row](int e) { return row[e]; }, a.num_experts, a.top_k, a.renormalize,
                            a.shared_slot, lane, a.ids + t * out_k, a.weights + t * out_k);
    }
  } else {                            // the other warps store the routed tokens' logit rows
    for (int slot = 0; slot < kRouteWarps; ++slot) {
      const int j = slot * kCluster + rank;
      if (j >= tokens) break;
      __nv_bfloat16* out = logits + (tok0 + j) * num_rows;
      for (int e = threadIdx.x - kRouteWarps * 32; e < num_rows; e += kThreads - kRouteWarps * 32) {
        out[e] = __float2bfloat16_rn(inbox[slot * num_rows + e]);
      }
    }
  }
}

// Clusters of 16 CTAs (non-portable; H100 / H200 schedule them) where the device can place one,
// else 8: 16 halve each CTA's gate rows (35B-A3B: 3 tiles instead of 5; Qwen3-Next R = 513 in one
// tile group instead of two — H200 router_probe, T = 1: 5.49 → 5.24 µs, 10.66 → 7.21). Decided
// once per device (cudaOccupancyMaxActiveClusters), outside any stream work.
template <int kPerLane, int kCluster>
cudaError_t launch_clustered(const MoeRouterArgs& a, cudaStream_t stream) {
  const int tiles_per_cta = ceil_div(ceil_div(a.rows, kTileRows), kCluster);
  const size_t smem = (kRedFloats + static_cast<size_t>(kTileTokens / kCluster) * a.rows) * sizeof(float);
  const dim3 grid(kCluster, static_cast<unsigned>(ceil_div<int64_t>(a.num_tokens, kTileTokens)));
  return launch_pdl_cluster(moe_router_kernel<kPerLane, kCluster>, grid, dim3(kThreads), smem, stream, kCluster,
                            a, tiles_per_cta);
}

constexpr int kMaxDevices = 64;

template <int kPerLane>
cudaError_t launch_instance(const MoeRouterArgs& a, cudaStream_t stream) {
  static int wide[kMaxDevices] = {};   // per device: 0 unknown, 1 clusters of 16, 2 of 8
  int dev = 0;
  ATLAS_RETURN_IF_ERROR(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) return cudaErrorInvalidDevice;
  if (wide[dev] == 0) {
    const auto kernel = moe_router_kernel<kPerLane, 16>;
    int clusters = 0;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess) {
      const size_t smem = (kRedFloats + static_cast<size_t>(kTileTokens / 16) * (kMoeRouterMaxExperts + 1)) * sizeof(float);
      clusters = max_active_clusters(kernel, dev, 16, kThreads, smem, dim3(16));
    }
    (void)cudaGetLastError();          // a refused attribute is not this launch's error
    wide[dev] = clusters > 0 ? 1 : 2;
  }
  return wide[dev] == 1 ? launch_clustered<kPerLane, 16>(a, stream) : launch_clustered<kPerLane, 8>(a, stream);
}

}  // namespace

cudaError_t launch_moe_router(const MoeRouterArgs& a, cudaStream_t stream) {
  const int extra = a.shared_slot ? 1 : 0;
  if (a.num_tokens < 1 || ceil_div<int64_t>(a.num_tokens, kTileTokens) > 65535 || a.hidden < 8 ||
      a.hidden % 8 != 0 || a.num_experts < 1 || a.num_experts > kMoeRouterMaxExperts ||
      (a.rows != a.num_experts && a.rows != a.num_experts + 1) || a.rows < a.num_experts + extra ||
      a.top_k < 1 || a.top_k > a.num_experts || a.top_k > kMoeRouterMaxTopK || (a.shared_slot && a.top_k >= 32) ||
      a.x == nullptr || a.gates == nullptr || a.logits == nullptr || a.ids == nullptr || a.weights == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int per_lane = ceil_div(a.num_experts, 32);
  if (per_lane <= 1) return launch_instance<1>(a, stream);
  if (per_lane <= 2) return launch_instance<2>(a, stream);
  if (per_lane <= 4) return launch_instance<4>(a, stream);
  if (per_lane <= 8) return launch_instance<8>(a, stream);     // E ≤ 256: Qwen3.5/3.6-35B-A3B
  if (per_lane <= 16) return launch_instance<16>(a, stream);   // E ≤ 512: Qwen3-Next-80B-A3B
  return launch_instance<32>(a, stream);
}

}  // namespace atlas
