// paged_decode: decode / speculative-verify attention over the paged KV cache (DESIGN "Paged KV
// cache"), BF16 or FP8 E4M3 KV with one float32 scale per (token, kv head), GQA, split-K.
// Launcher only; no torch.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

#include "common/dtype.h"

namespace atlas {

struct PagedDecodeArgs {
  const void* query;           // [B, q_len, nq, hd] bf16; (nq, hd) contiguous, rows q_stride_* apart
  const void* k_cache;         // [num_blocks, bs, nkv, hd] bf16 | e4m3, contiguous, 16-byte aligned
  const void* v_cache;         // [num_blocks, bs, nkv, hd] same dtype and shape as k_cache
  const float* k_scale;        // [num_blocks, bs, nkv] f32 (e4m3 cache only; else nullptr)
  const float* v_scale;        // [num_blocks, bs, nkv] f32 (e4m3 cache only; else nullptr)
  const int32_t* block_tables; // [B, max_blocks] contiguous; ids outside [0, num_blocks) read as 0
  const int32_t* seq_lens;     // [B] tokens in the cache incl. the q_len new ones; clamped to
                               //     [0, max_blocks · bs] on the device
  void* out;                   // [B, q_len, nq, hd] bf16 contiguous (written)
  float* lse;                  // [B, q_len, nq] f32 contiguous, natural log (written; may be null)
  const void* gate;            // null, or [B, q_len, nq, hd] bf16 with hd contiguous, element (b, j, h, c) at
                               //   b·gate_stride_b + j·gate_stride_t + h·gate_stride_h + c: out is then
                               //   bf16(bf16(o) · 1 / (1 + exp(−gate))), sigmoid_gate_mul's expression on
                               //   the rounded output (the Qwen3-Next output gate, one launch fewer)
  int64_t gate_stride_b;       // elements (gate only; any ≥ 0, a size-1 dim's stride is never used)
  int64_t gate_stride_t;
  int64_t gate_stride_h;
  float* partial_o;            // [B, nkv, max_splits, group·q_len, hd] f32 workspace (max_splits > 1)
  float* partial_lse;          // [B, nkv, max_splits, group·q_len] f32 workspace (max_splits > 1)
  int64_t q_stride_b;          // elements between query[b] and query[b + 1]
  int64_t q_stride_t;          // elements between query[b, j] and query[b, j + 1]
  int batch;                   // B in [1, 65535]
  int q_len;                   // query tokens per sequence, [1, kPagedDecodeMaxQLen]
  int num_q_heads;             // nq, a multiple of nkv
  int num_kv_heads;            // nkv in [1, 65535]
  int head_dim;                // hd in {64, 128, 256}
  int block_size;              // bs ≥ 1 (any: 16, 528, ...)
  int num_blocks;              // rows of the cache pools
  int max_blocks;              // columns of block_tables
  int max_splits;              // paged_decode_max_splits(max_blocks · bs, nkv): workspace split slots
  float softmax_scale;         // scores = softmax_scale · q·k (finite, > 0)
  DType kv_dtype;              // kBF16 | kE4M3
};

constexpr int kPagedDecodeMaxQLen = 8;

// Split-K rule (flash-decoding). It depends on the sequence's own seq_len (and the layer's
// kv-head count) only, never on the batch, so a sequence's output bits do not depend on what
// else is in the batch. A sequence of L tokens gets
//   nominal = clamp(max(ceil(L / 256), min(ceil(L / 128), 16)), 1, cap),   cap = paged_decode_split_cap(nkv)
// splits of chunk = round_up(ceil(L / nominal), tile) positions (tile: the cache dtype's KV tile,
// paged_decode_tile_n — a split is whole tiles, so BF16 and FP8 chunks can differ); the count that
// actually holds positions is ceil(L / chunk) ≤ nominal. cap = clamp(256 / nkv, 16, 128): at
// B = 1 a long sequence still fills ~2 CTAs per SM of the H200's 132 (nkv · cap ≈ 256 CTAs),
// while more kv heads need fewer splits, and so less partial-O traffic, to get there.
// Short sequences (v3): 128-position splits up to 16 of them (L ≤ 2K; 16 splits up to 4K),
// so a short sequence's critical path is 4 KV tiles, not 8: at B = 1 the KV is a few hundred
// KB and the call is a chain of latencies (v2: B = 1 × 1K 13.7 µs, 8 CTAs × 8 tiles of
// ~0.5 µs each), while the doubled partial traffic (≈ 8·rows / (256·elem) of the KV bytes)
// costs < 0.1 µs there. The rule stays monotone in L (the max of two monotone terms), so the
// count at the table's capacity bounds every sequence's count (the workspace size).
constexpr int kPagedDecodeTileN = 32;           // KV positions per shared-memory tile (BF16)
constexpr int kPagedDecodeTileNFp8 = 64;        // FP8 (v23): the same bytes per tile as BF16's
constexpr int kPagedDecodeMinSplitLen = 256;    // 8 tiles; partial O ≈ 4·rows / (256·elem) of the KV bytes
constexpr int kPagedDecodeShortSplitLen = 128;  // 4 tiles, for short sequences ...
constexpr int kPagedDecodeShortSplits = 16;     // ... up to this many splits
constexpr int kPagedDecodeMaxSplits = 128;      // largest cap (nkv ≤ 2)
constexpr int kPagedDecodeTargetCtas = 256;     // kv heads × splits wanted for one long sequence

struct PagedDecodeSplit {
  int chunk;  // positions per split, a multiple of the tile
  int count;  // splits holding positions (1 when L == 0)
};

__host__ __device__ inline int paged_decode_split_cap(int num_kv_heads) {
  const int cap = kPagedDecodeTargetCtas / (num_kv_heads > 0 ? num_kv_heads : 1);
  return cap < 16 ? 16 : (cap > kPagedDecodeMaxSplits ? kPagedDecodeMaxSplits : cap);
}

// nominal split count for `len` ≥ 0 tokens (see the rule above); monotone in len.
__host__ __device__ inline int paged_decode_nominal_splits(int64_t len, int cap) {
  int64_t n = (len + kPagedDecodeMinSplitLen - 1) / kPagedDecodeMinSplitLen;
  int64_t s = (len + kPagedDecodeShortSplitLen - 1) / kPagedDecodeShortSplitLen;
  s = s < kPagedDecodeShortSplits ? s : kPagedDecodeShortSplits;
  n = n > s ? n : s;
  return n < 1 ? 1 : static_cast<int>(n > cap ? cap : n);
}

// KV positions per shared-memory tile of a cache dtype.
__host__ __device__ constexpr int paged_decode_tile_n(bool fp8) { return fp8 ? kPagedDecodeTileNFp8 : kPagedDecodeTileN; }

// The splits of a sequence of seq_len tokens, for KV tiles of kTile positions (paged_decode_tile_n
// of the cache dtype; a template argument: as a runtime one, even a constant after inlining, it
// moved ptxas' register allocation of the BF16 kernels, +16 SASS instructions and ≈ +1% at B = 1).
template <int kTile>
__host__ __device__ inline PagedDecodeSplit paged_decode_split(int seq_len, int cap) {
  const int len = seq_len > 0 ? seq_len : 0;
  const int nominal = paged_decode_nominal_splits(len, cap);
  const int per = ((len > 0 ? len : 1) + nominal - 1) / nominal;
  const int chunk = (per + kTile - 1) / kTile * kTile;
  const int count = len > 0 ? (len + chunk - 1) / chunk : 1;
  return {chunk, count};
}

// Workspace split slots for sequences of at most `capacity` = max_blocks · bs tokens: the
// nominal count at the capacity bounds every sequence's count (it is monotone in L).
__host__ __device__ inline int paged_decode_max_splits(int64_t capacity, int num_kv_heads) {
  return paged_decode_nominal_splits(capacity > 0 ? capacity : 0, paged_decode_split_cap(num_kv_heads));
}

// One or two launches on `stream` (attention, then the split combine when max_splits > 1);
// never syncs. cudaErrorInvalidValue for arguments outside the ranges above (ops.paged_decode
// rejects them first, naming the argument).
cudaError_t launch_paged_decode(const PagedDecodeArgs& args, cudaStream_t stream);

}  // namespace atlas
