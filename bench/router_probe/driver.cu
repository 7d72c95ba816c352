// router_probe driver: ops.moe_router (csrc/moe_router.cu) timed without torch, so variants of the
// kernel can be compared in one device call:
//   nvcc -std=c++17 -arch=sm_90 -O3 --expt-relaxed-constexpr -I../../csrc -o driver driver.cu ../../csrc/moe_router.cu
// [router | shared gate] of Qwen3.6-35B-A3B (R = 257, h = 2048, top-8) and Qwen3-Next-80B-A3B
// (R = 513, top-10), shared slot, T ∈ {1, 8, 32}: graph-replayed µs per call (20 calls per graph
// on the same gate rows, L2-resident as in a decode step's graph), beside R·h·2 / 4.2 TB/s.
#include <cuda_runtime.h>

#include <cstdio>

#include "../probe_common.cuh"
#include "moe_router.h"

using namespace atlas;

int main() {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  printf("%5s %3s %5s %3s %8s %9s\n", "R", "k", "h", "T", "us", "floor_us");
  for (const int experts : {256, 512}) {
    const int rows = experts + 1, h = 2048, k = experts == 256 ? 8 : 10;
    for (const int t : {1, 8, 32}) {
      uint8_t *x, *gates, *logits;
      int32_t* ids;
      float* w;
      CK(cudaMalloc(&x, size_t(t) * h * 2));
      CK(cudaMalloc(&gates, size_t(rows) * h * 2));
      CK(cudaMalloc(&logits, size_t(t) * rows * 2));
      CK(cudaMalloc(&ids, size_t(t) * (k + 1) * 4));
      CK(cudaMalloc(&w, size_t(t) * (k + 1) * 4));
      fill_bytes<<<256, 256, 0, s>>>(x, size_t(t) * h * 2, 1);
      fill_bytes<<<256, 256, 0, s>>>(gates, size_t(rows) * h * 2, 2);
      CK(cudaMemset2DAsync(x + 1, 2, 0x3c, 1, size_t(t) * h, s));          // bf16 high bytes: finite, small
      CK(cudaMemset2DAsync(gates + 1, 2, 0x3c, 1, size_t(rows) * h, s));
      MoeRouterArgs a{};
      a.x = x; a.gates = gates; a.num_tokens = t; a.hidden = h; a.rows = rows; a.num_experts = experts;
      a.top_k = k; a.renormalize = true; a.shared_slot = true; a.logits = logits; a.ids = ids; a.weights = w;
      CK(launch_moe_router(a, s));
      CK(cudaStreamSynchronize(s));
      const float us = graph_us(s, 20, [&](int) { CK(launch_moe_router(a, s)); });
      printf("%5d %3d %5d %3d %8.2f %9.3f\n", rows, k, h, t, us, double(rows) * h * 2 / 4.2e6);
      CK(cudaFree(x)); CK(cudaFree(gates)); CK(cudaFree(logits)); CK(cudaFree(ids)); CK(cudaFree(w));
    }
  }
  return 0;
}
