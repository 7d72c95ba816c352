// moe_router: the MoE router in one launch — logits = bf16(x · gatesᵀ) (float32 sums), then
// moe_route's selection over them (softmax over E in float32, top-k, optional renormalization,
// optional shared-expert slot). Launcher only; no torch.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace atlas {

constexpr int kMoeRouterMaxExperts = 1024;  // as moe_route: one warp per token, ≤ 32 logits per lane
constexpr int kMoeRouterMaxTopK = 32;

struct MoeRouterArgs {
  const void* x;        // [T, h] bf16, contiguous, 16-byte aligned
  const void* gates;    // [R, h] bf16, contiguous, 16-byte aligned: R = E router rows, or E + 1 with the
                        // shared-expert gate row last
  int64_t num_tokens;   // T ≥ 1
  int hidden;           // h ≥ 8, a multiple of 8 (16-byte units)
  int rows;             // R ∈ {E, E + 1}
  int num_experts;      // E, 1..kMoeRouterMaxExperts
  int top_k;            // k, 1..min(E, kMoeRouterMaxTopK)
  bool renormalize;     // divide the k weights by their sum (Qwen3 norm_topk_prob)
  bool shared_slot;     // also emit slot k = (id E, sigmoid(logit E)) (needs R = E + 1, k ≤ 31)
  void* logits;         // [T, R] bf16 out: every row's logit, the shared gate's included
  int32_t* ids;         // [T, k (+1)] out: slot j = j-th best expert
  float* weights;       // [T, k (+1)] out
};

// One launch on `stream` (clusters of 16 CTAs, 8 where the device cannot place 16; programmatic
// dependent launch); never syncs. The first launch per device asks the occupancy API once.
// cudaErrorInvalidValue outside the ranges above.
cudaError_t launch_moe_router(const MoeRouterArgs& args, cudaStream_t stream);

}  // namespace atlas
