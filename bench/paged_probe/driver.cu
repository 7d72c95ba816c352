// paged_probe driver: where paged_decode's time goes, without hardware counters.
//
//   driver [full|time]        (built by run.sh against make_probe.py's instrumented kernel;
//                              `time`: the timing and launch lines only, for the
//                              -DPROBE_NOMATH build)
//
// Per config (hd 256, q_len 1, block_size 16, shuffled block ids over one pool of `copies`
// caches, random bf16 / e4m3 KV with scales in [0.5, 1.5), seq_lens = L for every sequence,
// tables exactly L / 16 wide as bench_attention.py builds them):
//   decode_us  graph-replayed µs per call (attention + combine, PDL edges as in the bench),
//              rotating over `copies` caches (≥ 4 copies and ≥ 600 MB where memory allows)
//   nowarm_us  the same with the v7 L2 warm-up forced off (g_force_warm = 0)
//   read_us    a plain contiguous 16-byte-load read of the same number of KV bytes
//   pread_us   a read of exactly the call's K / V rows through its block table (16-position
//              blocks, one kv head's 512 B rows at a 1 KB stride): the paged layout's own cost
//   padj_us    the same rows, the kv heads' CTAs of one block adjacent in launch order
//   pall_us    one CTA per block reading all kv heads' rows (contiguous nkv · 512 B per position):
//              what a kernel that handled every kv head of a split would read (session 17)
//   ppf_us     pread's CTAs, each also bulk-prefetching the other kv heads' rows of its positions
//              into L2 (DRAM then sees each position's nkv rows together; session 18)
//   p2b_us     one kv head's rows of two blocks per 256-thread CTA: pall's CTA count and size on
//              the strided layout (session 18)
//   floor_us   (KV + FP8 scale) bytes / 4.2 TB/s
// then the launch the shape gets (attention grid; instance: m_tiles, QREG, splits per CTA, v7
// warm-up, stages, registers, smem, CTAs the device holds at once; combine kind, CTAs, threads,
// registers) and two probed calls (each with its own record buffers, see make_probe.py):
//   cold      after a 512 MB read of other memory (KV, tables, query, partials out of L2) and a
//             sync: nothing before it, nothing overlapping it (what ncu's single call sees);
//   chained   the 3rd of 3 back-to-back calls on other copies (PDL as in a graph replay): its
//             CTAs may start under the previous call's drain / combine (v7); the previous
//             call's attention end and combine exit are printed on its time base.
// For each (times in µs after the call's first attention CTA start):
//   attention CTAs: span, start / end spread (%globaltimer), SM clock (clock64 / globaltimer),
//   per-SM CTA counts with their mean last end time, SMs used;
//   phase cycles p10/p50/p90 over CTAs (thread 0 of each, clock64):
//     warm     entry → v7 L2 warm-up issued (≈ 0 when the grid skips it)
//     pdl      pdl_wait + trigger
//     issue    L1 block-id prefetch, Q loads, seq_lens → split plan → block ids → the first
//              kStages − 1 tiles' copies issued
//     qstage   Q stored to smem (waits for its loads) / QREG fragments
//     tile0    first tile landed (cp.async.wait + barrier)
//     loop     tile 0 landed → last tile's P·V issued
//     epi      last split's finish (row sums, barrier, partial / out stores), fused fold, end
//   tiles per CTA, then per tile t < 20: wait = top → landed (cp.async.wait + barrier),
//   compute = landed(t) → top(t + 1) (last tile: → its P·V issued; in fused mode a tile that
//   ends a split includes that split's finish_split), landed@ = landed(t) − entry, cycles
//   p10/p50/p90;
//   combine CTAs: entry, wait passed (≈ the attention grid done) and exit, p0/p50/p100, and how
//   many returned early (no partials to fold).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../probe_common.cuh"
#include "paged_decode.h"

namespace atlas {   // defined by make_probe.py in the instrumented copy
extern unsigned long long *g_probe_attn, *g_probe_comb;
extern int g_force_warm;
extern int g_attn_grid_x, g_attn_grid_y, g_attn_grid_z, g_attn_hd, g_attn_fp8, g_attn_m_tiles, g_attn_qreg,
    g_attn_splits_per_cta, g_attn_warm, g_attn_resident, g_attn_regs, g_attn_smem, g_attn_stages, g_attn_warps;
extern int g_comb_kind, g_comb_ctas, g_comb_threads, g_comb_regs;
}  // namespace atlas
using namespace atlas;

