// Shared by the torch-free probe drivers (bench/gemv_probe, bench/paged_probe, bench/moe_probe):
// the CUDA error check, graph-replayed timing, quantiles of per-CTA stamps, input fills.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                    \
  do {                                                                                           \
    cudaError_t e_ = (x);                                                                        \
    if (e_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } \
  } while (0)

// µs per call: launch_rep(r) for r < reps captured in one graph, one warm-up replay, then the
// median of 7 timed replays divided by reps.
template <typename F>
float graph_us(cudaStream_t s, int reps, F launch_rep) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int r = 0; r < reps; ++r) launch_rep(r);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaGraphLaunch(ge, s));   // warm-up replay
  std::vector<float> t;
  for (int it = 0; it < 7; ++it) {
    CK(cudaEventRecord(e0, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms * 1e3f / reps);
  }
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(t.begin(), t.end());
  return t[3];
}

// The q-quantile (0..1) of v; 0 for an empty v.
template <typename T>
T quantile(std::vector<T> v, double q) {
  if (v.empty()) return T(0);
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(q * v.size()))];
}

// Timing-only inputs: hashed random bytes (packed e2m1 weights, bf16 bits) and finite e4m3
// block scales.
__global__ void fill_bytes(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = uint8_t(h);
  }
}
__global__ void fill_scales(uint8_t* p, size_t n) {  // e4m3 in [2^-4, 2^3]: finite, no NaN
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = uint8_t(0x20 + (i * 7) % 0x30);
}

// A grid-stride XOR over p[0, n16) (16-byte units, 4 streaming loads in flight per thread): the
// read-bandwidth baseline. Callers write the result only on an impossible value.
__device__ inline uint32_t read_units(const uint4* __restrict__ p, size_t n16) {
  uint32_t acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    const uint4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride), d = __ldcs(p + i + 3 * stride);
    acc ^= a.x ^ b.y ^ c.z ^ d.w;
  }
  for (; i < n16; i += stride) acc ^= __ldcs(p + i).x;
  return acc;
}
