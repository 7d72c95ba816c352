// read_floor: what one launch costs at the least, and what the one-row GEMV's memory stream
// costs without its math. Torch-free; build and run: bench/read_floor/run.sh. Analysis:
// bench/NOTES.md, "Bare reads" and w4a16_gemv "Session 34".
//
// Every launch below is made the way atlas's kernels are (programmatic dependent launch: wait for
// the previous grid, then trigger the next), chained in a CUDA graph (graph_us: median of 7
// replays / launches), each launch on its own window of one 2 GiB pool with reps · window ≥ 4 ×
// the L2, so every launch reads DRAM. Tables, in order:
//   1. bare reads   read_pdl over n bytes (16-byte streaming loads, 4 in flight per thread), the
//                   best of four grids (SMs × {1, 2, 4, 8} CTAs of 512 threads): the lower bound
//                   for ANY kernel that must read those bytes after its predecessor, t(n) ≈ F +
//                   n / BW with F (launch boundary, ramp, DRAM latency, tail) paid once per
//                   dependent launch. Also without PDL. The fit F + n / BW over n ≥ 8 MB closes
//                   the output.
//   2. tiled pattern  the one-row GEMV's bytes read its way (bench_gemv's M = 1 shapes): a CTA
//                   per 16-row tile of the chunk-major tiled layout ([K/128][N][64 B] packed,
//                   [K/128][N][8 B] scales), warp w its K segment w of S, per chunk 1 KB + 128 B;
//                   read_tiled<D>: D chunks' loads in flight per warp (issued together, then
//                   consumed); read_tiled_ring: the GEMV's own machinery minus its math — a
//                   per-warp cp.async ring (with / without the .L2::256B prefetch size), then the
//                   CTA's activations staged first, then the warp-split epilogue too.
//   3. ring study   27B o and down through rings of 2–5 stages, batch refills, no scale copies.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "../probe_common.cuh"

// Wait for the previous grid (its writes visible), let the next one launch, read p[0, n16).
__global__ void read_pdl(const uint4* __restrict__ p, size_t n16, float* sink) {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  if (read_units(p, n16) == 0x12345678u) sink[0] = 1.0f;
}

// The tiled GEMV pattern (see the header): grid = tiles, S warps per CTA, cpw chunks per warp.
template <int D>
__global__ void read_tiled(const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scales, int rows,
                           int cpw, float* sink) {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = blockIdx.x * 16, c0 = warp * cpw;
  const int64_t step = int64_t(rows) * 64, s_step = int64_t(rows) * 8;
  const uint8_t* src0 = packed + (int64_t(c0) * rows + row0 + lane / 4) * 64 + (lane % 4) * 16;
  const uint8_t* src1 = src0 + 8 * 64;   // piece lane + 32: rows 8..15
  const uint8_t* ssrc = scales + (int64_t(c0) * rows + row0 + lane % 16) * 8;
  uint32_t acc = 0;
  for (int c = 0; c < cpw; c += D) {
    uint4 a[D], b[D];
    uint2 sc[D];
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (c + d < cpw) {
        a[d] = __ldcs(reinterpret_cast<const uint4*>(src0 + (c + d) * step));
        b[d] = __ldcs(reinterpret_cast<const uint4*>(src1 + (c + d) * step));
        if (lane < 16) sc[d] = __ldcs(reinterpret_cast<const uint2*>(ssrc + (c + d) * s_step));
        else sc[d] = make_uint2(0, 0);
      }
    }
#pragma unroll
    for (int d = 0; d < D; ++d)
      if (c + d < cpw) acc ^= a[d].x ^ b[d].y ^ sc[d].x;
  }
  if (acc == 0x12345678u) sink[0] = 1.0f;
}

