// C++ driver (no torch): the MTP-head kernels against host re-implementations of
// atlas/reference.py — argmax (ids exact, prob ≤ 1e-4 relative), moe_route (ids exact, weights
// ≤ 1e-5), embedding (bit-exact, bad ids → zero rows), embedding_norm_concat (≤ one bf16 ulp),
// moe_experts (BF16 and NVFP4 stacks, shared-expert epilogue, out-of-range and repeated ids,
// expert groups of more than 32 pairs, K tails; relative error ≤ 5e-3; workspace poisoned). Outputs are poisoned first. Meant for compute-sanitizer (memcheck:
// every index path, incl. split tails and strided rows). Exit 77 = no GPU (ctest: skipped).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "driver.h"
#include "argmax.h"
#include "embedding.h"
#include "moe_experts.h"
#include "moe_route.h"

namespace {

#define EXPECT(cond, ...) do { if (!(cond)) { std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
  std::printf(__VA_ARGS__); std::printf("\n"); return 1; } } while (0)

float bf(float v) { return __bfloat162float(__float2bfloat16(v)); }

// A device buffer holding a copy of a host vector (freed by the caller's scope via ~Dev).
template <typename T> struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(const std::vector<T>& h) : n(h.size()) {
    cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T));
    cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice);
  }
  explicit Dev(size_t count, unsigned char poison = 0xFF) : n(count) {
    cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T));
    cudaMemset(p, poison, std::max<size_t>(n, 1) * sizeof(T));
  }
  std::vector<T> get() const {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
  ~Dev() { cudaFree(p); }
};

// ---- argmax ---------------------------------------------------------------------------------
int test_argmax(std::mt19937& rng) {
  for (const bool f32 : {false, true}) {
    for (const int64_t v : {1L, 255L, 4096L, 4097L, 248077L}) {
      const int64_t r = 5, stride = v + 3;                     // strided rows
      std::normal_distribution<float> normal(0.f, 4.f);
      std::vector<float> x(r * stride);
      for (auto& e : x) e = f32 ? normal(rng) : bf(normal(rng));
      if (v > 8) {                                              // ties across splits: lowest index wins
        float m = -INFINITY;
        for (int64_t j = 0; j < v; ++j) m = std::max(m, x[j]);
        x[v - 1] = m;
        x[v / 3] = m;
      }
      for (int64_t j = 0; j < v; ++j) x[2 * stride + j] = -INFINITY;   // a fully masked row
      x[3 * stride + v - 1] = 1e4f;                                      // the last element wins
      std::vector<__nv_bfloat16> xb(x.size());
      for (size_t i = 0; i < x.size(); ++i) xb[i] = __float2bfloat16(x[i]);
      Dev<float> dx(x);
      Dev<__nv_bfloat16> dxb(xb);
      const int64_t splits = (v + atlas::kArgmaxChunk - 1) / atlas::kArgmaxChunk;
      Dev<float> part{size_t(3 * r * splits)};
      Dev<int64_t> ids{size_t(r)};
      Dev<float> prob{size_t(r)};
      atlas::ArgmaxArgs a{};
      a.logits = f32 ? static_cast<const void*>(dx.p) : static_cast<const void*>(dxb.p);
      a.dtype = f32 ? atlas::DType::kF32 : atlas::DType::kBF16;
      a.rows = r; a.vocab = v; a.row_stride = stride;
      a.partials = part.p; a.ids = ids.p; a.prob = prob.p;
      CHECK(atlas::launch_argmax(a, 0));
      CHECK(cudaDeviceSynchronize());
      const auto hi = ids.get();
      const auto hp = prob.get();
      for (int64_t row = 0; row < r; ++row) {
        const float* xr = x.data() + row * stride;
        int64_t best = 0;
        for (int64_t j = 1; j < v; ++j) if (xr[j] > xr[best]) best = j;
        double z = 0;
        for (int64_t j = 0; j < v; ++j) if (xr[j] != -INFINITY) z += std::exp(double(xr[j]) - xr[best]);
        EXPECT(hi[row] == best, "argmax f32=%d V=%ld row %ld: id %ld, want %ld", f32, v, row, hi[row], best);
        if (row != 2) {
          const double want = 1.0 / z;
          EXPECT(std::fabs(hp[row] - want) <= 1e-4 * want, "argmax prob %g, want %g", hp[row], want);
        }
      }
    }
  }
  std::printf("argmax ok\n");
  return 0;
}

