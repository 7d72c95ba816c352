// Tensor-core NVFP4 building blocks shared by w4a16_gemv and moe_experts: cp.async wrappers,
// the m16n8k16 bf16 mma, and the exact e2m1 → bf16 dequantization of one 32-bit word of codes.
// Numerics (why each step is exact) are in csrc/w4a16_gemv.cu's header comment ("dequant").
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

namespace atlas {

constexpr float kScaleBias = 0x1p119f;       // block scale · 2^119 fits bf16 (448·2^119 < 2^128)
constexpr float kOutBias = 0x1p7f;           // 2^-126 (e2m1 trick) · 2^119 = 2^-7, undone on store

// ---- PTX wrappers ----
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy to shared address `dst` (a 32-bit shared-window address: no generic →
// shared conversion per copy); src_bytes = 0 zero-fills without reading.
// .L2::256B (a prefetch size, not a cache policy: no descriptor, see below): a GEMV chunk reads
// 64 B of each weight row and 8 B of its scale row, so without it DRAM sees 64- and 32-byte
// requests scattered over thousands of rows; with it the first chunk's request brings the
// row's next 256 B into L2 for the following chunks. Measured on the H200 (gemv v2.1 → v2.3):
// 27B LM head 326.8 → 265.1 µs (0.52 → 0.66 of copy bandwidth). SASS: LDGSTS.E[.BYPASS].LTC256B.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(src), "r"(src_bytes));
}
// The same copies without the zero-fill operand (every source row is real: no per-copy
// predicate to recompute).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" :: "r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global.L2::256B [%0], [%1], 8;\n" :: "r"(dst), "l"(src));
}
// 8-byte async copy (.ca: .cg only moves 16 bytes), same prefetch size.
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global.L2::256B [%0], [%1], 8, %2;\n"
               :: "r"(dst), "l"(src), "r"(src_bytes));
}
// No L2::cache_hint (v1 gave weights and scales a createpolicy evict_first descriptor): ptxas
// 13.x on sm_90 can drop the createpolicy while keeping its cp.async users, which then read an
// unmaterialized uniform register as the cache descriptor (SASS `LDGSTS … desc[UR1]` with no
// definition of UR1) and trap: v2's first H200 run died with cudaErrorIllegalInstruction that
// way, once the copies' shared addresses became uniform-register based. The same miscompile
// is reported for Marlin (IST-DASLab/marlin#44) and worked around in Triton (#11660). The
// activations stay resident without it: every CTA re-reads them, so L2 LRU keeps them hot.
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

// Swizzled 16-byte slot of unit u (bf16 k = 8u .. 8u+7 of a 128-k chunk) in a 256-byte smem
// row r: lane (g, t) of an m16n8k16 fragment load reads unit 4t + w of rows g (and g + 8), and a
// quarter-warp (rows g, g+1 × t = 0..3) then hits 8 distinct 16-byte bank groups.
// w4a16_gemv uses it for activation rows; moe_experts for activation rows and BF16 weight rows.
__host__ __device__ inline int bf16_unit_slot(int r, int u) {
  const int t = u >> 2, w = u & 3;
  return 4 * t + (((w + 2 * (t >> 1)) & 3) ^ (r & 1));
}

// ---- NVFP4 dequantization ----

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

// dequant_word for the GEMV word bit order (atlas/nvfp4.py gemv_word_bits, GEMV_WORD_PIECES: the
// tiled w4a16_gemv layout's words, and moe_experts' stacks in that order): 4 bf16x2 registers
// r[i] = (code 2i, code 2i+1) · f — k-adjacent pairs, so activations feed the mma unpermuted
// (w4a16_gemv v3.17; dequant_word's pairs are (code i, code i+4): the instructions are the same,
// the word holds other codes) — register i the sum of disjoint masked, shifted pieces of q.
// Written as multiplies and a high multiply so ptxas puts the 5 shifts on the FMA pipe
// (IMAD.SHL, LEA.HI) and only the masks on the 16-lane ALU pipe — v3's rotations (5 SHF.W + 6
// LOP3 per word) kept the ALU pipe the bottleneck (w4a16_gemv v3.4, bench/NOTES.md).
__device__ __forceinline__ void dequant_word_tiled(uint32_t q, __nv_bfloat162 f, uint32_t (&r)[4]) {
  const uint32_t sub[4] = {q & 0x81C081C0u,
                           (q & 0x02070207u) * 64u,
                           (q & 0x00380038u) * 8u + (q & 0x04000400u) * 32u,
                           __umulhi(q & 0x38003800u, 1u << 27) + (q & 0x40004000u) * 2u};
#pragma unroll
  for (int i = 0; i < 4; ++i) r[i] = bf162_bits(__hmul2(bits_bf162(sub[i]), f));
}

}  // namespace atlas