// The same pattern through the one-row GEMV's own machinery, step by step (kernel minus math):
// a per-warp ring of 3 stages filled by cp.async (16 B weight pieces, 8 B scale pieces; kHint:
// the .L2::256B prefetch size the GEMV's copies carry), chunk c + 2 issued once chunk c landed
// (cp.async.wait_group 1 + __syncwarp); kX: first the CTA's activation range (K bf16 from an
// L2-resident x) loaded through registers into shared memory behind a barrier, the ring's first
// copies right behind the first loads, as the GEMV does; kEpi: the warp-split epilogue (two
// barriers, one partial per (warp, row) through shared memory, one f32 store per row).
__device__ __forceinline__ void cpa16(uint32_t dst, const void* src, bool hint) {
  if (hint) asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  else asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cpa8(uint32_t dst, const void* src, bool hint) {
  if (hint) asm volatile("cp.async.ca.shared.global.L2::256B [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
}
// (kStagesT: ring depth; kBatch: the ring refilled kStagesT − 1 chunks at a time once all of them
// landed, as read_tiled<D> does, instead of one chunk per landed chunk; kScales = false: no scale
// copies.)
template <bool kHint, bool kX, bool kEpi, int kStagesT = 3, bool kBatch = false, bool kScales = true>
__global__ void read_tiled_ring(const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scales, int rows,
                                int cpw, const uint4* __restrict__ x, int x_units, float* out) {
  constexpr int kStages = kStagesT, kStage = 1152;
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int row0 = blockIdx.x * 16, c0 = warp * cpw;
  const int64_t step = int64_t(rows) * 64, s_step = int64_t(rows) * 8;
  const uint8_t* src0 = packed + (int64_t(c0) * rows + row0 + lane / 4) * 64 + (lane % 4) * 16;
  const uint8_t* src1 = src0 + 8 * 64;
  const uint8_t* ssrc = scales + (int64_t(c0) * rows + row0 + lane % 16) * 8;
  const int x_bytes = kX ? x_units * 16 : 0;
  const uint32_t ring = uint32_t(__cvta_generic_to_shared(smem)) + x_bytes + warp * kStages * kStage;
  auto issue = [&](uint32_t st) {
    cpa16(st + lane * 16, src0, kHint);
    cpa16(st + (lane + 32) * 16, src1, kHint);
    if (kScales && lane < 16) cpa8(st + 1024 + lane * 8, ssrc, kHint);
    src0 += step; src1 += step; ssrc += s_step;
  };
  auto prologue = [&] {
    for (int p = 0; p < kStages - 1; ++p) {
      if (p < cpw) issue(ring + p * kStage);
      asm volatile("cp.async.commit_group;\n" ::);
    }
  };
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if constexpr (kX) {
    bool issued = false;
    for (int i0 = threadIdx.x; i0 < x_units; i0 += 4 * blockDim.x) {
      uint4 a[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) if (i0 + j * blockDim.x < x_units) a[j] = __ldcg(x + i0 + j * blockDim.x);
      if (!issued) { prologue(); issued = true; }
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (i0 + j * blockDim.x < x_units) reinterpret_cast<uint4*>(smem)[i0 + j * blockDim.x] = a[j];
    }
    if (!issued) prologue();
    __syncthreads();
  } else {
    prologue();
  }
  uint32_t acc = 0, cur = ring, fill = ring + (kStages - 1) * kStage;
  if constexpr (kBatch) {   // chunks [c, c + kStages − 1) land together, then the next batch is issued
    for (int c = 0; c < cpw; c += kStages - 1) {
      asm volatile("cp.async.wait_group 0;\n" ::);
      __syncwarp();
      for (int d = 0; d < kStages - 1; ++d) {
        if (c + d >= cpw) break;
        uint32_t v;
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(ring + d * kStage + lane * 16));
        acc ^= v;
      }
      __syncwarp();
      for (int d = 0; d < kStages - 1; ++d)
        if (c + kStages - 1 + d < cpw) issue(ring + d * kStage);
      asm volatile("cp.async.commit_group;\n" ::);
    }
  } else {   // one chunk issued per landed chunk (the GEMV's ring)
    for (int c = 0; c < cpw; ++c) {
      asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));
      __syncwarp();
      if (c + kStages - 1 < cpw) issue(fill);
      asm volatile("cp.async.commit_group;\n" ::);
      uint32_t v;
      asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(cur + lane * 16));
      acc ^= v;
      fill = cur;
      cur = cur + kStage == ring + kStages * kStage ? ring : cur + kStage;
    }
  }
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  if constexpr (kEpi) {
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();
    float* part = reinterpret_cast<float*>(smem);
    if (lane < 16) part[warp * 16 + lane] = float(acc & 0xff);
    __syncthreads();
    if (threadIdx.x < 16) {
      float a = 0.f;
      for (int w = 0; w < warps; ++w) a += part[w * 16 + threadIdx.x];
      out[row0 + threadIdx.x] = a;
    }
  } else if (acc == 0x12345678u) {
    out[0] = 1.0f;
  }
}