// ---- moe_route --------------------------------------------------------------------------------
int test_moe_route(std::mt19937& rng) {
  struct C { int t, e, k; bool renorm, f32, shared; };
  for (const C c : {C{1, 8, 2, true, false, false}, C{33, 256, 8, true, false, true}, C{5, 512, 10, false, true, false},
                    C{7, 1024, 32, true, false, false}, C{3, 33, 4, true, true, true}}) {
    const int out_k = c.k + (c.shared ? 1 : 0);
    const int64_t stride = c.e + 1;                            // [router | shared gate] logits
    std::normal_distribution<float> normal(0.f, 3.f);
    std::vector<float> x(size_t(c.t) * stride);
    for (auto& v : x) v = c.f32 ? normal(rng) : bf(normal(rng));   // bf16: ties are common
    std::vector<__nv_bfloat16> xb(x.size());
    for (size_t i = 0; i < x.size(); ++i) xb[i] = __float2bfloat16(x[i]);
    Dev<float> dx(x);
    Dev<__nv_bfloat16> dxb(xb);
    Dev<int32_t> ids(size_t(c.t) * out_k);
    Dev<float> w(size_t(c.t) * out_k);
    atlas::MoeRouteArgs a{};
    a.logits = c.f32 ? static_cast<const void*>(dx.p) : static_cast<const void*>(dxb.p);
    a.row_stride = stride;
    a.dtype = c.f32 ? atlas::DType::kF32 : atlas::DType::kBF16;
    a.num_tokens = c.t; a.num_experts = c.e; a.top_k = c.k; a.renormalize = c.renorm; a.shared_slot = c.shared;
    a.ids = ids.p; a.weights = w.p;
    CHECK(atlas::launch_moe_route(a, 0));
    CHECK(cudaDeviceSynchronize());
    const auto hi = ids.get();
    const auto hw = w.get();
    for (int t = 0; t < c.t; ++t) {
      const float* xr = x.data() + size_t(t) * stride;
      std::vector<int> order(c.e);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int i, int j) { return xr[i] > xr[j]; });
      float m = xr[order[0]];
      double z = 0, zsel = 0;
      for (int e = 0; e < c.e; ++e) z += std::exp(double(xr[e]) - m);
      for (int j = 0; j < c.k; ++j) zsel += std::exp(double(xr[order[j]]) - m) / z;
      for (int j = 0; j < c.k; ++j) {
        EXPECT(hi[t * out_k + j] == order[j], "moe_route E=%d row %d slot %d: id %d, want %d", c.e, t, j,
               hi[t * out_k + j], order[j]);
        double p = std::exp(double(xr[order[j]]) - m) / z;
        if (c.renorm) p /= zsel;
        EXPECT(std::fabs(hw[t * out_k + j] - p) <= 1e-5 * p + 1e-7, "moe_route weight %g, want %g", hw[t * out_k + j], p);
      }
      if (c.shared) {
        const double sg = 1.0 / (1.0 + std::exp(-double(xr[c.e])));
        EXPECT(hi[t * out_k + c.k] == c.e && std::fabs(hw[t * out_k + c.k] - sg) <= 1e-6, "moe_route shared slot");
      }
    }
  }
  std::printf("moe_route ok\n");
  return 0;
}

