// argmax: row-wise greedy pick over logits with its top-1 softmax probability (the MTP draft
// and its confidence). Launcher only; no torch.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

#include "common/dtype.h"

namespace atlas {

// Logits per CTA in the split pass (256 threads × 16). atlas/ops.py sizes the partials
// workspace with the same constant (ops.ARGMAX_CHUNK).
constexpr int kArgmaxChunk = 4096;

struct ArgmaxArgs {
  const void* logits;     // [R, V] bf16 | f32, row r at logits + r · row_stride elements
  DType dtype;            // kBF16 | kF32
  int64_t rows;           // R ≥ 1
  int64_t vocab;          // V ≥ 1
  int64_t row_stride;     // elements between rows, ≥ V
  float* partials;        // [3, R, S] f32 scratch, S = ceil(V / kArgmaxChunk): per (row, split)
                          // plane 0 max, plane 1 Σ exp(x − max), plane 2 index (int32 bits)
  int64_t* ids;           // [R] out: lowest index among the row's maxima
  float* prob;            // [R] out: 1 / Σ_v exp(x_v − max) (softmax of the winner)
};

// Two launches on `stream` (split pass, merge pass); never syncs.
// cudaErrorInvalidValue for arguments outside the ranges above.
cudaError_t launch_argmax(const ArgmaxArgs& args, cudaStream_t stream);

}  // namespace atlas
