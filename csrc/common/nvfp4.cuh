// E2M1 / E4M3 codecs shared by the NVFP4 kernels. Bit-exact with atlas/reference.py.
#pragma once
#include <cuda_fp8.h>
#include <cstdint>

namespace atlas {

constexpr float kE2M1Max = 6.0f;    // largest |E2M1| value
constexpr float kE4M3Max = 448.0f;  // largest finite E4M3 (e4m3fn) value
constexpr int kNvfp4Block = 16;     // elements per block scale, along K

// float → 4-bit E2M1 code, round-to-nearest-even, saturating at ±6 (reference.e2m1_encode).
// Thresholds on |v|: ≤0.25→0, <0.75→0.5, ≤1.25→1, <1.75→1.5, ≤2.5→2, <3.5→3, ≤5→4, else 6.
// Bit 3 is v's sign bit (so −0.1 → code 8, i.e. −0). Hopper has no cvt for e2m1, hence compares.
__device__ __forceinline__ uint32_t e2m1_encode_rne(float v) {
  const float a = fabsf(v);
  const uint32_t idx = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) +
                       (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return idx | ((__float_as_uint(v) >> 28) & 0x8u);
}

// float → E4M3 byte, round-to-nearest-even, saturating to ±448 (reference.e4m3_rne_satfinite).
__device__ __forceinline__ uint8_t e4m3_encode_satfinite(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// E4M3 byte → float (exact).
__device__ __forceinline__ float e4m3_decode(uint8_t b) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
  return __half2float(__half(h));
}

// Global scale from the tensor's amax: amax / (6·448), or 1.0 for an all-zero tensor.
__device__ __forceinline__ float nvfp4_global_scale(float amax) {
  return amax > 0.0f ? amax / (kE2M1Max * kE4M3Max) : 1.0f;
}

}  // namespace atlas
