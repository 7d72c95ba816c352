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
// Decomposition: one warp per row (token), 4 rows per 128-thread CTA, grid ceil(T / 4); the
//   warp's work is common/route.cuh's route_token (shared with moe_router, which computes the
//   logits itself). Lane l holds experts e = l + 32·i, i ∈ [0, kPerLane) in registers (kPerLane = the smallest
//   of 1, 2, 4, 8, 16, 32 with 32·kPerLane ≥ E: a template parameter, so the arrays stay in
//   registers). Softmax: warp max and warp sum by xor-shuffles. Top-k (v2): every expert a
//   64-bit key (order-preserving logit bits | ~e), each lane's keys sorted descending in
//   registers once (bitonic network), then k rounds of two redux.sync maxima over the lanes'
//   heads (logit half, then index half among the ties) and a register shift on the winning
//   lane; lane j keeps round j's (id, p). v1 rescanned kPerLane slots and ran a 5-step
//   shuffle arg-max (10 shuffles) per round: ≈ 300 dependent cycles × k = 8 rounds, ≈ 2 µs of
//   the 4.2 µs one-token launch on the H200 (bench_mtp parts). v3: the rounds only select;
//   each slot's probability and their sum (in slot order, the same bits) follow the rounds
//   (bench_mtp --parts, one token: 3.14 → 2.96 µs). No shared memory, no host sync:
//   graph-capturable.
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
#include "common/route.cuh"
#include "moe_route.h"

namespace atlas {
namespace {

constexpr int kWarpsPerCta = 4;

__device__ __forceinline__ float load_logit(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load_logit(const float* p) { return *p; }

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
  const int out_k = top_k + (shared_slot ? 1 : 0);
  route_token<kPerLane>([row](int e) { return load_logit(row + e); }, num_experts, top_k, renormalize,
                        shared_slot, lane, ids + t * out_k, weights + t * out_k);
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
