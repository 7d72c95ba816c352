// moe_experts: the routed SwiGLU experts of a sparse MoE block as grouped GEMVs over device-side
// expert ids (no host sync, graph-capturable). Launcher only; no torch.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace atlas {

// One stack of E expert weights of one role, all [N, K], in one format.
struct ExpertStack {
  const void* weight;          // bf16 [E, N, K]  |  nvfp4 packed uint8 [E, N, K/2]
  const uint8_t* block_scale;  // nvfp4: e4m3 [E, N, K/16]; bf16: nullptr
  const float* global_scale;   // nvfp4: f32 [E];            bf16: nullptr
};

constexpr int kMoeExpertsMaxHidden = 8192;   // x row staged in shared memory as bf16 (16 KB)
constexpr int kMoeExpertsMaxTopK = 32;

struct MoeExpertsArgs {
  const void* x;          // [T, h] bf16, contiguous
  const int32_t* ids;     // [T, k] expert ids in [0, E) (others: that pair contributes 0)
  const int32_t* pair_order;  // optional [T·k]: gate_up CTA row y runs pair pair_order[y] (pairs
                              // sorted by expert, so pairs sharing an expert run back to back and
                              // re-read its weights from L2); nullptr = pair y
  const float* weights;   // [T, k] routing weights
  ExpertStack gate;       // [E, I, h]
  ExpertStack up;         // [E, I, h]
  ExpertStack down;       // [E, h, I]
  bool nvfp4;             // all three stacks NVFP4 (else all BF16)
  void* act;              // [T·k, I] bf16 scratch: bf16(silu(g)·u) of each (token, slot) pair
  const void* shared;     // optional [T, h] bf16 contiguous: the shared expert's output
  const void* shared_gate;   // [T] bf16 logits, element t at shared_gate + t·shared_gate_stride
  int64_t shared_gate_stride;
  bool out_bf16;          // (shared == nullptr) store the sum rounded to bf16 instead of f32
  void* out;              // shared == nullptr: [T, h] f32 | bf16 (out_bf16) = Σ_j weights[t, j] ·
                          //   bf16(down_e · act)
                          // else: [T, h] bf16 = bf16(that + sigmoid(shared_gate[t]) · shared[t])
  int64_t num_tokens;     // T ≥ 1
  int top_k;              // k, 1..kMoeExpertsMaxTopK
  int num_experts;        // E
  int hidden;             // h, % 32 == 0, ≤ kMoeExpertsMaxHidden
  int inter;              // I, % 32 == 0, ≤ kMoeExpertsMaxHidden
};

// Two launches on `stream` (gate+up+silu, then down+combine); never syncs.
// cudaErrorInvalidValue outside the ranges above.
cudaError_t launch_moe_experts(const MoeExpertsArgs& args, cudaStream_t stream);

}  // namespace atlas
