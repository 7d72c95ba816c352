// C++ driver (no torch): launch_qk_norm_rope, launch_rms_norm and launch_sigmoid_gate_mul against
// host re-implementations in float64. qk_norm_rope: every head-dim instance (64, 128, 256), BF16
// and FP8 caches, strided q (the per-head [q | gate] layout of a gated q_proj), k/v as views of
// one [T, 2·nkv·hd] buffer, padding (negative) and out-of-range slots, positions up to 40000.
// Checks: q_out and K within one bf16 step of the float64 value; V bit for bit (bf16 copy, or
// FP8 bytes + scales with reshape_and_cache's math); slots not named keep their 0xFF poison.
// Meant for compute-sanitizer as well. Exit 77 = no GPU (ctest: skipped).
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
#include "qk_norm_rope.h"
#include "rms_norm.h"
#include "sigmoid_gate.h"

namespace {


float bf(__nv_bfloat16 x) { return __bfloat162float(x); }

// |got − want| within `steps` bf16 rounding steps of want (2^-8 relative, floored at 2^-126), or
// within `atol` (RoPE's x1·c − x2·s may cancel to a value whose float32 noise spans many steps).
bool close_bf16(float got, double want, double steps = 1.0, double atol = 0.0) {
  const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(want), 1e-38)) - 7);
  return std::fabs(got - want) <= std::max(steps * ulp, atol);
}

double abs_max(const std::vector<double>& y) {
  double m = 0;
  for (double v : y) m = std::max(m, std::fabs(v));
  return m;
}

// rms-normalize then NeoX-rotate one head row in float64 (the reference's math, unrounded).
void host_norm_rope(const __nv_bfloat16* x, const float* w, int hd, int rot, double pos, double theta,
                    bool zero_centered, float eps, std::vector<double>& y) {
  double ss = 0;
  for (int i = 0; i < hd; ++i) ss += double(bf(x[i])) * bf(x[i]);
  const double inv = 1.0 / std::sqrt(ss / hd + eps);
  std::vector<double> n(hd);
  for (int i = 0; i < hd; ++i) n[i] = bf(x[i]) * inv * (zero_centered ? 1.0 + w[i] : double(w[i]));
  y = n;
  const int half = rot / 2;
  for (int i = 0; i < half; ++i) {
    const double a = pos * std::pow(theta, -2.0 * i / rot), c = std::cos(a), s = std::sin(a);
    y[i] = n[i] * c - n[i + half] * s;
    y[i + half] = n[i + half] * c + n[i] * s;
  }
}

struct QkCase { int t, nq, nkv, hd, rot; bool fp8; };

