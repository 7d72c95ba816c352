// qk_norm_rope: per-head RMSNorm of q and k, partial NeoX RoPE, and the K/V write into the
// paged cache (BF16, or FP8 with one scale per (token, kv head)), in one launch.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace atlas {

struct QkNormRopeArgs {
  const void* q;              // [T, nq, hd] bf16, strides (q_stride_t, q_stride_h, 1)
  const void* k;              // [T, nkv, hd] bf16, strides (k_stride_t, k_stride_h, 1)
  const void* v;              // [T, nkv, hd] bf16, strides (v_stride_t, v_stride_h, 1)
  int64_t q_stride_t = 0, q_stride_h = 0;
  int64_t k_stride_t = 0, k_stride_h = 0;
  int64_t v_stride_t = 0, v_stride_h = 0;
  const void* q_norm_weight;  // [hd] bf16 | f32 (weight_f32)
  const void* k_norm_weight;  // [hd] bf16 | f32 (weight_f32)
  const int64_t* positions;   // [T] RoPE position of each token
  const int64_t* slot_mapping;  // [T] cache slot = block · bs + offset; < 0 or ≥ num_slots: no write
  void* q_out;                // [T, nq, hd] bf16, contiguous
  void* k_cache;              // [num_blocks, bs, nkv, hd] bf16 | e4m3
  void* v_cache;              // [num_blocks, bs, nkv, hd] bf16 | e4m3
  float* k_scale = nullptr;   // [num_blocks, bs, nkv] f32 (FP8 cache only)
  float* v_scale = nullptr;   // [num_blocks, bs, nkv] f32 (FP8 cache only)
  int64_t num_slots = 0;      // num_blocks · bs
  int num_tokens = 0;         // T
  int nq = 0, nkv = 0;
  int head_dim = 0;           // 64 | 128 | 256
  int rotary_dim = 0;         // even, ≤ head_dim: dims [0, rotary_dim) are rotated
  double log2_theta = 0.0;    // log2(rope_theta)
  float eps = 1e-6f;
  bool weight_f32 = false;
  bool zero_centered = false;
  bool cache_fp8 = false;
};

cudaError_t launch_qk_norm_rope(const QkNormRopeArgs& args, cudaStream_t stream);

}  // namespace atlas
