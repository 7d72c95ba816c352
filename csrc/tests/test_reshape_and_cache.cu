// C++ driver (no torch): launch_reshape_and_cache against a host re-implementation of the
// reference, bit for bit (cache bytes and FP8 scales), with strided rows, padding (negative)
// and out-of-range slots, every lane-group instance (hd 8 .. 1024) and both cache dtypes.
// Poisoned caches: a slot the kernel must not write keeps 0xFF bytes. Meant for
// compute-sanitizer (out-of-range slots must not be written). Exit 77 = no GPU (ctest: skipped).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "driver.h"
#include "reshape_and_cache.h"

namespace {


struct Case { int t, nkv, hd, bs, num_blocks; bool fp8; };

// Host reference of one (token, head) row: bf16 copy, or e4m3(x / (amax / 448)) + scale.
void host_row(const __nv_bfloat16* x, int hd, bool fp8, uint8_t* out, float* scale) {
  if (!fp8) { std::memcpy(out, x, size_t(hd) * 2); return; }
  float amax = 0.f;
  for (int i = 0; i < hd; ++i) amax = std::fmax(amax, std::fabs(__bfloat162float(x[i])));
  const float s = amax > 0.f ? amax / 448.0f : 1.0f;
  for (int i = 0; i < hd; ++i) out[i] = __nv_cvt_float_to_fp8(__bfloat162float(x[i]) / s, __NV_SATFINITE, __NV_E4M3);
  *scale = s;
}

int run_case(const Case& c, std::mt19937& rng) {
  const int64_t stride = int64_t(4 * c.nkv) * c.hd;          // rows of a qkv buffer [T, (2·nkv q + nkv k + nkv v)·hd]
  const int64_t num_slots = int64_t(c.num_blocks) * c.bs;
  const int elem = c.fp8 ? 1 : 2;
  const size_t row_bytes = size_t(c.nkv) * c.hd * elem;       // one slot of one cache
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> expo(-3.f, 4.f);
  std::vector<__nv_bfloat16> qkv(size_t(c.t) * stride);
  float magnitude = 1.f;                                      // per head row: 1e-3 .. 1e4
  for (size_t i = 0; i < qkv.size(); ++i) {
    if (i % c.hd == 0) magnitude = std::pow(10.f, expo(rng));
    qkv[i] = __float2bfloat16(normal(rng) * magnitude);
  }
  std::vector<int64_t> perm(num_slots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int64_t> slots(perm.begin(), perm.begin() + c.t);
  for (int i = 1; i < c.t; i += 5) slots[i] = -1;                       // padding
  for (int i = 3; i < c.t; i += 7) slots[i] = num_slots + i;            // out of range: skipped

  // reference: poisoned caches with the named slots written
  std::vector<uint8_t> ref[2] = {std::vector<uint8_t>(num_slots * row_bytes, 0xFF),
                                 std::vector<uint8_t>(num_slots * row_bytes, 0xFF)};
  std::vector<float> ref_scale[2] = {std::vector<float>(num_slots * c.nkv, NAN), std::vector<float>(num_slots * c.nkv, NAN)};
  for (int t = 0; t < c.t; ++t) {
    if (slots[t] < 0 || slots[t] >= num_slots) continue;
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < c.nkv; ++h)
        host_row(&qkv[t * stride + int64_t(2 * c.nkv + kv * c.nkv + h) * c.hd], c.hd, c.fp8,
                 &ref[kv][slots[t] * row_bytes + size_t(h) * c.hd * elem], &ref_scale[kv][slots[t] * c.nkv + h]);
  }

  __nv_bfloat16* d_qkv; int64_t* d_slots; uint8_t* d_cache[2]; float* d_scale[2];
  CHECK(cudaMalloc(&d_qkv, qkv.size() * 2));
  CHECK(cudaMalloc(&d_slots, slots.size() * 8 + 8));
  CHECK(cudaMemcpy(d_qkv, qkv.data(), qkv.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_slots, slots.data(), slots.size() * 8, cudaMemcpyHostToDevice));
  for (int kv = 0; kv < 2; ++kv) {
    CHECK(cudaMalloc(&d_cache[kv], num_slots * row_bytes));
    CHECK(cudaMemset(d_cache[kv], 0xFF, num_slots * row_bytes));
    CHECK(cudaMalloc(&d_scale[kv], num_slots * c.nkv * 4));
    CHECK(cudaMemset(d_scale[kv], 0xFF, num_slots * c.nkv * 4));   // 0xFFFFFFFF: a NaN
  }
  atlas::ReshapeAndCacheArgs a{};
  a.key = d_qkv + int64_t(2 * c.nkv) * c.hd;
  a.value = d_qkv + int64_t(3 * c.nkv) * c.hd;
  a.k_cache = d_cache[0];
  a.v_cache = d_cache[1];
  a.k_scale = c.fp8 ? d_scale[0] : nullptr;
  a.v_scale = c.fp8 ? d_scale[1] : nullptr;
  a.slot_mapping = d_slots;
  a.num_tokens = c.t;
  a.key_stride = a.value_stride = stride;
  a.num_slots = num_slots;
  a.num_kv_heads = c.nkv;
  a.head_dim = c.hd;
  a.cache_dtype = c.fp8 ? atlas::DType::kE4M3 : atlas::DType::kBF16;
  CHECK(atlas::launch_reshape_and_cache(a, 0));
  CHECK(cudaDeviceSynchronize());

  int bad = 0;
  for (int kv = 0; kv < 2; ++kv) {
    std::vector<uint8_t> got(num_slots * row_bytes);
    std::vector<float> got_scale(num_slots * c.nkv);
    CHECK(cudaMemcpy(got.data(), d_cache[kv], got.size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(got_scale.data(), d_scale[kv], got_scale.size() * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < got.size() && bad < 5; ++i)
      if (got[i] != ref[kv][i]) {
        std::printf("  %s byte %zu (slot %zu): got 0x%02x want 0x%02x\n", kv ? "v_cache" : "k_cache", i,
                    i / row_bytes, got[i], ref[kv][i]);
        ++bad;
      }
    for (size_t i = 0; c.fp8 && i < got_scale.size() && bad < 5; ++i)
      if (std::memcmp(&got_scale[i], &ref_scale[kv][i], 4) != 0 && !(std::isnan(got_scale[i]) && std::isnan(ref_scale[kv][i]))) {
        std::printf("  %s %zu: got %g want %g\n", kv ? "v_scale" : "k_scale", i, got_scale[i], ref_scale[kv][i]);
        ++bad;
      }
  }
  for (int kv = 0; kv < 2; ++kv) { cudaFree(d_cache[kv]); cudaFree(d_scale[kv]); }
  cudaFree(d_qkv);
  cudaFree(d_slots);
  std::printf("%s T=%d nkv=%d hd=%d bs=%d %s\n", bad ? "FAIL" : "ok  ", c.t, c.nkv, c.hd, c.bs, c.fp8 ? "fp8" : "bf16");
  return bad ? 1 : 0;
}

}  // namespace

int main() {
  if (atlas_test::no_cuda_device()) return atlas_test::kSkipped;
  std::mt19937 rng(1234);
  const Case shapes[] = {
      {1, 4, 256, 16, 2},   {7, 2, 256, 528, 1},  {300, 8, 128, 16, 40}, {64, 3, 8, 16, 8},
      {33, 2, 96, 16, 5},   {50, 2, 512, 528, 1}, {20, 1, 1024, 16, 3},  {0, 2, 256, 16, 1},
  };
  int failures = 0;
  for (bool fp8 : {false, true})
    for (Case c : shapes) {
      c.fp8 = fp8;
      failures += run_case(c, rng);
    }
  std::printf("%s\n", failures ? "FAILED" : "all passed");
  return failures ? 1 : 0;
}
