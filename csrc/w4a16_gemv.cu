// w4a16_gemv: y[m, n] = Σ_k x[m, k] · W[n, k],  W = e2m1 · e4m3 block scale (16 along K) · global
// scale (NVFP4, checkpoint layout), x bf16 [M ≤ 32, K], f32 accumulation, y bf16 | f32.
//
// Decomposition (one tensor-core kernel for every M; swap-AB: Y^T = W · X^T)
//   mma.sync.m16n8k16 bf16 → f32 with the WEIGHT as the A operand (16 rows n × 16 k) and the
//   activations as B (16 k × 8 rows of x): M ≤ 32 is 1..4 n8 tiles (template MT = ceil(M/8)).
//   grid  (S, groups): blockIdx.x = split of K (cluster rank; S = w4a16_gemv_k_splits(K) ≤ 8,
//         a function of K only), blockIdx.y = a group of 16·W weight rows (dual: the groups of
//         weight 0, then those of weight 1).
//   block W warps (W = 1, 2 or 4, picked from N so ≥ 2 CTAs per SM exist); warp w owns the
//         16-row tile (group·W + w) and all M columns, over the CTA's contiguous K range.
//   lane  (g = lane/4, t = lane%4) holds rows g and g+8 of its tile; per 128-k chunk it owns the
//         32 contiguous k [32t, 32t+32) of each row: one 16-byte smem load per row.
//   K permutation: inside a chunk, mma step (w, h) (w = word 0..3, h = 0..1) feeds logical k
//         pair (2t, 2t+1) with physical k (8w+2h, 8w+2h+4) + 32t and pair (2t+8, 2t+9) with
//         (8w+2h+1, 8w+2h+5) + 32t; the B fragment is built (prmt) with the same permutation.
//         The per-row op order depends on K only, so a row is bit-identical for every M.
//   dequant: nibbles i and i+4 of a 32-bit word are 16 bits apart, so one shift puts both at
//         bits 12..15 / 28..31, and (v & 0x80008000) | ((v >> 6) & 0x01C001C0) is the bf16x2
//         pair e2m1 · 2^-126 (0.5 is a bf16 subnormal). One exact bf16 multiply by
//         F = bf16(block_scale · 2^119) gives e2m1 · scale · 2^-7 ∈ [2^-17, 21]: normal, exact
//         (≤ 6 significant bits). The 2^7 and the global scale are applied once, in f32, on the
//         store: y = acc · (global_scale · 128). Nothing over- or underflows for any e4m3 scale.
//   pipeline: 5 stages of cp.async (weights and scales with an L2 evict-first policy: they are
//         read once; activations default policy: every row group re-reads them), one barrier
//         per 128-k chunk. A stage holds W·16 rows × 64 B of packed weight, W·16 × 8 scale
//         bytes and MT·8 rows × 256 B of activations (16-byte units XOR-swizzled so the B
//         fragment loads are bank-conflict free). silu variant: raw gate/up are staged and
//         converted to the bf16 activation one stage ahead (f32 silu·up, RNE to bf16).
//   launch: programmatic dependent launch. The prologue's weight and scale loads are issued
//         before griddepcontrol.wait (weights are constants: no kernel before this one writes
//         them), activations and outputs only after it; launch_dependents after the main loop
//         lets the next kernel's prologue overlap this epilogue.
//   split-K: S CTAs of a cluster each sum a contiguous K range; partials [16W, 8MT] f32 go to
//         shared memory and rank r sums elements r, r+S·threads, … over ranks 0..S−1 in order
//         through distributed shared memory (fixed order: deterministic, no atomics).
//   tails: rows ≥ n and (generic path) k ≥ K are zero-filled by cp.async; K % 128 == 0 with
//         16-byte-aligned rows takes the vector path, any K % 16 == 0 the generic one.
//
// Floor: bytes = N·K/2 + N·K/16 (+ M·K·2 + M·N·2); 14336×5120 ⇒ 41.3 MB ⇒ 9.6 µs at 4.3 TB/s
//   (measured fraction: see bench/NOTES.md, bench/bench_gemv.py).
// Issue budget at 4.3 TB/s on 132 SMs: ≈ 7.8 thread-instructions per weight byte; this kernel
//   spends ≈ 6 at M = 1 (dequant 19 per 8 weights, the rest loads, prmt, mma, scales).
#include "w4a16_gemv.h"

