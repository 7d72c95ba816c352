// moe_route: the MoE router's selection, equal to atlas/reference.py::moe_route (ids exactly,
// weights to float32 rounding).
//
//   p[t, e]   = exp(x[t, e] − max_t) / Σ_e' exp(x[t, e'] − max_t)        (float32)
//   ids[t, :] = the k experts of largest logit, best first; equal logits: lower index first
//               (ranking by logit, not by the rounded p, which could tie distinct logits)
//   w[t, j]   = p[t, ids[t, j]]  (÷ Σ_j p[t, ids[t, j]] when renormalize)
//   shared_slot: ids[t, k] = E, w[t, k] = sigmoid(x[t, E]) — the shared-expert gate logit that
//   rides in column E of [router | shared gate] logits, so moe_experts runs the shared expert
//   as one more (row, slot) pair
//
// Decomposition: one warp per row (token), 4 rows per 128-thread CTA, grid ceil(T / 4).
//   Lane l holds experts e = l + 32·i, i ∈ [0, kPerLane) in registers (kPerLane = the smallest
//   of 1, 2, 4, 8, 16, 32 with 32·kPerLane ≥ E: a template parameter, so the arrays stay in
//   registers). Softmax: warp max and warp sum by xor-shuffles. Top-k (v2): every expert a
//   64-bit key (order-preserving logit bits | ~e), each lane's keys sorted descending in
//   registers once (bitonic network), then k rounds of two redux.sync maxima over the lanes'
//   heads (logit half, then index half among the ties) and a register shift on the winning
//   lane; lane j keeps round j's (id, p). v1 rescanned kPerLane slots and ran a 5-step
//   shuffle arg-max (10 shuffles) per round: ≈ 300 dependent cycles × k = 8 rounds, ≈ 2 µs of
//   the 4.2 µs one-token launch on the H200 (bench_mtp parts). No shared memory, no host
//   sync: graph-capturable.
//
// Launched with programmatic dependent launch (common/pdl.cuh): waits for the router GEMV before
// reading its logits and lets the next kernel launch at once.
//
// Floor: T·E·elem bytes read + T·k·8 written: 35B-A3B, T = 32, E = 256: 16 KB — launch-bound
//   (~2 µs eager, ~1 µs in a graph) by orders of magnitude; the point of the kernel is to keep
//   routing on the device, not bandwidth, and its latency is the dependent chain of the k rounds.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "common/checks.h"
#include "common/pdl.cuh"
#include "moe_route.h"

namespace atlas {
namespace {

constexpr int kWarpsPerCta = 4;

__device__ __forceinline__ float load_logit(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load_logit(const float* p) { return *p; }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// A logit as an unsigned key whose integer order is the float order, so warp maxima are one
// redux.sync: −inf lowest, −0 and +0 one key (equal logits: the lower index wins, as the
// reference's stable sort), every NaN one key above +inf (torch sorts NaN first). Key 0 lies
// below every logit's key.
__device__ __forceinline__ uint32_t ordered_key(float v) {
  uint32_t u = __float_as_uint(v);
  if (u == 0x80000000u) u = 0u;             // −0 → +0
  if (v != v) u = 0x7FC00000u;              // any NaN → the canonical quiet NaN
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// Compare-exchange of a descending sort: afterwards a ≥ b.
__device__ __forceinline__ void order_desc(uint64_t& a, uint64_t& b) {
  const uint64_t hi = a > b ? a : b, lo = a > b ? b : a;
  a = hi;
  b = lo;
}

template <typename T, int kPerLane>
__global__ void __launch_bounds__(kWarpsPerCta * 32) moe_route_kernel(
    const T* __restrict__ logits,     // [T, E], rows row_stride apart
    int64_t row_stride, int64_t num_tokens, int num_experts, int top_k, bool renormalize, bool shared_slot,
    int32_t* __restrict__ ids,        // [T, k (+1)]
    float* __restrict__ weights) {    // [T, k (+1)]
  const int lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  pdl_wait();                         // the router logits are the previous kernel's output
  pdl_launch_dependents();
  if (t >= num_tokens) return;        // whole warp exits together
  const T* row = logits + t * row_stride;

  // 1. load: lane owns experts lane + 32·i (−inf pads past E)
  float x[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    x[i] = e < num_experts ? load_logit(row + e) : -INFINITY;
  }

  // 2. softmax denominator over all E experts (float32)
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) m = fmaxf(m, x[i]);
  m = warp_max(m);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) s += (x[i] == -INFINITY) ? 0.f : expf(x[i] - m);
  s = warp_sum(s);

  // 3. top-k. Expert e's 64-bit key: ordered_key(logit) above, ~e below — larger key = larger
  //    logit, then lower index (0 for the padding past E: below every expert). Each lane sorts
  //    its kPerLane keys descending (a bitonic network: log² depth, no dynamic indexing), so
  //    its best untaken expert is always key[0]; a round is two warp maxima (the logit half,
  //    then the index half among the lanes holding it) and a shift on the winning lane.
  uint64_t key[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    key[i] = e < num_experts ? (uint64_t{ordered_key(x[i])} << 32) | uint32_t(~e) : 0;
  }
#pragma unroll
  for (int size = 2; size <= kPerLane; size *= 2)
#pragma unroll
    for (int stride = size / 2; stride > 0; stride /= 2)
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int j = i ^ stride;
        if (j > i) {
          if ((i & size) == 0) order_desc(key[i], key[j]);   // the last merge (size = kPerLane) is
          else order_desc(key[j], key[i]);                   // all descending
        }
      }
  int my_id = 0;
  float my_p = 0.f, sum_p = 0.f;
  for (int j = 0; j < top_k; ++j) {
    const uint32_t hi = static_cast<uint32_t>(key[0] >> 32);
    const uint32_t best_hi = __reduce_max_sync(0xffffffffu, hi);
    const uint32_t best_lo = __reduce_max_sync(0xffffffffu, hi == best_hi ? static_cast<uint32_t>(key[0]) : 0u);
    const int id = static_cast<int>(~best_lo);
    if (id % 32 == lane) {                    // the winner's lane: its next best moves up
#pragma unroll
      for (int i = 0; i + 1 < kPerLane; ++i) key[i] = key[i + 1];
      key[kPerLane - 1] = 0;
    }
    const float bv = key_value(best_hi);
    const float p = (bv == -INFINITY) ? 0.f : expf(bv - m) / s;
    sum_p += p;
    if (lane == j) { my_id = id; my_p = p; }
  }