// ---- embedding / embedding_norm_concat ---------------------------------------------------------
int test_embedding(std::mt19937& rng) {
  for (const int h : {2048, 60}) {
    const int64_t v = 1000, t = 9;
    std::normal_distribution<float> normal;
    std::vector<__nv_bfloat16> table(size_t(v) * h);
    for (auto& e : table) e = __float2bfloat16(normal(rng));
    std::vector<int64_t> id(t);
    for (auto& e : id) e = rng() % v;
    id[3] = v; id[5] = -2;                                     // bad ids → zero rows
    Dev<__nv_bfloat16> dt(table);
    Dev<int64_t> di(id);
    Dev<__nv_bfloat16> out(size_t(t) * h);
    atlas::EmbeddingArgs a{};
    a.table = dt.p; a.ids = di.p; a.ids_int64 = true; a.out = out.p; a.num_tokens = t; a.vocab = v; a.hidden = h;
    CHECK(atlas::launch_embedding(a, 0));
    CHECK(cudaDeviceSynchronize());
    const auto ho = out.get();
    for (int64_t r = 0; r < t; ++r) {
      for (int j = 0; j < h; ++j) {
        const bool bad = id[r] < 0 || id[r] >= v;
        const float want = bad ? 0.f : __bfloat162float(table[id[r] * h + j]);
        EXPECT(__bfloat162float(ho[r * h + j]) == want, "embedding row %ld col %d", r, j);
      }
    }
    if (h % 8) continue;
    // embedding_norm_concat: hidden rows strided by 2h; zero-centered weights
    std::vector<__nv_bfloat16> hid(size_t(t) * 2 * h);
    for (auto& e : hid) e = __float2bfloat16(normal(rng) * 10.f);
    std::vector<float> we(h), wh(h);
    for (auto& e : we) e = normal(rng) * 0.1f;
    for (auto& e : wh) e = normal(rng) * 0.1f;
    Dev<__nv_bfloat16> dh(hid);
    Dev<float> dwe(we), dwh(wh);
    Dev<__nv_bfloat16> cat(size_t(t) * 2 * h);
    atlas::EmbeddingNormConcatArgs c{};
    c.table = dt.p; c.ids = di.p; c.ids_int64 = true; c.hidden = dh.p; c.hidden_stride = 2 * h;
    c.w_embed = dwe.p; c.w_hidden = dwh.p; c.out = cat.p; c.num_tokens = t; c.vocab = v; c.hidden_size = h;
    c.eps = 1e-6f; c.zero_centered = true;
    CHECK(atlas::launch_embedding_norm_concat(c, 0));
    CHECK(cudaDeviceSynchronize());
    const auto hc = cat.get();
    for (int64_t r = 0; r < t; ++r) {
      for (int half = 0; half < 2; ++half) {
        const bool bad = id[r] < 0 || id[r] >= v;
        std::vector<float> x(h, 0.f);
        for (int j = 0; j < h; ++j) {
          x[j] = half ? __bfloat162float(hid[r * 2 * h + j]) : (bad ? 0.f : __bfloat162float(table[id[r] * h + j]));
        }
        double ss = 0;
        for (float e : x) ss += double(e) * e;
        const float inv = 1.f / std::sqrt(float(ss / h) + 1e-6f);
        for (int j = 0; j < h; ++j) {
          const float want = bf(x[j] * inv * (1.f + (half ? wh[j] : we[j])));
          const float got = __bfloat162float(hc[r * 2 * h + half * h + j]);
          EXPECT(std::fabs(got - want) <= std::fabs(want) * 0.0079f + 1e-6f, "embedding_norm_concat row %ld half %d col %d: %g vs %g",
                 r, half, j, got, want);
        }
      }
    }
  }
  std::printf("embedding ok\n");
  return 0;
}

// ---- moe_experts --------------------------------------------------------------------------------
const float kE2M1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};

// A stack of E weights [N, K]: host dense floats + device data in the chosen format.
struct Stack {
  std::vector<float> dense;              // [E, N, K] what the kernel multiplies by
  std::vector<__nv_bfloat16> bf16;       // [E, N, K]
  std::vector<uint8_t> packed, scale;    // [E, N, K/2], [E, N, K/16] (e4m3 bytes)
  std::vector<float> gs;                 // [E]
};

