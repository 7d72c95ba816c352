// argmax: greedy token and its top-1 softmax probability for each row of a logits matrix,
// equal to atlas/reference.py::argmax (ids exactly; prob to ≈ 1e-5 relative: ex2.approx, v4).
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
//     same values in the same registers either way; a chunk wholly inside [0, V) issues all its
//     loads unconditionally (v4). Each thread takes the max of its 16 (fmaxf), its first
//     register holding it (selects), then Σ exp(x − max) by ex2.approx, ≈ 8 instructions per
//     logit (v4; v2–v3: a branch per logit and accurate expf, 39 — issue-bound at R = 32; v1
//     kept an online running triple: expf on both sides of a data-dependent branch); the CTA
//     merges the threads' triples (warp xor-shuffles, then 8 warp results through shared
//     memory) and writes one partial per (row, split).
//   Merge pass: grid R, one warp per row: lanes merge the S partials in a fixed order, then a
//     warp xor-shuffle merge; lane 0 writes ids and prob.
//   merge(a, b): the winner is the larger max, or on equal max the lower index; the loser's
//   sum is rescaled by exp(max_loser − max_winner). The result depends only on the row (never
//   on R), so a row's draft is the same whatever batch it was proposed in.
//   −inf logits (masked vocab) contribute 0; NaN logits never win and make prob NaN (a row
//   with no finite maximum: its first index).
//
// Both kernels are launched with programmatic dependent launch (common/pdl.cuh): each waits for
// the previous kernel (the LM-head GEMV, then the split pass) before its first global access and
// lets the next one launch at once, so the launch gaps overlap the previous kernel's tail.
//
// Floor: R·V·elem bytes; one row of 248 320 bf16 logits = 0.50 MB → 0.12 µs at 4.3 TB/s, far
//   below the two launches (~2 × 2 µs eager, ~2 × 1 µs in a CUDA graph): at decode sizes this
//   op is launch-bound by design, and the split pass exists so it stays so at R = 32
//   (15.9 MB → 3.7 µs floor). Measured (bench/argmax_probe, H200, graph-replayed, bf16 V =
//   248 320): v4 R = 1 3.26 µs, R = 8 4.59, R = 32 8.63 (v3: 4.40 / 6.43 / 14.2, session 25
//   call 5; v2's element loads: 4.26 / 6.6 / 16.0).
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

// exp(d) as ex2.approx.ftz(d · log2 e): 2 instructions (__expf adds 4 for denormal inputs and
// results); exactly 1 at d = 0, 0 at d = −inf, NaN at NaN, ≈ 2 ulp elsewhere, results below
// 2^-126 flushed to 0 (terms of a sum that is ≥ 1).
__device__ __forceinline__ float exp_approx(float d) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(d * 1.4426950408889634f));
  return y;
}

__device__ __forceinline__ Best empty_best() { return {-INFINITY, 0.f, INT_MAX}; }

__device__ __forceinline__ Best merge(const Best& a, const Best& b) {
  const bool a_wins = a.m > b.m || (a.m == b.m && a.idx < b.idx);
  const float wm = a_wins ? a.m : b.m, lm = a_wins ? b.m : a.m;
  const float ws = a_wins ? a.s : b.s, ls = a_wins ? b.s : a.s;
  const float scale = (lm == -INFINITY) ? 0.f : exp_approx(lm - wm);   // (v4; was expf)
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
  //    reads 512 contiguous bytes per unit and a thread's logits ascend with their register index),
  //    every load issued before the first use. A chunk wholly inside [0, V) with 16-byte aligned
  //    rows (`full`, CTA-uniform: all but the last split of a row) takes one unconditional 16-byte
  //    load per unit; otherwise (the tail, or kVec false) a 16-byte load per unit wholly inside
  //    [0, V) and element loads for the rest — the same logits in the same registers either way.
  //    Out-of-range positions hold −inf and form a suffix of the registers: the first n_valid are
  //    in range.
  float x[kPerThread];
  const bool full = kVec && v0 + kArgmaxChunk <= vocab;
  int n_valid = kPerThread;
  if (full) {
    uint4 q[kUnits];
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      q[i] = *reinterpret_cast<const uint4*>(row + v0 + (static_cast<int64_t>(i) * kThreads + threadIdx.x) * kUnit);
    }
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      const T* e = reinterpret_cast<const T*>(&q[i]);
#pragma unroll
      for (int j = 0; j < kUnit; ++j) x[i * kUnit + j] = load_logit(e + j);
    }
  } else {
    n_valid = 0;
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
      const int64_t left = vocab - u0;   // in-range logits of this unit: clamp(left, 0, kUnit)
      n_valid += left <= 0 ? 0 : left >= kUnit ? kUnit : static_cast<int>(left);
    }
  }
  // v4: branch-free, the index computed once, ≈ 8 instructions per logit (v3: one branch per
  // logit — strict > with an "all −inf so far" arm — and accurate expf, 39 instructions per
  // logit: the split pass issue-bound at 79%, ncu R = 32). The max by fmaxf (a NaN never wins:
  // fmaxf returns the other operand); its first register by selects from the back (registers past
  // n_valid hold −inf, which never equals a finite max); m = −inf: the first in-range register
  // (v1–v3's rule). Σ exp(x − m) by ex2.approx (exp_approx: exactly 1 at x = m, ≈ 2 ulp elsewhere);
  // against m' = 0 when m = −inf, so −inf terms are 0 and NaN terms stay NaN.
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) m = fmaxf(m, x[i]);
  int first = kPerThread;
#pragma unroll
  for (int i = kPerThread - 1; i >= 0; --i) first = x[i] == m ? i : first;
  if (m == -INFINITY) first = n_valid > 0 ? 0 : kPerThread;
  Best b{m, 0.f, INT_MAX};
  if (first < kPerThread) {
    b.idx = static_cast<int>(v0 + (static_cast<int64_t>(first / kUnit) * kThreads + threadIdx.x) * kUnit +
                             first % kUnit);
  }
  const float m_sub = m == -INFINITY ? 0.f : m;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) b.s += exp_approx(x[i] - m_sub);

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
