// embedding: out[t, :] = table[ids[t], :] (exact copy), zero row for an id outside [0, V)
// (ops.embedding checks ids on CPU; on the GPU that check would sync, so the kernel makes a bad
// id harmless instead of reading out of range).
//
// Decomposition: grid (ceil(h / (256·VecElems)), T), 256 threads; CTA (c, t) copies vector
//   chunks c·256 + tid of row t, a chunk being 16 bytes (8 bf16) when h % 8 == 0 (every Qwen3
//   hidden size), else one bf16 (any h). The id is read once per thread (a broadcast load).
//
// Both kernels here are launched with programmatic dependent launch (common/pdl.cuh): they wait
// for the previous kernel (the argmax that produced the ids) before any global access.
//
// Floor: T·h·2·2 bytes (read + write): 35B-A3B, T = 32: 262 KB → 0.06 µs; launch-bound (~1 µs
//   in a CUDA graph). It exists so the drafted token's embedding is fetched on the device.
//
// embedding_norm_concat: the MTP fc input [norm_e(embed(ids)) | norm_h(hidden)] in one launch
// instead of four (gather, two RMSNorms, concat). Grid (T, 2), 256 threads: CTA (t, 0) normalizes
// the gathered embedding row, CTA (t, 1) the hidden row; each thread keeps ≤ 4 16-byte vectors
// of its row in registers (h ≤ 8192), the sum of squares is a warp-shuffle + shared-memory block
// reduction, and the normalized row is written to its half of out. Floor: T·h·2·3 bytes
// (35B-A3B, T = 32: 0.4 MB, launch-bound).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>

#include "common/checks.h"
#include "common/pdl.cuh"
#include "common/warp.cuh"
#include "embedding.h"

namespace atlas {
namespace {

constexpr int kThreads = 256;

template <typename IdT, typename Vec>
__global__ void __launch_bounds__(kThreads) embedding_kernel(
    const Vec* __restrict__ table,   // [V, h / VecElems]
    const IdT* __restrict__ ids,     // [T]
    Vec* __restrict__ out,           // [T, h / VecElems]
    int64_t vocab, int64_t vecs_per_row) {
  const int64_t t = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;   // [0, h / VecElems)
  pdl_wait();
  pdl_launch_dependents();
  if (c >= vecs_per_row) return;
  const int64_t id = static_cast<int64_t>(ids[t]);
  Vec v;
  if (id >= 0 && id < vocab) {
    v = table[id * vecs_per_row + c];
  } else {
    v = Vec{};   // zero bits = +0.0 in bf16
  }
  out[t * vecs_per_row + c] = v;
}

template <typename IdT>
cudaError_t launch_typed(const EmbeddingArgs& a, cudaStream_t stream) {
  const bool vec16 = a.hidden % 8 == 0;
  const int64_t vecs = vec16 ? a.hidden / 8 : a.hidden;
  const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(vecs, kThreads)), static_cast<unsigned>(a.num_tokens));
  const IdT* ids = static_cast<const IdT*>(a.ids);
  if (vec16) {
    return launch_pdl(embedding_kernel<IdT, uint4>, grid, dim3(kThreads), 0, stream,
                      static_cast<const uint4*>(a.table), ids, static_cast<uint4*>(a.out), a.vocab, vecs);
  }
  return launch_pdl(embedding_kernel<IdT, unsigned short>, grid, dim3(kThreads), 0, stream,
                    static_cast<const unsigned short*>(a.table), ids, static_cast<unsigned short*>(a.out), a.vocab,
                    vecs);
}

constexpr int kNormVecs = kEmbeddingNormMaxHidden / 8 / kThreads;   // 16-byte vectors per thread (4)

template <typename IdT>
__global__ void __launch_bounds__(kThreads) embedding_norm_concat_kernel(EmbeddingNormConcatArgs a) {
  const int64_t t = blockIdx.x;
  const bool is_hidden = blockIdx.y == 1;
  const int vecs = a.hidden_size / 8;
  pdl_wait();                  // ids (argmax) and hidden (the previous draft's norm) are fresh outputs
  pdl_launch_dependents();
  const uint4* src = nullptr;                                        // [h / 8] row, or nullptr: zero row
  if (is_hidden) {
    src = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.hidden) + t * a.hidden_stride);
  } else {
    const int64_t id = static_cast<int64_t>(static_cast<const IdT*>(a.ids)[t]);
    if (id >= 0 && id < a.vocab) {
      src = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.table) + id * a.hidden_size);
    }
  }
  // 1. load the row (vector v = threadIdx.x + i·256) and its sum of squares
  uint4 v[kNormVecs];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kNormVecs; ++i) {
    const int c = threadIdx.x + i * kThreads;
    v[i] = (src != nullptr && c < vecs) ? src[c] : uint4{0, 0, 0, 0};
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v[i]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(p[j]);
      ss = fmaf(f.x, f.x, fmaf(f.y, f.y, ss));
    }
  }
  // 2. block sum: warp shuffles, then the 8 warp sums through shared memory
  __shared__ float warp_ss[kThreads / 32];
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) warp_ss[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += warp_ss[w];
  const float inv_rms = rsqrtf(total / static_cast<float>(a.hidden_size) + a.eps);
  // 3. scale and store into this CTA's half of out[t]
  const float* w = is_hidden ? a.w_hidden : a.w_embed;
  uint4* dst = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(a.out) + (2 * t + (is_hidden ? 1 : 0)) * a.hidden_size);
#pragma unroll
  for (int i = 0; i < kNormVecs; ++i) {
    const int c = threadIdx.x + i * kThreads;
    if (c >= vecs) break;
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v[i]);
    uint4 o;
    __nv_bfloat162* q = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(p[j]);
      const int e = c * 8 + 2 * j;
      const float w0 = a.zero_centered ? 1.f + w[e] : w[e];
      const float w1 = a.zero_centered ? 1.f + w[e + 1] : w[e + 1];
      q[j] = __floats2bfloat162_rn(f.x * inv_rms * w0, f.y * inv_rms * w1);
    }
    dst[c] = o;
  }
}

}  // namespace

cudaError_t launch_embedding_norm_concat(const EmbeddingNormConcatArgs& a, cudaStream_t stream) {
  if (a.num_tokens < 1 || a.num_tokens > 65535 || a.vocab < 1 || a.hidden_size < 8 || a.hidden_size % 8 != 0 ||
      a.hidden_size > kEmbeddingNormMaxHidden || a.hidden_stride % 8 != 0 || a.table == nullptr || a.ids == nullptr ||
      a.hidden == nullptr || a.w_embed == nullptr || a.w_hidden == nullptr || a.out == nullptr) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(a.num_tokens), 2);
  return a.ids_int64 ? launch_pdl(embedding_norm_concat_kernel<int64_t>, grid, dim3(kThreads), 0, stream, a)
                     : launch_pdl(embedding_norm_concat_kernel<int32_t>, grid, dim3(kThreads), 0, stream, a);
}

cudaError_t launch_embedding(const EmbeddingArgs& a, cudaStream_t stream) {
  if (a.num_tokens < 1 || a.num_tokens > 65535 || a.vocab < 1 || a.hidden < 1 || a.table == nullptr ||
      a.ids == nullptr || a.out == nullptr) {
    return cudaErrorInvalidValue;
  }
  return a.ids_int64 ? launch_typed<int64_t>(a, stream) : launch_typed<int32_t>(a, stream);
}

}  // namespace atlas