constexpr int kHd = 256, kBs = 16;
constexpr int kAttnWords = 64, kCombWords = 8;   // record sizes (make_probe.py)
constexpr int kProbeTiles = 20;                  // tiles with per-tile stamps (make_probe.py)

__device__ __forceinline__ uint32_t hash32(uint64_t i, uint32_t seed) {
  uint32_t h = uint32_t(i) * 2654435761u ^ uint32_t(i >> 32) * 0x85ebca6bu ^ seed;
  h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
  return h;
}
// p: [n] bf16 bits, uniform in [-1, 1)
__global__ void fill_bf16(uint16_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float v = (hash32(i, seed) >> 8) * (2.0f / 16777216.0f) - 1.0f;
    p[i] = uint16_t(__float_as_uint(v) >> 16);
  }
}
// p: [n] e4m3 bytes, finite: sign, exponent field ≤ 7, any mantissa (|x| < 2, never NaN)
__global__ void fill_e4m3(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t h = hash32(i, seed);
    p[i] = uint8_t((h & 0x80u) | ((h >> 8) & 0x3Fu));
  }
}
// p: [n] f32 in [0.5, 1.5)
__global__ void fill_scale(float* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = 0.5f + (hash32(i, seed) >> 8) * (1.0f / 16777216.0f);
}

// k, v: [n16] 16-byte units each (blockIdx.y picks K or V), 4 loads in flight per thread; out
// written only on an impossible value.
__global__ void read_kv(const uint4* __restrict__ k, const uint4* __restrict__ v, size_t n16, float* out) {
  if (read_units(blockIdx.y == 0 ? k : v, n16) == 0x12345678u) out[0] = 1.0f;
}
// Block blk's kBs positions' K and V rows of kv head kvh (row_bytes each; pools [num_blocks, kBs,
// nkv, row_bytes]) by 128 threads (t: this thread), all of a thread's loads in flight at once
// (row_bytes ≤ 512: ≤ 8 per thread); returns a value no caller can predict (so nothing is elided).
__device__ __forceinline__ uint32_t read_head_rows(const uint8_t* __restrict__ k, const uint8_t* __restrict__ v,
                                                   int blk, int kvh, int nkv, int row_bytes, int t) {
  const int units_per_row = row_bytes / 16, units = 2 * kBs * units_per_row;   // K and V
  uint4 x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int u = i * 128 + t;
    x[i] = make_uint4(0, 0, 0, 0);
    if (u < units) {
      const int kv = u / (kBs * units_per_row), pos = (u / units_per_row) % kBs, c = u % units_per_row;
      const uint8_t* row = (kv == 0 ? k : v) + (((int64_t)blk * kBs + pos) * nkv + kvh) * row_bytes;
      x[i] = __ldcs(reinterpret_cast<const uint4*>(row) + c);
    }
  }
  uint32_t acc = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) acc ^= x[i].x;
  return acc;
}
// The rows one call reads, through its block table: CTA (block j, kv head, sequence) reads
// the kBs positions' K and V rows of that kv head (row_bytes each; K and V pools
// [num_blocks, kBs, nkv, row_bytes]); tables: [B, max_blocks]. All of a thread's loads in
// flight at once (row_bytes ≤ 512: ≤ 8 per thread with 128 threads). Grid (blocks, nkv, B), or
// with heads_first (nkv, blocks, B): the kv heads' CTAs of one block adjacent in launch order.
__global__ void read_paged(const uint8_t* __restrict__ k, const uint8_t* __restrict__ v,
                           const int32_t* __restrict__ tables, int max_blocks, int nkv, int row_bytes,
                           int heads_first, float* out) {
  const int j = heads_first ? blockIdx.y : blockIdx.x, kvh = heads_first ? blockIdx.x : blockIdx.y, b = blockIdx.z;
  const int blk = tables[(int64_t)b * max_blocks + j];
  if (read_head_rows(k, v, blk, kvh, nkv, row_bytes, threadIdx.x) == 0x12345678u) out[0] = 1.0f;
}

