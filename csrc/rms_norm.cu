// rms_norm: y[r, :] = bf16( x[r, :] · rsqrt(Σ x² / D + eps) · w ),  w = 1 + weight (zero-centered
// Qwen3-Next / 3.5 / 3.6 norms) or weight (Qwen3), float32 math, one rounding at the store.
// Residual variant (a decoder layer's "hidden += sublayer(x); normed = norm(hidden)"):
//   h = bf16(x + residual) (float32 add, one rounding: what a bf16 torch add gives), residual ← h,
//   y = rms_norm(h), so the norm sees exactly the bf16 value the residual stream keeps (as HF).
//
// Decomposition (common/rms_norm_row.cuh, shared with moe_experts' fused epilogue): one CTA per
// row r ∈ [0, R); blockDim = clamp(round_up(D/8, 32), 32, 256), so a
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
#include "common/rms_norm_row.cuh"
#include "rms_norm.h"

namespace atlas {
namespace {

__global__ void __launch_bounds__(kRmsMaxThreads) rms_norm_kernel(const RmsNormArgs a) {
  __shared__ float red[kRmsMaxThreads / 32];
  pdl_wait();                       // launched with PDL: the previous kernel's writes are visible now
  pdl_launch_dependents();          // the next kernel may launch (it waits for us before reading y)
  const int64_t r = blockIdx.x;                                            // row, [0, R)
  const uint4* x = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.x) + r * a.x_row_stride);
  uint4* y = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(a.out) + r * a.dim);
  uint4* res = a.residual == nullptr ? nullptr
             : reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(a.residual) + r * a.dim);
  rms_norm_row([&](int64_t v, float* f) { bf16x8_to_float(x[v], f); }, res, y, a.dim / kRmsVec, a.dim, a.weight,
               a.weight_f32, a.zero_centered, a.eps, red);
}

}  // namespace

cudaError_t launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  if (a.dim <= 0 || a.dim % kRmsVec != 0 || a.x_row_stride % kRmsVec != 0 || a.rows > 0x7fffffff)
    return cudaErrorInvalidValue;
  return launch_pdl(rms_norm_kernel, dim3(static_cast<unsigned>(a.rows)), dim3(rms_norm_threads(a.dim)), 0, stream, a);
}

}  // namespace atlas
