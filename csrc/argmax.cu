// argmax: greedy token and its top-1 softmax probability for each row of a logits matrix,
// equal to atlas/reference.py::argmax (ids exactly; prob to float32 rounding).
//
//   ids[r]  = min { v : x[r, v] = max_v' x[r, v'] }           (lowest index wins ties)
//   prob[r] = 1 / Σ_v exp(x[r, v] − max_r)                     (float32 math)
//
// Decomposition (flash-decoding style split over V, so one row of 248 320 logits is read by
// ~61 CTAs instead of one: a single 1024-thread CTA per row managed ≈ 5 GB/s in the seed engine):
//   Split pass: grid (S = ceil(V / 4096), R), 256 threads. CTA (s, r) owns logits
//     [s·4096, (s+1)·4096) of row r; thread t reads the 16-byte units i ∈ [0, 16 / U) at
//     v = s·4096 + (256·i + t)·U + [0, U), U = 8 bf16 | 4 f32 logits (v3: a warp reads 512
//     contiguous bytes per unit; v2 read one logit per thread per load, 64 bytes per warp
//     instruction). One 16-byte load per unit when rows are 16-byte aligned and the unit lies
//     inside [0, V), else element loads of the same logits (V = 248 077, odd strides): the
//     same values in the same registers either way. Each thread takes the max of its 16 and
//     its first index, then Σ exp(x − max) (v2; v1 kept an online running triple: expf on both
//     sides of a data-dependent branch, ≈ 2× the instructions); the CTA merges the threads'
//     triples (warp xor-shuffles, then 8 warp results through shared memory) and writes one
//     partial per (row, split).
//   Merge pass: grid R, one warp per row: lanes merge the S partials in a fixed order, then a
//     warp xor-shuffle merge; lane 0 writes ids and prob.
//   merge(a, b): the winner is the larger max, or on equal max the lower index; the loser's
//   sum is rescaled by exp(max_loser − max_winner). The result depends only on the row (never
//   on R), so a row's draft is the same whatever batch it was proposed in.
//   −inf logits (masked vocab) contribute 0; NaN logits make prob NaN (ids then unspecified).
//
// Both kernels are launched with programmatic dependent launch (common/pdl.cuh): each waits for
// the previous kernel (the LM-head GEMV, then the split pass) before its first global access and
// lets the next one launch at once, so the launch gaps overlap the previous kernel's tail.
//
// Floor: R·V·elem bytes; one row of 248 320 bf16 logits = 0.50 MB → 0.12 µs at 4.3 TB/s, far
//   below the two launches (~2 × 2 µs eager, ~2 × 1 µs in a CUDA graph): at decode sizes this
//   op is launch-bound by design, and the split pass exists so it stays so at R = 32
//   (15.9 MB → 3.7 µs floor). Measured (bench/argmax_probe, H200, graph-replayed, bf16 V =
//   248 320): R = 1 4.13 µs, R = 8 6.4, R = 32 14.2 (v2's element loads: 4.26 / 6.6 / 16.0).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>

#include "argmax.h"
#include "common/checks.h"
#include "common/pdl.cuh"

namespace atlas {
namespace {

constexpr int kThreads = 256;                        // 8 warps
constexpr int kPerThread = kArgmaxChunk / kThreads;  // 16 logits per thread
static_assert(kPerThread * kThreads == kArgmaxChunk, "chunk must split evenly over the CTA");

// Running (max, Σ exp(x − max), argmax) of a set of logits; idx INT_MAX = empty set.
struct Best {
  float m;
  float s;
  int idx;
};

__device__ __forceinline__ Best empty_best() { return {-INFINITY, 0.f, INT_MAX}; }

__device__ __forceinline__ Best merge(const Best& a, const Best& b) {
  const bool a_wins = a.m > b.m || (a.m == b.m && a.idx < b.idx);
  const float wm = a_wins ? a.m : b.m, lm = a_wins ? b.m : a.m;
  const float ws = a_wins ? a.s : b.s, ls = a_wins ? b.s : a.s;
  const float scale = (lm == -INFINITY) ? 0.f : expf(lm - wm);
  return {wm, ws + ls * scale, a_wins ? a.idx : b.idx};
}

__device__ __forceinline__ Best warp_merge(Best b) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    Best o{__shfl_xor_sync(0xffffffffu, b.m, off), __shfl_xor_sync(0xffffffffu, b.s, off),
           __shfl_xor_sync(0xffffffffu, b.idx, off)};
    b = merge(b, o);
  }
  return b;
}