int run_qk_norm_rope(const QkCase& c, std::mt19937& rng) {
  const int bs = 16, num_blocks = 2 * c.t + 2;
  const int64_t num_slots = int64_t(num_blocks) * bs;
  const int elem = c.fp8 ? 1 : 2;
  const int64_t q_stride_t = int64_t(c.nq) * 2 * c.hd, q_stride_h = 2 * c.hd;     // [T, nq, 2·hd] [q | gate]
  const int64_t kv_stride_t = int64_t(2 * c.nkv) * c.hd;                           // [T, 2·nkv·hd] [k | v]
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> expo(-2.f, 3.f);
  std::vector<__nv_bfloat16> q(size_t(c.t) * q_stride_t), kv(size_t(c.t) * kv_stride_t);
  float mag = 1.f;
  for (size_t i = 0; i < q.size(); ++i) { if (i % c.hd == 0) mag = std::pow(10.f, expo(rng)); q[i] = __float2bfloat16(normal(rng) * mag); }
  for (size_t i = 0; i < kv.size(); ++i) { if (i % c.hd == 0) mag = std::pow(10.f, expo(rng)); kv[i] = __float2bfloat16(normal(rng) * mag); }
  std::vector<float> qw(c.hd), kw(c.hd);
  for (int i = 0; i < c.hd; ++i) { qw[i] = 0.2f * normal(rng); kw[i] = 0.2f * normal(rng); }
  std::vector<int64_t> pos(c.t), slots(c.t), perm(num_slots);
  std::uniform_int_distribution<int64_t> pdist(0, 40000);
  for (auto& p : pos) p = pdist(rng);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int i = 0; i < c.t; ++i) slots[i] = perm[i];
  for (int i = 1; i < c.t; i += 5) slots[i] = -1;                 // padding: no write
  for (int i = 3; i < c.t; i += 7) slots[i] = num_slots + i;      // out of range: skipped

  const size_t row_bytes = size_t(c.nkv) * c.hd * elem;
  __nv_bfloat16 *d_q, *d_kv, *d_qout; float *d_qw, *d_kw, *d_scale[2]; int64_t *d_pos, *d_slots; uint8_t* d_cache[2];
  CHECK(cudaMalloc(&d_q, q.size() * 2)); CHECK(cudaMalloc(&d_kv, kv.size() * 2));
  CHECK(cudaMalloc(&d_qout, size_t(c.t) * c.nq * c.hd * 2));
  CHECK(cudaMalloc(&d_qw, c.hd * 4)); CHECK(cudaMalloc(&d_kw, c.hd * 4));
  CHECK(cudaMalloc(&d_pos, c.t * 8)); CHECK(cudaMalloc(&d_slots, c.t * 8));
  CHECK(cudaMemcpy(d_q, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_kv, kv.data(), kv.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_qw, qw.data(), c.hd * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_kw, kw.data(), c.hd * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_pos, pos.data(), c.t * 8, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_slots, slots.data(), c.t * 8, cudaMemcpyHostToDevice));
  CHECK(cudaMemset(d_qout, 0xFF, size_t(c.t) * c.nq * c.hd * 2));
  for (int i = 0; i < 2; ++i) {
    CHECK(cudaMalloc(&d_cache[i], num_slots * row_bytes)); CHECK(cudaMemset(d_cache[i], 0xFF, num_slots * row_bytes));
    CHECK(cudaMalloc(&d_scale[i], num_slots * c.nkv * 4)); CHECK(cudaMemset(d_scale[i], 0xFF, num_slots * c.nkv * 4));
  }
  atlas::QkNormRopeArgs a{};
  a.q = d_q; a.k = d_kv; a.v = d_kv + int64_t(c.nkv) * c.hd;
  a.q_stride_t = q_stride_t; a.q_stride_h = q_stride_h;
  a.k_stride_t = a.v_stride_t = kv_stride_t; a.k_stride_h = a.v_stride_h = c.hd;
  a.q_norm_weight = d_qw; a.k_norm_weight = d_kw; a.weight_f32 = true;
  a.positions = d_pos; a.slot_mapping = d_slots; a.q_out = d_qout;
  a.k_cache = d_cache[0]; a.v_cache = d_cache[1];
  if (c.fp8) { a.k_scale = d_scale[0]; a.v_scale = d_scale[1]; }
  a.num_slots = num_slots; a.num_tokens = c.t; a.nq = c.nq; a.nkv = c.nkv; a.head_dim = c.hd;
  a.rotary_dim = c.rot; a.log2_theta = std::log2(1e7); a.eps = 1e-6f; a.zero_centered = true; a.cache_fp8 = c.fp8;
  CHECK(atlas::launch_qk_norm_rope(a, 0));
  CHECK(cudaDeviceSynchronize());

  std::vector<__nv_bfloat16> qout(size_t(c.t) * c.nq * c.hd);
  std::vector<uint8_t> cache[2] = {std::vector<uint8_t>(num_slots * row_bytes), std::vector<uint8_t>(num_slots * row_bytes)};
  std::vector<float> scale[2] = {std::vector<float>(num_slots * c.nkv), std::vector<float>(num_slots * c.nkv)};
  CHECK(cudaMemcpy(qout.data(), d_qout, qout.size() * 2, cudaMemcpyDeviceToHost));
  for (int i = 0; i < 2; ++i) {
    CHECK(cudaMemcpy(cache[i].data(), d_cache[i], cache[i].size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(scale[i].data(), d_scale[i], scale[i].size() * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaFree(d_cache[i])); CHECK(cudaFree(d_scale[i]));
  }
  for (void* p : {(void*)d_q, (void*)d_kv, (void*)d_qout, (void*)d_qw, (void*)d_kw, (void*)d_pos, (void*)d_slots}) CHECK(cudaFree(p));

  int bad = 0;
  std::vector<double> y;
  std::vector<char> written(num_slots, 0);
  for (int t = 0; t < c.t; ++t) {
    for (int h = 0; h < c.nq; ++h) {
      host_norm_rope(&q[t * q_stride_t + h * q_stride_h], qw.data(), c.hd, c.rot, double(pos[t]), 1e7, true, 1e-6f, y);
      const double atol = abs_max(y) * std::ldexp(1.0, -20);
      for (int i = 0; i < c.hd; ++i) bad += !close_bf16(bf(qout[(size_t(t) * c.nq + h) * c.hd + i]), y[i], 1.0, atol);
    }
    const int64_t s = slots[t];
    if (s < 0 || s >= num_slots) continue;
    written[s] = 1;
    for (int h = 0; h < c.nkv; ++h) {
      const size_t row = size_t(s) * c.nkv + h;
      // K: within one bf16 step (bf16 cache) / the dequantized FP8 value within 2^-4 relative + amax/448·2^-9
      host_norm_rope(&kv[t * kv_stride_t + int64_t(h) * c.hd], kw.data(), c.hd, c.rot, double(pos[t]), 1e7, true, 1e-6f, y);
      double amax = 0;
      for (double v : y) amax = std::max(amax, std::fabs(v));
      for (int i = 0; i < c.hd; ++i) {
        if (c.fp8) {
          const float got = __half2float(__half(__nv_cvt_fp8_to_halfraw(cache[0][row * c.hd + i], __NV_E4M3))) * scale[0][row];
          bad += std::fabs(got - y[i]) > std::fabs(y[i]) * 0.0703 + amax / 448 * 0.002;
        } else {
          __nv_bfloat16 got; std::memcpy(&got, &cache[0][(row * c.hd + i) * 2], 2);
          bad += !close_bf16(bf(got), y[i], 1.0, amax * std::ldexp(1.0, -20));
        }
      }
      // V: exact (reshape_and_cache's math on the same bf16 input)
      const __nv_bfloat16* v = &kv[t * kv_stride_t + int64_t(c.nkv + h) * c.hd];
      if (c.fp8) {
        float vmax = 0.f;
        for (int i = 0; i < c.hd; ++i) vmax = std::fmax(vmax, std::fabs(bf(v[i])));
        const float sc = vmax > 0.f ? vmax / 448.0f : 1.0f;
        bad += scale[1][row] != sc;
        for (int i = 0; i < c.hd; ++i) bad += cache[1][row * c.hd + i] != __nv_cvt_float_to_fp8(bf(v[i]) / sc, __NV_SATFINITE, __NV_E4M3);
      } else {
        bad += std::memcmp(&cache[1][row * c.hd * 2], v, size_t(c.hd) * 2) != 0;
      }
    }
  }
  for (int64_t s = 0; s < num_slots; ++s)                   // untouched slots keep the poison
    if (!written[s])
      for (int i = 0; i < 2; ++i)
        for (size_t b = 0; b < row_bytes; ++b) bad += cache[i][s * row_bytes + b] != 0xFF;
  std::printf("qk_norm_rope t=%d nq=%d nkv=%d hd=%d rot=%d %s: %s (%d bad)\n", c.t, c.nq, c.nkv, c.hd, c.rot,
              c.fp8 ? "fp8" : "bf16", bad ? "FAIL" : "ok", bad);
  return bad ? 1 : 0;
}

int run_rms_norm(int rows, int dim, bool zero_centered, bool with_residual, std::mt19937& rng) {
  const int64_t stride = dim + 16;
  std::normal_distribution<float> normal;
  std::vector<__nv_bfloat16> x(size_t(rows) * stride), out(size_t(rows) * dim), res(size_t(rows) * dim), res_out(res.size());
  for (auto& v : x) v = __float2bfloat16(normal(rng) * 300.f);
  for (auto& v : res) v = __float2bfloat16(normal(rng) * 1000.f);
  std::vector<__nv_bfloat16> w(dim);
  for (auto& v : w) v = __float2bfloat16(0.3f * normal(rng));
  __nv_bfloat16 *d_x, *d_w, *d_out, *d_res;
  CHECK(cudaMalloc(&d_x, x.size() * 2)); CHECK(cudaMalloc(&d_w, dim * 2)); CHECK(cudaMalloc(&d_out, out.size() * 2));
  CHECK(cudaMalloc(&d_res, res.size() * 2));
  CHECK(cudaMemcpy(d_x, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_w, w.data(), dim * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_res, res.data(), res.size() * 2, cudaMemcpyHostToDevice));
  atlas::RmsNormArgs a{};
  a.x = d_x + 8; a.weight = d_w; a.out = d_out; a.rows = rows; a.dim = dim; a.x_row_stride = stride;
  a.eps = 1e-6f; a.weight_f32 = false; a.zero_centered = zero_centered;
  if (with_residual) a.residual = d_res;
  CHECK(atlas::launch_rms_norm(a, 0));
  CHECK(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(res_out.data(), d_res, res.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaFree(d_x)); CHECK(cudaFree(d_w)); CHECK(cudaFree(d_out)); CHECK(cudaFree(d_res));
  int bad = 0;
  for (int r = 0; r < rows; ++r) {
    std::vector<__nv_bfloat16> h(&x[r * stride + 8], &x[r * stride + 8] + dim);
    if (with_residual)                     // h = bf16(x + residual), written back exactly
      for (int i = 0; i < dim; ++i) {
        h[i] = __float2bfloat16(bf(h[i]) + bf(res[size_t(r) * dim + i]));
        bad += std::memcmp(&h[i], &res_out[size_t(r) * dim + i], 2) != 0;
      }
    const __nv_bfloat16* xr = h.data();
    double ss = 0;
    for (int i = 0; i < dim; ++i) ss += double(bf(xr[i])) * bf(xr[i]);
    const double inv = 1.0 / std::sqrt(ss / dim + 1e-6);
    for (int i = 0; i < dim; ++i) {
      const double wi = zero_centered ? 1.0 + bf(w[i]) : double(bf(w[i]));
      bad += !close_bf16(bf(out[size_t(r) * dim + i]), bf(xr[i]) * inv * wi);
    }
  }
  std::printf("rms_norm rows=%d dim=%d zc=%d residual=%d: %s (%d bad)\n", rows, dim, zero_centered, with_residual,
              bad ? "FAIL" : "ok", bad);
  return bad ? 1 : 0;
}

int run_sigmoid_gate(int t, int heads, int hd, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<__nv_bfloat16> x(size_t(t) * heads * hd), g(size_t(t) * heads * 2 * hd), out(x.size());
  for (auto& v : x) v = __float2bfloat16(normal(rng));
  for (auto& v : g) v = __float2bfloat16(6.f * normal(rng));
  __nv_bfloat16 *d_x, *d_g;
  CHECK(cudaMalloc(&d_x, x.size() * 2)); CHECK(cudaMalloc(&d_g, g.size() * 2));
  CHECK(cudaMemcpy(d_x, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_g, g.data(), g.size() * 2, cudaMemcpyHostToDevice));
  atlas::SigmoidGateArgs a{};
  a.x = d_x; a.gate = d_g + hd; a.out = d_x;                        // in place; gate = second half of [q | gate]
  a.tokens = t; a.heads = heads; a.head_dim = hd; a.gate_stride_t = int64_t(heads) * 2 * hd; a.gate_stride_h = 2 * hd;
  CHECK(atlas::launch_sigmoid_gate_mul(a, 0));
  CHECK(cudaMemcpy(out.data(), d_x, out.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaFree(d_x)); CHECK(cudaFree(d_g));
  int bad = 0;
  for (int i = 0; i < t * heads; ++i)
    for (int d = 0; d < hd; ++d) {
      const double gv = bf(g[size_t(i) * 2 * hd + hd + d]);
      bad += !close_bf16(bf(out[size_t(i) * hd + d]), bf(x[size_t(i) * hd + d]) / (1.0 + std::exp(-gv)));
    }
  std::printf("sigmoid_gate_mul t=%d heads=%d hd=%d: %s (%d bad)\n", t, heads, hd, bad ? "FAIL" : "ok", bad);
  return bad ? 1 : 0;
}

}  // namespace

int main() {
  if (atlas_test::no_cuda_device()) return atlas_test::kSkipped;
  std::mt19937 rng(1234);
  int failed = 0;
  for (const QkCase& c : {QkCase{1, 16, 2, 256, 64, false}, QkCase{9, 24, 4, 256, 64, true}, QkCase{33, 32, 8, 128, 128, false},
                          QkCase{33, 32, 8, 128, 128, true}, QkCase{7, 8, 8, 64, 64, true}, QkCase{5, 8, 2, 64, 16, false},
                          QkCase{12, 16, 2, 256, 256, true}})
    failed += run_qk_norm_rope(c, rng);
  for (int rows : {1, 7, 33})
    for (int dim : {256, 2048, 5120}) failed += run_rms_norm(rows, dim, dim != 2048, rows == 7, rng);
  failed += run_sigmoid_gate(1, 16, 256, rng) + run_sigmoid_gate(7, 24, 256, rng) + run_sigmoid_gate(300, 32, 128, rng);
  std::printf("%s\n", failed ? "FAILED" : "all ok");
  return failed ? 1 : 0;
}
