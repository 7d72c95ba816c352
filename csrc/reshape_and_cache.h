// reshape_and_cache: write K/V rows of this step into the paged KV cache (DESIGN "Paged KV
// cache"), BF16 copy or FP8 E4M3 with one float32 scale per (token, kv head). Launcher only;
// no torch.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

#include "common/dtype.h"

namespace atlas {

struct ReshapeAndCacheArgs {
  const void* key;             // [T, nkv, hd] bf16, rows key_stride elements apart, 16-byte aligned
  const void* value;           // [T, nkv, hd] bf16, rows value_stride elements apart, 16-byte aligned
  void* k_cache;               // [num_blocks, bs, nkv, hd] bf16 | e4m3, contiguous, 16-byte aligned
  void* v_cache;               // [num_blocks, bs, nkv, hd] same dtype as k_cache
  float* k_scale;              // [num_blocks, bs, nkv] f32 (e4m3 cache only; else nullptr)
  float* v_scale;              // [num_blocks, bs, nkv] f32 (e4m3 cache only; else nullptr)
  const int64_t* slot_mapping; // [T] slot = block · bs + offset; < 0 or ≥ num_slots: skipped
  int64_t num_tokens;          // T ≥ 0
  int64_t key_stride;          // elements between key rows, % 8 == 0
  int64_t value_stride;        // elements between value rows, % 8 == 0
  int64_t num_slots;           // num_blocks · bs
  int num_kv_heads;            // nkv ≥ 1
  int head_dim;                // hd, % 8 == 0, ≤ kReshapeAndCacheMaxHeadDim
  DType cache_dtype;           // kBF16 | kE4M3
};

// Largest head_dim the launcher has an instance for (32 lanes × 4 chunks × 8 elements).
constexpr int kReshapeAndCacheMaxHeadDim = 1024;

// One launch on `stream`; never syncs. cudaErrorInvalidValue for arguments outside the
// ranges above (ops.reshape_and_cache rejects them first, naming the argument).
cudaError_t launch_reshape_and_cache(const ReshapeAndCacheArgs& args, cudaStream_t stream);

}  // namespace atlas
