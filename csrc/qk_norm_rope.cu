// qk_norm_rope: the per-token prologue of Qwen3 / Qwen3-Next attention in ONE launch and with ONE
// bf16 rounding per value:
//
//   q_out[t, h, :]  = bf16( rope( rmsnorm(q[t, h, :]) · wq ) )             h ∈ [0, nq)
//   k_row           = bf16( rope( rmsnorm(k[t, h, :]) · wk ) )             h ∈ [0, nkv)
//   cache[slot_t, h] ← k_row, v[t, h, :]   (BF16 copy, or FP8 exactly as reshape_and_cache:
//                      scale = amax(|row|) / 448, e4m3_rne_satfinite(row / scale), IEEE division)
//
//   rmsnorm(x) = x · rsqrt(Σ x² / hd + eps), w = 1 + weight (zero_centered) or weight.
//   rope: NeoX rotate-half on dims [0, rot): dim i < rot/2 pairs with i + rot/2;
//         inv_freq_f = theta^(−2f/rot), angle = pos · inv_freq_f and sincos in float64 (exact
//         at any position; float32 angles lose ~3 mrad at 32K), then float32 math.
//
// Why fused: a separate norm, RoPE and cache write would round K to bf16 two or three times;
// the seed engine traced a deep-layer quality cliff to exactly that and fused these steps.
//
// Decomposition: one warp per (token, row) task, rows = nq query heads, nkv key heads, nkv
// value heads (nq + 2·nkv tasks per token, flattened over tokens); 8 warps (256 threads) per
// CTA, grid = ceil(T·(nq + 2·nkv) / 8). Lane l owns the hd/32 contiguous elements
// [l·hd/32, (l+1)·hd/32) of its row (8 bf16 = one 16-byte load at hd = 256), so the warp's loads
// and stores are coalesced. The sum of squares (and the FP8 amax) are warp shuffles; the RoPE
// partner of an element lives in another lane, so the normed row goes through shared memory
// (hd floats per warp), and the token's rot/2 (cos, sin) pairs are computed one frequency per
// lane (32 at rot = 64) into shared memory. Shared memory: 8·2·hd·4 bytes (16 KB at hd = 256).
//
// Launched with programmatic dependent launch (common/pdl.cuh): the kernel is scheduled while the
// projection GEMV drains; it triggers its own dependents first, prepares the RoPE table, norm
// weights and cache slot before its wait (v2, see step 0) and reads the q / k / v rows after it.
//
// Floor: reads T·(nq + 2·nkv)·hd·2 bytes and writes T·(nq·hd·2 + 2·nkv·hd·c) (c = 2 bf16, 1 fp8);
// decode at 27B shapes (nq 24, nkv 4, hd 256) moves ~33 KB per token: launch-bound (~2 µs
// graph-replayed); at prefill T = 4096 it is 134 MB ≈ 31 µs at 4.3 TB/s.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/checks.h"
#include "common/pdl.cuh"
#include "common/warp.cuh"
#include "common/nvfp4.cuh"
#include "qk_norm_rope.h"

