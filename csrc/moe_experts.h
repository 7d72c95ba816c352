// moe_experts: the routed SwiGLU experts of a sparse MoE block as grouped tensor-core GEMVs over
// device-side expert ids (no host sync, graph-capturable). Launcher only; no torch.
#pragma once
#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>

namespace atlas {

// One stack of E expert weights of one role, all [N, K], in one format.
// NVFP4 layouts (MoeExpertsArgs::gemv_words, ::tiled): expert e's N·K/2 code bytes start at
// e·N·K/2 and its N·K/16 scale bytes at e·N·K/16 in every layout; inside an expert, row n's
// 128-k chunk c (64 code bytes, 8 scale bytes) is at
//   row-major (checkpoint, gemv_words):  n·K/2 + c·64      |  n·K/16 + c·8
//   tiled (per-expert chunk-major):      c·N·64 + n·64     |  c·N·8 + n·8
// (tiled: w4a16_gemv's tiled layout per expert, so the rows streamed side by side are adjacent).
struct ExpertStack {
  const void* weight;          // bf16 [E, N, K]  |  nvfp4 packed uint8 [E, N, K/2] (layout above)
  const uint8_t* block_scale;  // nvfp4: e4m3 [E, N, K/16] (layout above); bf16: nullptr
  const float* global_scale;   // nvfp4: f32 [E];            bf16: nullptr
};

constexpr int kMoeExpertsMaxHidden = 8192;    // h and I
constexpr int kMoeExpertsMaxTopK = 32;
constexpr int kMoeExpertsMaxExperts = 4096;   // E of the stacks: the grouping kernel's counters live in smem
constexpr int64_t kMoeExpertsMaxPairs = 65535;  // T·k

struct MoeExpertsArgs {
  const void* x;          // [T, h] bf16, contiguous
  const int32_t* ids;     // [T, k] expert ids in [0, E) (others: that pair contributes 0)
  const float* weights;   // [T, k] routing weights
  ExpertStack gate;       // [E, I, h]
  ExpertStack up;         // [E, I, h]
  ExpertStack down;       // [E, h, I]
  bool nvfp4;             // all three stacks NVFP4 (else all BF16)
  bool gemv_words;        // nvfp4 only: every 32-bit word of the three stacks holds its 8 codes in
                          //   the GEMV bit order (atlas/nvfp4.py gemv_word_bits; rows stay
                          //   row-major): k-adjacent dequant pairs, no activation permutation
  bool tiled;             // nvfp4 with gemv_words, h and I multiples of 128 only: the three stacks
                          //   per-expert chunk-major (ExpertStack's layouts)
  void* workspace;        // moe_experts_workspace_bytes(T, k, E, h, I) bytes, 256-byte aligned, any
                          //   contents: the expert groups, act [T·k, I] bf16, d [T·k, h] bf16
  const void* shared;     // optional [T, h] bf16 contiguous: the shared expert's output
  const void* shared_gate;   // [T] bf16 logits, element t at shared_gate + t·shared_gate_stride
  int64_t shared_gate_stride;
  bool out_bf16;          // (shared == nullptr) store the sum rounded to bf16 instead of f32
  void* out;              // shared == nullptr: [T, h] f32 | bf16 (out_bf16) = Σ_j weights[t, j] ·
                          //   bf16(down_e · act)
                          // else: [T, h] bf16 = bf16(that + sigmoid(shared_gate[t]) · shared[t])
  int64_t num_tokens;     // T ≥ 1, T·k ≤ kMoeExpertsMaxPairs
  int top_k;              // k, 1..kMoeExpertsMaxTopK
  int num_experts;        // E, 1..kMoeExpertsMaxExperts
  int hidden;             // h, % 32 == 0, ≤ kMoeExpertsMaxHidden
  int inter;              // I, % 32 == 0, ≤ kMoeExpertsMaxHidden
};

// Scratch bytes launch_moe_experts needs for these sizes (0 for sizes out of range).
size_t moe_experts_workspace_bytes(int64_t num_tokens, int top_k, int num_experts, int hidden, int inter);

// Four launches on `stream` (group pairs by expert — skipped at T·k ≤ 32 —, gate+up+silu, down,
// combine; NVFP4 with T·k ≤ 36: three expert-indexed GEMV launches, one slot per pair, no
// grouping); never syncs.
// cudaErrorInvalidValue outside the ranges above, or when x, out or a weight stack is not 16-byte
// aligned (block scales: 8-byte; workspace: 256-byte).
cudaError_t launch_moe_experts(const MoeExpertsArgs& args, cudaStream_t stream);

}  // namespace atlas
