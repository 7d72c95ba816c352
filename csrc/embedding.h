// embedding: gather rows of a BF16 embedding table by device ids (the drafted token's
// embedding, read without a host sync). Launcher only; no torch.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace atlas {

struct EmbeddingArgs {
  const void* table;     // [V, h] bf16, contiguous, 16-byte aligned
  const void* ids;       // [T] int32 | int64 (ids_int64 says which); ids outside [0, V) → zero row
  bool ids_int64;
  void* out;             // [T, h] bf16, contiguous, 16-byte aligned
  int64_t num_tokens;    // T ≥ 1
  int64_t vocab;         // V ≥ 1
  int64_t hidden;        // h ≥ 1
};

// One launch on `stream`; never syncs. cudaErrorInvalidValue outside the ranges above.
cudaError_t launch_embedding(const EmbeddingArgs& args, cudaStream_t stream);

}  // namespace atlas