  // 4. store (renormalized: w = p / Σ p over the k selected); lane k: the shared-expert slot
  const int out_k = top_k + (shared_slot ? 1 : 0);
  if (lane < top_k) {
    ids[t * out_k + lane] = my_id;
    weights[t * out_k + lane] = renormalize ? my_p / sum_p : my_p;
  } else if (shared_slot && lane == top_k) {
    ids[t * out_k + lane] = num_experts;
    weights[t * out_k + lane] = 1.f / (1.f + expf(-load_logit(row + num_experts)));
  }
}

template <typename T>
cudaError_t launch_typed(const MoeRouteArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(a.num_tokens, kWarpsPerCta)));
  const dim3 block(kWarpsPerCta * 32);
  const T* x = static_cast<const T*>(a.logits);
  const int per_lane = ceil_div(a.num_experts, 32);
  auto run = [&](auto kernel) {
    return launch_pdl(kernel, grid, block, 0, stream, x, a.row_stride, a.num_tokens, a.num_experts, a.top_k,
                      a.renormalize, a.shared_slot, a.ids, a.weights);
  };
  if (per_lane <= 1) return run(moe_route_kernel<T, 1>);
  if (per_lane <= 2) return run(moe_route_kernel<T, 2>);
  if (per_lane <= 4) return run(moe_route_kernel<T, 4>);
  if (per_lane <= 8) return run(moe_route_kernel<T, 8>);   // E ≤ 256: Qwen3.5/3.6-35B-A3B
  if (per_lane <= 16) return run(moe_route_kernel<T, 16>); // E ≤ 512: Qwen3-Next-80B-A3B
  return run(moe_route_kernel<T, 32>);
}

}  // namespace

cudaError_t launch_moe_route(const MoeRouteArgs& a, cudaStream_t stream) {
  if (a.num_tokens < 1 || a.row_stride < a.num_experts + (a.shared_slot ? 1 : 0) ||
      (a.shared_slot && a.top_k >= 32) || a.num_experts < 1 || a.num_experts > kMoeRouteMaxExperts || a.top_k < 1 ||
      a.top_k > a.num_experts || a.top_k > kMoeRouteMaxTopK || a.logits == nullptr || a.ids == nullptr ||
      a.weights == nullptr || ceil_div<int64_t>(a.num_tokens, kWarpsPerCta) > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  switch (a.dtype) {
    case DType::kBF16: return launch_typed<__nv_bfloat16>(a, stream);
    case DType::kF32: return launch_typed<float>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace atlas
