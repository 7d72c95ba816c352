// sigmoid_gate_mul: out[t, h, :] = bf16( x[t, h, :] · 1 / (1 + exp(−gate[t, h, :])) ), fp32 math.
// Qwen3-Next / 3.5 / 3.6 gated attention: the attention output times sigmoid of the gate half
// of q_proj, before o_proj. The gate may be a strided view (per-head [q | gate] rows of the
// q_proj GEMM output, head stride 2·hd), so it is addressed through (t, h) strides.
//
// Decomposition: one thread per 16-byte vector (8 elements) of x; grid-stride loop over the
// T·H·hd/8 vectors, 256 threads per CTA, ≤ 8 CTAs per SM worth of grid. Vector v maps to
// (t, h, j) = (v / (H·hd/8), (v / (hd/8)) % H, v % (hd/8)); x and out are contiguous.
// expf (not __expf): the reference is torch.sigmoid in float32; differences stay ≤ 1 bf16 ulp.
// Programmatic dependent launch (common/pdl.cuh): the o_proj GEMV that follows in a decode step
// starts streaming its weights while this kernel runs.
//
// Floor: reads 2·T·H·hd·2 and writes T·H·hd·2 bytes; decode (T = 1..32, H·hd = 4096..6144)
// moves ≤ 1.2 MB, < 0.3 µs at 4.3 TB/s, so the launch (~2 µs graph-replayed) dominates.
#include <algorithm>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/checks.h"
#include "common/gate.cuh"
#include "common/pdl.cuh"
#include "sigmoid_gate.h"

namespace atlas {
namespace {

constexpr int kVec = 8;        // bf16 per 16-byte vector
constexpr int kThreads = 256;
constexpr int64_t kMaxCtas = 132 * 8;

__global__ void __launch_bounds__(kThreads) sigmoid_gate_mul_kernel(const SigmoidGateArgs a) {
  pdl_wait();                       // launched with PDL: the attention output is visible now
  pdl_launch_dependents();          // o_proj's GEMV may launch and prefetch its weights meanwhile
  const int64_t vec_per_head = a.head_dim / kVec;
  const int64_t total = a.tokens * a.heads * vec_per_head;
  const uint4* x = static_cast<const uint4*>(a.x);                 // [T·H·hd/8] vectors
  uint4* out = static_cast<uint4*>(a.out);
  const __nv_bfloat16* gate = static_cast<const __nv_bfloat16*>(a.gate);
  for (int64_t v = blockIdx.x * int64_t(kThreads) + threadIdx.x; v < total; v += int64_t(gridDim.x) * kThreads) {
    const int64_t j = v % vec_per_head;                            // vector within the head
    const int64_t th = v / vec_per_head;
    const int64_t h = th % a.heads, t = th / a.heads;
    const uint4 xv = x[v];
    const uint4 gv = *reinterpret_cast<const uint4*>(gate + t * a.gate_stride_t + h * a.gate_stride_h + j * kVec);
    const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv);
    const __nv_bfloat162* gp = reinterpret_cast<const __nv_bfloat162*>(&gv);
    uint4 ov;
    __nv_bfloat162* op = reinterpret_cast<__nv_bfloat162*>(&ov);
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) {
      const float2 xf = __bfloat1622float2(xp[i]), gf = __bfloat1622float2(gp[i]);
      op[i] = __floats2bfloat162_rn(sigmoid_gate_f32(xf.x, gf.x), sigmoid_gate_f32(xf.y, gf.y));
    }
    out[v] = ov;
  }
}

}  // namespace

cudaError_t launch_sigmoid_gate_mul(const SigmoidGateArgs& a, cudaStream_t stream) {
  if (a.head_dim % kVec != 0 || a.gate_stride_t % kVec != 0 || a.gate_stride_h % kVec != 0)
    return cudaErrorInvalidValue;
  const int64_t total = a.tokens * a.heads * (a.head_dim / kVec);
  if (total == 0) return cudaSuccess;
  const int64_t ctas = std::min(kMaxCtas, ceil_div<int64_t>(total, kThreads));
  return launch_pdl(sigmoid_gate_mul_kernel, dim3(static_cast<unsigned>(ctas)), dim3(kThreads), 0, stream, a);
}

}  // namespace atlas
