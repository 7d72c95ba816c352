// w4a16_gemv: NVFP4 weight × BF16 activation, M = 1..32 rows, plus the fused variants
// (qg de-interleave on the store, dual = two weights in one launch, silu(gate)·up or
// x·sigmoid(gate) computed on the load).
// Launcher only; no torch. See csrc/w4a16_gemv.cu for the decomposition.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

#include "common/dtype.h"

namespace atlas {

constexpr int kW4A16GemvMaxRows = 32;  // M ≤ 32 (four mma n8 tiles)

// One NVFP4 weight (DESIGN "Formats") and its output. Layout of packed / block_scale:
//   checkpoint (tiled = false): row-major [rows, K/2] and [rows, K/16], never padded;
//   tiled (tiled = true, K % 128 == 0 only): chunk-major — chunk c (128 k) of every row is one
//     run: row n's 64 packed bytes at c·rows·64 + n·64, its 8 scale bytes at c·rows·8 + n·8, and
//     each 32-bit word's 8 codes in the bit order of atlas/nvfp4.py gemv_word_bits. A warp's
//     16-row chunk is then 1 KB contiguous, and the tiles streamed at the same time read
//     neighbouring memory (derived once at load: atlas/nvfp4.py tile_for_gemv).
struct W4A16GemvWeight {
  const uint8_t* packed = nullptr;       // [rows ≥ n, K/2] uint8 (layout above), 8-byte aligned
  const uint8_t* block_scale = nullptr;  // [rows ≥ n, K/16] e4m3 bytes (layout above)
  bool tiled = false;                    // the tiled layout (requires the vector path)
  bool gemv_words = false;               // each 32-bit word's codes in the tiled layout's bit
                                         // order (expert-indexed launches only: moe_experts'
                                         // stacks, MoeExpertsArgs::gemv_words): checkpoint rows,
                                         // or with tiled each expert in the tiled layout (required
                                         // there: an indexed tiled launch reads GEMV words)
  int rows = 0;                          // tiled: the weight's row count (the chunk stride;
                                         // indexed: one expert's, n)
  const float* global_scale = nullptr;   // [] f32 on the device (read by the kernel: no host sync)
  void* out = nullptr;                   // [M, n] bf16 | f32, row stride n
  int n = 0;                             // weight rows computed: the first n rows (n_rows prefix)
  int qg_head_dim = 0;                   // 0: out[:, i] = row i. hd > 0: rows are per head
                                         // [q (hd) | gate (hd)]; row h·2hd + i goes to column
                                         // h·hd + i (i < hd) or n/2 + h·hd + i − hd (gate)
};

// The activation the weight multiplies, computed from the raw operands x and x2 as they are
// loaded: f32 math, one rounding to bf16 (the same expression as the unfused kernels, so the
// fused GEMV is bitwise the unfused composition).
enum class GemvAct : int {
  kPlain = 0,        // x (x2 unused, must be nullptr)
  kSiluMul = 1,      // bf16(silu(x) · x2), silu(g) = g / (1 + expf(−g)) (IEEE division):
                     // w4a16_gemv_silu, x = gate, x2 = up (reference.silu_mul)
  kSigmoidGate = 2,  // bf16(x · (1 / (1 + expf(−x2)))): w4a16_gemv_gated, x = the attention
                     // output, x2 = the gate (csrc/sigmoid_gate.cu's expression)
};

// An expert-indexed launch (moe_experts at T = 1, csrc/moe_experts.cu): each weight is a stack of
// experts [E, n, K] (each expert in the checkpoint or the tiled layout, expert e at packed +
// e·packed_stride, block_scale + e·scale_stride, global_scale + e) and the launch runs `count` one-row GEMVs, slot j with expert
// ids[j] (read on the device, after griddepcontrol.wait unless ids_ready: no host sync), its x
// (and x2) row at x + (j / x_div)·x_stride, its outputs at w[i].out + j·out_stride. A slot whose
// id is outside [0, num_experts) is skipped: its outputs are left unwritten. M = 1 on the vector
// path only (the one-row kernel, w4a16_gemv_m1_kernel); each slot's rows are bitwise an ordinary
// launch's.
struct W4A16GemvSlots {
  const int32_t* ids = nullptr;   // [count] int32 on the device; nullptr: an ordinary launch
  int count = 0;                  // slots, ≥ 1
  int num_experts = 0;            // E of the stacks
  int64_t packed_stride[2] = {};  // bytes between experts of w[i].packed (n·K/2)
  int64_t scale_stride[2] = {};   // bytes between experts of w[i].block_scale (n·K/16)
  int64_t x_stride = 0;           // elements between the slots' x (and x2) rows; 0: one shared x
  int x_div = 1;                  // slot j reads x row j / x_div (≥ 1; moe_experts' gate+up over
                                  // T·k pair slots: k, so pair t·k + j reads token t)
  int64_t out_stride = 0;         // elements between the slots' output rows
  bool ids_ready = false;         // the ids were complete before this grid could launch (the
                                  // previous kernel triggers its dependents only after waiting for
                                  // the ids' producer): read them, and issue the weight prologue,
                                  // before griddepcontrol.wait
};

struct W4A16GemvArgs {
  const void* x = nullptr;    // [M, K] bf16, contiguous, 16-byte aligned: the activation, silu's
                              // gate or the gated attention output (act)
  const void* x2 = nullptr;   // [M, K] bf16, rows x2_stride apart, 16-byte aligned: silu's up or
                              // the sigmoid gate; nullptr for kPlain
  int64_t x2_stride = 0;      // elements between x2 rows: 0 (means K) or ≥ K, a multiple of 8
                              // (the gate half of a [M, Q | G] q_proj output: 2K)
  GemvAct act = GemvAct::kPlain;
  W4A16GemvWeight w[2];       // w[1] used only when num_weights == 2 (dual)
  int num_weights = 1;        // 1 | 2; both weights share x, K and the split of K
  int m = 0;                  // rows of x, 1..32
  int k = 0;                  // K, a multiple of 16
  DType out_dtype = DType::kBF16;  // kBF16 | kF32, for every output
  W4A16GemvSlots slots;       // expert-indexed launch (slots.ids != nullptr), see above
};

// Segments of K (≤ 8): a function of K only (never of M or N). A row's result is the f32 sum
// of its segment partials in segment order, however the launch spreads the segments over CTAs
// (chosen from N), so it is bitwise the same in every M, for every n_rows prefix, in the dual
// launch and in the single one.
int w4a16_gemv_k_splits(int k);
// 128-k chunks per segment: ceil(ceil(K / 128) / w4a16_gemv_k_splits(K)); the last segments may be
// short or empty. moe_experts sums its dots in these segments too (the same bits as this GEMV).
int w4a16_gemv_segment_chunks(int k);

// One launch on `stream` (a thread-block cluster when K is split). Never syncs; capturable.
// Errors: cudaErrorInvalidValue for bad sizes/pointers/strides (x2 given iff act != kPlain),
// cudaErrorMisalignedAddress for x/x2 not 16-byte or packed not 8-byte aligned, else the
// launch error.
cudaError_t launch_w4a16_gemv(const W4A16GemvArgs& args, cudaStream_t stream);

}  // namespace atlas
