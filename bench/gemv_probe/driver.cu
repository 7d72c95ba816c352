// gemv_probe driver: where the one-row GEMV's time goes, without hardware counters.
//
//   driver [sweep|x] [M]      (built by run.sh against make_probe.py's instrumented kernel)
//
// Per shape (the Qwen3.6 bench shapes, tiled layout, random bytes with finite e4m3 scales):
//   gemv_us   graph-replayed µs per call, weights rotated over ≥ 4 copies (≥ 600 MB in total)
//   read_us   a plain 16-byte-load read of the same bytes, graph-replayed the same way
//   floor_us  bytes / 4.2 TB/s
// then one probed cold call: CTA start / end spread (%globaltimer), effective SM clock, per-SM
// CTA counts with their last end time, and the phase split in SM cycles (p10/p50/p90):
//   issue (weight prologue), pdlwait, acts (activation prologue), chunk0 (first chunk landed),
//   loop (main loop), store (split-K reduction + stores).
// `sweep`: the same timing for every (splits, warps) the launcher could pick, and (M = 1) for
// K split over the warps of one CTA (ws S: S warps per tile).
//
//   driver moe [T]            (session 18) moe_experts' expert-indexed launches at T tokens
//                             (Qwen3.6-35B-A3B: h 2048, I 512, k = 9 slots per token, the shared
//                             expert as expert 256 in slot 8; checkpoint-layout NVFP4 stacks
//                             rotated over 4 copies): gate+up (dual, T·9 slots) and the silu down
//                             each timed alone, graph-replayed, with one probed cold call each.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "../probe_common.cuh"
#include "w4a16_gemv.h"

namespace atlas {
void set_probe(unsigned long long* p);
extern int g_force_splits, g_force_warps, g_force_wsplits, g_last_splits, g_last_warps;
}  // namespace atlas
using namespace atlas;

// p: [n16] 16-byte units, 4 loads in flight per thread; out written only on an impossible value.
__global__ void read_bytes(const uint4* __restrict__ p, size_t n16, float* out) {
  if (read_units(p, n16) == 0x12345678u) out[0] = 1.0f;
}

struct Shape { const char* name; int n, k; };

// h: [ctas][16] as make_probe.py writes it.
void report(const std::vector<unsigned long long>& h, int ctas) {
  unsigned long long t0 = ~0ull, tend = 0;
  for (int c = 0; c < ctas; ++c) { t0 = std::min(t0, h[c * 16]); tend = std::max(tend, h[c * 16 + 6]); }
  std::vector<double> start, end, clock;
  std::vector<int> count(256, 0);
  std::vector<double> last(256, 0.0);
  for (int c = 0; c < ctas; ++c) {
    const unsigned long long* p = &h[c * 16];
    start.push_back((p[0] - t0) / 1e3);
    end.push_back((p[6] - t0) / 1e3);
    const double ns = double(p[6] - p[0]);
    if (ns > 2000) clock.push_back((p[14] - p[8]) / ns);
    const int sm = int(p[7]) & 255;
    ++count[sm];
    last[sm] = std::max(last[sm], end.back());
  }
  printf("    span %.2f us; CTA start p50/p100 %.2f/%.2f, end p0/p50/p100 %.2f/%.2f/%.2f; SM clock p50 %.2f GHz\n",
         (tend - t0) / 1e3, quantile(start, 0.5), quantile(start, 1.0), quantile(end, 0.0), quantile(end, 0.5),
         quantile(end, 1.0), clock.empty() ? 0.0 : quantile(clock, 0.5));
  printf("    per SM (CTAs: SMs, mean last end us):");
  for (int n = 1; n < 64; ++n) {
    int sms = 0;
    double sum = 0;
    for (int sm = 0; sm < 256; ++sm) if (count[sm] == n) { ++sms; sum += last[sm]; }
    if (sms) printf("  %d: %d, %.1f", n, sms, sum / sms);
  }
  printf("\n    phase cycles p10/p50/p90:");
  const char* names[6] = {"issue", "pdlwait", "acts", "chunk0", "loop", "store"};
  for (int ph = 0; ph < 6; ++ph) {
    std::vector<long long> d;
    for (int c = 0; c < ctas; ++c) d.push_back((long long)(h[c * 16 + 9 + ph] - h[c * 16 + 8 + ph]));
    printf("  %s %lld/%lld/%lld", names[ph], quantile(d, 0.1), quantile(d, 0.5), quantile(d, 0.9));
  }
  printf("\n");
}

