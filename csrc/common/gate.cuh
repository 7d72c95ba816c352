// The Qwen3-Next attention output gate of one element, x · sigmoid(g) in float32, written once:
// sigmoid_gate_mul, paged_decode's gated stores and w4a16_gemv_gated all call it, so their
// results are the same bits (the reciprocal first, then the product: not x / (1 + e), which
// rounds differently; expf, not __expf — the reference is torch.sigmoid in float32).
#pragma once
#include <cuda_runtime.h>

namespace atlas {

__device__ __forceinline__ float sigmoid_gate_f32(float x, float g) { return x * (1.0f / (1.0f + expf(-g))); }

}  // namespace atlas
