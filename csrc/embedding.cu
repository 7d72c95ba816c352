// embedding: out[t, :] = table[ids[t], :] (exact copy), zero row for an id outside [0, V)
// (ops.embedding checks ids on CPU; on the GPU that check would sync, so the kernel makes a bad
// id harmless instead of reading out of range).
//
// Decomposition: grid (ceil(h / (256·VecElems)), T), 256 threads; CTA (c, t) copies vector
//   chunks c·256 + tid of row t, a chunk being 16 bytes (8 bf16) when h % 8 == 0 (every Qwen3
//   hidden size), else one bf16 (any h). The id is read once per thread (a broadcast load).
//
// Floor: T·h·2·2 bytes (read + write): 35B-A3B, T = 32: 262 KB → 0.06 µs; launch-bound (~1 µs
//   in a CUDA graph). It exists so the drafted token's embedding is fetched on the device.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>

#include "common/checks.h"
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
    embedding_kernel<IdT, uint4><<<grid, kThreads, 0, stream>>>(
        static_cast<const uint4*>(a.table), ids, static_cast<uint4*>(a.out), a.vocab, vecs);
  } else {
    embedding_kernel<IdT, unsigned short><<<grid, kThreads, 0, stream>>>(
        static_cast<const unsigned short*>(a.table), ids, static_cast<unsigned short*>(a.out), a.vocab, vecs);
  }
  return last_launch_error();
}

}  // namespace

cudaError_t launch_embedding(const EmbeddingArgs& a, cudaStream_t stream) {
  if (a.num_tokens < 1 || a.num_tokens > 65535 || a.vocab < 1 || a.hidden < 1 || a.table == nullptr ||
      a.ids == nullptr || a.out == nullptr) {
    return cudaErrorInvalidValue;
  }
  return a.ids_int64 ? launch_typed<int64_t>(a, stream) : launch_typed<int32_t>(a, stream);
}

}  // namespace atlas
