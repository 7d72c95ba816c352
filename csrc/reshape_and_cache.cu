// reshape_and_cache: write this step's K/V rows into the paged KV cache, bit-exact with
// atlas/reference.py::reshape_and_cache.
//
//   for t in [0, T), s = slot_mapping[t], 0 ≤ s < num_slots (others skipped):
//     BF16 cache:  k_cache[s] = key[t],  v_cache[s] = value[t]                (exact copy)
//     E4M3 cache:  per kv head h, row x = key[t, h, :] (and likewise value):
//                  scale = amax(|x|) / 448   (1.0 when amax == 0)
//                  k_cache[s, h, :] = e4m3_rne_satfinite(x / scale),  k_scale[s, h] = scale
//   k_cache viewed as [num_slots = num_blocks · bs, nkv, hd]: slot s = block · bs + offset is
//   its row, so the kernel never needs bs (any block size: 16, 528, ...).
//
// Versions (bench/bench_reshape_and_cache.py, H200, fraction of copy bandwidth; bench/NOTES.md):
//   v1  32 lanes × one 16-byte chunk per (token, K|V, head) row at hd 256; data loads waited
//       on the slot load; FP8 divided with __fdiv_rn per element (~11 SASS instructions each,
//       ~20 instructions per element in all). T 4096 / 16384: bf16 nkv2 0.55 / 0.76, nkv4
//       0.68 / 0.82; fp8 nkv2 0.37 / 0.52, nkv4 0.47 / 0.57 (FP8 slower than BF16 at fewer
//       bytes: issue-bound, ~1.6 µs of issue per SM per wave of 2048 threads).
//   v2  (this) 4 chunks (64 B) per lane, all loads issued before the slot is known; FP8 divides
//       by one correctly rounded reciprocal + one exact correction (3 FP ops, see quantize).
//
// Decomposition: one "row" = (token t, K or V, kv head h), hd contiguous bf16 values.
//   Rows are numbered row = t · 2·nkv + (is_v · nkv + h), h fastest, so neighbouring rows are
//   neighbouring memory on both sides. A group of kLanes lanes (1..32: the smallest power of two
//   with kLanes · kChunks ≥ hd/8) owns one row; lane l owns the kChunks = 4 16-byte chunks
//   c = l + i·kLanes, i ∈ [0, 4), i.e. elements [8c, 8c + 8). hd 256: 8 lanes per row, a warp
//   holds 4 rows (one token at nkv 2) and each load instruction reads 4 rows × 128 B.
//   Groups never straddle a warp (kLanes divides 32), so the FP8 amax is a group-local
//   xor-shuffle reduce (3 steps at hd 256, over 32 elements already reduced per lane).
//   Grid: ceil(T · 2·nkv / (256 / kLanes)) CTAs of 256 threads (8 warps), one row per group;
//   no shared memory. Each lane issues the slot load and its 4 16-byte data loads back to back
//   (64 B in flight per lane: ~64 KB per SM at T 4096, twice the ≈ 32 KB that Little's law asks
//   of 4.2 TB/s × ~1 µs over 132 SMs; v1 had 16 B per lane and its data loads waited for the
//   slot, two memory latencies per thread), then (FP8) reduces and converts, then stores
//   16 (BF16) or 8 (FP8) bytes per chunk; lane 0 of the group stores the scale.
//   hd 256, T 4096, nkv 2: 16384 rows / 32 per CTA = 512 CTAs, one wave (v1: 2048 CTAs).
//   FP8 stores stay 8 bytes per chunk: a warp's store instruction still writes whole 32-byte
//   sectors (4 rows × 64 B), and a lane owning 16 adjacent values for one 16-byte store would
//   need chunk loads at a 32-byte lane stride (two half-used passes over each sector) or a
//   shuffle per chunk pair; store count is not what the v1 numbers indict.
//   Cache offsets are int64: slot · nkv · hd passes 2^31 at ~16 k blocks of 16 × 8 × 128.
//   Skipped rows (slot < 0: padding; slot ≥ num_slots: out of range, which ops.py rejects
//   only on CPU because checking a CUDA tensor would sync) store nothing. They do load their
//   K/V row (valid memory: key/value hold all T tokens), so that no load waits for the slot;
//   their lanes still join the shuffle, so every shuffle runs with a full warp.
//
// Division: the reference divides x / scale in IEEE float32 and rounds to E4M3 (RNE, satfinite).
//   The kernel takes r = RN(1/scale) once per row and per element q0 = RN(x·r),
//   e = fma(q0, scale, -x) (exact), q = fma(-e, r, q0), sign copied from x (Markstein's
//   correction: q = RN(x / scale) whenever e does not underflow). Checked exhaustively on the
//   host (IEEE fmaf) over every positive finite bf16 amax with a normal scale and every bf16 x
//   with |x| ≤ amax, both signs (1.06e9 pairs): for scale ≥ 2^-100, q differs from RN(x / scale)
//   only where |x / scale| < 2^-13 (the residual underflows; E4M3 rounds both to the same ±0);
//   the E4M3 bytes differ only for scale < 2^-113.4. Rows with scale < 2^-100 (amax < 448 ·
//   2^-100 ≈ 3.5e-28) or a non-finite scale therefore divide with __fdiv_rn, as v1 did for all.
//   (Without the copysign, x = -0 can come out +0 depending on how the compiler distributes the
//   negations: 0x80 vs 0x00 in E4M3.) test_kernel_fp8_every_bf16_pair repeats the exhaustive
//   check through the kernel on the GPU. The conversion is cvt.rn.satfinite, as in v1. The
//   amax is taken on bf16 bit patterns (exact; a NaN row gets scale 1 as in the reference,
//   where v1's fmaxf skipped NaN; inputs are finite by contract anyway).
//
// Floor (bytes moved): T·nkv·hd·2 (K and V) · (2 read + c written, c = 2 BF16 | 1 FP8)
//   + T·nkv·2·4 (FP8 scales) + T·8 (slots). Qwen3 nkv = 4, hd = 256, T = 4096:
//   BF16 33.6 MB → 7.8 µs, FP8 25.3 MB → 5.9 µs at the H200's ≈ 4.3 TB/s copy bandwidth.
//   Target ≥ 80% of copy bandwidth at T ≥ 4096 (bench/bench_reshape_and_cache.py; measured
//   fraction: see bench/NOTES.md). At T = 1 (decode) the launch itself (~1 µs) dominates.
//   T = 4096 is ONE wave of 4–8 µs: the launch, the first DRAM round trip and the drain are
//   ≈ 2.5 µs of it (measured, v2), so v3 launches with programmatic dependent launch
//   (common/pdl.cuh) to overlap its launch with the previous kernel's tail.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>