#include <algorithm>
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common/checks.h"

namespace atlas {
namespace {

namespace cg = cooperative_groups;

constexpr int kTileN = 16;                   // weight rows per warp (mma M after swap-AB)
constexpr int kChunkK = 128;                 // K per pipeline stage
constexpr int kRowBytes = kChunkK / 2;       // 64 packed bytes per row per chunk
constexpr int kScaleBytes = kChunkK / 16;    // 8 block scales per row per chunk
constexpr int kXRowBytes = kChunkK * 2;      // 256 activation bytes per row per chunk
constexpr int kXUnits = kXRowBytes / 16;     // 16 units of 8 bf16 per activation row
constexpr int kStages = 5;                   // cp.async pipeline depth: a CTA with ≤ 4 chunks
                                             // (K ≤ 512, or 2048 split 4 ways) has all in flight at once
static_assert(kStages >= 3, "silu converts one stage ahead of the one computed");
constexpr int kMaxWarps = 4;
constexpr int kMaxDevices = 64;             // per-device launch attribute bookkeeping
constexpr float kScaleBias = 0x1p119f;       // block scale · 2^119 fits bf16 (448·2^119 < 2^128)
constexpr float kOutBias = 0x1p7f;           // 2^-126 (e2m1 trick) · 2^119 = 2^-7, undone on store

// Byte offsets inside one pipeline stage.
struct StageLayout {
  int w_off;   // [16W rows][64 B]   packed weight
  int s_off;   // [16W rows][8 B]    e4m3 block scales
  int x_off;   // [8MT rows][256 B]  bf16 activations, swizzled units
  int g_off;   // [8MT rows][256 B]  silu: raw gate (linear)
  int u_off;   // [8MT rows][256 B]  silu: raw up (linear)
  int bytes;
};

__host__ __device__ inline StageLayout stage_layout(int warps, int mt, bool silu) {
  StageLayout l;
  l.w_off = 0;
  l.s_off = warps * kTileN * kRowBytes;
  l.x_off = l.s_off + warps * kTileN * kScaleBytes;
  l.g_off = l.x_off + mt * 8 * kXRowBytes;
  l.u_off = l.g_off + (silu ? mt * 8 * kXRowBytes : 0);
  l.bytes = l.u_off + (silu ? mt * 8 * kXRowBytes : 0);
  return l;
}

// Activation unit u = 4t + w of row r (k = 8u .. 8u+8 of the chunk) lives at this 16-byte slot.
// A quarter-warp (rows g, g+1; t = 0..3) reading word w then hits 8 distinct 4-bank groups.
__host__ __device__ inline int x_slot(int r, int u) {
  const int t = u >> 2, w = u & 3;
  return 4 * t + (((w + 2 * (t >> 1)) & 3) ^ (r & 1));
}

// ---- PTX wrappers ------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Weights and scales are read exactly once: evict-first keeps the activations resident in L2.
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// 16-byte async copy; src_bytes = 0 zero-fills without reading.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(smem_u32(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async16_evict_first(void* dst, const void* src, int src_bytes,
                                                       uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n"
               :: "r"(smem_u32(dst)), "l"(src), "r"(src_bytes), "l"(policy));
}
// 8-byte async copies (.ca: .cg only moves 16 bytes).
__device__ __forceinline__ void cp_async8_evict_first(void* dst, const void* src, int src_bytes,
                                                      uint64_t policy) {
  asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], 8, %2, %3;\n"
               :: "r"(smem_u32(dst)), "l"(src), "r"(src_bytes), "l"(policy));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// D += A · B, m16n8k16, bf16 inputs, f32 accumulators (A row-major 16×16, B col-major 16×8).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// d = (low16(a), low16(b)) for sel 0x5410, (high16(a), high16(b)) for sel 0x7632.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ uint32_t bf162_bits(__nv_bfloat162 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ __nv_bfloat162 bits_bf162(uint32_t v) {
  return *reinterpret_cast<__nv_bfloat162*>(&v);
}

// ---- named steps -------------------------------------------------------------------------