__device__ __forceinline__ float load_logit(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load_logit(const float* p) { return *p; }

// grid (S, R), block kThreads: partial (max, sum, idx) of split s of row r.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads) argmax_split_kernel(
    const T* __restrict__ logits,     // [R, V] (row stride row_stride)
    int64_t vocab, int64_t row_stride,
    float* __restrict__ partials) {   // [3, R, S]
  constexpr int kUnit = 16 / sizeof(T);             // logits per 16-byte unit: 8 bf16 | 4 f32
  constexpr int kUnits = kPerThread / kUnit;        // units per thread
  const int s = blockIdx.x, r = blockIdx.y;
  const int num_splits = gridDim.x, rows = gridDim.y;
  const T* row = logits + static_cast<int64_t>(r) * row_stride;
  const int64_t v0 = static_cast<int64_t>(s) * kArgmaxChunk;
  pdl_wait();                  // the logits are the previous kernel's output
  pdl_launch_dependents();

  // 1. each thread loads its units (unit i: logits v0 + (i·256 + t)·kUnit + [0, kUnit), so a warp
  //    reads 512 contiguous bytes per unit and a thread's logits ascend), all loads issued before
  //    the dependent math; kVec: one 16-byte load per unit wholly inside [0, V) (rows 16-byte
  //    aligned), else element loads — the same logits in the same places either way
  float x[kPerThread];
#pragma unroll
  for (int i = 0; i < kUnits; ++i) {
    const int64_t u0 = v0 + (static_cast<int64_t>(i) * kThreads + threadIdx.x) * kUnit;
    if (kVec && u0 + kUnit <= vocab) {
      const uint4 q = *reinterpret_cast<const uint4*>(row + u0);
      const T* e = reinterpret_cast<const T*>(&q);
#pragma unroll
      for (int j = 0; j < kUnit; ++j) x[i * kUnit + j] = load_logit(e + j);
    } else {
#pragma unroll
      for (int j = 0; j < kUnit; ++j) x[i * kUnit + j] = u0 + j < vocab ? load_logit(row + u0 + j) : -INFINITY;
    }
  }
  // Two passes over the registers (v2): the max and its first index by compares alone, then
  // Σ exp(x − max) — one expf per logit and no divergent branch (v1's online push rescaled the
  // sum on every new maximum, expf on both sides of a data-dependent branch).
  Best b = empty_best();
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int64_t v = v0 + (static_cast<int64_t>(i / kUnit) * kThreads + threadIdx.x) * kUnit + i % kUnit;
    if (v >= vocab) continue;
    if (x[i] > b.m) {                    // strict >: the first of equal maxima wins
      b.m = x[i];
      b.idx = static_cast<int>(v);
    } else if (b.idx == INT_MAX) {       // all −inf so far: still report the first index
      b.idx = static_cast<int>(v);
    }
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const float e = expf(x[i] - b.m);                      // out-of-range lanes hold −inf
    b.s += (x[i] == -INFINITY) ? 0.f : e;                  // (and b.m = −inf would make NaN)
  }

  // 2. CTA merge: warps, then the 8 warp results
  __shared__ Best warp_best[kThreads / 32];
  b = warp_merge(b);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_best[warp] = b;
  __syncthreads();
  if (warp == 0) {
    b = lane < kThreads / 32 ? warp_best[lane] : empty_best();
    b = warp_merge(b);
    if (lane == 0) {
      const int64_t plane = static_cast<int64_t>(rows) * num_splits;
      const int64_t at = static_cast<int64_t>(r) * num_splits + s;
      partials[at] = b.m;
      partials[plane + at] = b.s;
      partials[2 * plane + at] = __int_as_float(b.idx);
    }
  }
}

// grid R, block 32: merge row r's S partials; write ids[r], prob[r].
__global__ void __launch_bounds__(32) argmax_merge_kernel(
    const float* __restrict__ partials,   // [3, R, S]
    int num_splits,
    int64_t* __restrict__ ids,            // [R]
    float* __restrict__ prob) {           // [R]
  const int r = blockIdx.x, rows = gridDim.x, lane = threadIdx.x;
  const int64_t plane = static_cast<int64_t>(rows) * num_splits;
  const float* p = partials + static_cast<int64_t>(r) * num_splits;
  pdl_wait();                  // the split pass's partials
  pdl_launch_dependents();
  Best b = empty_best();
  for (int s = lane; s < num_splits; s += 32) {
    b = merge(b, Best{p[s], p[plane + s], __float_as_int(p[2 * plane + s])});
  }
  b = warp_merge(b);
  if (lane == 0) {
    ids[r] = b.idx;
    prob[r] = 1.f / b.s;
  }
}

}  // namespace

cudaError_t launch_argmax(const ArgmaxArgs& a, cudaStream_t stream) {
  if (a.rows < 1 || a.rows > 65535 || a.vocab < 1 || a.vocab >= INT_MAX || a.row_stride < a.vocab ||
      a.logits == nullptr || a.partials == nullptr || a.ids == nullptr || a.prob == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int num_splits = static_cast<int>(ceil_div<int64_t>(a.vocab, kArgmaxChunk));
  const dim3 split_grid(num_splits, static_cast<unsigned>(a.rows));
  const int elem = a.dtype == DType::kBF16 ? 2 : 4;
  const bool vec = reinterpret_cast<uintptr_t>(a.logits) % 16 == 0 && (a.row_stride * elem) % 16 == 0;
  auto split = [&](auto kernel, const auto* logits) {
    return launch_pdl(kernel, split_grid, dim3(kThreads), 0, stream, logits, a.vocab, a.row_stride, a.partials);
  };
  switch (a.dtype) {
    case DType::kBF16: {
      const auto* p = static_cast<const __nv_bfloat16*>(a.logits);
      ATLAS_RETURN_IF_ERROR(vec ? split(argmax_split_kernel<__nv_bfloat16, true>, p)
                                : split(argmax_split_kernel<__nv_bfloat16, false>, p));
      break;
    }
    case DType::kF32: {
      const auto* p = static_cast<const float*>(a.logits);
      ATLAS_RETURN_IF_ERROR(vec ? split(argmax_split_kernel<float, true>, p) : split(argmax_split_kernel<float, false>, p));
      break;
    }
    default:
      return cudaErrorInvalidValue;
  }
  return launch_pdl(argmax_merge_kernel, dim3(static_cast<unsigned>(a.rows)), dim3(32), 0, stream,
                    static_cast<const float*>(a.partials), num_splits, a.ids, a.prob);
}

}  // namespace atlas
