// l2_prefetch: cp.async.bulk.prefetch.L2 over a few strided byte regions (csrc/l2_prefetch.h).
//
// Why: at batch 1 an MTP draft position is ≈ 13 dependent kernels of which only the last big one,
// the LM head (286 MB at Qwen3.6-35B-A3B NVFP4), is DRAM-bound; the ≈ 55 µs before it read ≈ 35
// MB, leaving DRAM mostly idle. A prefetch on a forked graph branch fills L2 with the head's
// first rows meanwhile, so the LM head itself reads fewer bytes from DRAM (bench/NOTES.md,
// "MtpHead.propose", session 35).
//
// Decomposition: piece (b, r) = block b of run r of a region (block size = ceil(run / blocks),
//   rounded up to 16 B); pieces are numbered block-major over all regions' runs and thread i of
//   the grid issues pieces i, i + threads, … — one bulk prefetch instruction each, executed by
//   the SM's TMA unit (no load-path slot, no register, no completion to wait for). A grid of
//   few small CTAs (≤ kMaxCtas × 32 threads) so it co-resides with the kernels it runs beside.
// Floor: none of its own — it issues Σ pieces instructions and returns; the bytes then stream
//   at whatever DRAM bandwidth the other kernels leave.
#include <algorithm>
#include <cuda_runtime.h>

#include "l2_prefetch.h"

namespace atlas {
namespace {

constexpr int kThreads = 32;
constexpr int kMaxCtas = 32;

__device__ __forceinline__ void bulk_prefetch_l2(const void* p, uint32_t bytes, uint64_t policy, bool hinted) {
  if (hinted)
    asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;\n" ::"l"(p), "r"(bytes), "l"(policy)
                 : "memory");
  else
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}

__global__ void __launch_bounds__(kThreads) l2_prefetch_kernel(const __grid_constant__ L2PrefetchArgs a) {
  uint64_t policy = 0;
  if (a.evict_last) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  int64_t runs_total = 0;
  for (int i = 0; i < a.count; ++i) runs_total += a.region[i].runs;
  const int64_t pieces = runs_total * a.blocks;
  const int64_t step = int64_t(gridDim.x) * kThreads;
  for (int64_t p = blockIdx.x * int64_t(kThreads) + threadIdx.x; p < pieces; p += step) {
    const int64_t b = p / runs_total;        // block (progress along every run)
    int64_t r = p - b * runs_total;          // run, over all regions
    int i = 0;
    while (r >= a.region[i].runs) r -= a.region[i++].runs;
    const L2PrefetchRegion& g = a.region[i];
    const int64_t piece = ((g.run_bytes + a.blocks - 1) / a.blocks + 15) & ~int64_t(15);
    const int64_t off = b * piece;
    if (off >= g.run_bytes) continue;
    const int64_t bytes = min(piece, g.run_bytes - off);
    bulk_prefetch_l2(g.base + r * g.stride + off, static_cast<uint32_t>(bytes), policy, a.evict_last);
  }
}

}  // namespace

cudaError_t launch_l2_prefetch(const L2PrefetchArgs& a, cudaStream_t stream) {
  if (a.count < 1 || a.count > kL2PrefetchMaxRegions || a.blocks < 1) return cudaErrorInvalidValue;
  int64_t runs_total = 0;
  for (int i = 0; i < a.count; ++i) {
    const L2PrefetchRegion& g = a.region[i];
    if (g.base == nullptr || g.runs < 1 || g.run_bytes < 16 || g.run_bytes % 16 || g.stride % 16 ||
        reinterpret_cast<uintptr_t>(g.base) % 16 || (g.run_bytes + a.blocks - 1) / a.blocks > (int64_t(1) << 30))
      return cudaErrorInvalidValue;
    runs_total += g.runs;
  }
  const int64_t pieces = runs_total * a.blocks;
  const int ctas = static_cast<int>(std::min<int64_t>(kMaxCtas, (pieces + kThreads - 1) / kThreads));
  l2_prefetch_kernel<<<ctas, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace atlas