// read_paged's CTA (block j, kv head, sequence) that also bulk-prefetches into L2 the other kv
// heads' rows of its 16 positions (threads < 32: K / V × position), issued beside its own loads,
// so each position's nkv · row_bytes reach DRAM together while every CTA still copies only its
// own head (session 18: is pall's gain the DRAM access order, kept by this, or its CTA shape?).
__global__ void read_paged_pf(const uint8_t* __restrict__ k, const uint8_t* __restrict__ v,
                              const int32_t* __restrict__ tables, int max_blocks, int nkv, int row_bytes,
                              float* out) {
  const int j = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int blk = tables[(int64_t)b * max_blocks + j];
  if (threadIdx.x < 2 * kBs) {
    const int kv = threadIdx.x / kBs, pos = threadIdx.x % kBs;
    const uint8_t* pos_row = (kv == 0 ? k : v) + ((int64_t)blk * kBs + pos) * nkv * row_bytes;
    for (int oh = 0; oh < nkv; ++oh)
      if (oh != kvh) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(pos_row + oh * row_bytes),
                                  "r"(row_bytes) : "memory");
  }
  if (read_head_rows(k, v, blk, kvh, nkv, row_bytes, threadIdx.x) == 0x12345678u) out[0] = 1.0f;
}
// One kv head's rows of TWO consecutive blocks per CTA (256 threads, the strided layout): pall's
// CTA count and size without its contiguous rows (session 18).
__global__ void read_paged_two_blocks(const uint8_t* __restrict__ k, const uint8_t* __restrict__ v,
                                      const int32_t* __restrict__ tables, int max_blocks, int nkv, int row_bytes,
                                      float* out) {
  const int j = 2 * blockIdx.x + threadIdx.x / 128, kvh = blockIdx.y, b = blockIdx.z, t = threadIdx.x % 128;
  if (j >= max_blocks) return;
  const int blk = tables[(int64_t)b * max_blocks + j];
  if (read_head_rows(k, v, blk, kvh, nkv, row_bytes, t) == 0x12345678u) out[0] = 1.0f;
}

// One CTA per (block, sequence) reading every kv head's rows: each position's nkv · row_bytes
// are one contiguous run (what a kernel handling all kv heads of a split would read);
// 128 · nkv threads, 8 loads each in flight.
__global__ void read_paged_all_heads(const uint8_t* __restrict__ k, const uint8_t* __restrict__ v,
                                     const int32_t* __restrict__ tables, int max_blocks, int nkv, int row_bytes,
                                     float* out) {
  const int j = blockIdx.x, b = blockIdx.z;
  const int blk = tables[(int64_t)b * max_blocks + j];
  const int pos_units = nkv * row_bytes / 16, units = 2 * kBs * pos_units;   // K and V
  uint4 x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int u = i * blockDim.x + threadIdx.x;
    x[i] = make_uint4(0, 0, 0, 0);
    if (u < units) {
      const int kv = u / (kBs * pos_units), rest = u % (kBs * pos_units);
      x[i] = __ldcs(reinterpret_cast<const uint4*>((kv == 0 ? k : v) + (int64_t)blk * kBs * nkv * row_bytes) + rest);
    }
  }
  uint32_t acc = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) acc ^= x[i].x;
  if (acc == 0x12345678u) out[0] = 1.0f;
}

template <typename T>
void print_pct(const char* name, const std::vector<T>& d) {   // " name p10/p50/p90"
  printf("  %s %lld/%lld/%lld", name, (long long)quantile(d, 0.1), (long long)quantile(d, 0.5), (long long)quantile(d, 0.9));
}

// One call's records as make_probe.py writes them: attention [ctas][kAttnWords], combine
// [cctas][kCombWords]; empty when not recorded.
struct Records {
  std::vector<unsigned long long> attn, comb;
  int ctas = 0, cctas = 0;
  unsigned long long t0() const {   // first attention CTA start (globaltimer ns)
    unsigned long long t = ~0ull;
    for (int i = 0; i < ctas; ++i) if (attn[size_t(i) * kAttnWords]) t = std::min(t, attn[size_t(i) * kAttnWords]);
    return t;
  }
  unsigned long long attn_end() const {
    unsigned long long t = 0;
    for (int i = 0; i < ctas; ++i) t = std::max(t, attn[size_t(i) * kAttnWords + 7]);
    return t;
  }
  unsigned long long comb_end() const {
    unsigned long long t = 0;
    for (int i = 0; i < cctas; ++i) t = std::max(t, comb[size_t(i) * kCombWords + 2]);
    return t;
  }
};

