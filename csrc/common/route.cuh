// One token's MoE routing by one warp — softmax over E experts in float32, top-k by logit (lower
// index first among equal logits), optional renormalization, optional shared-expert slot — shared
// by moe_route (logits from global memory) and moe_router (logits it computed itself, read from
// its cluster's shared memory). Semantics: atlas/reference.py::moe_route; the algorithm (v2:
// per-lane bitonic sort once, then k rounds of two redux.sync maxima) is described in
// csrc/moe_route.cu.
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "warp.cuh"

namespace atlas {

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

// Routes one token; every lane of the warp calls it. logit(e) → float: expert e's logit for
// e ∈ [0, num_experts), and for e = num_experts the shared-expert gate logit (read only when
// shared_slot). Writes ids_row[j], weights_row[j] for j < top_k (+ slot top_k = (E, sigmoid)).
// kPerLane: the smallest of 1, 2, 4, ... with 32·kPerLane ≥ num_experts.
template <int kPerLane, typename LogitFn>
__device__ __forceinline__ void route_token(LogitFn logit, int num_experts, int top_k, bool renormalize,
                                            bool shared_slot, int lane,
                                            int32_t* __restrict__ ids_row,       // [k (+1)]
                                            float* __restrict__ weights_row) {   // [k (+1)]
  // 1. load: lane owns experts lane + 32·i (−inf pads past E)
  float x[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    x[i] = e < num_experts ? logit(e) : -INFINITY;
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
  //    The rounds only select (lane j keeps round j's id and logit key); the probabilities and
  //    their sum (in slot order, as the reference) follow, off the rounds' dependent chain.
  int my_id = 0;
  uint32_t my_hi = 0u;
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
    if (lane == j) { my_id = id; my_hi = best_hi; }
  }
  const float bv = key_value(my_hi);
  const float my_p = (lane >= top_k || bv == -INFINITY) ? 0.f : expf(bv - m) / s;
  float sum_p = 0.f;
  for (int j = 0; j < top_k; ++j) sum_p += __shfl_sync(0xffffffffu, my_p, j);

  // 4. store (renormalized: w = p / Σ p over the k selected); lane k: the shared-expert slot
  if (lane < top_k) {
    ids_row[lane] = my_id;
    weights_row[lane] = renormalize ? my_p / sum_p : my_p;
  } else if (shared_slot && lane == top_k) {
    ids_row[lane] = num_experts;
    weights_row[lane] = 1.f / (1.f + expf(-logit(num_experts)));
  }
}

}  // namespace atlas
