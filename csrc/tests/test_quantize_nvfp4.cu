// C++ driver (no torch): launch_quantize_nvfp4 against a host re-implementation of the
// reference, bit for bit, on random and adversarial bf16 data. Exit 77 = no GPU (ctest: skipped).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "driver.h"
#include "quantize_nvfp4.h"

namespace {

uint8_t host_e2m1(float v) {
  const float a = std::fabs(v);
  uint32_t idx = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return uint8_t(idx | (std::signbit(v) ? 8u : 0u));
}
uint8_t host_e4m3(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }
float host_e4m3_decode(uint8_t b) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(b, __NV_E4M3);
  return __half2float(__half(h));
}


int run_case(int n, int k, std::vector<__nv_bfloat16> w) {
  std::vector<float> x(w.size());
  float amax = 0.f;
  for (size_t i = 0; i < w.size(); ++i) { x[i] = __bfloat162float(w[i]); amax = std::fmax(amax, std::fabs(x[i])); }
  const float gs = amax > 0.f ? amax / 2688.0f : 1.0f;
  std::vector<uint8_t> ref_packed(size_t(n) * k / 2), ref_scale(size_t(n) * k / 16);
  for (size_t b = 0; b < ref_scale.size(); ++b) {
    float bm = 0.f;
    for (int i = 0; i < 16; ++i) bm = std::fmax(bm, std::fabs(x[b * 16 + i]));
    const uint8_t s = host_e4m3(bm / 6.0f / gs);
    const float denom = host_e4m3_decode(s) * gs;
    ref_scale[b] = s;
    for (int i = 0; i < 16; i += 2) {
      uint8_t lo = denom > 0.f ? host_e2m1(x[b * 16 + i] / denom) : 0;
      uint8_t hi = denom > 0.f ? host_e2m1(x[b * 16 + i + 1] / denom) : 0;
      ref_packed[b * 8 + i / 2] = uint8_t(lo | (hi << 4));
    }
  }
  __nv_bfloat16* d_in; uint8_t *d_packed, *d_scale; float *d_gs, *d_amax;
  CHECK(cudaMalloc(&d_in, w.size() * 2)); CHECK(cudaMalloc(&d_packed, ref_packed.size()));
  CHECK(cudaMalloc(&d_scale, ref_scale.size())); CHECK(cudaMalloc(&d_gs, 4)); CHECK(cudaMalloc(&d_amax, 4));
  CHECK(cudaMemcpy(d_in, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemset(d_packed, 0xFF, ref_packed.size())); CHECK(cudaMemset(d_scale, 0xFF, ref_scale.size()));
  atlas::QuantizeNvfp4Args a{d_in, atlas::DType::kBF16, d_packed, d_scale, d_gs, d_amax, n, k};
  CHECK(atlas::launch_quantize_nvfp4(a, 0));
  CHECK(cudaDeviceSynchronize());
  std::vector<uint8_t> packed(ref_packed.size()), scale(ref_scale.size()); float got_gs;
  CHECK(cudaMemcpy(packed.data(), d_packed, packed.size(), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(scale.data(), d_scale, scale.size(), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&got_gs, d_gs, 4, cudaMemcpyDeviceToHost));
  cudaFree(d_in); cudaFree(d_packed); cudaFree(d_scale); cudaFree(d_gs); cudaFree(d_amax);
  const bool ok = packed == ref_packed && scale == ref_scale && std::memcmp(&got_gs, &gs, 4) == 0;
  std::printf("quantize_nvfp4 %dx%d: %s\n", n, k, ok ? "bit-exact" : "MISMATCH");
  return ok ? 0 : 1;
}

}  // namespace

int main() {
  if (atlas_test::no_cuda_device()) return atlas_test::kSkipped;
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.f, 1.f);
  int failures = 0;
  for (auto [n, k] : {std::pair{1, 16}, {5, 48}, {257, 4096}}) {
    std::vector<__nv_bfloat16> w(size_t(n) * k);
    for (auto& v : w) v = __float2bfloat16(normal(rng) * std::exp(normal(rng) * 2.f));
    failures += run_case(n, k, w);
  }
  // Tie points with divisor exactly 1 (global amax 2688 → gs 1; block amax 6 → scale 1).
  std::vector<__nv_bfloat16> t(2 * 32, __float2bfloat16(0.f));
  t[0] = __float2bfloat16(2688.f);
  const float ties[16] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f, 6.f, -0.25f, -0.75f, -1.25f, -1.75f, -2.5f, -3.5f, -5.f, -6.f};
  for (int i = 0; i < 16; ++i) t[32 + i] = __float2bfloat16(ties[i]);
  failures += run_case(2, 32, t);
  failures += run_case(3, 64, std::vector<__nv_bfloat16>(3 * 64, __float2bfloat16(0.f)));
  return failures ? 1 : 0;
}
