// quantize_nvfp4: W[N, K] (bf16 | f16 | f32) → NVFP4 packed codes, E4M3 block scales and one
// float32 global scale, bit-exact with atlas/reference.py::quantize_nvfp4.
//
//   global_scale gs = amax(|W|) / (6·448)   (1.0 when amax == 0)
//   per 16-block b of a row:  s_b = e4m3_rne_satfinite(block_amax_b / 6 / gs)
//                             code = e2m1_rne_satfinite(x / (float(s_b) · gs)), 0 where that is 0
//
// Decomposition (two launches, no host sync between them: gs is read on the device):
//   1. global_absmax_kernel: grid-stride over 16-byte vectors, 256 threads; each thread keeps a
//      running max, warp shuffle → shared → one atomicMax per CTA on the float's bit pattern
//      (valid: all values are ≥ 0). Grid = min(#vectors / 256, 1024).
//   2. quantize_blocks_kernel: one thread per 16-element block (the whole block fits in its
//      registers: 32 B of bf16 = two 16-byte loads), 256 threads per CTA. Consecutive threads
//      own consecutive blocks, so loads, the 8-byte code stores and the 1-byte scale stores
//      are all coalesced. Thread 0 of CTA 0 also stores gs.
// Division is IEEE (the extension is built without --use_fast_math): bit-exactness with the
// float32 torch reference depends on it.
//
// Floor: reads N·K·sizeof(in) twice (absmax pass + quantize pass) and writes N·K·(1/2 + 1/16)
// bytes; a 5120×17408 bf16 weight moves 2·178 + 50 = 407 MB ≈ 95 µs at 4.3 TB/s. This runs
// once at load time, so it is checked for exactness, not tuned.
#include <algorithm>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/checks.h"
#include "common/nvfp4.cuh"
#include "quantize_nvfp4.h"

namespace atlas {
namespace {

constexpr int kThreads = 256;
// The absmax pass needs only enough CTAs to fill the GPU (a few waves of 132 SMs); the
// grid-stride loop covers the rest.
constexpr int64_t kMaxAbsmaxCtas = 1024;

// Element type traits: how many elements one 16-byte vector holds, and their float values.
template <typename T> struct Vec16;
template <> struct Vec16<__nv_bfloat16> {
  static constexpr int kElems = 8;
  __device__ static void to_float(const uint4& v, float* out) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 f = __bfloat1622float2(p[i]); out[2 * i] = f.x; out[2 * i + 1] = f.y; }
  }
};
template <> struct Vec16<__half> {
  static constexpr int kElems = 8;
  __device__ static void to_float(const uint4& v, float* out) {
    const __half2* p = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 f = __half22float2(p[i]); out[2 * i] = f.x; out[2 * i + 1] = f.y; }
  }
};
template <> struct Vec16<float> {
  static constexpr int kElems = 4;
  __device__ static void to_float(const uint4& v, float* out) {
    out[0] = __uint_as_float(v.x); out[1] = __uint_as_float(v.y);
    out[2] = __uint_as_float(v.z); out[3] = __uint_as_float(v.w);
  }
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
global_absmax_kernel(const uint4* __restrict__ in,  // [num_vecs] 16-byte vectors of T
                     int64_t num_vecs,
                     float* __restrict__ amax) {     // [1], zeroed before launch
  float m = 0.0f;
  float vals[Vec16<T>::kElems];
  for (int64_t i = blockIdx.x * (int64_t)kThreads + threadIdx.x; i < num_vecs;
       i += (int64_t)gridDim.x * kThreads) {
    Vec16<T>::to_float(__ldg(in + i), vals);
#pragma unroll
    for (int j = 0; j < Vec16<T>::kElems; ++j) m = fmaxf(m, fabsf(vals[j]));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  __shared__ float warp_max[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    // Non-negative floats order like their bit patterns read as signed ints.
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(m));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
quantize_blocks_kernel(const uint4* __restrict__ in,     // [N·K/16 blocks][16 / kElems vectors]
                       int64_t num_blocks,               // N·K/16
                       const float* __restrict__ amax,   // [1] global absmax
                       uint2* __restrict__ packed,       // [N·K/16] 8 bytes = 16 codes per block
                       uint8_t* __restrict__ block_scale,// [N·K/16] e4m3
                       float* __restrict__ global_scale) {
  const float gs = nvfp4_global_scale(*amax);
  const int64_t b = blockIdx.x * (int64_t)kThreads + threadIdx.x;  // block index, [0, N·K/16)
  if (b == 0) *global_scale = gs;
  if (b >= num_blocks) return;

  constexpr int kVecs = kNvfp4Block / Vec16<T>::kElems;  // 2 (bf16/f16) or 4 (f32)
  float x[kNvfp4Block];
#pragma unroll
  for (int v = 0; v < kVecs; ++v) Vec16<T>::to_float(__ldg(in + b * kVecs + v), x + v * Vec16<T>::kElems);

  float block_amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kNvfp4Block; ++i) block_amax = fmaxf(block_amax, fabsf(x[i]));

  // Same float32 operation order as the reference: (block_amax / 6) / gs, then s · gs.
  const uint8_t s = e4m3_encode_satfinite(block_amax / kE2M1Max / gs);
  const float denom = e4m3_decode(s) * gs;

  uint32_t lo = 0, hi = 0;  // codes 0..7 → lo, 8..15 → hi; element 2j in the low nibble
  if (denom > 0.0f) {
#pragma unroll
    for (int i = 0; i < 8; ++i) lo |= e2m1_encode_rne(x[i] / denom) << (4 * i);
#pragma unroll
    for (int i = 0; i < 8; ++i) hi |= e2m1_encode_rne(x[8 + i] / denom) << (4 * i);
  }
  packed[b] = make_uint2(lo, hi);
  block_scale[b] = s;
}

template <typename T>
cudaError_t launch_typed(const QuantizeNvfp4Args& a, cudaStream_t stream) {
  const int64_t numel = a.n * a.k;
  const int64_t num_vecs = numel / Vec16<T>::kElems;
  const int64_t num_blocks = numel / kNvfp4Block;
  ATLAS_RETURN_IF_ERROR(cudaMemsetAsync(a.amax, 0, sizeof(float), stream));
  if (numel > 0) {
    const int64_t grid = std::min<int64_t>(ceil_div<int64_t>(num_vecs, kThreads), kMaxAbsmaxCtas);
    global_absmax_kernel<T><<<(unsigned)grid, kThreads, 0, stream>>>(
        static_cast<const uint4*>(a.input), num_vecs, a.amax);
    ATLAS_RETURN_IF_ERROR(last_launch_error());
  }
  const int64_t grid = std::max<int64_t>(1, ceil_div<int64_t>(num_blocks, kThreads));
  quantize_blocks_kernel<T><<<(unsigned)grid, kThreads, 0, stream>>>(
      static_cast<const uint4*>(a.input), num_blocks, a.amax, reinterpret_cast<uint2*>(a.packed),
      a.block_scale, a.global_scale);
  return last_launch_error();
}

}  // namespace

cudaError_t launch_quantize_nvfp4(const QuantizeNvfp4Args& a, cudaStream_t stream) {
  if (a.k % kNvfp4Block != 0 || a.n < 0) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(a.input) % 16 != 0) return cudaErrorMisalignedAddress;
  switch (a.input_dtype) {
    case DType::kBF16: return launch_typed<__nv_bfloat16>(a, stream);
    case DType::kF16: return launch_typed<__half>(a, stream);
    case DType::kF32: return launch_typed<float>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace atlas
