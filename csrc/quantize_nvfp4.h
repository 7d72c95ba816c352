// quantize_nvfp4: BF16/F16/F32 [N, K] → NVFP4 (DESIGN "Formats"). Launcher only; no torch.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

#include "common/dtype.h"

namespace atlas {

struct QuantizeNvfp4Args {
  const void* input;     // [N, K] bf16 | f16 | f32, contiguous, 16-byte aligned
  DType input_dtype;     // kBF16 | kF16 | kF32
  uint8_t* packed;       // [N, K/2]  out: code(2j) | code(2j+1) << 4
  uint8_t* block_scale;  // [N, K/16] out: e4m3 bytes
  float* global_scale;   // []        out: amax / (6·448), 1.0 when amax == 0
  float* amax;           // [1]       scratch: zeroed and reduced here
  int64_t n;             // rows (N)
  int64_t k;             // columns (K), K % 16 == 0
};

// Two launches on `stream`: global absmax, then per-block quantization. Never syncs.
cudaError_t launch_quantize_nvfp4(const QuantizeNvfp4Args& args, cudaStream_t stream);

}  // namespace atlas