namespace atlas {
namespace {

constexpr int kWarps = 8;                 // tasks (rows) per CTA
constexpr int kThreads = kWarps * 32;

// N contiguous bf16 as one vector load/store: 2 → 4 B, 4 → 8 B, 8 → 16 B.
template <int N> struct Bf16Vec;
template <> struct Bf16Vec<2> { using T = uint32_t; };
template <> struct Bf16Vec<4> { using T = uint2; };
template <> struct Bf16Vec<8> { using T = uint4; };

template <int N>
__device__ __forceinline__ void load_bf16(const __nv_bfloat16* p, float* f) {
  const typename Bf16Vec<N>::T v = *reinterpret_cast<const typename Bf16Vec<N>::T*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) { const float2 t = __bfloat1622float2(h[i]); f[2 * i] = t.x; f[2 * i + 1] = t.y; }
}

template <int N>
__device__ __forceinline__ void store_bf16(__nv_bfloat16* p, const float* f) {
  typename Bf16Vec<N>::T v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<typename Bf16Vec<N>::T*>(p) = v;
}

// N values → N e4m3 bytes of f / scale (IEEE division, RNE, satfinite), one store of N bytes.
template <int N>
__device__ __forceinline__ void store_e4m3(uint8_t* p, const float* f, float scale) {
  uint32_t w[(N + 3) / 4] = {};
#pragma unroll
  for (int i = 0; i < N; ++i) w[i / 4] |= uint32_t(e4m3_encode_satfinite(__fdiv_rn(f[i], scale))) << (8 * (i % 4));
  if constexpr (N == 8) *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  else if constexpr (N == 4) *reinterpret_cast<uint32_t*>(p) = w[0];
  else *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(w[0]);
}

__device__ __forceinline__ float load_weight(const void* w, bool f32, int i) {
  return f32 ? static_cast<const float*>(w)[i] : __bfloat162float(static_cast<const __nv_bfloat16*>(w)[i]);
}

enum class RowKind { kQuery, kKey, kValue };

template <int HD>
__global__ void __launch_bounds__(kThreads) qk_norm_rope_kernel(const QkNormRopeArgs a) {
  constexpr int kPerLane = HD / 32;                 // contiguous elements per lane
  __shared__ float normed_row[kWarps][HD];          // a warp's normed row: RoPE partners
  __shared__ float rope_cos[kWarps][HD / 2];        // the warp's token: cos, sin per frequency
  __shared__ float rope_sin[kWarps][HD / 2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Trigger first (v2): the attention grid's CTAs launch now and warm L2 with their first KV
  // tiles before their own wait (paged_decode v7). With step 0 below between this grid's start
  // and a trigger placed after the wait, that warm-up started later and the layer step got
  // slower although this kernel got faster (H200 A/B, bench/NOTES.md, qk_norm_rope v2).
  pdl_launch_dependents();
  const int rows_per_token = a.nq + 2 * a.nkv;
  const int64_t task = int64_t(blockIdx.x) * kWarps + warp;          // [0, T·rows_per_token)
  const bool has_task = task < int64_t(a.num_tokens) * rows_per_token;   // warp-uniform
  const int64_t t = has_task ? task / rows_per_token : 0;               // token, [0, T)
  const int r = static_cast<int>(task % rows_per_token);
  const RowKind kind = r < a.nq ? RowKind::kQuery : r < a.nq + a.nkv ? RowKind::kKey : RowKind::kValue;
  const int head = kind == RowKind::kQuery ? r : kind == RowKind::kKey ? r - a.nq : r - a.nq - a.nkv;
  const int d0 = lane * kPerLane;                                      // first owned dim
  const int half = a.rotary_dim / 2;

  // Step 0, BEFORE the wait (v2): everything that does not come from the projection — the
  // token's RoPE table (a float64 sincos per frequency), the norm weights, the cache slot. This
  // grid is launched once the projection GEMV has passed its own wait (it triggers after its
  // main loop), so whatever wrote positions / slot_mapping before that GEMV ran is complete
  // and visible; the weights are constants. Contract: positions and slot_mapping must be
  // complete when the kernel launched right before this one triggers its dependents — never its
  // outputs (in the layers they are step inputs, written before the projection, and the GEMV
  // triggers only after its own wait). v1 loaded them after the wait: three dependent round trips
  // (positions → sincos, weights, slot) on the critical path of a ≈ 3 µs kernel (graph-replayed
  // chain: 2.97 → 1.8 µs).
  float w_norm[kPerLane];
  int64_t slot = -1;
  if (has_task && kind != RowKind::kValue) {
    if (half > 0) {
      const double pos = static_cast<double>(a.positions[t]);
      for (int fi = lane; fi < half; fi += 32) {
        double sn, cs;
        sincos(pos * exp2(-(2.0 * fi / a.rotary_dim) * a.log2_theta), &sn, &cs);
        rope_cos[warp][fi] = static_cast<float>(cs);
        rope_sin[warp][fi] = static_cast<float>(sn);
      }
    }
    const void* w = kind == RowKind::kQuery ? a.q_norm_weight : a.k_norm_weight;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const float wi = load_weight(w, a.weight_f32, d0 + i);
      w_norm[i] = a.zero_centered ? 1.0f + wi : wi;
    }
  }
  if (has_task && kind != RowKind::kQuery) slot = a.slot_mapping[t];
  pdl_wait();                       // launched with PDL: the projections' outputs are visible now
  if (!has_task) return;

  // Step 1: load the row (kPerLane contiguous bf16 per lane).
  const __nv_bfloat16* src =
      kind == RowKind::kQuery ? static_cast<const __nv_bfloat16*>(a.q) + t * a.q_stride_t + head * a.q_stride_h
    : kind == RowKind::kKey   ? static_cast<const __nv_bfloat16*>(a.k) + t * a.k_stride_t + head * a.k_stride_h
                              : static_cast<const __nv_bfloat16*>(a.v) + t * a.v_stride_t + head * a.v_stride_h;
  float f[kPerLane];
  load_bf16<kPerLane>(src + d0, f);

  if (kind != RowKind::kValue) {
    // Step 2: RMSNorm over the head (fp32), weight with the zero-centered offset (step 0).
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) ss = fmaf(f[i], f[i], ss);
    const float inv_rms = rsqrtf(warp_sum(ss) / float(HD) + a.eps);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) f[i] = f[i] * inv_rms * w_norm[i];

