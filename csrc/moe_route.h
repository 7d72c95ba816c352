// moe_route: MoE router on the device — softmax over all E experts in float32, top-k (lowest
// index wins ties), optional renormalization. Launcher only; no torch.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

#include "common/dtype.h"

namespace atlas {

constexpr int kMoeRouteMaxExperts = 1024;  // one warp per row, ≤ 32 logits per lane
constexpr int kMoeRouteMaxTopK = 32;       // lane j keeps slot j

struct MoeRouteArgs {
  const void* logits;   // [T, E] bf16 | f32, row t at logits + t · row_stride elements
  int64_t row_stride;   // ≥ E (E + 1 when the shared-expert gate logit rides along)
  DType dtype;          // kBF16 | kF32
  int64_t num_tokens;   // T ≥ 1
  int num_experts;      // E, 1..kMoeRouteMaxExperts
  int top_k;            // k, 1..min(E, kMoeRouteMaxTopK)
  bool renormalize;     // divide the k weights by their sum (Qwen3 norm_topk_prob)
  bool shared_slot;     // also emit slot k = (id E, sigmoid(logits[t, E])): the shared expert as one
                        // more weighted expert (needs row_stride ≥ E + 1 and k ≤ 31)
  int32_t* ids;         // [T, k (+1)] out: slot j = j-th best expert
  float* weights;       // [T, k (+1)] out
};

// One launch on `stream`; never syncs. cudaErrorInvalidValue outside the ranges above.
cudaError_t launch_moe_route(const MoeRouteArgs& args, cudaStream_t stream);

}  // namespace atlas
