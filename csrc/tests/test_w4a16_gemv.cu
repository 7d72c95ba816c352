// C++ driver (no torch): launch_w4a16_gemv against a float64 host reference on random NVFP4
// weights (every code, e4m3 scales over the whole range incl. subnormal and zero), odd N, K
// with and without the vector path, M = 1..32 with bitwise batch invariance, dual, qg, silu,
// sigmoid gate (contiguous and strided) and n_rows, outputs poisoned with 0xFF (NaN) first.
// For compute-sanitizer. Exit 77 = no GPU.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "driver.h"
#include "w4a16_gemv.h"

namespace {

#undef CHECK
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); std::exit(1); } } while (0)

float e4m3_decode(uint8_t b) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(b, __NV_E4M3);
  return __half2float(__half(h));
}
double e2m1_decode(int code) {
  static const double mags[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  return (code & 8 ? -1.0 : 1.0) * mags[code & 7];
}
uint16_t bf16_bits(float v) { __nv_bfloat16 b = __float2bfloat16(v); uint16_t u; std::memcpy(&u, &b, 2); return u; }
float bf16_value(uint16_t u) { __nv_bfloat16 b; std::memcpy(&b, &u, 2); return __bfloat162float(b); }

struct HostWeight {
  int n, k;
  std::vector<uint8_t> packed, scale;  // [n, k/2], [n, k/16]
  float gs;
};

HostWeight random_weight(int n, int k, float gs, std::mt19937& rng) {
  HostWeight w{n, k, std::vector<uint8_t>(size_t(n) * k / 2), std::vector<uint8_t>(size_t(n) * k / 16), gs};
  std::uniform_int_distribution<int> byte(0, 255), scale(0, 0x7E);
  for (auto& b : w.packed) b = uint8_t(byte(rng));
  for (size_t i = 0; i < w.scale.size(); ++i) {
    w.scale[i] = uint8_t(byte(rng) < 3 ? 0 : scale(rng));   // some zero blocks
    if (w.scale[i] == 0) std::memset(&w.packed[i * 8], 0, 8);
  }
  return w;
}

// y[m][n] in double
std::vector<double> reference(const HostWeight& w, const std::vector<uint16_t>& x, int m) {
  std::vector<double> y(size_t(m) * w.n, 0.0);
  std::vector<double> row(w.k);
  for (int n = 0; n < w.n; ++n) {
    for (int k = 0; k < w.k; ++k) {
      const uint8_t b = w.packed[size_t(n) * w.k / 2 + k / 2];
      row[k] = e2m1_decode(k % 2 ? b >> 4 : b & 15) * e4m3_decode(w.scale[size_t(n) * w.k / 16 + k / 16]) * w.gs;
    }
    for (int i = 0; i < m; ++i) {
      double s = 0.0;
      for (int k = 0; k < w.k; ++k) s += double(bf16_value(x[size_t(i) * w.k + k])) * row[k];
      y[size_t(i) * w.n + n] = s;
    }
  }
  return y;
}

struct DeviceWeight {
  uint8_t *packed = nullptr, *scale = nullptr;
  float* gs = nullptr;
  explicit DeviceWeight(const HostWeight& w) {
    CHECK(cudaMalloc(&packed, w.packed.size())); CHECK(cudaMalloc(&scale, w.scale.size()));
    CHECK(cudaMalloc(&gs, 4));
    CHECK(cudaMemcpy(packed, w.packed.data(), w.packed.size(), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(scale, w.scale.data(), w.scale.size(), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(gs, &w.gs, 4, cudaMemcpyHostToDevice));
  }
  ~DeviceWeight() { cudaFree(packed); cudaFree(scale); cudaFree(gs); }
};

// Run one launch; returns the output as float (bf16 or f32 out).
// x2 (silu's up or the sigmoid gate, rows x2_stride apart, 0 = K) is used iff act != kPlain.
std::vector<float> run(const atlas::W4A16GemvWeight& wt_in, int m, int k, const uint16_t* d_x,
                       const uint16_t* d_x2, atlas::DType dt, int qg_hd = 0,
                       atlas::GemvAct act = atlas::GemvAct::kSiluMul, int64_t x2_stride = 0) {
  atlas::W4A16GemvArgs a{};
  a.x = d_x; a.x2 = d_x2; a.m = m; a.k = k; a.out_dtype = dt; a.num_weights = 1;
  a.act = d_x2 ? act : atlas::GemvAct::kPlain;
  a.x2_stride = x2_stride;
  a.w[0] = wt_in;
  a.w[0].qg_head_dim = qg_hd;
  const size_t esz = dt == atlas::DType::kF32 ? 4 : 2, count = size_t(m) * wt_in.n;
  void* d_out; CHECK(cudaMalloc(&d_out, count * esz)); CHECK(cudaMemset(d_out, 0xFF, count * esz));
  a.w[0].out = d_out;
  CHECK(atlas::launch_w4a16_gemv(a, 0));
  CHECK(cudaDeviceSynchronize());
  std::vector<float> out(count);
  if (dt == atlas::DType::kF32) {
    CHECK(cudaMemcpy(out.data(), d_out, count * 4, cudaMemcpyDeviceToHost));
  } else {
    std::vector<uint16_t> h(count);
    CHECK(cudaMemcpy(h.data(), d_out, count * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < count; ++i) out[i] = bf16_value(h[i]);
  }
  cudaFree(d_out);
  return out;
}

double rel_err(const std::vector<float>& y, const std::vector<double>& ref, int m, int n, int ld) {
  double num = 0.0, den = 0.0;
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      const double d = double(y[size_t(i) * n + j]) - ref[size_t(i) * ld + j];
      num += d * d; den += ref[size_t(i) * ld + j] * ref[size_t(i) * ld + j];
    }
  return std::isfinite(num) ? std::sqrt(num / std::fmax(den, 1e-300)) : INFINITY;
}

int failures = 0;
void expect(bool ok, const char* what, int n, int k, int m) {
  if (!ok) { ++failures; std::printf("FAIL %s N=%d K=%d M=%d\n", what, n, k, m); }
}

void run_shape(int n, int k, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  const HostWeight w = random_weight(n, k, 1e-3f, rng);
  std::vector<uint16_t> x(size_t(32) * k), g(size_t(32) * k), u(size_t(32) * k);
  for (auto& v : x) v = bf16_bits(normal(rng));
  for (auto& v : g) v = bf16_bits(normal(rng) * 3.f);
  for (auto& v : u) v = bf16_bits(normal(rng));
  const std::vector<double> ref = reference(w, x, 32);
  DeviceWeight dw(w);
  uint16_t *d_x, *d_g, *d_u;
  CHECK(cudaMalloc(&d_x, x.size() * 2)); CHECK(cudaMalloc(&d_g, g.size() * 2)); CHECK(cudaMalloc(&d_u, u.size() * 2));
  CHECK(cudaMemcpy(d_x, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_g, g.data(), g.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_u, u.data(), u.size() * 2, cudaMemcpyHostToDevice));
  atlas::W4A16GemvWeight wt{};
  wt.packed = dw.packed; wt.block_scale = dw.scale; wt.global_scale = dw.gs; wt.n = n;

  // f32 and bf16 outputs vs the float64 reference; M = 32 is the invariance baseline
  const std::vector<float> y32 = run(wt, 32, k, d_x, nullptr, atlas::DType::kBF16);
  expect(rel_err(y32, ref, 32, n, n) <= 0.0040, "bf16 vs reference", n, k, 32);
  const std::vector<float> f32 = run(wt, 32, k, d_x, nullptr, atlas::DType::kF32);
  expect(rel_err(f32, ref, 32, n, n) <= 2e-5, "f32 vs reference", n, k, 32);
  for (int m = 1; m <= 32; ++m) {  // row i of an M-row call == the same row in the 32-row call
    const std::vector<float> y = run(wt, m, k, d_x, nullptr, atlas::DType::kBF16);
    expect(std::memcmp(y.data(), y32.data(), y.size() * 4) == 0, "batch invariance", n, k, m);
  }
  for (int i : {0, 7, 31}) {  // each row alone
    const std::vector<float> y = run(wt, 1, k, d_x + size_t(i) * k, nullptr, atlas::DType::kBF16);
    expect(std::memcmp(y.data(), y32.data() + size_t(i) * n, size_t(n) * 4) == 0, "single row", n, k, i);
  }
  // n_rows prefix: bitwise the first columns
  if (n > 1) {
    atlas::W4A16GemvWeight pre = wt;
    pre.n = n / 2 + 1;
    const std::vector<float> y = run(pre, 5, k, d_x, nullptr, atlas::DType::kBF16);
    bool same = true;
    for (int i = 0; i < 5; ++i) same &= std::memcmp(&y[size_t(i) * pre.n], &y32[size_t(i) * n], size_t(pre.n) * 4) == 0;
    expect(same, "n_rows prefix", n, k, 5);
  }
  // silu: equals the plain kernel on the host-computed bf16(silu(g)·u) (same f32 formula)
  {
    std::vector<uint16_t> act(g.size());
    for (size_t i = 0; i < g.size(); ++i) {
      const float gf = bf16_value(g[i]), uf = bf16_value(u[i]);
      act[i] = bf16_bits(gf / (1.0f + std::exp(-gf)) * uf);
    }
    uint16_t* d_act; CHECK(cudaMalloc(&d_act, act.size() * 2));
    CHECK(cudaMemcpy(d_act, act.data(), act.size() * 2, cudaMemcpyHostToDevice));
    const std::vector<float> fused = run(wt, 9, k, d_g, d_u, atlas::DType::kBF16);
    const std::vector<float> plain = run(wt, 9, k, d_act, nullptr, atlas::DType::kBF16);
    // host expf may differ from the device's by an ulp, which can flip a bf16 rounding: near-equal
    const std::vector<double> ref_act = reference(w, act, 9);
    expect(rel_err(fused, ref_act, 9, n, n) <= 0.0045 && rel_err(plain, ref_act, 9, n, n) <= 0.0040,
           "silu", n, k, 9);
    cudaFree(d_act);
  }
  // sigmoid gate: x · sigmoid(g) (csrc/sigmoid_gate.cu's expression), near-equal to the plain
  // kernel on the host-computed activation; a gate read with row stride 2K (the G half of a
  // [M, Q | G] buffer) gives bitwise the contiguous gate's result
  {
    std::vector<uint16_t> act(g.size()), qg(2 * g.size());
    for (size_t i = 0; i < g.size(); ++i) {
      const float xf = bf16_value(x[i]), gf = bf16_value(g[i]);
      act[i] = bf16_bits(xf * (1.0f / (1.0f + std::exp(-gf))));
      const size_t row = i / k, col = i % k;
      qg[row * 2 * k + col] = bf16_bits(NAN);              // the Q half: never read
      qg[row * 2 * k + k + col] = g[i];
    }
    uint16_t *d_act, *d_qg;
    CHECK(cudaMalloc(&d_act, act.size() * 2)); CHECK(cudaMalloc(&d_qg, qg.size() * 2));
    CHECK(cudaMemcpy(d_act, act.data(), act.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_qg, qg.data(), qg.size() * 2, cudaMemcpyHostToDevice));
    const std::vector<float> fused = run(wt, 9, k, d_x, d_g, atlas::DType::kBF16, 0, atlas::GemvAct::kSigmoidGate);
    const std::vector<float> strided = run(wt, 9, k, d_x, d_qg + k, atlas::DType::kBF16, 0,
                                           atlas::GemvAct::kSigmoidGate, 2 * int64_t(k));
    const std::vector<double> ref_act = reference(w, act, 9);
    expect(rel_err(fused, ref_act, 9, n, n) <= 0.0045, "sigmoid gate", n, k, 9);
    expect(std::memcmp(fused.data(), strided.data(), fused.size() * 4) == 0, "sigmoid gate strided", n, k, 9);
    cudaFree(d_act); cudaFree(d_qg);
  }
  cudaFree(d_x); cudaFree(d_g); cudaFree(d_u);
}

void run_dual_and_qg(std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  const int k = 256, n1 = 17, n2 = 64, m = 3;
  const HostWeight w1 = random_weight(n1, k, 2e-3f, rng), w2 = random_weight(n2, k, 5.0f, rng);
  std::vector<uint16_t> x(size_t(m) * k);
  for (auto& v : x) v = bf16_bits(normal(rng));
  DeviceWeight d1(w1), d2(w2);
  uint16_t* d_x; CHECK(cudaMalloc(&d_x, x.size() * 2));
  CHECK(cudaMemcpy(d_x, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  atlas::W4A16GemvWeight a1{}, a2{};
  a1.packed = d1.packed; a1.block_scale = d1.scale; a1.global_scale = d1.gs; a1.n = n1;
  a2.packed = d2.packed; a2.block_scale = d2.scale; a2.global_scale = d2.gs; a2.n = n2;
  const std::vector<float> s1 = run(a1, m, k, d_x, nullptr, atlas::DType::kBF16);
  const std::vector<float> s2 = run(a2, m, k, d_x, nullptr, atlas::DType::kBF16);
  atlas::W4A16GemvArgs a{};
  a.x = d_x; a.m = m; a.k = k; a.num_weights = 2; a.w[0] = a1; a.w[1] = a2;
  uint16_t *o1, *o2;
  CHECK(cudaMalloc(&o1, size_t(m) * n1 * 2)); CHECK(cudaMalloc(&o2, size_t(m) * n2 * 2));
  CHECK(cudaMemset(o1, 0xFF, size_t(m) * n1 * 2)); CHECK(cudaMemset(o2, 0xFF, size_t(m) * n2 * 2));
  a.w[0].out = o1; a.w[1].out = o2;
  CHECK(atlas::launch_w4a16_gemv(a, 0));
  CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> h1(size_t(m) * n1), h2(size_t(m) * n2);
  CHECK(cudaMemcpy(h1.data(), o1, h1.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(h2.data(), o2, h2.size() * 2, cudaMemcpyDeviceToHost));
  bool same = true;
  for (size_t i = 0; i < h1.size(); ++i) same &= bf16_value(h1[i]) == s1[i];
  for (size_t i = 0; i < h2.size(); ++i) same &= bf16_value(h2[i]) == s2[i];
  expect(same, "dual == two singles", n1, k, m);
  // qg: 2 heads of hd 16 → rows [q0 g0 q1 g1] → columns [q0 q1 | g0 g1]
  const std::vector<float> qg = run(a2, m, k, d_x, nullptr, atlas::DType::kBF16, 16);
  bool perm = true;
  for (int i = 0; i < m; ++i)
    for (int r = 0; r < n2; ++r) {
      const int h = r / 32, j = r % 32;
      const int col = j < 16 ? h * 16 + j : 32 + h * 16 + (j - 16);
      perm &= qg[size_t(i) * n2 + col] == s2[size_t(i) * n2 + r];
    }
  expect(perm, "qg de-interleave", n2, k, m);
  cudaFree(o1); cudaFree(o2); cudaFree(d_x);
}

}  // namespace

int main() {
  if (atlas_test::no_cuda_device()) return atlas_test::kSkipped;
  std::mt19937 rng(4321);
  // vector path (K % 128 == 0) and generic path (K % 128 != 0); N odd, 1, tails of 16 rows
  for (auto [n, k] : {std::pair{1, 16}, {17, 48}, {33, 4112}, {100, 272}, {77, 2048}, {513, 512}, {40, 5120}}) {
    run_shape(n, k, rng);
    std::printf("w4a16_gemv N=%d K=%d (K segments %d): done\n", n, k, atlas::w4a16_gemv_k_splits(k));
  }
  run_dual_and_qg(rng);
  // launcher argument errors
  atlas::W4A16GemvArgs bad{};
  expect(atlas::launch_w4a16_gemv(bad, 0) == cudaErrorInvalidValue, "null args rejected", 0, 0, 0);
  {  // an activation needs its second operand (and a plain GEMV must not get one)
    const HostWeight w = random_weight(16, 64, 1e-3f, rng);
    DeviceWeight dw(w);
    uint16_t* d_x; CHECK(cudaMalloc(&d_x, 64 * 2 * 2));
    void* d_out; CHECK(cudaMalloc(&d_out, 16 * 4));
    atlas::W4A16GemvArgs a{};
    a.x = d_x; a.m = 1; a.k = 64; a.num_weights = 1;
    a.w[0].packed = dw.packed; a.w[0].block_scale = dw.scale; a.w[0].global_scale = dw.gs;
    a.w[0].out = d_out; a.w[0].n = 16;
    a.act = atlas::GemvAct::kSigmoidGate;
    expect(atlas::launch_w4a16_gemv(a, 0) == cudaErrorInvalidValue, "gate missing rejected", 16, 64, 1);
    a.x2 = d_x; a.x2_stride = 60;
    expect(atlas::launch_w4a16_gemv(a, 0) == cudaErrorInvalidValue, "x2_stride < K rejected", 16, 64, 1);
    a.act = atlas::GemvAct::kPlain; a.x2_stride = 0;
    expect(atlas::launch_w4a16_gemv(a, 0) == cudaErrorInvalidValue, "plain with x2 rejected", 16, 64, 1);
    cudaFree(d_x); cudaFree(d_out);
  }
  std::printf("%s\n", failures ? "FAILED" : "all passed");
  return failures ? 1 : 0;
}