// Two e4m3 block scales (low byte = first block) → bf16x2 (scale · 2^119), exact: the e4m3 →
// f16 conversion is exact (subnormal e4m3 included), · 2^119 is exact in f32, and 4
// significant bits fit bf16. Zero stays zero, NaN stays NaN.
__device__ __forceinline__ __nv_bfloat162 scale_pair_bf16(uint16_t two_e4m3) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_e4m3), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  return __floats2bfloat162_rn(f.x * kScaleBias, f.y * kScaleBias);
}

// 8 E2M1 codes (nibble i = k offset i of a word) → 4 bf16x2 registers r[i] = (code i, code i+4)
// · f, i.e. e2m1 · scale · 2^-7 (exact; see the header comment).
__device__ __forceinline__ void dequant_word(uint32_t q, __nv_bfloat162 f, uint32_t (&r)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t v = q << (12 - 4 * i);                                     // codes at 12..15, 28..31
    const uint32_t sub = (v & 0x80008000u) | ((v >> 6) & 0x01C001C0u);       // e2m1 · 2^-126
    r[i] = bf162_bits(__hmul2(bits_bf162(sub), f));
  }
}

// silu(g) · u in f32, rounded once to bf16 (the documented rounding of w4a16_gemv_silu).
__device__ __forceinline__ float silu_mul_f32(float g, float u) {
  return g / (1.0f + expf(-g)) * u;
}

__device__ __forceinline__ uint32_t silu_mul_bf16x2(uint32_t g2, uint32_t u2) {
  const float2 g = __bfloat1622float2(bits_bf162(g2));
  const float2 u = __bfloat1622float2(bits_bf162(u2));
  return bf162_bits(__floats2bfloat162_rn(silu_mul_f32(g.x, u.x), silu_mul_f32(g.y, u.y)));
}

// Output column of weight row n: identity, or the q/gate de-interleave of w4a16_gemv_qg.
__device__ __forceinline__ int out_column(int n, int n_total, int qg_head_dim) {
  if (qg_head_dim == 0) return n;
  const int h = n / (2 * qg_head_dim), i = n - h * 2 * qg_head_dim;
  return i < qg_head_dim ? h * qg_head_dim + i : n_total / 2 + h * qg_head_dim + (i - qg_head_dim);
}

__device__ __forceinline__ void store_out(const W4A16GemvWeight& w, DType dt, int m, int n, float v) {
  const int64_t off = static_cast<int64_t>(m) * w.n + out_column(n, w.n, w.qg_head_dim);
  if (dt == DType::kF32) static_cast<float*>(w.out)[off] = v;
  else static_cast<__nv_bfloat16*>(w.out)[off] = __float2bfloat16_rn(v);
}

