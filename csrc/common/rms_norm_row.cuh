// One row of rms_norm over a CTA — the definition csrc/rms_norm.cu launches and moe_experts'
// fused combine + residual + norm epilogue reuses, so the two give the same bits:
//   h = bf16(x + residual) (float32 add, one rounding) → residual   (when residual != nullptr)
//   y = bf16(h · rsqrt(Σ h² / D + eps) · w),  w = 1 + weight (zero_centered) | weight
// Thread t owns the 16-byte vectors (8 bf16) v = t, t + blockDim, … of the row; Σ h² is each
// thread's fmaf chain over its vectors in that order, then block_sum (warp xor-shuffles, one
// float per warp in shared memory, warps added in order). So the bits depend on blockDim:
// rms_norm_threads(D) everywhere.
#pragma once
#include <cuda_bf16.h>
#include <cstdint>

namespace atlas {

constexpr int kRmsVec = 8;            // bf16 per 16-byte vector
constexpr int kRmsMaxThreads = 256;

// Threads of a row's CTA: one vector per thread up to D = 2048, 32..256.
__host__ __device__ inline int rms_norm_threads(int64_t dim) {
  const int64_t warps32 = (dim / kRmsVec + 31) / 32 * 32;
  return static_cast<int>(warps32 < 32 ? 32 : (warps32 > kRmsMaxThreads ? kRmsMaxThreads : warps32));
}

__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float* f) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) { const float2 t = __bfloat1622float2(p[i]); f[2 * i] = t.x; f[2 * i + 1] = t.y; }
}

__device__ __forceinline__ uint4 float_to_bf16x8(const float* f) {
  uint4 v;
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

// Norm weight element i as float, with the zero-centered offset folded in.
__device__ __forceinline__ float norm_weight(const void* w, bool f32, bool zero_centered, int64_t i) {
  const float v = f32 ? static_cast<const float*>(w)[i]
                      : __bfloat162float(static_cast<const __nv_bfloat16*>(w)[i]);
  return zero_centered ? 1.0f + v : v;
}

// Sum over the CTA; every thread gets the total. `red` holds one float per warp.
__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < warps; ++w) total += red[w];   // same order in every thread
  return total;
}

// The row: load_x(v, f) writes vector v of x as 8 floats (bf16 values); residual / y are the
// row's [nvec] vectors. Step 2 re-reads h from residual (this thread wrote it) or calls
// load_x again (plain norm). `red`: kRmsMaxThreads / 32 floats of shared memory.
template <class LoadX>
__device__ __forceinline__ void rms_norm_row(const LoadX& load_x, uint4* residual, uint4* y, int64_t nvec,
                                             int64_t dim, const void* weight, bool weight_f32, bool zero_centered,
                                             float eps, float* red) {
  float ss = 0.f;
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
    float f[kRmsVec];
    load_x(v, f);
    if (residual != nullptr) {
      float rf[kRmsVec];
      bf16x8_to_float(residual[v], rf);
#pragma unroll
      for (int i = 0; i < kRmsVec; ++i) f[i] += rf[i];
      const uint4 h = float_to_bf16x8(f);
      residual[v] = h;
      bf16x8_to_float(h, f);                                            // normalize the rounded h
    }
#pragma unroll
    for (int i = 0; i < kRmsVec; ++i) ss = fmaf(f[i], f[i], ss);
  }
  const float inv_rms = rsqrtf(block_sum(ss, red) / static_cast<float>(dim) + eps);
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
    float f[kRmsVec];
    if (residual != nullptr) bf16x8_to_float(residual[v], f);
    else load_x(v, f);
#pragma unroll
    for (int i = 0; i < kRmsVec; ++i) f[i] = f[i] * inv_rms * norm_weight(weight, weight_f32, zero_centered, v * kRmsVec + i);
    y[v] = float_to_bf16x8(f);
  }
}

}  // namespace atlas
