// C++ driver (no torch): launch_paged_decode against a float64 host re-implementation of the
// reference (causal GQA attention over the paged cache), for every head dim, both KV dtypes,
// 1/2/4 MMA row tiles and two row groups, block sizes 7/16/528, single- and multi-split
// sequences in split and fused mode, seq_len 0. Every cache slot a sequence does not own holds
// NaN (bf16 0xFFFF, e4m3 0x7F, scale NaN), unused block-table entries an out-of-range id, and
// the output starts as NaN: reading past a sequence or skipping a write fails the check. The
// last cases feed bad block ids and seq_lens: they must run clean under compute-sanitizer
// (memcheck: no read outside the pools; racecheck: the shared-memory pipeline).
// Exit 77 = no GPU (ctest: skipped).
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
#include "paged_decode.h"

namespace {


struct Case { int batch, max_len, bs, hd, nq, nkv, q_len; bool fp8; bool bad_ids; };

template <typename T>
struct DevBuf {
  T* p = nullptr;
  explicit DevBuf(size_t n) { if (n) cudaMalloc(&p, n * sizeof(T)); }
  ~DevBuf() { cudaFree(p); }
};

int run_case(const Case& c, std::mt19937& rng) {
  const int group = c.nq / c.nkv;
  const int max_blocks = (c.max_len + c.bs - 1) / c.bs + 1;
  std::vector<int> seq_lens(c.batch);
  std::uniform_int_distribution<int> len_dist(c.q_len, c.max_len);
  for (int b = 0; b < c.batch; ++b) seq_lens[b] = len_dist(rng);
  seq_lens.back() = c.max_len;
  if (c.batch > 2) seq_lens[0] = 0;                                  // empty sequence
  int num_blocks = 3;
  for (int n : seq_lens) num_blocks += (n + c.bs - 1) / c.bs;
  std::vector<int> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> table(size_t(c.batch) * max_blocks, 1 << 30);  // unused entries: out of range
  std::vector<char> owned(size_t(num_blocks) * c.bs, 0);
  for (int b = 0, at = 0; b < c.batch; ++b) {
    const int used = (seq_lens[b] + c.bs - 1) / c.bs;
    for (int i = 0; i < used; ++i) table[size_t(b) * max_blocks + i] = perm[at++];
    for (int p = 0; p < seq_lens[b]; ++p) owned[size_t(table[size_t(b) * max_blocks + p / c.bs]) * c.bs + p % c.bs] = 1;
  }

  // caches (bytes), dequantized copies (host reference) and scales
  const size_t slots = size_t(num_blocks) * c.bs, row = size_t(c.nkv) * c.hd, elem = c.fp8 ? 1 : 2;
  std::vector<uint8_t> cache[2] = {std::vector<uint8_t>(slots * row * elem), std::vector<uint8_t>(slots * row * elem)};
  std::vector<double> deq[2] = {std::vector<double>(slots * row), std::vector<double>(slots * row)};
  std::vector<float> scale[2] = {std::vector<float>(slots * c.nkv), std::vector<float>(slots * c.nkv)};
  std::normal_distribution<float> normal;
  const float mag[2] = {3.f, 40.f};
  for (int kv = 0; kv < 2; ++kv)
    for (size_t s = 0; s < slots; ++s)
      for (int h = 0; h < c.nkv; ++h) {
        const size_t base = (s * c.nkv + h) * c.hd;
        std::vector<float> x(c.hd);
        float amax = 0.f;
        for (int i = 0; i < c.hd; ++i) {
          x[i] = __bfloat162float(__float2bfloat16(normal(rng) * mag[kv]));
          amax = std::fmax(amax, std::fabs(x[i]));
        }
        const float sc = amax > 0.f ? amax / 448.f : 1.f;
        scale[kv][s * c.nkv + h] = owned[s] ? sc : NAN;
        for (int i = 0; i < c.hd; ++i) {
          if (c.fp8) {
            const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(x[i] / sc, __NV_SATFINITE, __NV_E4M3);
            cache[kv][base + i] = owned[s] ? q : 0x7F;
            __nv_fp8_e4m3 f; f.__x = q;
            deq[kv][base + i] = double(float(f)) * sc;
          } else {
            const __nv_bfloat16 v = __float2bfloat16(x[i]);
            uint16_t bits; std::memcpy(&bits, &v, 2);
            if (!owned[s]) bits = 0xFFFF;                                // NaN
            std::memcpy(&cache[kv][(base + i) * 2], &bits, 2);
            deq[kv][base + i] = x[i];
          }
        }
      }
  std::vector<__nv_bfloat16> query(size_t(c.batch) * c.q_len * c.nq * c.hd);
  std::vector<float> qf(query.size());
  for (size_t i = 0; i < query.size(); ++i) { query[i] = __float2bfloat16(normal(rng)); qf[i] = __bfloat162float(query[i]); }
  const float softmax_scale = 1.f / std::sqrt(float(c.hd));

  // host reference: out [B, q_len, nq, hd], lse [B, q_len, nq]
  std::vector<double> ref(query.size(), 0.0), ref_lse(size_t(c.batch) * c.q_len * c.nq, -INFINITY);
  if (!c.bad_ids)
    for (int b = 0; b < c.batch; ++b)
      for (int j = 0; j < c.q_len; ++j)
        for (int h = 0; h < c.nq; ++h) {
          const int last = seq_lens[b] - c.q_len + j, kvh = h / group;
          if (last < 0) continue;
          const size_t qrow = ((size_t(b) * c.q_len + j) * c.nq + h) * c.hd;
          std::vector<double> s(last + 1);
          double m = -INFINITY;
          for (int p = 0; p <= last; ++p) {
            const size_t slot = size_t(table[size_t(b) * max_blocks + p / c.bs]) * c.bs + p % c.bs;
            double dot = 0;
            for (int i = 0; i < c.hd; ++i) dot += qf[qrow + i] * deq[0][(slot * c.nkv + kvh) * c.hd + i];
            s[p] = dot * softmax_scale;
            m = std::max(m, s[p]);
          }
          double l = 0;
          for (int p = 0; p <= last; ++p) {
            const size_t slot = size_t(table[size_t(b) * max_blocks + p / c.bs]) * c.bs + p % c.bs;
            const double w = std::exp(s[p] - m);
            l += w;
            for (int i = 0; i < c.hd; ++i) ref[qrow + i] += w * deq[1][(slot * c.nkv + kvh) * c.hd + i];
          }
          for (int i = 0; i < c.hd; ++i) ref[qrow + i] /= l;
          ref_lse[(size_t(b) * c.q_len + j) * c.nq + h] = m + std::log(l);
        }
  if (c.bad_ids) {                                                     // memory safety only
    table[0] = -7;
    table[max_blocks - 1] = num_blocks;
    seq_lens[0] = 1 << 30;
    if (c.batch > 1) seq_lens[1] = -5;
  }

  const int splits = atlas::paged_decode_max_splits(int64_t(max_blocks) * c.bs, c.nkv);
  const int rows = group * c.q_len;
  DevBuf<__nv_bfloat16> d_q(query.size()), d_out(query.size());
  DevBuf<uint8_t> d_k(cache[0].size()), d_v(cache[1].size());
  DevBuf<float> d_ks(c.fp8 ? slots * c.nkv : 0), d_vs(c.fp8 ? slots * c.nkv : 0), d_lse(ref_lse.size());
  DevBuf<float> d_po(size_t(c.batch) * c.nkv * splits * rows * c.hd), d_plse(size_t(c.batch) * c.nkv * splits * rows);
  DevBuf<int32_t> d_table(table.size()), d_lens(seq_lens.size());
  CHECK(cudaMemcpy(d_q.p, query.data(), query.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_k.p, cache[0].data(), cache[0].size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_v.p, cache[1].data(), cache[1].size(), cudaMemcpyHostToDevice));
  if (c.fp8) {
    CHECK(cudaMemcpy(d_ks.p, scale[0].data(), scale[0].size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_vs.p, scale[1].data(), scale[1].size() * 4, cudaMemcpyHostToDevice));
  }
  CHECK(cudaMemcpy(d_table.p, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_lens.p, seq_lens.data(), seq_lens.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemset(d_out.p, 0xFF, query.size() * 2));                 // NaN
  CHECK(cudaMemset(d_lse.p, 0xFF, ref_lse.size() * 4));

  atlas::PagedDecodeArgs a{};
  a.query = d_q.p; a.k_cache = d_k.p; a.v_cache = d_v.p; a.k_scale = d_ks.p; a.v_scale = d_vs.p;
  a.block_tables = d_table.p; a.seq_lens = d_lens.p; a.out = d_out.p; a.lse = d_lse.p;
  a.partial_o = d_po.p; a.partial_lse = d_plse.p;
  a.q_stride_b = int64_t(c.q_len) * c.nq * c.hd; a.q_stride_t = int64_t(c.nq) * c.hd;
  a.batch = c.batch; a.q_len = c.q_len; a.num_q_heads = c.nq; a.num_kv_heads = c.nkv; a.head_dim = c.hd;
  a.block_size = c.bs; a.num_blocks = num_blocks; a.max_blocks = max_blocks; a.max_splits = splits;
  a.softmax_scale = softmax_scale; a.kv_dtype = c.fp8 ? atlas::DType::kE4M3 : atlas::DType::kBF16;
  CHECK(atlas::launch_paged_decode(a, 0));
  CHECK(cudaDeviceSynchronize());
  if (c.bad_ids) {
    std::printf("ok   bad ids/seq_lens B=%d L=%d hd=%d %s: no fault\n", c.batch, c.max_len, c.hd, c.fp8 ? "fp8" : "bf16");
    return 0;
  }
  std::vector<__nv_bfloat16> out(query.size());
  std::vector<float> lse(ref_lse.size());
  CHECK(cudaMemcpy(out.data(), d_out.p, out.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(lse.data(), d_lse.p, lse.size() * 4, cudaMemcpyDeviceToHost));
  double num = 0, den = 0, lse_err = 0;
  bool finite = true;
  for (size_t i = 0; i < out.size(); ++i) {
    const double o = __bfloat162float(out[i]);
    finite &= std::isfinite(o);
    num += (o - ref[i]) * (o - ref[i]);
    den += ref[i] * ref[i];
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(ref_lse[i])) { finite &= std::isinf(lse[i]) && lse[i] < 0; continue; }
    lse_err = std::max(lse_err, std::fabs(lse[i] - ref_lse[i]));
  }
  const double err = std::sqrt(num / std::max(den, 1e-300));
  const bool ok = finite && err < 1e-2 && lse_err < 2e-3;
  std::printf("%s B=%d L=%d bs=%d hd=%d heads=%d/%d q_len=%d %s: rel err %.2e, lse err %.2e%s\n",
              ok ? "ok  " : "FAIL", c.batch, c.max_len, c.bs, c.hd, c.nq, c.nkv, c.q_len, c.fp8 ? "fp8" : "bf16",
              err, lse_err, finite ? "" : " (non-finite output)");
  return ok ? 0 : 1;
}

}  // namespace

int main() {
  if (atlas_test::no_cuda_device()) return atlas_test::kSkipped;
  std::mt19937 rng(1234);
  const Case cases[] = {
      {1, 1, 16, 128, 16, 2, 1, false, false},
      {3, 17, 16, 256, 16, 2, 1, false, false},
      {3, 17, 16, 256, 16, 2, 1, true, false},
      {3, 300, 7, 64, 8, 8, 3, false, false},      // bs 7, 3 splits, group 1
      {3, 300, 7, 64, 8, 8, 3, true, false},
      {4, 1000, 528, 128, 24, 4, 8, false, false}, // 48 rows → 4 row tiles
      {4, 1000, 528, 128, 24, 4, 8, true, false},
      {2, 600, 16, 256, 16, 2, 8, true, false},    // 64 rows
      {2, 600, 16, 64, 16, 1, 8, false, false},    // 128 rows → 2 row groups
      {2, 600, 16, 64, 16, 1, 8, true, false},
      {2, 5000, 16, 256, 16, 2, 2, false, false},  // 20 splits, 16 rows → 1 row tile, grouped combine
      {2, 5000, 16, 256, 16, 2, 2, true, false},
      {1, 9000, 16, 64, 8, 1, 2, false, false},    // 36 splits: grouped combine, 2 CTAs per row
      {1, 9000, 16, 64, 8, 1, 2, true, false},
      {1, 32000, 16, 256, 16, 2, 1, false, false}, // 125 splits: 16 groups, the last of 5
      {48, 2500, 16, 64, 16, 8, 1, false, false},  // fused mode (48·8·2 ≥ 256 CTAs), 2 groups
      {48, 2500, 16, 64, 16, 8, 1, true, false},
      {3, 400, 16, 128, 8, 2, 1, false, true},     // bad ids / seq_lens: memory safety
      {3, 400, 16, 256, 8, 2, 1, true, true},
  };
  int failures = 0;
  for (const Case& c : cases) failures += run_case(c, rng);
  std::printf("%d of %zu cases failed\n", failures, sizeof(cases) / sizeof(cases[0]));
  return failures ? 1 : 0;
}