// One launch of kern<<<grid, block, smem, s>>>(args...), with a PDL edge to the previous launch
// when pdl.
template <typename... KArgs, typename... Args>
static void launch(cudaStream_t s, bool pdl, int grid, int block, int smem, void (*kern)(KArgs...), Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, kern, static_cast<KArgs>(args)...));
}

// The DRAM windows of a launch reading n bytes: reps launches per graph on windows r % slots.
struct Windows {
  size_t window, slots;
  int reps;
  Windows(size_t n, size_t pool_bytes, int l2) {
    window = n < 4096 ? 4096 : (n + 4095) / 4096 * 4096;
    const int want = int((4 * size_t(l2) + window - 1) / window);   // ≥ 4 × L2 per graph
    reps = want < 16 ? 16 : (want > 512 ? 512 : want);
    slots = pool_bytes / window;
  }
};

int main() {
  int dev = 0, sms = 0, l2 = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  const size_t pool_bytes = size_t(2) << 30;
  uint8_t* pool;
  float* sink;     // [1]: written only on an impossible value
  float* out_rows; // [≤ 16 M] the ring epilogue's row sums
  uint4* xbuf;     // [4096] the activations (L2-resident: every CTA reads the same)
  CK(cudaMalloc(&pool, pool_bytes));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMalloc(&out_rows, 64 << 20));
  CK(cudaMalloc(&xbuf, 64 << 10));
  CK(cudaMemset(xbuf, 0, 64 << 10));
  fill_bytes<<<sms * 8, 512>>>(pool, pool_bytes, 7u);
  CK(cudaDeviceSynchronize());
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // µs per launch of `launch_at(window base)`, over w's windows
  auto time_windows = [&](const Windows& w, auto launch_at) {
    return graph_us(s, w.reps, [&](int r) { launch_at(pool + (size_t(r) % w.slots) * w.window); });
  };
  // the best bare read of n bytes over the four grids (and that grid)
  auto bare_read = [&](size_t n, const Windows& w, int* grid_out) {
    float best = 1e30f;
    for (int mult : {1, 2, 4, 8}) {
      const float us = time_windows(w, [&](const uint8_t* base) {
        launch(s, true, sms * mult, 512, 0, read_pdl, reinterpret_cast<const uint4*>(base), n / 16, sink);
      });
      if (us < best) { best = us; if (grid_out) *grid_out = sms * mult; }
    }
    return best;
  };

  // 1. bare reads: the byte counts of the targets' kernels (MB = 1e6 B) — GEMV weights + scales
  // (bench_gemv), one layer's KV at B = 1 (bench_attention) — and round sizes for the fit
  const double sizes_mb[] = {0.0, 0.295, 0.59, 1.18, 2.36, 4.72, 8.52, 9.44, 16.78, 17.7, 34.08,
                             41.3, 50.1, 67.1, 100.3, 134.2, 286.1};
  printf("# read_floor · gpu: %s (%d SMs, L2 %d MB) · µs per launch, graph-replayed, DRAM-cold\n",
         prop.name, sms, l2 >> 20);
  printf("| MB | grid | us | GBps | us_no_pdl |\n|---|---|---|---|---|\n");
  std::vector<double> fx, fy;
  for (double mb : sizes_mb) {
    const size_t n = size_t(mb * 1e6) / 16 * 16;
    const Windows w(n, pool_bytes, l2);
    int grid = 0;
    const float us = bare_read(n, w, &grid);
    const float us_nopdl = time_windows(w, [&](const uint8_t* base) {
      launch(s, false, grid, 512, 0, read_pdl, reinterpret_cast<const uint4*>(base), n / 16, sink);
    });
    printf("| %.3g | %d | %.2f | %.0f | %.2f |\n", mb, grid, us, n / (us * 1e-6) / 1e9, us_nopdl);
    if (mb >= 8.0) { fx.push_back(n / 1e6); fy.push_back(us); }
  }

  // 2. the GEMV shapes (bench_gemv, M = 1): N, K, warps per tile (the one-row kernel's warp split)
  struct Shape { const char* name; int n, k, s; };
  const Shape shapes[] = {{"35B o 2048x4096", 2048, 4096, 8},        {"35B q+g+k+v 9216x2048", 9216, 2048, 4},
                          {"27B o 5120x6144", 5120, 6144, 8},        {"27B q+g+k+v 14336x5120", 14336, 5120, 4},
                          {"27B down 5120x17408", 5120, 17408, 8},   {"27B gate_up 34816x5120", 34816, 5120, 4}};
  using RingKernel = void (*)(const uint8_t*, const uint8_t*, int, int, const uint4*, int, float*);
  // µs of a tiled-pattern kernel over shape sh (packed then scales in each window)
  auto time_tiled = [&](const Shape& sh, const Windows& w, auto kern, int smem, auto... tail) {
    const size_t pb = size_t(sh.n) * sh.k / 2;
    const int cpw = sh.k / 128 / sh.s;
    if (smem > 0) CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return time_windows(w, [&](const uint8_t* base) {
      launch(s, true, sh.n / 16, 32 * sh.s, smem, kern, base, base + pb, sh.n, cpw, tail...);
    });
  };
  printf("\n| tiled pattern | MB | bare_us | D2_us | D4_us | D8_us | D16_us | ring_us | ring_nohint_us | ring_x_us | ring_x_epi_us |\n"
         "|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape& sh : shapes) {
    const size_t n = size_t(sh.n) * sh.k / 2 + size_t(sh.n) * sh.k / 16;
    const Windows w(n, pool_bytes, l2);
    const float bare = bare_read(n, w, nullptr);
    const float d_us[4] = {time_tiled(sh, w, read_tiled<2>, 0, sink), time_tiled(sh, w, read_tiled<4>, 0, sink),
                           time_tiled(sh, w, read_tiled<8>, 0, sink), time_tiled(sh, w, read_tiled<16>, 0, sink)};
    // the ring variants: x = the CTA's K range (warp split: all of K), as the one-row kernel stages
    const int x_units = sh.k * 2 / 16, ring_smem = sh.s * 3 * 1152, x_smem = x_units * 16 + ring_smem;
    const RingKernel rings[4] = {read_tiled_ring<true, false, false>, read_tiled_ring<false, false, false>,
                                 read_tiled_ring<true, true, false>, read_tiled_ring<true, true, true>};
    float r_us[4];
    for (int v = 0; v < 4; ++v)
      r_us[v] = time_tiled(sh, w, rings[v], v >= 2 ? x_smem : ring_smem, (const uint4*)xbuf, x_units, out_rows);
    printf("| %s | %.3g | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", sh.name, n / 1e6, bare,
           d_us[0], d_us[1], d_us[2], d_us[3], r_us[0], r_us[1], r_us[2], r_us[3]);
  }

  // 3. ring study (27B o, 27B down): what makes the cp.async ring slower than read_tiled<2> at long K
  printf("\n| ring study | D2_us | ring3 | ring2 | ring4 | ring5 | batch3 | batch5 | ring3_noscale |\n|---|---|---|---|---|---|---|---|---|\n");
  const RingKernel study[] = {read_tiled_ring<false, false, false, 3>, read_tiled_ring<false, false, false, 2>,
                              read_tiled_ring<false, false, false, 4>, read_tiled_ring<false, false, false, 5>,
                              read_tiled_ring<false, false, false, 3, true>, read_tiled_ring<false, false, false, 5, true>,
                              read_tiled_ring<false, false, false, 3, false, false>};
  const int depth[] = {3, 2, 4, 5, 3, 5, 3};
  for (const Shape& sh : shapes) {
    if (sh.n != 5120) continue;
    const size_t n = size_t(sh.n) * sh.k / 2 + size_t(sh.n) * sh.k / 16;
    const Windows w(n, pool_bytes, l2);
    float us[8];
    us[0] = time_tiled(sh, w, read_tiled<2>, 0, sink);
    for (int v = 0; v < 7; ++v)
      us[v + 1] = time_tiled(sh, w, study[v], sh.s * depth[v] * 1152, (const uint4*)xbuf, 0, out_rows);
    printf("| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", sh.name, us[0], us[1], us[2], us[3], us[4],
           us[5], us[6], us[7]);
  }

  // least squares us = F + MB · (1 / BW) over table 1's sizes ≥ 8 MB
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  const double k = double(fx.size());
  for (size_t i = 0; i < fx.size(); ++i) { sx += fx[i]; sy += fy[i]; sxx += fx[i] * fx[i]; sxy += fx[i] * fy[i]; }
  const double slope = (k * sxy - sx * sy) / (k * sxx - sx * sx), icpt = (sy - slope * sx) / k;
  printf("\nfit over >= 8 MB: us = %.2f + MB / %.0f GB/s\n", icpt, 1e3 / slope);
  CK(cudaFree(pool));
  CK(cudaFree(sink));
  CK(cudaFree(out_rows));
  CK(cudaFree(xbuf));
  return 0;
}