Stack make_stack(std::mt19937& rng, int e, int n, int k, bool nvfp4) {
  Stack s;
  s.dense.resize(size_t(e) * n * k);
  if (!nvfp4) {
    std::normal_distribution<float> normal(0.f, 1.f / std::sqrt(float(k)));
    s.bf16.resize(s.dense.size());
    for (size_t i = 0; i < s.dense.size(); ++i) {
      s.bf16[i] = __float2bfloat16(normal(rng));
      s.dense[i] = __bfloat162float(s.bf16[i]);
    }
    return s;
  }
  s.packed.resize(size_t(e) * n * k / 2);
  s.scale.resize(size_t(e) * n * k / 16);
  s.gs.resize(e);
  std::uniform_int_distribution<int> code(0, 15), sc(0x20, 0x48);   // e4m3 scales ≈ 2^-3 .. 2^2
  for (int x = 0; x < e; ++x) s.gs[x] = std::ldexp(1.f, -6 - x % 3);
  for (size_t i = 0; i < s.packed.size(); ++i) s.packed[i] = uint8_t(code(rng) | (code(rng) << 4));
  for (size_t i = 0; i < s.scale.size(); ++i) s.scale[i] = uint8_t(sc(rng));
  for (int x = 0; x < e; ++x) {
    for (int64_t r = 0; r < n; ++r) {
      for (int j = 0; j < k; ++j) {
        const size_t row = size_t(x) * n + r;
        const uint8_t byte = s.packed[row * (k / 2) + j / 2];
        const int c = (j % 2) ? byte >> 4 : byte & 0xF;
        const float mag = kE2M1[c & 7] * ((c & 8) ? -1.f : 1.f);
        const __half_raw hr = __nv_cvt_fp8_to_halfraw(s.scale[row * (k / 16) + j / 16], __NV_E4M3);
        s.dense[row * k + j] = mag * __half2float(__half(hr)) * s.gs[x];
      }
    }
  }
  return s;
}

struct StackDev {
  Dev<__nv_bfloat16> bf16;
  Dev<uint8_t> packed, scale;
  Dev<float> gs;
  explicit StackDev(const Stack& s) : bf16(s.bf16), packed(s.packed), scale(s.scale), gs(s.gs) {}
  atlas::ExpertStack view(bool nvfp4) const {
    atlas::ExpertStack v{};
    if (nvfp4) { v.weight = packed.p; v.block_scale = scale.p; v.global_scale = gs.p; }
    else { v.weight = bf16.p; }
    return v;
  }
};

