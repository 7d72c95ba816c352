// rms_norm: y[r, :] = bf16( x[r, :] · rsqrt(Σ x² / D + eps) · w ),  w = 1 + weight (zero-centered
// Qwen3-Next / 3.5 / 3.6 norms) or weight (Qwen3), float32 math, one rounding at the store.
// Residual variant (a decoder layer's "hidden += sublayer(x); normed = norm(hidden)"):
//   h = bf16(x + residual) (float32 add, one rounding: what a bf16 torch add gives), residual ← h,
//   y = rms_norm(h), so the norm sees exactly the bf16 value the residual stream keeps (as HF).
//
// Decomposition: one CTA per row r ∈ [0, R); blockDim = clamp(round_up(D/8, 32), 32, 256), so a
// 2048-wide hidden row is one 16-byte vector (8 bf16) per thread and a 256-wide head row is one
// warp. Step 1 (sum of squares): each thread walks its vectors, block reduction through warp
// shuffles and one float per warp in shared memory. Step 2 (scale and store): the thread walks
// the same vectors again (L1 hits: the CTA has just read them), multiplies by rsqrt and w, and
// stores 16 bytes. With a residual, step 1 also forms h and stores it to residual, and step 2
// re-reads h from there (the same thread wrote it).
//
// Launched with programmatic dependent launch (common/pdl.cuh): it waits for the previous
// kernel first thing, and lets the next one (a GEMV prefetching its weights) launch at once.
//
// Floor: reads R·D·2 and writes R·D·2 bytes (+ D weights); the decode case (R = 1..32,
// D = 2048..5120) moves ≤ 0.7 MB, i.e. < 0.2 µs at 4.3 TB/s: this kernel is launch-bound
// (~2 µs graph-replayed), so it is written for clarity, not tuned.
#include <algorithm>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/checks.h"
#include "common/pdl.cuh"
#include "common/warp.cuh"
#include "rms_norm.h"

namespace atlas {
namespace {

constexpr int kVec = 8;          // bf16 per 16-byte vector
constexpr int kMaxThreads = 256;

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
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < warps; ++w) total += red[w];   // same order in every thread
  return total;
}

__global__ void __launch_bounds__(kMaxThreads) rms_norm_kernel(const RmsNormArgs a) {
  __shared__ float red[kMaxThreads / 32];
  pdl_wait();                       // launched with PDL: the previous kernel's writes are visible now
  pdl_launch_dependents();          // the next kernel may launch (it waits for us before reading y)
  const int64_t r = blockIdx.x;                                            // row, [0, R)
  const int64_t nvec = a.dim / kVec;
  const uint4* x = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.x) + r * a.x_row_stride);
  uint4* y = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(a.out) + r * a.dim);
  uint4* res = a.residual == nullptr ? nullptr
             : reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(a.residual) + r * a.dim);

  // Step 1: (h = bf16(x + residual) → residual) and Σ h² over the row.
  float ss = 0.f;
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
    float f[kVec];
    bf16x8_to_float(x[v], f);
    if (res != nullptr) {
      float rf[kVec];
      bf16x8_to_float(res[v], rf);
#pragma unroll
      for (int i = 0; i < kVec; ++i) f[i] += rf[i];
      const uint4 h = float_to_bf16x8(f);
      res[v] = h;
      bf16x8_to_float(h, f);                                            // normalize the rounded h
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) ss = fmaf(f[i], f[i], ss);
  }
  const float inv_rms = rsqrtf(block_sum(ss, red) / static_cast<float>(a.dim) + a.eps);

  // Step 2: scale, weight, one rounding, 16-byte store.
  const uint4* src = res != nullptr ? res : x;
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
    float f[kVec];
    bf16x8_to_float(src[v], f);
#pragma unroll
    for (int i = 0; i < kVec; ++i)
      f[i] = f[i] * inv_rms * norm_weight(a.weight, a.weight_f32, a.zero_centered, v * kVec + i);
    y[v] = float_to_bf16x8(f);
  }
}

}  // namespace

cudaError_t launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  if (a.dim <= 0 || a.dim % kVec != 0 || a.x_row_stride % kVec != 0 || a.rows > 0x7fffffff)
    return cudaErrorInvalidValue;
  const int64_t nvec = a.dim / kVec;
  const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, ceil_div<int64_t>(nvec, 32) * 32)));
  return launch_pdl(rms_norm_kernel, dim3(static_cast<unsigned>(a.rows)), dim3(threads), 0, stream, a);
}

}  // namespace atlas
