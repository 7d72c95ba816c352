// rms_norm: y = x · rsqrt(mean(x²) + eps) · w  (w = 1 + weight when zero_centered), fp32 math.
// With a residual: h = bf16(x + residual) is written back to residual, and y = rms_norm(h).
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace atlas {

struct RmsNormArgs {
  const void* x;           // [R, D] bf16, inner dim contiguous, row stride x_row_stride elements
  const void* weight;      // [D] bf16 | f32 (weight_f32), contiguous
  void* out;               // [R, D] bf16, contiguous
  void* residual = nullptr;  // [R, D] bf16, contiguous, in/out (nullptr: plain norm)
  int64_t rows = 0;        // R
  int64_t dim = 0;         // D, D % 8 == 0
  int64_t x_row_stride = 0;  // elements between rows of x, % 8 == 0
  float eps = 1e-6f;
  bool weight_f32 = false;
  bool zero_centered = false;
};

cudaError_t launch_rms_norm(const RmsNormArgs& args, cudaStream_t stream);

}  // namespace atlas
