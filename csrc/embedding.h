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

// The MTP head's fc input in one launch:
//   out[t, 0:h]  = rms_norm(table[ids[t]], w_embed),  out[t, h:2h] = rms_norm(hidden[t], w_hidden)
//   rms_norm(x, w) = bf16(x · rsqrt(mean(x²) + eps) · (zero_centered ? 1 + w : w)), float32 math.
constexpr int kEmbeddingNormMaxHidden = 8192;

struct EmbeddingNormConcatArgs {
  const void* table;       // [V, h] bf16, contiguous, 16-byte aligned
  const void* ids;         // [T] int32 | int64; ids outside [0, V) read a zero row
  bool ids_int64;
  const void* hidden;      // [T, h] bf16, rows hidden_stride elements apart (% 8 == 0), 16-byte aligned
  int64_t hidden_stride;
  const float* w_embed;    // [h] f32
  const float* w_hidden;   // [h] f32
  void* out;               // [T, 2h] bf16, contiguous
  int64_t num_tokens;      // T, 1..65535
  int64_t vocab;           // V ≥ 1
  int hidden_size;         // h, % 8 == 0, ≤ kEmbeddingNormMaxHidden
  float eps;
  bool zero_centered;
};

cudaError_t launch_embedding_norm_concat(const EmbeddingNormConcatArgs& args, cudaStream_t stream);

}  // namespace atlas
