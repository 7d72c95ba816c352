// w4a16_gemv: NVFP4 weight × BF16 activation, M = 1..32 rows, plus the fused variants
// (qg de-interleave on the store, dual = two weights in one launch, silu(gate)·up on the load).
// Launcher only; no torch. See csrc/w4a16_gemv.cu for the decomposition.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

#include "common/dtype.h"

namespace atlas {

constexpr int kW4A16GemvMaxRows = 32;  // M ≤ 32 (four mma n8 tiles)

// One NVFP4 weight (DESIGN "Formats", checkpoint layout, never padded) and its output.
struct W4A16GemvWeight {
  const uint8_t* packed = nullptr;       // [≥ n, K/2] uint8, row stride K/2 bytes, 8-byte aligned
  const uint8_t* block_scale = nullptr;  // [≥ n, K/16] e4m3 bytes, row stride K/16
  const float* global_scale = nullptr;   // [] f32 on the device (read by the kernel: no host sync)
  void* out = nullptr;                   // [M, n] bf16 | f32, row stride n
  int n = 0;                             // weight rows computed: the first n rows (n_rows prefix)
  int qg_head_dim = 0;                   // 0: out[:, i] = row i. hd > 0: rows are per head
                                         // [q (hd) | gate (hd)]; row h·2hd + i goes to column
                                         // h·hd + i (i < hd) or n/2 + h·hd + i − hd (gate)
};

struct W4A16GemvArgs {
  const void* x = nullptr;    // [M, K] bf16, contiguous, 16-byte aligned: the activation,
                              // or silu's gate when `up` is set
  const void* up = nullptr;   // [M, K] bf16 or nullptr: activation = bf16(silu(x) · up), silu and
                              // product in f32 (silu(g) = g / (1 + expf(−g)), IEEE division)
  W4A16GemvWeight w[2];       // w[1] used only when num_weights == 2 (dual)
  int num_weights = 1;        // 1 | 2; both weights share x, K and the split of K
  int m = 0;                  // rows of x, 1..32
  int k = 0;                  // K, a multiple of 16
  DType out_dtype = DType::kBF16;  // kBF16 | kF32, for every output
};

// Segments of K (≤ 8): a function of K only (never of M or N). A row's result is the f32 sum
// of its segment partials in segment order, however the launch spreads the segments over CTAs
// (chosen from N), so it is bitwise the same in every M, for every n_rows prefix, in the dual
// launch and in the single one.
int w4a16_gemv_k_splits(int k);

// One launch on `stream` (a thread-block cluster when K is split). Never syncs; capturable.
// Errors: cudaErrorInvalidValue for bad sizes/pointers, cudaErrorMisalignedAddress for
// x/up not 16-byte or packed not 8-byte aligned, else the launch error.
cudaError_t launch_w4a16_gemv(const W4A16GemvArgs& args, cudaStream_t stream);

}  // namespace atlas