int test_moe_experts(std::mt19937& rng) {
  struct C { int t, k, e, h, inter; bool nvfp4, shared, out_bf16 = false; };
  for (const C c : {C{1, 8, 16, 2048, 512, true, true}, C{6, 8, 16, 2048, 512, true, true},
                    C{4, 2, 8, 256, 64, false, false}, C{3, 10, 12, 512, 128, false, true},
                    C{2, 4, 6, 96, 32, true, false}, C{5, 3, 9, 256, 64, true, false, true},
                    C{2, 20, 24, 256, 64, true, true},
                    C{3, 6, 4, 96, 32, true, true}, C{3, 6, 4, 96, 32, false, false},   // k > E: repeated ids
                    C{40, 4, 4, 384, 160, true, false}, C{40, 4, 4, 128, 64, false, true},   // 40-pair groups: 2 passes
                    C{16, 9, 12, 256, 128, true, false}, C{17, 9, 12, 256, 128, true, true}}) {   // T·k 144: indexed, 153: grouped
    const Stack g = make_stack(rng, c.e, c.inter, c.h, c.nvfp4), u = make_stack(rng, c.e, c.inter, c.h, c.nvfp4),
                d = make_stack(rng, c.e, c.h, c.inter, c.nvfp4);
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<float> uni(0.f, 1.f);
    std::vector<__nv_bfloat16> x(size_t(c.t) * c.h), shared(size_t(c.t) * c.h), sgate(size_t(c.t) * 3);
    for (auto& v : x) v = __float2bfloat16(normal(rng));
    for (auto& v : shared) v = __float2bfloat16(normal(rng));
    for (auto& v : sgate) v = __float2bfloat16(normal(rng));
    std::vector<int32_t> ids(size_t(c.t) * c.k);
    std::vector<float> w(ids.size());
    for (int t = 0; t < c.t; ++t) {
      std::vector<int> perm(c.e);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int j = 0; j < c.k; ++j) { ids[t * c.k + j] = perm[j % c.e]; w[t * c.k + j] = uni(rng); }
    }
    ids[c.k - 1] = c.e + 3;                                     // out of range: contributes nothing
    if (c.t > 1) ids[c.k] = -1;

    // host reference (reference.moe_experts + the shared epilogue)
    std::vector<float> want(size_t(c.t) * c.h, 0.f);
    for (int t = 0; t < c.t; ++t) {
      for (int j = 0; j < c.k; ++j) {
        const int ex = ids[t * c.k + j];
        if (ex < 0 || ex >= c.e) continue;
        std::vector<float> a(c.inter);
        for (int n = 0; n < c.inter; ++n) {
          double gg = 0, uu = 0;
          for (int q = 0; q < c.h; ++q) {
            const float xv = __bfloat162float(x[t * c.h + q]);
            gg += double(g.dense[(size_t(ex) * c.inter + n) * c.h + q]) * xv;
            uu += double(u.dense[(size_t(ex) * c.inter + n) * c.h + q]) * xv;
          }
          const float gb = bf(float(gg)), ub = bf(float(uu));
          a[n] = bf(gb / (1.f + std::exp(-gb)) * ub);
        }
        for (int n = 0; n < c.h; ++n) {
          double dd = 0;
          for (int q = 0; q < c.inter; ++q) dd += double(d.dense[(size_t(ex) * c.h + n) * c.inter + q]) * a[q];
          want[t * c.h + n] += w[t * c.k + j] * bf(float(dd));
        }
      }
      if (c.out_bf16) {
        for (int n = 0; n < c.h; ++n) want[t * c.h + n] = bf(want[t * c.h + n]);
      }
      if (c.shared) {
        const float sg = __bfloat162float(sgate[t * 3]);
        for (int n = 0; n < c.h; ++n) {
          want[t * c.h + n] = bf(want[t * c.h + n] + __bfloat162float(shared[t * c.h + n]) / (1.f + std::exp(-sg)));
        }
      }
    }

    const StackDev dg(g), du(u), dd(d);
    Dev<__nv_bfloat16> dx(x), dshared(shared), dsgate(sgate);
    Dev<int32_t> did(ids);
    Dev<float> dw(w);
    Dev<uint8_t> workspace(atlas::moe_experts_workspace_bytes(c.t, c.k, c.e, c.h, c.inter));   // 0xFF: NaN act / d
    EXPECT(workspace.n > 0, "moe_experts_workspace_bytes rejected t=%d k=%d E=%d", c.t, c.k, c.e);
    const bool bf16_out = c.shared || c.out_bf16;
    Dev<float> out_f(bf16_out ? 0 : size_t(c.t) * c.h);
    Dev<__nv_bfloat16> out_b(bf16_out ? size_t(c.t) * c.h : 0);
    atlas::MoeExpertsArgs a{};
    a.x = dx.p; a.ids = did.p; a.weights = dw.p;
    a.gate = dg.view(c.nvfp4); a.up = du.view(c.nvfp4); a.down = dd.view(c.nvfp4); a.nvfp4 = c.nvfp4;
    a.workspace = workspace.p;
    if (c.shared) { a.shared = dshared.p; a.shared_gate = dsgate.p; a.shared_gate_stride = 3; a.out = out_b.p; }
    else if (c.out_bf16) { a.out = out_b.p; a.out_bf16 = true; }
    else { a.out = out_f.p; }
    a.num_tokens = c.t; a.top_k = c.k; a.num_experts = c.e; a.hidden = c.h; a.inter = c.inter;
    CHECK(atlas::launch_moe_experts(a, 0));
    CHECK(cudaDeviceSynchronize());
    std::vector<float> got(want.size());
    if (bf16_out) { const auto o = out_b.get(); for (size_t i = 0; i < o.size(); ++i) got[i] = __bfloat162float(o[i]); }
    else { got = out_f.get(); }
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT(std::isfinite(got[i]), "moe_experts: non-finite output at %zu", i);
      num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
      den += double(want[i]) * want[i];
    }
    const double rel = std::sqrt(num / std::max(den, 1e-30));
    EXPECT(rel < 5e-3, "moe_experts t=%d k=%d E=%d h=%d I=%d nvfp4=%d shared=%d: rel err %g", c.t, c.k, c.e, c.h, c.inter,
           c.nvfp4, c.shared, rel);
  }
  std::printf("moe_experts ok\n");
  return 0;
}

}  // namespace

int main() {
  if (atlas_test::no_cuda_device()) return atlas_test::kSkipped;
  std::mt19937 rng(1234);
  if (test_argmax(rng) || test_moe_route(rng) || test_embedding(rng) || test_moe_experts(rng)) return 1;
  std::printf("all MTP kernel checks passed\n");
  return 0;
}
