// sigmoid_gate_mul: out = x · sigmoid(gate), elementwise, fp32 math, one bf16 rounding.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace atlas {

struct SigmoidGateArgs {
  const void* x;             // [T, H, hd] bf16, contiguous
  const void* gate;          // [T, H, hd] bf16, strides (gate_stride_t, gate_stride_h, 1)
  void* out;                 // [T, H, hd] bf16, contiguous (may alias x)
  int64_t tokens = 0;        // T
  int64_t heads = 0;         // H
  int64_t head_dim = 0;      // hd, % 8 == 0
  int64_t gate_stride_t = 0; // elements, % 8 == 0
  int64_t gate_stride_h = 0; // elements, % 8 == 0
};

cudaError_t launch_sigmoid_gate_mul(const SigmoidGateArgs& args, cudaStream_t stream);

}  // namespace atlas