void report(const Records& r) {
  const unsigned long long t0 = r.t0(), tend = r.attn_end();
  int idle = 0;
  std::vector<double> start, end, clock;
  std::vector<int> count(256, 0);
  std::vector<double> last(256, 0.0);
  auto rec = [&](int i) { return &r.attn[size_t(i) * kAttnWords]; };
  auto active = [&](const unsigned long long* p) { return p[0] != 0 && p[7] != 0 && !(p[18] & 1); };
  for (int i = 0; i < r.ctas; ++i) {
    const unsigned long long* p = rec(i);
    if (p[0] == 0 || p[7] == 0) continue;
    start.push_back((p[0] - t0) / 1e3);
    end.push_back((p[7] - t0) / 1e3);
    if (p[18] & 1) { ++idle; continue; }
    const double ns = double(p[7] - p[0]);
    if (ns > 2000) clock.push_back((p[15] - p[8]) / ns);
    const int sm = int(p[16]) & 255;
    ++count[sm];
    last[sm] = std::max(last[sm], end.back());
  }
  printf("      attention: %d CTAs (%d idle, %d unrecorded), span %.2f us; start p50/p100 %.2f/%.2f, "
         "end p0/p50/p100 %.2f/%.2f/%.2f; SM clock p50 %.2f GHz\n",
         r.ctas, idle, r.ctas - int(start.size()), (tend - t0) / 1e3, quantile(start, 0.5), quantile(start, 1.0),
         quantile(end, 0.0), quantile(end, 0.5), quantile(end, 1.0), quantile(clock, 0.5));
  printf("      per SM (CTAs: SMs, mean last end us):");
  int used = 0;
  for (int n = 1; n < 64; ++n) {
    int sms = 0;
    double sum = 0;
    for (int sm = 0; sm < 256; ++sm) if (count[sm] == n) { ++sms; sum += last[sm]; }
    if (sms) printf("  %d: %d, %.1f", n, sms, sum / sms);
    used += sms;
  }
  printf("  (%d SMs)\n      phase cycles p10/p50/p90:", used);
  const char* names[7] = {"warm", "pdl", "issue", "qstage", "tile0", "loop", "epi"};
  for (int ph = 0; ph < 7; ++ph) {
    std::vector<long long> d;
    for (int i = 0; i < r.ctas; ++i) {
      const unsigned long long* p = rec(i);
      if (active(p) && p[8 + ph] != 0 && p[9 + ph] != 0) d.push_back((long long)(p[9 + ph] - p[8 + ph]));
    }
    print_pct(names[ph], d);
  }
  {  // the warp-split kernel's issue phase in three (slots 19: plan known, 20: first copies issued)
    std::vector<long long> plan, first, rest;
    for (int i = 0; i < r.ctas; ++i) {
      const unsigned long long* p = rec(i);
      if (!active(p) || p[19] == 0 || p[20] == 0) continue;
      plan.push_back((long long)(p[19] - p[10]));
      first.push_back((long long)(p[20] - p[19]));
      rest.push_back((long long)(p[11] - p[20]));
    }
    if (!plan.empty()) {
      printf("\n      issue = ");
      print_pct("plan", plan);
      print_pct("first-copies", first);
      print_pct("rest", rest);
    }
  }
  std::vector<long long> tiles;
  for (int i = 0; i < r.ctas; ++i) if (active(rec(i)) && rec(i)[17] > 0) tiles.push_back((long long)rec(i)[17] - 1);
  printf("\n      tiles per CTA p0/p50/p100 %lld/%lld/%lld; per tile (cycles):\n", quantile(tiles, 0.0),
         quantile(tiles, 0.5), quantile(tiles, 1.0));
  const int shown = int(std::min<long long>(kProbeTiles, quantile(tiles, 1.0)));
  for (int t = 0; t < shown; ++t) {
    std::vector<long long> wait, comp, landed;
    for (int i = 0; i < r.ctas; ++i) {
      const unsigned long long* p = rec(i);
      const long long nt = (long long)p[17] - 1;
      if (!active(p) || nt <= t) continue;
      const unsigned long long top = p[24 + 2 * t], land = p[25 + 2 * t];
      wait.push_back((long long)(land - top));
      landed.push_back((long long)(land - p[8]));
      if (t + 1 == nt) comp.push_back((long long)(p[14] - land));                   // to "last P·V issued"
      else if (t + 1 < kProbeTiles) comp.push_back((long long)(p[24 + 2 * (t + 1)] - land));   // to the next top
    }
    printf("      tile %2d", t);
    print_pct("wait", wait);
    print_pct("compute", comp);
    print_pct("landed@", landed);
    printf("\n");
  }
  if (r.cctas > 0) {
    std::vector<double> entry, waited, exitt;
    int early = 0, kind = 0;
    for (int i = 0; i < r.cctas; ++i) {
      const unsigned long long* p = &r.comb[size_t(i) * kCombWords];
      if (p[0] == 0) continue;
      kind = int(p[7]);
      entry.push_back((double(p[0]) - double(t0)) / 1e3);
      waited.push_back((double(p[1]) - double(t0)) / 1e3);
      if (p[2] == 0) { ++early; continue; }
      exitt.push_back((double(p[2]) - double(t0)) / 1e3);
    }
    printf("      combine (%s): %d CTAs (%d returned early); us after the first attention start, p0/p50/p100: "
           "entry %.2f/%.2f/%.2f, wait passed %.2f/%.2f/%.2f, exit %.2f/%.2f/%.2f\n",
           kind == 3 ? "grouped" : kind == 2 ? "flat fused" : "flat", r.cctas, early, quantile(entry, 0.0),
           quantile(entry, 0.5), quantile(entry, 1.0), quantile(waited, 0.0), quantile(waited, 0.5),
           quantile(waited, 1.0), quantile(exitt, 0.0), quantile(exitt, 0.5), quantile(exitt, 1.0));
  }
}