    // Step 3: partial NeoX RoPE on dims [0, rot); partners and the table from shared memory.
    if (half > 0) {
      float* row = normed_row[warp];
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) row[d0 + i] = f[i];
      __syncwarp();
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int d = d0 + i;
        if (d >= a.rotary_dim) continue;
        const int fi = d < half ? d : d - half;                        // frequency index
        const float c = rope_cos[warp][fi], s = rope_sin[warp][fi];
        f[i] = d < half ? f[i] * c - row[d + half] * s : f[i] * c + row[d - half] * s;
      }
    }
    if (kind == RowKind::kQuery) {
      store_bf16<kPerLane>(static_cast<__nv_bfloat16*>(a.q_out) + (t * a.nq + head) * HD + d0, f);
      return;
    }
    // K is rounded once to bf16 here: the value a bf16 cache holds and an FP8 cache quantizes.
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) f[i] = __bfloat162float(__float2bfloat16_rn(f[i]));
  }

  // Step 4: K or V row into the cache at this token's slot (step 0; skipped when out of range).
  if (slot < 0 || slot >= a.num_slots) return;
  const int64_t row_index = slot * a.nkv + head;                       // [num_slots · nkv)
  void* cache = kind == RowKind::kKey ? a.k_cache : a.v_cache;
  if (a.cache_fp8) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) amax = fmaxf(amax, fabsf(f[i]));
    amax = warp_max(amax);
    const float scale = amax > 0.f ? __fdiv_rn(amax, kE4M3Max) : 1.f;
    store_e4m3<kPerLane>(static_cast<uint8_t*>(cache) + row_index * HD + d0, f, scale);
    if (lane == 0) (kind == RowKind::kKey ? a.k_scale : a.v_scale)[row_index] = scale;
  } else {
    store_bf16<kPerLane>(static_cast<__nv_bfloat16*>(cache) + row_index * HD + d0, f);
  }
}

}  // namespace

cudaError_t launch_qk_norm_rope(const QkNormRopeArgs& a, cudaStream_t stream) {
  if (a.rotary_dim < 0 || a.rotary_dim % 2 != 0 || a.rotary_dim > a.head_dim || a.nq <= 0 || a.nkv <= 0 ||
      (a.cache_fp8 && (a.k_scale == nullptr || a.v_scale == nullptr)))
    return cudaErrorInvalidValue;
  const int64_t tasks = int64_t(a.num_tokens) * (a.nq + 2 * a.nkv);
  if (tasks == 0) return cudaSuccess;
  const dim3 ctas(static_cast<unsigned>(ceil_div<int64_t>(tasks, kWarps)));
  switch (a.head_dim) {
    case 64:  return launch_pdl(qk_norm_rope_kernel<64>, ctas, dim3(kThreads), 0, stream, a);
    case 128: return launch_pdl(qk_norm_rope_kernel<128>, ctas, dim3(kThreads), 0, stream, a);
    case 256: return launch_pdl(qk_norm_rope_kernel<256>, ctas, dim3(kThreads), 0, stream, a);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace atlas
