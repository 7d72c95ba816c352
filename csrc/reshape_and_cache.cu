// reshape_and_cache: write this step's K/V rows into the paged KV cache, bit-exact with
// atlas/reference.py::reshape_and_cache.
//
//   for t in [0, T), s = slot_mapping[t], 0 ≤ s < num_slots (others skipped):
//     BF16 cache:  k_cache[s] = key[t],  v_cache[s] = value[t]                (exact copy)
//     E4M3 cache:  per kv head h, row x = key[t, h, :] (and likewise value):
//                  scale = amax(|x|) / 448   (1.0 when amax == 0)
//                  k_cache[s, h, :] = e4m3_rne_satfinite(x / scale),  k_scale[s, h] = scale
//   k_cache viewed as [num_slots = num_blocks · bs, nkv, hd]: slot s = block · bs + offset is
//   its row, so the kernel never needs bs (any block size: 16, 528, ...).
//
// Decomposition: one "row" = (token t, K or V, kv head h), hd contiguous bf16 values.
//   Rows are numbered row = t · 2·nkv + (is_v · nkv + h), h fastest, so neighbouring rows are
//   neighbouring memory on both sides. A group of kLanes lanes (8, 16 or 32: the smallest
//   power of two ≥ hd/8, capped at a warp) owns one row; lane l owns the 16-byte chunks
//   c = l + i·kLanes, i ∈ [0, kChunks), i.e. elements [8c, 8c + 8). Groups never straddle a
//   warp (kLanes divides 32), so the FP8 amax is a group-local xor-shuffle reduce.
//   Grid: ceil(T · 2·nkv · kLanes / 256) CTAs of 256 threads (8 warps); no shared memory, no
//   pipeline: every lane issues its kChunks 16-byte loads, then (FP8) reduces and converts,
//   then stores 16 (BF16) or 8 (FP8) bytes per chunk. Lane 0 of the group stores the scale.
//   Cache offsets are int64: slot · nkv · hd passes 2^31 at ~16 k blocks of 16 × 8 × 128.
//   Skipped rows (slot < 0: padding; slot ≥ num_slots: out of range, which ops.py rejects
//   only on CPU because checking a CUDA tensor would sync) load and store nothing; their
//   lanes still join the shuffle, so every shuffle runs with a full warp.
//
// Division is IEEE (__fdiv_rn, whatever the build flags) and the conversion is cvt.rn.satfinite:
// the float32 torch reference computes the same bits.
//
// Floor (bytes moved): T·nkv·hd·2 (K and V) · (2 read + c written, c = 2 BF16 | 1 FP8)
//   + T·nkv·2·4 (FP8 scales) + T·8 (slots). Qwen3 nkv = 4, hd = 256, T = 4096:
//   BF16 33.6 MB → 7.8 µs, FP8 25.3 MB → 5.9 µs at the H200's ≈ 4.3 TB/s copy bandwidth.
//   Target ≥ 80% of copy bandwidth at T ≥ 4096 (bench/bench_reshape_and_cache.py; measured
//   fraction: see bench/NOTES.md). At T = 1 (decode) the launch itself (~2 µs) dominates.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "common/checks.h"
#include "reshape_and_cache.h"

