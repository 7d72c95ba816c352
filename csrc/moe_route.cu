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
//   registers). Softmax: warp max and warp sum by xor-shuffles. Top-k: k rounds of a warp
//   arg-max over the experts not yet taken — each lane proposes its best (strict > over
//   increasing e keeps the lowest index), the shuffle merge prefers the larger logit, then the
//   lower index; the owning lane marks the winner taken (one bit per register slot) and lane j
//   keeps round j's (id, p). No shared memory, no host sync: graph-capturable.
//
// Launched with programmatic dependent launch (common/pdl.cuh): waits for the router GEMV before
// reading its logits and lets the next kernel launch at once.
//
// Floor: T·E·elem bytes read + T·k·8 written: 35B-A3B, T = 32, E = 256: 16 KB — launch-bound
//   (~2 µs eager, ~1 µs in a graph) by orders of magnitude; the point of the kernel is to keep
//   routing on the device, not bandwidth. The k rounds cost k · (kPerLane + 5 shuffles) steps.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>

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

// Warp arg-max of (value, index): larger value wins, equal values → lower index.
__device__ __forceinline__ void warp_argmax(float& v, int& idx) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, off);
    if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
  }
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

  // 3. k rounds of arg-max over the experts not taken yet; lane j keeps round j
  uint32_t taken = 0;                 // bit i: expert lane + 32·i already selected
  int my_id = 0;
  float my_p = 0.f, sum_p = 0.f;
  for (int j = 0; j < top_k; ++j) {
    float bv = -INFINITY;
    int bi = INT_MAX;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      const bool free_slot = e < num_experts && !((taken >> i) & 1u);
      if (free_slot && (x[i] > bv || bi == INT_MAX)) { bv = x[i]; bi = e; }
    }
    warp_argmax(bv, bi);
    if ((bi & 31) == lane) taken |= 1u << (bi / 32);
    const float p = (bv == -INFINITY) ? 0.f : expf(bv - m) / s;
    sum_p += p;
    if (lane == j) { my_id = bi; my_p = p; }
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