// ---- the kernel --------------------------------------------------------------------------
// MT: n8 tiles of x rows (M ≤ 8·MT). kVec: K % 128 == 0 and 16-byte rows (16-byte weight
// copies, 8-byte scale copies, no K tail); else 8-byte weight copies and byte scale loads.
// kSilu: the activation is bf16(silu(x) · up).
template <int MT, bool kVec, bool kSilu>
__global__ void __launch_bounds__(kMaxWarps * 32)
w4a16_gemv_kernel(const __grid_constant__ W4A16GemvArgs args,
                  int groups0,            // row groups of weight 0 (the rest belong to weight 1)
                  int chunks_per_split) { // 128-k chunks summed by one CTA
  extern __shared__ __align__(16) uint8_t smem[];
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const int warps = nthreads / 32, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;                  // mma groupID / thread-in-group
  const int splits = gridDim.x, split = blockIdx.x;

  const int wi = blockIdx.y < groups0 ? 0 : 1;
  const W4A16GemvWeight& wt = args.w[wi];
  const int group = blockIdx.y - (wi ? groups0 : 0);
  const int K = args.k, M = args.m, n_rows = wt.n;
  const int row0 = group * warps * kTileN;              // first weight row of this CTA
  const int num_chunks = (K + kChunkK - 1) / kChunkK;
  const int c_begin = min(split * chunks_per_split, num_chunks);
  const int c_end = min(c_begin + chunks_per_split, num_chunks);
  const StageLayout lay = stage_layout(warps, MT, kSilu);
  const uint64_t policy = evict_first_policy();
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(args.x);    // [M, K]
  const __nv_bfloat16* up = static_cast<const __nv_bfloat16*>(args.up);  // [M, K] (silu)

  // Stage `slot` ← chunk c's weights and scales (never written by the kernels before this one).
  auto issue_weights = [&](int slot, int c) {
    uint8_t* st = smem + slot * lay.bytes;
    const int k0 = c * kChunkK;
    if constexpr (kVec) {
      for (int p = tid; p < warps * kTileN * 4; p += nthreads) {         // 16-byte pieces
        const int rl = p >> 2, u = p & 3, n = row0 + rl;
        const bool ok = n < n_rows;
        const uint8_t* src = wt.packed + (ok ? static_cast<int64_t>(n) * (K / 2) + k0 / 2 + u * 16 : 0);
        cp_async16_evict_first(st + lay.w_off + rl * kRowBytes + u * 16, src, ok ? 16 : 0, policy);
      }
      for (int rl = tid; rl < warps * kTileN; rl += nthreads) {          // 8 scales per row
        const int n = row0 + rl;
        const bool ok = n < n_rows;
        const uint8_t* src = wt.block_scale + (ok ? static_cast<int64_t>(n) * (K / 16) + k0 / 16 : 0);
        cp_async8_evict_first(st + lay.s_off + rl * kScaleBytes, src, ok ? 8 : 0, policy);
      }
    } else {
      for (int p = tid; p < warps * kTileN * 8; p += nthreads) {         // 8-byte pieces = 16 k
        const int rl = p >> 3, u = p & 7, n = row0 + rl, kk = k0 + 16 * u;
        const bool ok = n < n_rows && kk < K;
        const uint8_t* src = wt.packed + (ok ? static_cast<int64_t>(n) * (K / 2) + kk / 2 : 0);
        cp_async8_evict_first(st + lay.w_off + rl * kRowBytes + u * 8, src, ok ? 8 : 0, policy);
      }
      for (int p = tid; p < warps * kTileN * 8; p += nthreads) {         // scale bytes, synchronous
        const int rl = p >> 3, j = p & 7, n = row0 + rl, kk = k0 + 16 * j;
        const bool ok = n < n_rows && kk < K;
        st[lay.s_off + rl * kScaleBytes + j] =
            ok ? __ldg(wt.block_scale + static_cast<int64_t>(n) * (K / 16) + kk / 16) : uint8_t(0);
      }
    }
  };

  // Stage `slot` ← chunk c's activations (raw gate/up for silu): the previous kernel's output.
  auto issue_acts = [&](int slot, int c) {
    uint8_t* st = smem + slot * lay.bytes;
    const int k0 = c * kChunkK;
    for (int p = tid; p < M * kXUnits; p += nthreads) {                 // 8 bf16 per unit
      const int r = p / kXUnits, u = p % kXUnits, kk = k0 + 8 * u;
      const bool ok = kk < K;
      const int64_t src = ok ? static_cast<int64_t>(r) * K + kk : 0;
      if constexpr (kSilu) {
        cp_async16(st + lay.g_off + r * kXRowBytes + u * 16, x + src, ok ? 16 : 0);
        cp_async16(st + lay.u_off + r * kXRowBytes + u * 16, up + src, ok ? 16 : 0);
      } else {
        cp_async16(st + lay.x_off + r * kXRowBytes + x_slot(r, u) * 16, x + src, ok ? 16 : 0);
      }
    }
  };

  // silu: stage `slot`'s raw gate/up (landed, after a barrier) → swizzled bf16 activations.
  auto convert_stage = [&](int slot) {
    uint8_t* st = smem + slot * lay.bytes;
    for (int p = tid; p < M * kXUnits; p += nthreads) {
      const int r = p / kXUnits, u = p % kXUnits;
      const uint4 gv = *reinterpret_cast<const uint4*>(st + lay.g_off + r * kXRowBytes + u * 16);
      const uint4 uv = *reinterpret_cast<const uint4*>(st + lay.u_off + r * kXRowBytes + u * 16);
      uint4 a;
      a.x = silu_mul_bf16x2(gv.x, uv.x);
      a.y = silu_mul_bf16x2(gv.y, uv.y);
      a.z = silu_mul_bf16x2(gv.z, uv.z);
      a.w = silu_mul_bf16x2(gv.w, uv.w);
      *reinterpret_cast<uint4*>(st + lay.x_off + r * kXRowBytes + x_slot(r, u) * 16) = a;
    }
  };

  float acc[MT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  const bool warp_has_rows = row0 + warp * kTileN < n_rows;

  // One chunk on the tensor cores: 4 words × 2 mma steps × MT tiles.
  auto compute_stage = [&](int slot) {
    const uint8_t* st = smem + slot * lay.bytes;
    const uint8_t* sw = st + lay.w_off + warp * kTileN * kRowBytes;
    const uint8_t* ss = st + lay.s_off + warp * kTileN * kScaleBytes;
    const uint4 qa = *reinterpret_cast<const uint4*>(sw + g * kRowBytes + t * 16);        // row g
    const uint4 qb = *reinterpret_cast<const uint4*>(sw + (g + 8) * kRowBytes + t * 16);  // row g+8
    const __nv_bfloat162 fa = scale_pair_bf16(*reinterpret_cast<const uint16_t*>(ss + g * kScaleBytes + 2 * t));
    const __nv_bfloat162 fb = scale_pair_bf16(*reinterpret_cast<const uint16_t*>(ss + (g + 8) * kScaleBytes + 2 * t));
    const uint32_t wa[4] = {qa.x, qa.y, qa.z, qa.w}, wb[4] = {qb.x, qb.y, qb.z, qb.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {            // word w: k = 32t + 8w .. +8, block 2t + w/2
      uint32_t ra[4], rb[4];
      dequant_word(wa[w], w < 2 ? __low2bfloat162(fa) : __high2bfloat162(fa), ra);
      dequant_word(wb[w], w < 2 ? __low2bfloat162(fb) : __high2bfloat162(fb), rb);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int r = mt * 8 + g;            // x row of this lane's B column
        uint4 xv = make_uint4(0u, 0u, 0u, 0u);
        if (r < M) xv = *reinterpret_cast<const uint4*>(st + lay.x_off + r * kXRowBytes + x_slot(r, 4 * t + w) * 16);
        // h = 0: k (8w, 8w+4) and (8w+1, 8w+5); h = 1: (8w+2, 8w+6) and (8w+3, 8w+7)
        mma_bf16_16816(acc[mt], ra[0], rb[0], ra[1], rb[1], prmt(xv.x, xv.z, 0x5410), prmt(xv.x, xv.z, 0x7632));
        mma_bf16_16816(acc[mt], ra[2], rb[2], ra[3], rb[3], prmt(xv.y, xv.w, 0x5410), prmt(xv.y, xv.w, 0x7632));
      }
    }
  };

  // ---- prologue: the first kStages − 1 chunks' weights stream in before the previous kernel
  // is waited for (programmatic dependent launch; a no-op wait without it), then activations.
  // Group 0 holds all prologue weights and chunk 0's activations, group p chunk p's.
#pragma unroll
  for (int p = 0; p < kStages - 1; ++p) {
    if (c_begin + p < c_end) issue_weights(p, c_begin + p);
  }
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // x / gate / up and out are now safe
#pragma unroll
  for (int p = 0; p < kStages - 1; ++p) {
    if (c_begin + p < c_end) issue_acts(p, c_begin + p);
    cp_async_commit();
  }
  if constexpr (kSilu) {
    if (c_begin < c_end) {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      convert_stage(0);
    }
  }
  int slot = 0;                                  // stage slot of chunk c
  for (int c = c_begin; c < c_end; ++c) {
    const int prev = slot == 0 ? kStages - 1 : slot - 1, next = slot == kStages - 1 ? 0 : slot + 1;
    // plain: chunk c landed; silu: chunk c + 1 landed too (it is converted below)
    if constexpr (kSilu) cp_async_wait<kStages - 3>(); else cp_async_wait<kStages - 2>();
    __syncthreads();  // chunk c visible to all; every warp is done with chunk c − 1's slot
    if (c + kStages - 1 < c_end) {                 // into chunk c − 1's slot
      issue_weights(prev, c + kStages - 1);
      issue_acts(prev, c + kStages - 1);
    }
    cp_async_commit();
    if constexpr (kSilu) {
      if (c + 1 < c_end) convert_stage(next);
    }
    if (warp_has_rows) compute_stage(slot);
    slot = next;
  }
  // The next kernel may start launching (it waits for this whole grid before reading y).
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  // ---- store: y = acc · global_scale · 2^7 (one f32 multiply, one rounding to the output) ----
  const float factor = __ldg(wt.global_scale) * kOutBias;
  const int row_base = row0 + warp * kTileN;
  if (splits == 1) {
    if (!warp_has_rows) return;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = mt * 8 + 2 * t + (e & 1), n = row_base + g + 8 * (e >> 1);
        if (m < M && n < n_rows) store_out(wt, args.out_dtype, m, n, acc[mt][e] * factor);
      }
    }
    return;
  }
  // split-K: partials [16W rows][8MT cols] f32 in shared memory, summed over the cluster in
  // rank order 0..S−1 (deterministic), each rank storing every S-th element.
  cp_async_wait<0>();
  __syncthreads();  // all warps are done with the stage buffers
  constexpr int kCols = MT * 8;
  float* part = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      part[(warp * kTileN + g + 8 * (e >> 1)) * kCols + mt * 8 + 2 * t + (e & 1)] = acc[mt][e];
    }
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  for (int e = split * nthreads + tid; e < warps * kTileN * M; e += splits * nthreads) {
    const int rl = e / M, m = e % M, n = row0 + rl;
    if (n >= n_rows) continue;
    float s = 0.0f;
    for (int r = 0; r < splits; ++r) s += cluster.map_shared_rank(part, r)[rl * kCols + m];
    store_out(wt, args.out_dtype, m, n, s * factor);
  }
  cluster.sync();  // keep this CTA's partials alive until every rank has read them
}