struct Config { int b, len, nq, nkv; bool fp8; };

int main(int argc, char** argv) {
  const bool full = !(argc > 1 && std::string(argv[1]) == "time");
  const std::string set = argc > 2 ? argv[2] : "long";
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // short: the short-sequence split rule (L ≤ 2K); mid: 2K < L < 32K, where the minimum split
  // length (kPagedDecodeMinSplitLen) sets the CTA count of one sequence; long (default).
  const std::vector<Config> configs =
      set == "short" ? std::vector<Config>{{1, 512, 16, 2, false},  {1, 1024, 16, 2, false}, {1, 1024, 16, 2, true},
                                           {1, 1024, 24, 4, false}, {1, 2048, 16, 2, false}, {8, 1024, 16, 2, false},
                                           {32, 512, 16, 2, false}, {32, 1024, 16, 2, false}, {32, 1024, 16, 2, true},
                                           {128, 1024, 16, 2, false}}
      : set == "mid" ? std::vector<Config>{{1, 3000, 16, 2, false},  {1, 8192, 16, 2, false}, {1, 8192, 16, 2, true},
                                           {1, 8192, 24, 4, false},  {1, 8192, 24, 4, true},  {1, 16384, 16, 2, false},
                                           {8, 8192, 16, 2, false},  {8, 8192, 16, 2, true},  {32, 8192, 16, 2, false},
                                           {32, 8192, 16, 2, true},  {128, 8192, 16, 2, false}, {128, 8192, 16, 2, true},
                                           {8, 8192, 24, 4, false},  {8, 8192, 24, 4, true}}
                     : std::vector<Config>{{1, 32768, 16, 2, false}, {1, 32768, 16, 2, true}, {1, 32768, 24, 4, false},
                                           {1, 1024, 16, 2, false}, {32, 32768, 16, 2, false}, {32, 32768, 16, 2, true},
                                           {1, 32768, 24, 4, true}};
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float* sink;
  CK(cudaMalloc(&sink, 4));
  const size_t evict_bytes = size_t(512) << 20;   // > 10 × the 50 MB L2
  uint8_t* evict;
  CK(cudaMalloc(&evict, evict_bytes));
  CK(cudaMemset(evict, 1, evict_bytes));
  printf("%-26s %8s %6s %9s %9s %8s %8s %8s %8s %8s %8s %8s\n", "config", "KV MB", "copies", "decode_us", "nowarm_us",
         "read_us", "pread_us", "padj_us", "pall_us", "ppf_us", "p2b_us", "floor_us");
  for (const Config& cf : configs) {
    const int elem = cf.fp8 ? 1 : 2, row_bytes = kHd * elem;
    const int max_blocks = (cf.len + kBs - 1) / kBs;                             // tables exactly L / bs wide
    const int64_t blocks = int64_t(cf.b) * max_blocks;                           // per copy
    const size_t pool_per = size_t(blocks) * kBs * cf.nkv * row_bytes;           // K (or V) bytes per copy
    const size_t scales_per = cf.fp8 ? size_t(blocks) * kBs * cf.nkv * 4 : 0;    // k (or v) scale bytes per copy
    const size_t per = 2 * (pool_per + scales_per);                              // what one call reads
    const int max_splits = paged_decode_max_splits(int64_t(max_blocks) * kBs, cf.nkv);
    const int rows = cf.nq / cf.nkv;                                             // group · q_len
    const size_t part_o = size_t(cf.b) * cf.nkv * max_splits * rows * kHd * 4, part_lse = part_o / kHd;
    const size_t qbytes = size_t(cf.b) * cf.nq * kHd * 2;
    char name[64];
    snprintf(name, sizeof(name), "B=%d L=%d %d/%d %s", cf.b, cf.len, cf.nq, cf.nkv, cf.fp8 ? "fp8" : "bf16");
    // copies: ≥ 4 and ≥ 600 MB in all (≤ 256), as many as fit in 80% of free memory
    size_t free_b, total_b;
    CK(cudaMemGetInfo(&free_b, &total_b));
    const double avail = 0.8 * double(free_b) - double(part_o + part_lse + 2 * qbytes);
    int copies = int(std::min<size_t>(256, std::max<size_t>(4, (size_t(600e6) + per - 1) / per)));
    while (copies > 1 && copies * double(per) > avail) --copies;
#ifdef PROBE_HOT
    copies = 1;   // variants.sh `hot`: every call reads the same KV (L2-resident when it fits)
#endif
    if (copies * double(per) > avail) {
      printf("%-26s skipped: one copy needs %.0f MB, %.0f MB free\n", name, per / 1e6, free_b / 1e6);
      continue;
    }
    // pools: K [copies · blocks, kBs, nkv, hd] then V in one allocation; FP8 scales likewise
    const int64_t nblocks = int64_t(copies) * blocks;
    uint8_t* kv;
    CK(cudaMalloc(&kv, 2 * size_t(copies) * pool_per));
    uint8_t *k_pool = kv, *v_pool = kv + size_t(copies) * pool_per;
    float* scales = nullptr;                                  // k_scale [nblocks, kBs, nkv], then v_scale
    if (cf.fp8) {
      CK(cudaMalloc(&scales, 2 * size_t(copies) * scales_per));
      fill_scale<<<1024, 256, 0, s>>>(scales, 2 * size_t(copies) * scales_per / 4, 3);
      fill_e4m3<<<4096, 256, 0, s>>>(kv, 2 * size_t(copies) * pool_per, 17);
    } else {
      fill_bf16<<<4096, 256, 0, s>>>(reinterpret_cast<uint16_t*>(kv), size_t(copies) * pool_per, 17);
    }
    // block tables [copies][B, max_blocks]: a random permutation of the pool's blocks, so each
    // copy's blocks are scattered over the whole pool (bench_attention.py's layout)
    std::vector<int32_t> perm(nblocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(cf.b * 7919 + cf.len + cf.nkv));
    int32_t *tables, *seq_lens;                               // seq_lens [B] = L
    CK(cudaMalloc(&tables, perm.size() * 4));
    CK(cudaMemcpy(tables, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
    std::vector<int32_t> lens(cf.b, cf.len);
    CK(cudaMalloc(&seq_lens, cf.b * 4));
    CK(cudaMemcpy(seq_lens, lens.data(), cf.b * 4, cudaMemcpyHostToDevice));
    uint16_t *query, *out;                                    // [B, 1, nq, hd] bf16
    float *lse, *partial_o = nullptr, *partial_lse = nullptr; // lse [B, 1, nq]; partials see the header
    CK(cudaMalloc(&query, qbytes));
    CK(cudaMalloc(&out, qbytes));
    CK(cudaMalloc(&lse, size_t(cf.b) * cf.nq * 4));
    fill_bf16<<<64, 256, 0, s>>>(query, qbytes / 2, 5);
    if (max_splits > 1) {
      CK(cudaMalloc(&partial_o, part_o));
      CK(cudaMalloc(&partial_lse, part_lse));
    }
    auto args = [&](int c) {   // copy c: its slice of the tables, everything else shared
      PagedDecodeArgs a{};
      a.query = query;
      a.k_cache = k_pool;
      a.v_cache = v_pool;
      a.k_scale = cf.fp8 ? scales : nullptr;
      a.v_scale = cf.fp8 ? scales + size_t(copies) * scales_per / 4 : nullptr;
      a.block_tables = tables + size_t(c) * blocks;
      a.seq_lens = seq_lens;
      a.out = out;
      a.lse = lse;
      a.partial_o = partial_o;
      a.partial_lse = partial_lse;
      a.q_stride_b = cf.b > 1 ? int64_t(cf.nq) * kHd : 0;
      a.q_stride_t = 0;
      a.batch = cf.b;
      a.q_len = 1;
      a.num_q_heads = cf.nq;
      a.num_kv_heads = cf.nkv;
      a.head_dim = kHd;
      a.block_size = kBs;
      a.num_blocks = int(nblocks);
      a.max_blocks = max_blocks;
      a.max_splits = max_splits;
      a.softmax_scale = 1.0f / 16.0f;   // hd^-0.5
      a.kv_dtype = cf.fp8 ? DType::kE4M3 : DType::kBF16;
      return a;
    };
    const int reps = std::max(copies, 20);
    auto decode = [&](int warm) {   // graph-replayed µs per call; warm: g_force_warm
      g_force_warm = warm;
      for (int c = 0; c < copies; ++c) CK(launch_paged_decode(args(c), s));   // smem opt-in, occupancy
      CK(cudaStreamSynchronize(s));
      const float us = graph_us(s, reps, [&](int r) { CK(launch_paged_decode(args(r % copies), s)); });
      g_force_warm = -1;
      return us;
    };
    const float decode_us = decode(-1);
    const float nowarm_us = decode(0);
    const size_t n16 = pool_per / 16;
    const int rblocks = int(std::min<size_t>(size_t(sms) * 8, (n16 + 511) / 512));
    const float read_us = graph_us(s, reps, [&](int r) {
      const size_t off = size_t(r % copies) * pool_per;
      read_kv<<<dim3(rblocks, 2), 512, 0, s>>>(reinterpret_cast<const uint4*>(k_pool + off),
                                               reinterpret_cast<const uint4*>(v_pool + off), n16, sink);
    });
    const float pread_us = graph_us(s, reps, [&](int r) {
      read_paged<<<dim3(max_blocks, cf.nkv, cf.b), 128, 0, s>>>(k_pool, v_pool, tables + size_t(r % copies) * blocks,
                                                                max_blocks, cf.nkv, row_bytes, 0, sink);
    });
    const float padj_us = graph_us(s, reps, [&](int r) {
      read_paged<<<dim3(cf.nkv, max_blocks, cf.b), 128, 0, s>>>(k_pool, v_pool, tables + size_t(r % copies) * blocks,
                                                                max_blocks, cf.nkv, row_bytes, 1, sink);
    });
    const float pall_us = graph_us(s, reps, [&](int r) {
      read_paged_all_heads<<<dim3(max_blocks, 1, cf.b), 128 * cf.nkv, 0, s>>>(
          k_pool, v_pool, tables + size_t(r % copies) * blocks, max_blocks, cf.nkv, row_bytes, sink);
    });
    const float ppf_us = graph_us(s, reps, [&](int r) {
      read_paged_pf<<<dim3(max_blocks, cf.nkv, cf.b), 128, 0, s>>>(k_pool, v_pool, tables + size_t(r % copies) * blocks,
                                                                   max_blocks, cf.nkv, row_bytes, sink);
    });
    const float p2b_us = graph_us(s, reps, [&](int r) {
      read_paged_two_blocks<<<dim3((max_blocks + 1) / 2, cf.nkv, cf.b), 256, 0, s>>>(
          k_pool, v_pool, tables + size_t(r % copies) * blocks, max_blocks, cf.nkv, row_bytes, sink);
    });
    printf("%-26s %8.2f %6d %9.2f %9.2f %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f\n", name, per / 1e6, copies,
           decode_us, nowarm_us, read_us, pread_us, padj_us, pall_us, ppf_us, p2b_us, per / 4.2e6);
    CK(launch_paged_decode(args(0), s));   // fills g_attn_* / g_comb_* for this shape
    CK(cudaStreamSynchronize(s));
    const int ctas = g_attn_grid_x * g_attn_grid_y * g_attn_grid_z, cctas = g_comb_ctas;
    printf("    launch: grid %dx%dx%d = %d CTAs of %d warps (hd %d %s, m_tiles %d, QREG %d, splits/CTA %d, max_splits %d, "
           "warm-up %d, stages %d, %d regs, smem %d B, resident %d); combine %s",
           g_attn_grid_x, g_attn_grid_y, g_attn_grid_z, ctas, g_attn_warps, g_attn_hd, g_attn_fp8 ? "fp8" : "bf16", g_attn_m_tiles,
           g_attn_qreg, g_attn_splits_per_cta, max_splits, g_attn_warm, g_attn_stages, g_attn_regs, g_attn_smem,
           g_attn_resident,
           g_comb_kind == 0 ? "none" : g_comb_kind == 3 ? "grouped" : g_comb_kind == 2 ? "flat fused" : "flat");
    if (g_comb_kind) printf(": %d CTAs x %d threads, %d regs", cctas, g_comb_threads, g_comb_regs);
    printf("\n");
    if (full) {
      // four probed calls on copies copies / 2 + 0..3: 0 cold (alone), then 1, 2, 3 back to back
      const int n_calls = 4;
      unsigned long long *abuf, *cbuf;
      const size_t awords = size_t(ctas) * kAttnWords, cwords = size_t(std::max(cctas, 1)) * kCombWords;
      CK(cudaMalloc(&abuf, n_calls * awords * 8));
      CK(cudaMalloc(&cbuf, n_calls * cwords * 8));
      CK(cudaMemset(abuf, 0, n_calls * awords * 8));
      CK(cudaMemset(cbuf, 0, n_calls * cwords * 8));
      auto probed = [&](int call) {
        g_probe_attn = abuf + call * awords;
        g_probe_comb = cctas > 0 ? cbuf + call * cwords : nullptr;
        CK(launch_paged_decode(args((copies / 2 + call) % copies), s));
        g_probe_attn = g_probe_comb = nullptr;
      };
      read_kv<<<dim3(sms * 8, 1), 512, 0, s>>>(reinterpret_cast<const uint4*>(evict), nullptr, evict_bytes / 16, sink);
      CK(cudaStreamSynchronize(s));
      probed(0);
      CK(cudaStreamSynchronize(s));
      read_kv<<<dim3(sms * 8, 1), 512, 0, s>>>(reinterpret_cast<const uint4*>(evict), nullptr, evict_bytes / 16, sink);
      CK(cudaStreamSynchronize(s));
      for (int call = 1; call < n_calls; ++call) probed(call);
      CK(cudaStreamSynchronize(s));
      std::vector<Records> r(n_calls);
      for (int call = 0; call < n_calls; ++call) {
        r[call].ctas = ctas;
        r[call].cctas = cctas;
        r[call].attn.resize(awords);
        r[call].comb.resize(size_t(cctas) * kCombWords);
        CK(cudaMemcpy(r[call].attn.data(), abuf + call * awords, awords * 8, cudaMemcpyDeviceToHost));
        if (cctas > 0)
          CK(cudaMemcpy(r[call].comb.data(), cbuf + call * cwords, size_t(cctas) * kCombWords * 8, cudaMemcpyDeviceToHost));
      }
      printf("    cold call:\n");
      report(r[0]);
      const unsigned long long t3 = r[3].t0();
      printf("    chained call (3rd of 3 back to back): previous call's attention end %.2f us, combine exit %.2f us, "
             "relative to this call's first CTA start\n",
             (double(r[2].attn_end()) - double(t3)) / 1e3,
             cctas > 0 ? (double(r[2].comb_end()) - double(t3)) / 1e3 : 0.0);
      report(r[3]);
      CK(cudaFree(abuf));
      CK(cudaFree(cbuf));
    }
    CK(cudaFree(kv));
    if (scales) CK(cudaFree(scales));
    CK(cudaFree(tables));
    CK(cudaFree(seq_lens));
    CK(cudaFree(query));
    CK(cudaFree(out));
    CK(cudaFree(lse));
    if (partial_o) CK(cudaFree(partial_o));
    if (partial_lse) CK(cudaFree(partial_lse));
  }
  CK(cudaFree(evict));
  return 0;
}