#include "common/checks.h"
#include "common/pdl.cuh"
#include "reshape_and_cache.h"

namespace atlas {
namespace {

constexpr int kThreads = 256;          // 8 warps per CTA
constexpr int kChunkElems = 8;         // bf16 values in one 16-byte load
constexpr int kChunks = 4;             // 16-byte chunks per lane: 64 B of loads in flight
constexpr float kE4M3Max = 448.f;      // largest finite E4M3 (fn) value: 1.75 · 2^8
// Smallest scale divided by the reciprocal path (exhaustively exact down to 2^-113.4; see the
// header comment); below it the row divides with __fdiv_rn.
constexpr float kReciprocalMinScale = 0x1p-100f;

// What one 16-byte chunk of bf16 input becomes in the cache.
template <typename CacheT> struct CacheChunk;
template <> struct CacheChunk<__nv_bfloat16> {
  using Store = uint4;                  // 8 × bf16, copied bit for bit
  static constexpr bool kScaled = false;
};
template <> struct CacheChunk<__nv_fp8_e4m3> {
  using Store = uint2;                  // 8 × e4m3
  static constexpr bool kScaled = true;
};

__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float (&out)[kChunkElems]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {         // bf16 → f32 is a 16-bit shift: element 2i is the low half
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Running max |x| over one chunk as bf16 bit patterns, two per word: |x| clears the sign bit,
// and non-negative bf16 order is unsigned 16-bit order (subnormals included; NaN sorts above
// inf, as torch's amax propagates it). One LOP3 + half a VIMNMX3.U16x2 per pair, exact by
// construction (bf16 HMNMX2 costs the same but goes through the FP pipe), and no unpacked
// floats stay live across the shuffle.
__device__ __forceinline__ uint32_t chunk_amax_bits2(const uint4& v, uint32_t m) {
  constexpr uint32_t kMagnitude = 0x7fff7fffu;
  m = __vmaxu2(m, v.x & kMagnitude);
  m = __vmaxu2(m, v.y & kMagnitude);
  m = __vmaxu2(m, v.z & kMagnitude);
  return __vmaxu2(m, v.w & kMagnitude);
}

// max over the kLanes lanes of this row's group (xor offsets < kLanes stay inside the group),
// on float bit patterns of non-negative values (unsigned order = value order).
template <int kLanes>
__device__ __forceinline__ uint32_t group_max_bits(uint32_t v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// x / scale, bit-exact with IEEE division for scale ∈ [kReciprocalMinScale, FLT_MAX] (see the
// header comment): RN(x·r), its exact residual, one correction; the sign of x kept for ±0.
struct ReciprocalDivide {
  float scale;                          // > 0
  float recip;                          // RN(1 / scale)
  __device__ __forceinline__ float operator()(float x) const {
    const float q0 = __fmul_rn(x, recip);
    const float residual = __fmaf_rn(q0, scale, -x);       // q0·scale − x, exact
    return copysignf(__fmaf_rn(-residual, recip, q0), x);
  }
};
struct IeeeDivide {                     // rows with tiny or non-finite scales (v1's division)
  float scale;
  __device__ __forceinline__ float operator()(float x) const { return __fdiv_rn(x, scale); }
};
struct NoDivide {};                     // BF16 cache: chunks are copied

// 8 bf16 → 8 e4m3 of divide(x): round to nearest even, saturate at ±448.
template <typename Divide>
__device__ __forceinline__ uint2 quantize_chunk_e4m3(const uint4& v, const Divide& divide) {
  float f[kChunkElems];
  bf16x8_to_float(v, f);
  uint32_t word[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 pair = make_float2(divide(f[2 * i]), divide(f[2 * i + 1]));
    // .x lands in the low byte: element 2i at the lower address
    const uint32_t two = __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
    word[i / 2] |= two << (16 * (i % 2));
  }
  return make_uint2(word[0], word[1]);
}

// Grid: ceil(T · 2·nkv / (kThreads / kLanes)); see the header comment for who owns what.
template <typename CacheT, int kLanes>
__global__ void __launch_bounds__(kThreads)
reshape_and_cache_kernel(const __grid_constant__ ReshapeAndCacheArgs a) {
  using Chunk = CacheChunk<CacheT>;
  static_assert(32 % kLanes == 0, "a row's lane group must not straddle a warp");
  constexpr int kRowsPerCta = kThreads / kLanes;

  const int nkv = a.num_kv_heads;
  const int hd = a.head_dim;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerCta + threadIdx.x / kLanes;  // [0, T · 2·nkv) + tail
  const int lane = int(threadIdx.x % kLanes);          // [0, kLanes)
  const int64_t token = row / (2 * nkv);               // [0, T) for real rows
  const int kv_row = int(row - token * (2 * nkv));     // [0, 2·nkv): K heads, then V heads
  const bool is_v = kv_row >= nkv;
  const int head = is_v ? kv_row - nkv : kv_row;       // [0, nkv)
  const bool real_row = token < a.num_tokens;

  // Programmatic dependent launch (v3): this grid may be scheduled while the kernel that wrote
  // key / value / slot_mapping drains; every global access below comes after the wait, and the
  // next PDL kernel may start launching at once (it waits for this whole grid in turn).
  pdl_wait();
  pdl_launch_dependents();

  // Step 1: issue the slot load and all data loads back to back; nothing here waits on the
  // slot (chunks past hd stay 0; rows past T load nothing).
  const int64_t slot = real_row ? a.slot_mapping[token] : -1;
  const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(is_v ? a.value : a.key)
                             + token * (is_v ? a.value_stride : a.key_stride)
                             + int64_t(head) * hd;         // row [hd] bf16
  uint4 in[kChunks];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = lane + i * kLanes;                       // chunk [0, hd/8)
    in[i] = make_uint4(0u, 0u, 0u, 0u);
    if (real_row && c * kChunkElems < hd) in[i] = __ldg(reinterpret_cast<const uint4*>(src) + c);
  }

  // Step 2 (FP8): the row's scale = amax / 448 over the whole group (all lanes shuffle).
  float scale = 1.f;
  if constexpr (Chunk::kScaled) {
    uint32_t amax2 = 0u;                                   // two bf16 |x| maxima
#pragma unroll
    for (int i = 0; i < kChunks; ++i) amax2 = chunk_amax_bits2(in[i], amax2);
    const float amax = __uint_as_float(group_max_bits<kLanes>(max(amax2 << 16, amax2 & 0xffff0000u)));
    scale = amax > 0.f ? __fdiv_rn(amax, kE4M3Max) : 1.f;
  }
  const bool active = slot >= 0 && slot < a.num_slots;
  if (!active) return;

  // Step 3: store the chunks (and the scale) at the slot's row of the cache.
  const int64_t cache_row = (slot * nkv + head) * hd;      // int64: see the header comment
  typename Chunk::Store* dst = reinterpret_cast<typename Chunk::Store*>(
      static_cast<CacheT*>(is_v ? a.v_cache : a.k_cache) + cache_row);   // [hd/8] chunks
  auto store_row = [&](const auto& divide) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = lane + i * kLanes;
      if (c * kChunkElems >= hd) continue;
      if constexpr (Chunk::kScaled) dst[c] = quantize_chunk_e4m3(in[i], divide);
      else dst[c] = in[i];
    }
  };
  if constexpr (Chunk::kScaled) {
    // Uniform per row (per lane group); a warp diverges only around a row with a tiny scale.
    if (scale >= kReciprocalMinScale && scale <= FLT_MAX) store_row(ReciprocalDivide{scale, __frcp_rn(scale)});
    else store_row(IeeeDivide{scale});
    if (lane == 0) (is_v ? a.v_scale : a.k_scale)[slot * nkv + head] = scale;   // [num_slots, nkv]
  } else {
    store_row(NoDivide{});
  }
}

template <typename CacheT, int kLanes>
cudaError_t launch_instance(const ReshapeAndCacheArgs& a, cudaStream_t stream) {
  const int64_t rows = a.num_tokens * 2 * a.num_kv_heads;
  const int64_t blocks = ceil_div<int64_t>(rows, kThreads / kLanes);
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return launch_pdl(reshape_and_cache_kernel<CacheT, kLanes>, dim3(unsigned(blocks)), dim3(kThreads), 0,
                    stream, a);
}

// kLanes = the smallest power of two with kLanes · 4 chunks ≥ hd/8 (hd 256: 8 lanes).
template <typename CacheT>
cudaError_t launch_for_cache(const ReshapeAndCacheArgs& a, cudaStream_t stream) {
  const int chunks = a.head_dim / kChunkElems;
  if (chunks <= 1 * kChunks) return launch_instance<CacheT, 1>(a, stream);    // hd ≤ 32
  if (chunks <= 2 * kChunks) return launch_instance<CacheT, 2>(a, stream);    // hd ≤ 64
  if (chunks <= 4 * kChunks) return launch_instance<CacheT, 4>(a, stream);    // hd ≤ 128
  if (chunks <= 8 * kChunks) return launch_instance<CacheT, 8>(a, stream);    // hd ≤ 256
  if (chunks <= 16 * kChunks) return launch_instance<CacheT, 16>(a, stream);  // hd ≤ 512
  return launch_instance<CacheT, 32>(a, stream);                              // hd ≤ 1024
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

cudaError_t launch_reshape_and_cache(const ReshapeAndCacheArgs& a, cudaStream_t stream) {
  const bool fp8 = a.cache_dtype == DType::kE4M3;
  if (a.num_tokens < 0 || a.num_kv_heads < 1 || a.num_slots < 0 || a.head_dim < kChunkElems ||
      a.head_dim % kChunkElems != 0 || a.head_dim > kReshapeAndCacheMaxHeadDim ||
      a.key_stride % kChunkElems != 0 || a.value_stride % kChunkElems != 0 ||
      !aligned(a.key, 16) || !aligned(a.value, 16) || !aligned(a.k_cache, 16) ||
      !aligned(a.v_cache, 16) || (fp8 && (a.k_scale == nullptr || a.v_scale == nullptr)))
    return cudaErrorInvalidValue;
  if (a.num_tokens == 0) return cudaSuccess;
  switch (a.cache_dtype) {
    case DType::kBF16: return launch_for_cache<__nv_bfloat16>(a, stream);
    case DType::kE4M3: return launch_for_cache<__nv_fp8_e4m3>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace atlas