namespace atlas {
namespace {

constexpr int kThreads = 256;          // 8 warps per CTA
constexpr int kChunkElems = 8;         // bf16 values in one 16-byte load
constexpr float kE4M3Max = 448.f;      // largest finite E4M3 (fn) value: 1.75 · 2^8

// What one 16-byte chunk of bf16 input becomes in the cache.
template <typename CacheT> struct CacheChunk;
template <> struct CacheChunk<__nv_bfloat16> {
  using Store = uint4;                  // 8 × bf16, copied bit for bit
  static constexpr bool kScaled = false;
};
template <> struct CacheChunk<__nv_fp8_e4m3> {
  using Store = uint2;                  // 8 × e4m3
  static constexpr bool kScaled = true;
};

__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float (&out)[kChunkElems]) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(p[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// max |x| over one chunk (exact: |x| of a bf16 is a float, fmaxf rounds nothing).
__device__ __forceinline__ float chunk_amax(const uint4& v) {
  float f[kChunkElems];
  bf16x8_to_float(v, f);
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < kChunkElems; ++i) m = fmaxf(m, fabsf(f[i]));
  return m;
}

// max over the kLanes lanes of this row's group (xor offsets < kLanes stay inside the group).
template <int kLanes>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// 8 bf16 → 8 e4m3 of x / scale: IEEE division, round to nearest even, saturate at ±448.
__device__ __forceinline__ uint2 quantize_chunk_e4m3(const uint4& v, float scale) {
  float f[kChunkElems];
  bf16x8_to_float(v, f);
  uint32_t word[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 pair = make_float2(__fdiv_rn(f[2 * i], scale), __fdiv_rn(f[2 * i + 1], scale));
    // .x lands in the low byte: element 2i at the lower address
    const uint32_t two = __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
    word[i / 2] |= two << (16 * (i % 2));
  }
  return make_uint2(word[0], word[1]);
}

// Grid: ceil(T · 2·nkv · kLanes / kThreads); see the header comment for who owns what.
template <typename CacheT, int kLanes, int kChunks>
__global__ void __launch_bounds__(kThreads)
reshape_and_cache_kernel(const __grid_constant__ ReshapeAndCacheArgs a) {
  using Chunk = CacheChunk<CacheT>;
  static_assert(32 % kLanes == 0, "a row's lane group must not straddle a warp");

  const int nkv = a.num_kv_heads;
  const int hd = a.head_dim;
  const int64_t thread = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t row = thread / kLanes;                 // [0, T · 2·nkv) plus the grid's tail
  const int lane = int(threadIdx.x % kLanes);          // [0, kLanes)
  const int64_t token = row / (2 * nkv);               // [0, T) for real rows
  const int kv_row = int(row - token * (2 * nkv));     // [0, 2·nkv): K heads, then V heads
  const bool is_v = kv_row >= nkv;
  const int head = is_v ? kv_row - nkv : kv_row;       // [0, nkv)

  // Step 1: which slot, if any. A skipped row touches no memory below.
  const int64_t slot = token < a.num_tokens ? a.slot_mapping[token] : -1;
  const bool active = slot >= 0 && slot < a.num_slots;

  // Step 2: load this lane's chunks of the row (16-byte loads; chunks past hd stay 0).
  const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(is_v ? a.value : a.key)
                             + token * (is_v ? a.value_stride : a.key_stride)
                             + int64_t(head) * hd;         // row [hd] bf16
  uint4 in[kChunks];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = lane + i * kLanes;                       // chunk [0, hd/8)
    in[i] = make_uint4(0u, 0u, 0u, 0u);
    if (active && c * kChunkElems < hd) in[i] = __ldg(reinterpret_cast<const uint4*>(src) + c);
  }

  // Step 3 (FP8): the row's scale = amax / 448 over the whole group (all lanes shuffle).
  float scale = 1.f;
  if constexpr (Chunk::kScaled) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) amax = fmaxf(amax, chunk_amax(in[i]));
    amax = group_max<kLanes>(amax);
    scale = amax > 0.f ? __fdiv_rn(amax, kE4M3Max) : 1.f;
  }
  if (!active) return;

  // Step 4: store the chunks (and the scale) at the slot's row of the cache.
  const int64_t cache_row = (slot * nkv + head) * hd;      // int64: see the header comment
  typename Chunk::Store* dst = reinterpret_cast<typename Chunk::Store*>(
      static_cast<CacheT*>(is_v ? a.v_cache : a.k_cache) + cache_row);   // [hd/8] chunks
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = lane + i * kLanes;
    if (c * kChunkElems >= hd) continue;
    if constexpr (Chunk::kScaled) dst[c] = quantize_chunk_e4m3(in[i], scale);
    else dst[c] = in[i];
  }
  if constexpr (Chunk::kScaled) {
    if (lane == 0) (is_v ? a.v_scale : a.k_scale)[slot * nkv + head] = scale;   // [num_slots, nkv]
  }
}

template <typename CacheT, int kLanes, int kChunks>
cudaError_t launch_instance(const ReshapeAndCacheArgs& a, cudaStream_t stream) {
  const int64_t threads = a.num_tokens * 2 * a.num_kv_heads * kLanes;
  const int64_t blocks = ceil_div<int64_t>(threads, kThreads);
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  reshape_and_cache_kernel<CacheT, kLanes, kChunks><<<unsigned(blocks), kThreads, 0, stream>>>(a);
  return last_launch_error();
}

// kLanes = the smallest of 8/16/32 lanes covering hd/8 chunks; past 32 chunks a lane takes
// 2 or 4 chunks. (Groups of fewer than 8 lanes would only matter for hd < 64.)
template <typename CacheT>
cudaError_t launch_for_cache(const ReshapeAndCacheArgs& a, cudaStream_t stream) {
  const int chunks = a.head_dim / kChunkElems;
  if (chunks <= 8) return launch_instance<CacheT, 8, 1>(a, stream);     // hd ≤ 64
  if (chunks <= 16) return launch_instance<CacheT, 16, 1>(a, stream);   // hd ≤ 128
  if (chunks <= 32) return launch_instance<CacheT, 32, 1>(a, stream);   // hd ≤ 256
  if (chunks <= 64) return launch_instance<CacheT, 32, 2>(a, stream);   // hd ≤ 512
  return launch_instance<CacheT, 32, 4>(a, stream);                     // hd ≤ 1024
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

cudaError_t launch_reshape_and_cache(const ReshapeAndCacheArgs& a, cudaStream_t stream) {
  const bool fp8 = a.cache_dtype == DType::kE4M3;
  if (a.num_tokens < 0 || a.num_kv_heads < 1 || a.num_slots < 0 || a.head_dim < kChunkElems ||
      a.head_dim % kChunkElems != 0 || a.head_dim > kReshapeAndCacheMaxHeadDim ||
      a.key_stride % kChunkElems != 0 || a.value_stride % kChunkElems != 0 ||
      !aligned(a.key, 16) || !aligned(a.value, 16) || !aligned(a.k_cache, 16) ||
      !aligned(a.v_cache, 16) || (fp8 && (a.k_scale == nullptr || a.v_scale == nullptr)))
    return cudaErrorInvalidValue;
  if (a.num_tokens == 0) return cudaSuccess;
  switch (a.cache_dtype) {
    case DType::kBF16: return launch_for_cache<__nv_bfloat16>(a, stream);
    case DType::kE4M3: return launch_for_cache<__nv_fp8_e4m3>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace atlas