template <int MT, bool kVec, bool kSilu>
cudaError_t launch_instance(const W4A16GemvArgs& a, dim3 grid, int warps, int groups0,
                            int chunks_per_split, cudaStream_t stream) {
  auto kernel = w4a16_gemv_kernel<MT, kVec, kSilu>;
  const StageLayout lay = stage_layout(warps, MT, kSilu);
  const int part_bytes = warps * kTileN * MT * 8 * static_cast<int>(sizeof(float));
  const int smem = std::max(kStages * lay.bytes, part_bytes);
  // Opt in above the default 48 KB once per device and instance (the first call is normally
  // eager; later calls, e.g. under graph capture, make no attribute call).
  static int opted_in[kMaxDevices] = {};
  int dev = 0;
  ATLAS_RETURN_IF_ERROR(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) return cudaErrorInvalidDevice;
  if (smem > 48 * 1024 && smem > opted_in[dev]) {
    ATLAS_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    opted_in[dev] = smem;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(warps * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int num_attrs = 0;
  if (grid.x > 1) {                   // the S splits of one row group form a cluster
    attr[num_attrs].id = cudaLaunchAttributeClusterDimension;
    attr[num_attrs].val.clusterDim.x = grid.x;
    attr[num_attrs].val.clusterDim.y = 1;
    attr[num_attrs].val.clusterDim.z = 1;
    ++num_attrs;
  }
  // Programmatic dependent launch: the prologue's weight loads overlap the previous kernel's
  // tail (the kernel waits for it before touching activations or outputs). A plain launch
  // where the attribute is refused.
  attr[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[num_attrs].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = num_attrs + 1;
  if (cudaLaunchKernelEx(&cfg, kernel, a, groups0, chunks_per_split) == cudaSuccess) return cudaSuccess;
  (void)cudaGetLastError();           // clear the refusal
  cfg.numAttrs = num_attrs;
  ATLAS_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, kernel, a, groups0, chunks_per_split));
  return last_launch_error();
}

template <int MT>
cudaError_t launch_mt(const W4A16GemvArgs& a, bool vec, dim3 grid, int warps, int groups0,
                      int chunks_per_split, cudaStream_t stream) {
  const bool silu = a.up != nullptr;
  if (vec) {
    return silu ? launch_instance<MT, true, true>(a, grid, warps, groups0, chunks_per_split, stream)
                : launch_instance<MT, true, false>(a, grid, warps, groups0, chunks_per_split, stream);
  }
  return silu ? launch_instance<MT, false, true>(a, grid, warps, groups0, chunks_per_split, stream)
              : launch_instance<MT, false, false>(a, grid, warps, groups0, chunks_per_split, stream);
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

int w4a16_gemv_k_splits(int k) {
  // ≥ 4 chunks (512 k) per CTA so the cluster barrier and partial exchange stay small next to
  // the streaming; at most 8 (portable cluster size). K = 2048 → 4, K ≥ 4096 → 8, K ≤ 1024 → 1..2.
  const int chunks = (k + kChunkK - 1) / kChunkK;
  int s = 1;
  while (s < 8 && 2 * s * 4 <= chunks) s *= 2;
  return s;
}

cudaError_t launch_w4a16_gemv(const W4A16GemvArgs& a, cudaStream_t stream) {
  if (a.m < 1 || a.m > kW4A16GemvMaxRows || a.k < 16 || a.k % 16 != 0) return cudaErrorInvalidValue;
  if (a.num_weights != 1 && a.num_weights != 2) return cudaErrorInvalidValue;
  if (a.out_dtype != DType::kBF16 && a.out_dtype != DType::kF32) return cudaErrorInvalidValue;
  if (a.x == nullptr || !aligned(a.x, 16) || (a.up != nullptr && !aligned(a.up, 16))) {
    return a.x == nullptr ? cudaErrorInvalidValue : cudaErrorMisalignedAddress;
  }
  bool vec = a.k % kChunkK == 0;
  for (int i = 0; i < a.num_weights; ++i) {
    const W4A16GemvWeight& w = a.w[i];
    if (w.packed == nullptr || w.block_scale == nullptr || w.global_scale == nullptr ||
        w.out == nullptr || w.n < 1) return cudaErrorInvalidValue;
    if (w.qg_head_dim < 0 || (w.qg_head_dim > 0 && w.n % (2 * w.qg_head_dim) != 0)) return cudaErrorInvalidValue;
    if (!aligned(w.packed, 8)) return cudaErrorMisalignedAddress;
    vec = vec && aligned(w.packed, 16) && aligned(w.block_scale, 8);
  }
  const int splits = w4a16_gemv_k_splits(a.k);
  const int chunks = (a.k + kChunkK - 1) / kChunkK;
  const int chunks_per_split = (chunks + splits - 1) / splits;

  // Warps (16-row tiles) per CTA: 4 unless that leaves fewer than 2 CTAs per SM (132 SMs on
  // the H200); numerics do not depend on it. Small N (one expert, 512 rows) gets 1-warp CTAs.
  static int sm_count[kMaxDevices] = {};
  int dev = 0;
  ATLAS_RETURN_IF_ERROR(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) return cudaErrorInvalidDevice;
  if (sm_count[dev] == 0) {
    ATLAS_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sm_count[dev], cudaDevAttrMultiProcessorCount, dev));
  }
  int tiles = 0;
  for (int i = 0; i < a.num_weights; ++i) tiles += ceil_div(a.w[i].n, kTileN);
  int warps = kMaxWarps;
  while (warps > 1 && ceil_div(tiles, warps) * splits < 2 * sm_count[dev]) warps /= 2;
  const int groups0 = ceil_div(a.w[0].n, warps * kTileN);
  const int groups = groups0 + (a.num_weights == 2 ? ceil_div(a.w[1].n, warps * kTileN) : 0);
  if (groups > 65535) return cudaErrorInvalidValue;
  const dim3 grid(splits, groups);

  switch (ceil_div(a.m, 8)) {
    case 1: return launch_mt<1>(a, vec, grid, warps, groups0, chunks_per_split, stream);
    case 2: return launch_mt<2>(a, vec, grid, warps, groups0, chunks_per_split, stream);
    case 3: return launch_mt<3>(a, vec, grid, warps, groups0, chunks_per_split, stream);
    default: return launch_mt<4>(a, vec, grid, warps, groups0, chunks_per_split, stream);
  }
}

}  // namespace atlas