// `moe T`: see the header. Returns the process exit code.
int moe_main(int T) {
  constexpr int h = 2048, inter = 512, k = 9, routed = 256, E = routed + 1, kCopies = 4;
  const int slots = T * k;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t gu_packed = size_t(E) * inter * h / 2, gu_scales = size_t(E) * inter * h / 16;   // one of gate / up
  const size_t dn_packed = size_t(E) * h * inter / 2, dn_scales = size_t(E) * h * inter / 16;
  const size_t per = 2 * (gu_packed + gu_scales) + dn_packed + dn_scales;   // one copy of the three stacks
  uint8_t* w;
  CK(cudaMalloc(&w, per * kCopies));
  fill_bytes<<<4096, 256, 0, s>>>(w, per * kCopies, 17);
  float* gs;
  CK(cudaMalloc(&gs, E * 4));
  std::vector<float> ones(E, 1.0f);
  CK(cudaMemcpy(gs, ones.data(), E * 4, cudaMemcpyHostToDevice));
  struct Stack { const uint8_t* packed; const uint8_t* scale; };
  auto stack = [&](int c, int i) {   // copy c, stack i: 0 gate, 1 up, 2 down
    uint8_t* base = w + size_t(c) * per + size_t(i < 2 ? i : 2) * (gu_packed + gu_scales);
    const size_t packed = i < 2 ? gu_packed : dn_packed, scales = i < 2 ? gu_scales : dn_scales;
    fill_scales<<<256, 256, 0, s>>>(base + packed, scales);
    return Stack{base, base + packed};
  };
  std::vector<Stack> st;
  for (int c = 0; c < kCopies; ++c) for (int i = 0; i < 3; ++i) st.push_back(stack(c, i));
  std::vector<int32_t> ids(slots);
  std::mt19937 rng(11);
  for (int t = 0; t < T; ++t) {
    std::vector<int> perm(routed);
    for (int i = 0; i < routed; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int j = 0; j < k - 1; ++j) ids[t * k + j] = perm[j];
    ids[t * k + k - 1] = routed;   // the shared expert
  }
  int32_t* d_ids;
  uint8_t *x, *g, *u, *d;
  CK(cudaMalloc(&d_ids, slots * 4));
  CK(cudaMemcpy(d_ids, ids.data(), slots * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&x, size_t(T) * h * 2));
  CK(cudaMalloc(&g, size_t(slots) * inter * 2));
  CK(cudaMalloc(&u, size_t(slots) * inter * 2));
  CK(cudaMalloc(&d, size_t(slots) * h * 2));
  fill_bytes<<<64, 256, 0, s>>>(x, size_t(T) * h * 2, 5);   // random bf16 bits: timing only
  auto weight = [&](const Stack& sk, void* out, int n) {
    W4A16GemvWeight wt;
    wt.packed = sk.packed; wt.block_scale = sk.scale; wt.global_scale = gs; wt.out = out; wt.n = n;
    return wt;
  };
  auto gate_up = [&](int c) {
    W4A16GemvArgs a;
    a.x = x; a.m = 1; a.k = h; a.num_weights = 2;
    a.w[0] = weight(st[c * 3], g, inter);
    a.w[1] = weight(st[c * 3 + 1], u, inter);
    a.slots.ids = d_ids; a.slots.count = slots; a.slots.num_experts = E;
    a.slots.packed_stride[0] = a.slots.packed_stride[1] = int64_t(inter) * h / 2;
    a.slots.scale_stride[0] = a.slots.scale_stride[1] = int64_t(inter) * h / 16;
    a.slots.x_stride = T > 1 ? h : 0; a.slots.x_div = k; a.slots.out_stride = inter;
    return a;
  };
  auto down = [&](int c) {
    W4A16GemvArgs a;
    a.x = g; a.x2 = u; a.act = GemvAct::kSiluMul; a.m = 1; a.k = inter; a.num_weights = 1;
    a.w[0] = weight(st[c * 3 + 2], d, h);
    a.slots.ids = d_ids; a.slots.count = slots; a.slots.num_experts = E;
    a.slots.packed_stride[0] = int64_t(h) * inter / 2; a.slots.scale_stride[0] = int64_t(h) * inter / 16;
    a.slots.x_stride = inter; a.slots.out_stride = h; a.slots.ids_ready = true;
    return a;
  };
  const int max_ctas = 70000;
  unsigned long long* probe_buf;
  CK(cudaMalloc(&probe_buf, size_t(max_ctas) * 16 * 8));
  printf("moe T = %d (%d slots)\n%-16s %8s %6s   (the launch's plan)\n", T, slots, "launch", "us", "ctas");
  for (int which = 0; which < 2; ++which) {
    auto args = [&](int c) { return which == 0 ? gate_up(c) : down(c); };
    for (int c = 0; c < kCopies; ++c) CK(launch_w4a16_gemv(args(c), s));   // instantiation, smem opt-in
    CK(cudaStreamSynchronize(s));
    const float us = graph_us(s, 40, [&](int r) { CK(launch_w4a16_gemv(args(r % kCopies), s)); });
    CK(cudaMemset(probe_buf, 0, size_t(max_ctas) * 16 * 8));
    set_probe(probe_buf);
    CK(launch_w4a16_gemv(args(1), s));
    CK(cudaStreamSynchronize(s));
    set_probe(nullptr);
    std::vector<unsigned long long> hbuf(size_t(max_ctas) * 16);
    CK(cudaMemcpy(hbuf.data(), probe_buf, hbuf.size() * 8, cudaMemcpyDeviceToHost));
    int ctas = 0;
    while (ctas < max_ctas && hbuf[ctas * 16] != 0) ++ctas;   // skipped slots' CTAs: none here (every id valid)
    printf("%-16s %8.2f %6d   (splits %d [< 0: over warps], warps %d)\n", which == 0 ? "gate+up" : "down (silu)", us,
           ctas, g_last_splits, g_last_warps);
    if (ctas > 0) report(hbuf, ctas);
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "moe") return moe_main(argc > 2 ? atoi(argv[2]) : 1);
  const bool sweep = argc > 1 && std::string(argv[1]) == "sweep";
  const int M = argc > 2 ? atoi(argv[2]) : 1;
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const Shape shapes[] = {{"35B expert down", 2048, 512}, {"35B shared", 512, 2048}, {"35B o", 2048, 4096},
                          {"35B q+g+k+v", 9216, 2048},    {"27B o", 5120, 6144},     {"27B q+g+k+v", 14336, 5120},
                          {"27B down", 5120, 17408},      {"27B gate_up", 34816, 5120}, {"35B lm", 248320, 2048},
                          {"27B lm", 248320, 5120}};
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float *gscale, *sink;
  CK(cudaMalloc(&gscale, 4));
  CK(cudaMalloc(&sink, 4));
  const float one = 1.0f;
  CK(cudaMemcpy(gscale, &one, 4, cudaMemcpyHostToDevice));
  printf("M = %d\n%-16s %7s %6s %8s %8s %8s %6s\n", M, "shape", "MB", "copies", "gemv_us", "read_us", "floor_us", "ctas");
  for (const Shape& sh : shapes) {
    const size_t packed = size_t(sh.n) * sh.k / 2, scales = size_t(sh.n) * sh.k / 16, per = packed + scales;
    const int copies = std::max(4, std::min(64, int(600e6 / per)));
    uint8_t *w, *x, *y;
    CK(cudaMalloc(&w, per * copies));
    CK(cudaMalloc(&x, size_t(M) * sh.k * 2));
    CK(cudaMalloc(&y, size_t(M) * sh.n * 4));
    fill_bytes<<<1024, 256, 0, s>>>(w, per * copies, 17);
    for (int c = 0; c < copies; ++c) fill_scales<<<256, 256, 0, s>>>(w + c * per + packed, scales);
    fill_bytes<<<64, 256, 0, s>>>(x, size_t(M) * sh.k * 2, 5);   // random bf16 bits: timing only
    auto args = [&](int c) {   // copy c as a tiled (chunk-major) weight
      W4A16GemvArgs a;
      a.x = x; a.m = M; a.k = sh.k; a.num_weights = 1;
      a.w[0].packed = w + c * per; a.w[0].block_scale = w + c * per + packed;
      a.w[0].tiled = true; a.w[0].rows = sh.n; a.w[0].global_scale = gscale; a.w[0].out = y; a.w[0].n = sh.n;
      return a;
    };
    const int reps = std::max(copies, 40);
    auto gemv = [&] {
      for (int c = 0; c < copies; ++c) CK(launch_w4a16_gemv(args(c), s));   // instantiation, smem opt-in
      CK(cudaStreamSynchronize(s));
      return graph_us(s, reps, [&](int r) { CK(launch_w4a16_gemv(args(r % copies), s)); });
    };
    const float gemv_us = gemv();
    const int rblocks = int(std::min<size_t>(size_t(sms) * 8, (per / 16 + 511) / 512));
    const float read_us = graph_us(s, reps, [&](int r) {
      read_bytes<<<rblocks, 512, 0, s>>>(reinterpret_cast<const uint4*>(w + (r % copies) * per), per / 16, sink);
    });
    const int max_ctas = 70000;
    unsigned long long* probe_buf;
    CK(cudaMalloc(&probe_buf, size_t(max_ctas) * 16 * 8));
    CK(cudaMemset(probe_buf, 0, size_t(max_ctas) * 16 * 8));
    set_probe(probe_buf);
    CK(launch_w4a16_gemv(args(copies / 2), s));
    CK(cudaStreamSynchronize(s));
    set_probe(nullptr);
    std::vector<unsigned long long> h(size_t(max_ctas) * 16);
    CK(cudaMemcpy(h.data(), probe_buf, h.size() * 8, cudaMemcpyDeviceToHost));
    int ctas = 0;
    while (ctas < max_ctas && h[ctas * 16] != 0) ++ctas;
    printf("%-16s %7.2f %6d %8.2f %8.2f %8.2f %6d   (splits %d [< 0: over warps], warps %d)\n", sh.name, per / 1e6, copies, gemv_us,
           read_us, per / 4.2e6, ctas, g_last_splits, g_last_warps);
    if (ctas > 0) report(h, ctas);
    if (sweep) {
      const int segs = w4a16_gemv_k_splits(sh.k);
      printf("    sweep (splits, warps: us):");
      for (const int sp : {1, segs / 2, segs}) {
        if (sp < 1 || (sp == segs / 2 && (sp == 1 || sp == segs))) continue;
        for (const int wp : {1, 2, 4}) {
          g_force_splits = sp;
          g_force_warps = wp;
          printf("  s%d w%d %.2f", sp, wp, gemv());
        }
      }
      g_force_splits = g_force_warps = 0;
      if (M == 1) {   // K split over the warps of one CTA (S warps per tile, spc = segs / S ∈ {1, 2})
        for (const int ws : {segs / 2, segs}) {
          if (ws < 2) continue;
          g_force_wsplits = ws;
          printf("  ws%d %.2f", ws, gemv());
        }
        g_force_wsplits = 0;
      }
      printf("\n");
    }
    CK(cudaFree(probe_buf));
    CK(cudaFree(w));
    CK(cudaFree(x));
    CK(cudaFree(y));
  }
  return 0;
}
