// moe_probe driver: moe_experts (the MTP head's routed experts) timed without torch, so ring
// depths and launch shapes can be compared in one device call (built by run.sh, once per variant
// of csrc/moe_experts.cu).
//
//   driver            Qwen3.6-35B-A3B experts: h 2048, I 512, NVFP4, 256 routed experts + the
//                     shared expert as expert 256 in slot 8 (k = 9), T ∈ {1, 4, 8, 16, 24, 32} tokens
//   driver T...       the same at the given token counts
//   driver words T... the stacks read as in the GEMV word bit order (MoeExpertsArgs::gemv_words;
//                     the bytes are random either way, so the timing is valid)
//   driver tiled T... … and per-expert chunk-major (MoeExpertsArgs::tiled: the layers' layout)
//
// Per T: graph-replayed µs per call (20 calls per graph, expert weights rotating over kCopies
// copies of 455 MB, so no call finds its experts in L2 — at T = 1 a call reads 16 MB, so the
// rotation must cover more than the 50 MB L2), the distinct experts the ids hit,
// and the floor = their weight bytes / 4.2 TB/s (x, act, d and out are < 1% here).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "../probe_common.cuh"
#include "moe_experts.h"

using namespace atlas;

__global__ void fill_bf16(uint16_t* p, size_t n) {  // finite bf16 in ±[0.5, 2)
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = uint16_t(0x3F00 + (i * 37) % 0x100) | uint16_t((i & 1) << 15);
}
__global__ void fill_f32(float* p, size_t n, float v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) p[i] = v;
}

// One NVFP4 stack [E, N, K]: packed, block scales and global scales in one allocation.
struct Stack {
  uint8_t* base = nullptr;
  size_t packed = 0, scales = 0;
  ExpertStack view;
  Stack(int e, int n, int k, cudaStream_t s) {
    packed = size_t(e) * n * k / 2;
    scales = size_t(e) * n * k / 16;
    CK(cudaMalloc(&base, packed + scales + 4 * size_t(e) + 256));
    fill_bytes<<<1024, 256, 0, s>>>(base, packed, 17 + n);
    fill_scales<<<256, 256, 0, s>>>(base + packed, scales);
    float* gs = reinterpret_cast<float*>(base + ((packed + scales + 255) / 256) * 256);
    fill_f32<<<1, 256, 0, s>>>(gs, e, 1.0f);
    view = ExpertStack{base, base + packed, gs};
  }
};

int main(int argc, char** argv) {
  const int h = 2048, inter = 512, routed = 256, k = 9, E = routed + 1;
  const double expert_bytes = 3.0 * h * inter * (0.5 + 1.0 / 16);   // gate, up, down: packed + scales
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  constexpr int kCopies = 8;
  std::vector<Stack> gate, up, down;
  for (int c = 0; c < kCopies; ++c) {
    gate.emplace_back(E, inter, h, s);
    up.emplace_back(E, inter, h, s);
    down.emplace_back(E, h, inter, s);
  }
  std::mt19937 rng(7);
  printf("%-4s %8s %8s %8s %9s\n", "T", "us", "experts", "floor_us", "x_floor");
  std::vector<int> Ts = {1, 4, 8, 16, 24, 32};
  int first = 1;
  const bool tiled = argc > 1 && std::string(argv[1]) == "tiled";
  const bool words = tiled || (argc > 1 && std::string(argv[1]) == "words");
  if (words) ++first;
  if (argc > first) Ts.clear();
  for (int i = first; i < argc; ++i) Ts.push_back(std::atoi(argv[i]));
  for (const int T : Ts) {
    std::vector<int32_t> ids(size_t(T) * k);
    std::set<int> hit;
    for (int t = 0; t < T; ++t) {
      std::vector<int> perm(routed);
      for (int i = 0; i < routed; ++i) perm[i] = i;
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int j = 0; j < k - 1; ++j) { ids[t * k + j] = perm[j]; hit.insert(perm[j]); }
      ids[t * k + k - 1] = routed;   // the shared expert
      hit.insert(routed);
    }
    int32_t* d_ids;
    float *d_w, *d_out;
    uint16_t* d_x;
    uint8_t* ws;
    CK(cudaMalloc(&d_ids, ids.size() * 4));
    CK(cudaMemcpyAsync(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, s));
    CK(cudaMalloc(&d_w, ids.size() * 4));
    fill_f32<<<1, 256, 0, s>>>(d_w, ids.size(), 1.0f / k);
    CK(cudaMalloc(&d_x, size_t(T) * h * 2));
    fill_bf16<<<64, 256, 0, s>>>(d_x, size_t(T) * h);
    CK(cudaMalloc(&d_out, size_t(T) * h * 4));
    const size_t ws_bytes = moe_experts_workspace_bytes(T, k, E, h, inter);
    if (ws_bytes == 0) { printf("workspace size rejected\n"); return 1; }
    CK(cudaMalloc(&ws, ws_bytes));
    auto args = [&](int c) {
      MoeExpertsArgs a{};
      a.x = d_x; a.ids = d_ids; a.weights = d_w;
      a.gate = gate[c].view; a.up = up[c].view; a.down = down[c].view;
      a.nvfp4 = true; a.gemv_words = words; a.tiled = tiled; a.workspace = ws; a.out = d_out;
      a.num_tokens = T; a.top_k = k; a.num_experts = E; a.hidden = h; a.inter = inter;
      return a;
    };
    CK(cudaStreamSynchronize(s));          // ids copied (pageable source)
    CK(launch_moe_experts(args(0), s));   // instantiation, attribute calls
    CK(launch_moe_experts(args(1), s));
    CK(cudaStreamSynchronize(s));
    const float us = graph_us(s, 20, [&](int r) { CK(launch_moe_experts(args(r % kCopies), s)); });
    const double floor_us = hit.size() * expert_bytes / 4.2e6;
    printf("%-4d %8.2f %8zu %8.2f %9.2f\n", T, us, hit.size(), floor_us, us / floor_us);
    CK(cudaFree(d_ids)); CK(cudaFree(d_w)); CK(cudaFree(d_x)); CK(cudaFree(d_out)); CK(cudaFree(ws));
  }
  return 0;
}
