// atlas._C: every torch/pybind11 binding of atlas, and nothing else.
//
// Each kernel .cu is lean CUDA (no torch headers) and exports a plain launcher
// `cudaError_t launch_<op>(const <Op>Args&, cudaStream_t)` declared in csrc/<op>.h.
// Here tensors become Args: TORCH_CHECKs are a second net behind the Python validation in
// atlas/ops.py, and launches go on torch's current stream. Outputs are allocated by the
// caller (atlas/ops.py) and passed in, so every binding returns nothing.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "quantize_nvfp4.h"
#include "reshape_and_cache.h"
#include "argmax.h"
#include "embedding.h"
#include "moe_route.h"
#include "moe_router.h"
#include "moe_experts.h"
#include "paged_decode.h"
#include "w4a16_gemv.h"
#include "qk_norm_rope.h"
#include "rms_norm.h"
#include "sigmoid_gate.h"
// (each kernel family adds its header include here)

namespace {

cudaStream_t current_stream(const torch::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// Numbers in TORCH_CHECK messages go through num() (std::to_string), never through c10::str's
// std::ostream <<: on the H200 image (torch 2.11) a failing check whose message streamed an
// integer segfaulted the process instead of raising — strings stream fine, integers do not
// (probed in isolation: the same binding raised for a string-only message and crashed for one
// with an int64_t; most likely a locale facet clash between two libstdc++ builds in the process).
template <typename T>
std::string num(T v) { return std::to_string(v); }

void check_cuda(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA error: ", cudaGetErrorString(err));
}

#define CHECK_CUDA_TENSOR(t) TORCH_CHECK((t).is_cuda(), #t " must be a CUDA tensor")
#define CHECK_CONTIGUOUS(t) TORCH_CHECK((t).is_contiguous(), #t " must be contiguous")

// ---- quantize_nvfp4 -------------------------------------------------------------------------
void quantize_nvfp4(const torch::Tensor& w,            // [N, K] bf16|f16|f32
                    torch::Tensor& packed,             // [N, K/2] uint8 (out)
                    torch::Tensor& block_scale,        // [N, K/16] e4m3 (out)
                    torch::Tensor& global_scale,       // [] f32 (out)
                    torch::Tensor& amax_workspace) {   // [1] f32 (scratch)
  CHECK_CUDA_TENSOR(w); CHECK_CONTIGUOUS(w); CHECK_CONTIGUOUS(packed); CHECK_CONTIGUOUS(block_scale);
  TORCH_CHECK(w.dim() == 2 && w.size(1) % 16 == 0, "quantize_nvfp4: w must be [N, K] with K % 16 == 0");
  const c10::cuda::CUDAGuard guard(w.device());
  atlas::QuantizeNvfp4Args a{};
  a.input = w.data_ptr();
  a.input_dtype = w.scalar_type() == torch::kBFloat16 ? atlas::DType::kBF16
                : w.scalar_type() == torch::kHalf     ? atlas::DType::kF16
                                                      : atlas::DType::kF32;
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 || w.scalar_type() == torch::kHalf ||
              w.scalar_type() == torch::kFloat, "quantize_nvfp4: w must be bf16, f16 or f32");
  a.packed = packed.data_ptr<uint8_t>();
  a.block_scale = reinterpret_cast<uint8_t*>(block_scale.data_ptr());
  a.global_scale = global_scale.data_ptr<float>();
  a.amax = amax_workspace.data_ptr<float>();
  a.n = w.size(0);
  a.k = w.size(1);
  check_cuda(atlas::launch_quantize_nvfp4(a, current_stream(w)), "quantize_nvfp4");
}

// ---- w4a16_gemv bindings (GEMV family) -----------------------------------------------------
// One NVFP4 weight + its output → launcher struct; checks are a second net. The layout is told
// by the shapes: checkpoint packed [N, K/2] + scales [N, K/16], or the tiled layout
// (atlas/nvfp4.py tile_for_gemv) packed [N, K/128, 64] + scales [N, K/128, 8], views of
// chunk-major buffers.
atlas::W4A16GemvWeight gemv_weight(const torch::Tensor& packed,        // [≥ n, K/2] | [≥ n, K/128, 64] uint8
                                   const torch::Tensor& block_scale,   // [≥ n, K/16] | [≥ n, K/128, 8] e4m3
                                   const torch::Tensor& global_scale,  // [] f32
                                   torch::Tensor& out,                 // [M, n] bf16|f32 (out)
                                   int64_t n, int64_t qg_head_dim, int64_t k, const torch::Tensor& x) {
  CHECK_CUDA_TENSOR(packed); CHECK_CUDA_TENSOR(block_scale); CHECK_CUDA_TENSOR(global_scale);
  CHECK_CUDA_TENSOR(out); CHECK_CONTIGUOUS(out);
  const bool tiled = packed.dim() == 3;
  // The tiled layout is a [N, C, b] view of a chunk-major [C, N, b] buffer (strides (b, N·b, 1);
  // strides of size-1 dims are free).
  auto chunk_major = [](const torch::Tensor& t) {
    const int64_t n = t.size(0), c = t.size(1), b = t.size(2);
    return t.stride(2) == 1 && (n == 1 || t.stride(0) == b) && (c == 1 || t.stride(1) == n * b);
  };
  if (tiled) {
    TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && k % 128 == 0 && packed.size(1) == k / 128 &&
                packed.size(2) == 64 && chunk_major(packed),
                "w4a16_gemv: tiled packed must be a uint8 [N, K/128, 64] view of a chunk-major [K/128, N, 64] "
                "buffer (atlas.nvfp4.tile_for_gemv) with K = ", num(k));
    TORCH_CHECK(block_scale.scalar_type() == at::ScalarType::Float8_e4m3fn && block_scale.dim() == 3 &&
                block_scale.size(0) == packed.size(0) && block_scale.size(1) == k / 128 && block_scale.size(2) == 8 &&
                chunk_major(block_scale),
                "w4a16_gemv: tiled block_scale must be an e4m3 [N, K/128, 8] view of a chunk-major buffer");
  } else {
    CHECK_CONTIGUOUS(packed); CHECK_CONTIGUOUS(block_scale);
    TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 2 && packed.size(1) * 2 == k,
                "w4a16_gemv: packed must be uint8 [N, K/2] with K = ", num(k));
    TORCH_CHECK(block_scale.scalar_type() == at::ScalarType::Float8_e4m3fn && block_scale.dim() == 2 &&
                block_scale.size(0) == packed.size(0) && block_scale.size(1) * 16 == k,
                "w4a16_gemv: block_scale must be e4m3 [N, K/16]");
  }
  TORCH_CHECK(global_scale.scalar_type() == torch::kFloat && global_scale.numel() == 1,
              "w4a16_gemv: global_scale must be a float32 scalar");
  TORCH_CHECK(n >= 1 && n <= packed.size(0), "w4a16_gemv: n_rows must be in [1, N]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n &&
              (out.scalar_type() == torch::kBFloat16 || out.scalar_type() == torch::kFloat),
              "w4a16_gemv: out must be bf16|f32 [M, n_rows]");
  TORCH_CHECK(packed.device() == x.device() && out.device() == x.device() &&
              block_scale.device() == x.device() && global_scale.device() == x.device(),
              "w4a16_gemv: all tensors must be on x's device");
  atlas::W4A16GemvWeight w{};
  w.packed = packed.data_ptr<uint8_t>();
  w.block_scale = reinterpret_cast<const uint8_t*>(block_scale.data_ptr());
  w.global_scale = global_scale.data_ptr<float>();
  w.out = out.data_ptr();
  w.n = static_cast<int>(n);
  w.qg_head_dim = static_cast<int>(qg_head_dim);
  w.tiled = tiled;
  w.rows = static_cast<int>(packed.size(0));
  return w;
}

void check_gemv_activation(const torch::Tensor& x, const char* name) {  // [M, K] bf16
  CHECK_CUDA_TENSOR(x); CHECK_CONTIGUOUS(x);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.size(0) >= 1 &&
              x.size(0) <= atlas::kW4A16GemvMaxRows && x.size(1) % 16 == 0,
              "w4a16_gemv: ", name, " must be bf16 [M <= 32, K % 16 == 0]");
}

void run_w4a16_gemv(atlas::W4A16GemvArgs& a, const torch::Tensor& x, torch::Tensor& out0) {
  a.m = static_cast<int>(x.size(0));
  a.k = static_cast<int>(x.size(1));
  a.out_dtype = out0.scalar_type() == torch::kFloat ? atlas::DType::kF32 : atlas::DType::kBF16;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t err = atlas::launch_w4a16_gemv(a, current_stream(x));
  TORCH_CHECK(err == cudaSuccess, "w4a16_gemv (M = ", num(a.m), ", K = ", num(a.k), ", N = ", num(a.w[0].n),
              a.num_weights == 2 ? " and " + std::to_string(a.w[1].n) : std::string(),
              a.act == atlas::GemvAct::kSiluMul ? ", silu" : a.act == atlas::GemvAct::kSigmoidGate ? ", gated" : "",
              "): CUDA error: ", cudaGetErrorString(err));
}

// y = x · Wᵀ (or bf16(silu(x) · up) · Wᵀ when up is given); qg_head_dim > 0 de-interleaves q|gate.
void w4a16_gemv(const torch::Tensor& x,                   // [M, K] bf16 (silu: gate)
                const std::optional<torch::Tensor>& up,   // [M, K] bf16 or None
                const torch::Tensor& packed,              // [N, K/2] uint8
                const torch::Tensor& block_scale,         // [N, K/16] e4m3
                const torch::Tensor& global_scale,        // [] f32
                torch::Tensor& out,                       // [M, n_rows] bf16|f32 (out)
                int64_t n_rows, int64_t qg_head_dim) {
  check_gemv_activation(x, "x");
  atlas::W4A16GemvArgs a{};
  a.x = x.data_ptr();
  if (up.has_value()) {
    check_gemv_activation(*up, "up");
    TORCH_CHECK(up->sizes() == x.sizes() && up->device() == x.device(), "w4a16_gemv: up must match gate");
    a.x2 = up->data_ptr();
    a.act = atlas::GemvAct::kSiluMul;
  }
  a.w[0] = gemv_weight(packed, block_scale, global_scale, out, n_rows, qg_head_dim, x.size(1), x);
  a.num_weights = 1;
  run_w4a16_gemv(a, x, out);
}

// y = bf16(x · sigmoid(gate)) · Wᵀ: the gated attention output times o_proj in one launch.
void w4a16_gemv_gated(const torch::Tensor& x,             // [M, K] bf16 (attention output)
                      const torch::Tensor& gate,          // [M, K] bf16, rows strided (stride ≥ K, % 8)
                      const torch::Tensor& packed,        // [N, K/2] uint8
                      const torch::Tensor& block_scale,   // [N, K/16] e4m3
                      const torch::Tensor& global_scale,  // [] f32
                      torch::Tensor& out) {               // [M, N] bf16|f32 (out)
  check_gemv_activation(x, "x");
  CHECK_CUDA_TENSOR(gate);
  TORCH_CHECK(gate.scalar_type() == torch::kBFloat16 && gate.sizes() == x.sizes() && gate.device() == x.device() &&
              gate.stride(1) == 1 && (gate.size(0) == 1 || (gate.stride(0) >= x.size(1) && gate.stride(0) % 8 == 0)),
              "w4a16_gemv_gated: gate must be bf16 [M, K] like x, rows contiguous, row stride >= K and % 8 == 0");
  atlas::W4A16GemvArgs a{};
  a.x = x.data_ptr();
  a.x2 = gate.data_ptr();
  a.x2_stride = gate.size(0) == 1 ? 0 : gate.stride(0);
  a.act = atlas::GemvAct::kSigmoidGate;
  a.w[0] = gemv_weight(packed, block_scale, global_scale, out, packed.size(0), 0, x.size(1), x);
  a.num_weights = 1;
  run_w4a16_gemv(a, x, out);
}

// (y1, y2) = (x · W1ᵀ, x · W2ᵀ) in one launch; qg_head_dim1 > 0 de-interleaves y1's q|gate.
void w4a16_gemv_dual(const torch::Tensor& x,                                          // [M, K] bf16
                     const torch::Tensor& packed1, const torch::Tensor& block_scale1,  // [N1, K/2], [N1, K/16]
                     const torch::Tensor& global_scale1, torch::Tensor& out1,          // [], [M, N1] bf16 (out)
                     const torch::Tensor& packed2, const torch::Tensor& block_scale2,  // [N2, K/2], [N2, K/16]
                     const torch::Tensor& global_scale2, torch::Tensor& out2,          // [], [M, N2] bf16 (out)
                     int64_t qg_head_dim1) {                                           // 0 | hd of q1's heads
  check_gemv_activation(x, "x");
  TORCH_CHECK(out1.scalar_type() == out2.scalar_type(), "w4a16_gemv_dual: outputs must share a dtype");
  atlas::W4A16GemvArgs a{};
  a.x = x.data_ptr();
  a.w[0] = gemv_weight(packed1, block_scale1, global_scale1, out1, packed1.size(0), qg_head_dim1, x.size(1), x);
  a.w[1] = gemv_weight(packed2, block_scale2, global_scale2, out2, packed2.size(0), 0, x.size(1), x);
  TORCH_CHECK(a.w[0].tiled == a.w[1].tiled,
              "w4a16_gemv_dual: the two weights must share a layout (both tiled by NVFP4Weight.prepare_gemv, or "
              "both checkpoint tensors), got packed1 ", a.w[0].tiled ? "tiled" : "checkpoint", " and packed2 ",
              a.w[1].tiled ? "tiled" : "checkpoint");
  a.num_weights = 2;
  run_w4a16_gemv(a, x, out1);
}

// ---- reshape_and_cache / paged_decode bindings (paged KV family) --------------------------
void reshape_and_cache(const torch::Tensor& key,                     // [T, nkv, hd] bf16, rows strided
                       const torch::Tensor& value,                   // [T, nkv, hd] bf16, rows strided
                       torch::Tensor& k_cache,                       // [num_blocks, bs, nkv, hd] bf16|e4m3 (in/out)
                       torch::Tensor& v_cache,                       // [num_blocks, bs, nkv, hd] bf16|e4m3 (in/out)
                       const torch::Tensor& slot_mapping,            // [T] int64
                       const std::optional<torch::Tensor>& k_scale,  // [num_blocks, bs, nkv] f32 (out, e4m3 only)
                       const std::optional<torch::Tensor>& v_scale) {
  CHECK_CUDA_TENSOR(key); CHECK_CUDA_TENSOR(value); CHECK_CUDA_TENSOR(k_cache);
  CHECK_CUDA_TENSOR(v_cache); CHECK_CUDA_TENSOR(slot_mapping);
  CHECK_CONTIGUOUS(k_cache); CHECK_CONTIGUOUS(v_cache); CHECK_CONTIGUOUS(slot_mapping);
  TORCH_CHECK(key.dim() == 3 && key.scalar_type() == torch::kBFloat16 && value.sizes() == key.sizes() &&
              value.scalar_type() == torch::kBFloat16, "reshape_and_cache: key, value must be bf16 [T, nkv, hd]");
  const int64_t t = key.size(0), nkv = key.size(1), hd = key.size(2);
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && (nkv == 1 || (key.stride(1) == hd && value.stride(1) == hd)),
              "reshape_and_cache: key, value must have contiguous [nkv, hd] rows");
  const bool fp8 = k_cache.scalar_type() == at::ScalarType::Float8_e4m3fn;
  TORCH_CHECK((fp8 || k_cache.scalar_type() == torch::kBFloat16) && v_cache.scalar_type() == k_cache.scalar_type(),
              "reshape_and_cache: k_cache, v_cache must both be bf16 or both float8_e4m3fn");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == nkv && k_cache.size(3) == hd && v_cache.sizes() == k_cache.sizes(),
              "reshape_and_cache: k_cache, v_cache must be [num_blocks, bs, nkv, hd] with key's nkv, hd");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == t,
              "reshape_and_cache: slot_mapping must be int64 [T]");
  TORCH_CHECK(k_scale.has_value() == fp8 && v_scale.has_value() == fp8,
              "reshape_and_cache: k_scale, v_scale are required for an e4m3 cache and must be absent for bf16");
  const c10::cuda::CUDAGuard guard(key.device());
  atlas::ReshapeAndCacheArgs a{};
  a.key = key.data_ptr();
  a.value = value.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  if (fp8) {
    for (const auto* s : {&*k_scale, &*v_scale}) {
      CHECK_CUDA_TENSOR(*s); CHECK_CONTIGUOUS(*s);
      TORCH_CHECK(s->scalar_type() == torch::kFloat && s->dim() == 3 && s->size(0) == k_cache.size(0) &&
                  s->size(1) == k_cache.size(1) && s->size(2) == nkv,
                  "reshape_and_cache: k_scale, v_scale must be float32 [num_blocks, bs, nkv]");
    }
    a.k_scale = k_scale->data_ptr<float>();
    a.v_scale = v_scale->data_ptr<float>();
  }
  a.slot_mapping = slot_mapping.data_ptr<int64_t>();
  a.num_tokens = t;
  // the row stride of a size-1 dim is meaningless (and only row 0 is read): use the dense one
  a.key_stride = t > 1 ? key.stride(0) : nkv * hd;
  a.value_stride = t > 1 ? value.stride(0) : nkv * hd;
  a.num_slots = k_cache.size(0) * k_cache.size(1);
  a.num_kv_heads = static_cast<int>(nkv);
  a.head_dim = static_cast<int>(hd);
  a.cache_dtype = fp8 ? atlas::DType::kE4M3 : atlas::DType::kBF16;
  TORCH_CHECK(hd % 8 == 0 && hd <= atlas::kReshapeAndCacheMaxHeadDim && a.key_stride % 8 == 0 && a.value_stride % 8 == 0 &&
              reinterpret_cast<uintptr_t>(a.key) % 16 == 0 && reinterpret_cast<uintptr_t>(a.value) % 16 == 0 &&
              reinterpret_cast<uintptr_t>(a.k_cache) % 16 == 0 && reinterpret_cast<uintptr_t>(a.v_cache) % 16 == 0,
              "reshape_and_cache: hd % 8 == 0, hd <= 1024, row strides % 8 == 0 and 16-byte aligned key, value, caches required");
  check_cuda(atlas::launch_reshape_and_cache(a, current_stream(key)), "reshape_and_cache");
}

void paged_decode(const torch::Tensor& query,                       // [B, q_len, nq, hd] bf16, (nq, hd) contiguous
                  const torch::Tensor& k_cache,                     // [num_blocks, bs, nkv, hd] bf16|e4m3
                  const torch::Tensor& v_cache,                     // like k_cache
                  const torch::Tensor& block_tables,                // [B, max_blocks] int32
                  const torch::Tensor& seq_lens,                    // [B] int32
                  double softmax_scale,
                  const std::optional<torch::Tensor>& k_scale,      // [num_blocks, bs, nkv] f32 (e4m3 only)
                  const std::optional<torch::Tensor>& v_scale,      // [num_blocks, bs, nkv] f32 (e4m3 only)
                  torch::Tensor& out,                               // [B, q_len, nq, hd] bf16 (out)
                  torch::Tensor& lse,                               // [B, q_len, nq] f32 (out)
                  torch::Tensor& partial_o,                         // [B, nkv, splits, group·q_len, hd] f32 (scratch)
                  torch::Tensor& partial_lse,                       // [B, nkv, splits, group·q_len] f32 (scratch)
                  int64_t max_splits,
                  const std::optional<torch::Tensor>& gate) {       // [B, q_len, nq, hd] bf16, hd contiguous, or none
  CHECK_CUDA_TENSOR(query); CHECK_CUDA_TENSOR(k_cache); CHECK_CUDA_TENSOR(v_cache);
  CHECK_CUDA_TENSOR(block_tables); CHECK_CUDA_TENSOR(seq_lens); CHECK_CUDA_TENSOR(out); CHECK_CUDA_TENSOR(lse);
  CHECK_CONTIGUOUS(k_cache); CHECK_CONTIGUOUS(v_cache); CHECK_CONTIGUOUS(block_tables); CHECK_CONTIGUOUS(seq_lens);
  CHECK_CONTIGUOUS(out); CHECK_CONTIGUOUS(lse);
  TORCH_CHECK(query.dim() == 4 && query.scalar_type() == torch::kBFloat16,
              "paged_decode: query must be bf16 [B, q_len, nq, hd]");
  const int64_t b = query.size(0), q_len = query.size(1), nq = query.size(2), hd = query.size(3);
  TORCH_CHECK(query.stride(3) == 1 && (nq == 1 || query.stride(2) == hd),
              "paged_decode: query must have contiguous [nq, hd] rows");
  const bool fp8 = k_cache.scalar_type() == at::ScalarType::Float8_e4m3fn;
  TORCH_CHECK((k_cache.scalar_type() == torch::kBFloat16 || fp8) && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode: k_cache, v_cache must both be bf16 or both float8_e4m3fn");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == hd && v_cache.sizes() == k_cache.sizes(),
              "paged_decode: k_cache, v_cache must be [num_blocks, bs, nkv, hd] with query's hd");
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), nkv = k_cache.size(2);
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.dim() == 2 && block_tables.size(0) == b,
              "paged_decode: block_tables must be int32 [B, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.dim() == 1 && seq_lens.size(0) == b,
              "paged_decode: seq_lens must be int32 [B]");
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.sizes() == query.sizes(),
              "paged_decode: out must be bf16 [B, q_len, nq, hd]");
  TORCH_CHECK(lse.scalar_type() == torch::kFloat && lse.dim() == 3 && lse.size(0) == b && lse.size(1) == q_len &&
              lse.size(2) == nq, "paged_decode: lse must be float32 [B, q_len, nq]");
  TORCH_CHECK(k_scale.has_value() == fp8 && v_scale.has_value() == fp8,
              "paged_decode: k_scale, v_scale are required for an e4m3 cache and must be absent for bf16");
  const int64_t max_blocks = block_tables.size(1);
  TORCH_CHECK(max_blocks >= 1 && max_blocks * bs < (int64_t{1} << 31), "paged_decode: need 1 <= max_blocks, max_blocks * bs < 2^31");
  TORCH_CHECK(max_splits == atlas::paged_decode_max_splits(max_blocks * bs, static_cast<int>(nkv)),
              "paged_decode: max_splits must be paged_decode_max_splits(max_blocks * bs, nkv) = ",
              num(atlas::paged_decode_max_splits(max_blocks * bs, static_cast<int>(nkv))), ", got ", num(max_splits));
  const c10::cuda::CUDAGuard guard(query.device());
  atlas::PagedDecodeArgs a{};
  a.query = query.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  if (fp8) {
    for (const torch::Tensor* s : {&*k_scale, &*v_scale}) {
      CHECK_CUDA_TENSOR(*s); CHECK_CONTIGUOUS(*s);
      TORCH_CHECK(s->scalar_type() == torch::kFloat && s->dim() == 3 && s->size(0) == num_blocks &&
                  s->size(1) == bs && s->size(2) == nkv,
                  "paged_decode: k_scale, v_scale must be float32 [num_blocks, bs, nkv]");
    }
    a.k_scale = k_scale->data_ptr<float>();
    a.v_scale = v_scale->data_ptr<float>();
  }
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.out = out.data_ptr();
  a.lse = lse.data_ptr<float>();
  if (max_splits > 1) {
    CHECK_CUDA_TENSOR(partial_o); CHECK_CONTIGUOUS(partial_o); CHECK_CUDA_TENSOR(partial_lse); CHECK_CONTIGUOUS(partial_lse);
    const int64_t rows = (nkv > 0 ? nq / nkv : 0) * q_len;
    TORCH_CHECK(partial_o.scalar_type() == torch::kFloat && partial_o.numel() >= b * nkv * max_splits * rows * hd &&
                partial_lse.scalar_type() == torch::kFloat && partial_lse.numel() >= b * nkv * max_splits * rows,
                "paged_decode: partial_o, partial_lse must be float32 [B, nkv, max_splits, group*q_len(, hd)]");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(partial_o.data_ptr()) % 16 == 0, "paged_decode: partial_o must start 16-byte aligned");
    a.partial_o = partial_o.data_ptr<float>();
    a.partial_lse = partial_lse.data_ptr<float>();
  }
  // the stride of a size-1 dim is meaningless (only index 0 is read)
  a.q_stride_b = b > 1 ? query.stride(0) : 0;
  a.q_stride_t = q_len > 1 ? query.stride(1) : 0;
  a.batch = static_cast<int>(b);
  a.q_len = static_cast<int>(q_len);
  a.num_q_heads = static_cast<int>(nq);
  a.num_kv_heads = static_cast<int>(nkv);
  a.head_dim = static_cast<int>(hd);
  a.block_size = static_cast<int>(bs);
  a.num_blocks = static_cast<int>(std::min<int64_t>(num_blocks, INT32_MAX));
  a.max_blocks = static_cast<int>(max_blocks);
  a.max_splits = static_cast<int>(max_splits);
  a.softmax_scale = static_cast<float>(softmax_scale);
  a.kv_dtype = fp8 ? atlas::DType::kE4M3 : atlas::DType::kBF16;
  if (gate.has_value()) {
    const torch::Tensor& gt = *gate;
    CHECK_CUDA_TENSOR(gt);
    TORCH_CHECK(gt.scalar_type() == torch::kBFloat16 && gt.sizes() == query.sizes() && gt.stride(3) == 1 &&
                gt.device() == query.device(), "paged_decode: gate must be bf16 [B, q_len, nq, hd] like query, "
                "hd contiguous, on query's device");
    a.gate = gt.data_ptr();
    a.gate_stride_b = b > 1 ? gt.stride(0) : 0;
    a.gate_stride_t = q_len > 1 ? gt.stride(1) : 0;
    a.gate_stride_h = nq > 1 ? gt.stride(2) : 0;
    TORCH_CHECK(reinterpret_cast<uintptr_t>(a.gate) % 16 == 0 && a.gate_stride_b % 8 == 0 && a.gate_stride_t % 8 == 0 &&
                a.gate_stride_h % 8 == 0 && a.gate_stride_b >= 0 && a.gate_stride_t >= 0 && a.gate_stride_h >= 0,
                "paged_decode: gate must start 16-byte aligned with non-negative strides that are multiples of 8, got strides (",
                num(gt.stride(0)), ", ", num(gt.stride(1)), ", ", num(gt.stride(2)), ")");
  }
  check_cuda(atlas::launch_paged_decode(a, current_stream(query)), "paged_decode");
}


// ---- small fused layer kernels (norm, rope, gating, argmax, embedding, moe routing) ---------
// -- rms_norm / qk_norm_rope / sigmoid_gate_mul (attention layer work) --
void rms_norm(const torch::Tensor& x,        // [R, D] bf16, inner dim contiguous
              const torch::Tensor& weight,   // [D] bf16|f32
              torch::Tensor& out,            // [R, D] bf16 (out)
              const std::optional<torch::Tensor>& residual,  // [R, D] bf16 contiguous (in/out) or none
              double eps, bool zero_centered) {
  CHECK_CUDA_TENSOR(x); CHECK_CUDA_TENSOR(weight); CHECK_CONTIGUOUS(weight); CHECK_CONTIGUOUS(out);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1 && x.size(1) % 8 == 0 &&
              (x.size(0) <= 1 || x.stride(0) % 8 == 0), "rms_norm: x must be bf16 [R, D], D % 8 == 0, row stride % 8 == 0");
  TORCH_CHECK(weight.numel() == x.size(1) && (weight.scalar_type() == torch::kBFloat16 || weight.scalar_type() == torch::kFloat),
              "rms_norm: weight must be bf16|f32 [D]");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == torch::kBFloat16, "rms_norm: out must be bf16 [R, D]");
  const c10::cuda::CUDAGuard guard(x.device());
  atlas::RmsNormArgs a{};
  a.x = x.data_ptr(); a.weight = weight.data_ptr(); a.out = out.data_ptr();
  a.rows = x.size(0); a.dim = x.size(1); a.x_row_stride = x.size(0) > 1 ? x.stride(0) : x.size(1);
  a.eps = static_cast<float>(eps); a.weight_f32 = weight.scalar_type() == torch::kFloat; a.zero_centered = zero_centered;
  if (residual.has_value()) {
    CHECK_CUDA_TENSOR(*residual); CHECK_CONTIGUOUS(*residual);
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == torch::kBFloat16,
                "rms_norm: residual must be bf16 [R, D] like x");
    a.residual = residual->data_ptr();
  }
  check_cuda(atlas::launch_rms_norm(a, current_stream(x)), "rms_norm");
}

void qk_norm_rope(const torch::Tensor& q,               // [T, nq, hd] bf16, strided, inner contiguous
                  const torch::Tensor& k,               // [T, nkv, hd] bf16, strided
                  const torch::Tensor& v,               // [T, nkv, hd] bf16, strided
                  const torch::Tensor& q_norm_weight,   // [hd] bf16|f32
                  const torch::Tensor& k_norm_weight,   // [hd] same dtype
                  const torch::Tensor& positions,       // [T] int64
                  torch::Tensor& k_cache,               // [num_blocks, bs, nkv, hd] bf16|e4m3 (in/out)
                  torch::Tensor& v_cache,               // [num_blocks, bs, nkv, hd] bf16|e4m3 (in/out)
                  const torch::Tensor& slot_mapping,    // [T] int64
                  const std::optional<torch::Tensor>& k_scale,  // [num_blocks, bs, nkv] f32 (out, e4m3 only)
                  const std::optional<torch::Tensor>& v_scale,
                  torch::Tensor& q_out,                 // [T, nq, hd] bf16 (out)
                  double eps, bool zero_centered, int64_t rotary_dim, double rope_theta) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{
           &q, &k, &v, &q_norm_weight, &k_norm_weight, &positions, &k_cache, &v_cache, &slot_mapping, &q_out})
    CHECK_CUDA_TENSOR(*t);
  CHECK_CONTIGUOUS(k_cache); CHECK_CONTIGUOUS(v_cache); CHECK_CONTIGUOUS(q_out); CHECK_CONTIGUOUS(positions);
  CHECK_CONTIGUOUS(slot_mapping); CHECK_CONTIGUOUS(q_norm_weight); CHECK_CONTIGUOUS(k_norm_weight);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "qk_norm_rope: q must be [T, nq, hd], k and v [T, nkv, hd]");
  const int64_t t = q.size(0), nq = q.size(1), nkv = k.size(1), hd = q.size(2);
  for (const auto* x : {&q, &k, &v})
    TORCH_CHECK(x->scalar_type() == torch::kBFloat16 && x->stride(2) == 1 && x->stride(0) % 8 == 0 && x->stride(1) % 8 == 0 &&
                reinterpret_cast<uintptr_t>(x->data_ptr()) % 16 == 0,
                "qk_norm_rope: q, k, v must be bf16 with contiguous rows, strides % 8 == 0, 16-byte aligned");
  const bool fp8 = k_cache.scalar_type() == at::ScalarType::Float8_e4m3fn;
  TORCH_CHECK((fp8 || k_cache.scalar_type() == torch::kBFloat16) && v_cache.scalar_type() == k_cache.scalar_type() &&
              k_cache.dim() == 4 && k_cache.size(2) == nkv && k_cache.size(3) == hd && v_cache.sizes() == k_cache.sizes(),
              "qk_norm_rope: k_cache, v_cache must be bf16|e4m3 [num_blocks, bs, nkv, hd]");
  TORCH_CHECK(k_scale.has_value() == fp8 && v_scale.has_value() == fp8,
              "qk_norm_rope: k_scale, v_scale are required for an e4m3 cache and must be absent for bf16");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.numel() == t && slot_mapping.scalar_type() == torch::kLong &&
              slot_mapping.numel() == t, "qk_norm_rope: positions, slot_mapping must be int64 [T]");
  TORCH_CHECK(q_norm_weight.numel() == hd && k_norm_weight.numel() == hd && k_norm_weight.scalar_type() == q_norm_weight.scalar_type() &&
              (q_norm_weight.scalar_type() == torch::kBFloat16 || q_norm_weight.scalar_type() == torch::kFloat),
              "qk_norm_rope: q_norm_weight, k_norm_weight must be bf16|f32 [hd] of one dtype");
  TORCH_CHECK(q_out.scalar_type() == torch::kBFloat16 && q_out.dim() == 3 && q_out.size(0) == t && q_out.size(1) == nq &&
              q_out.size(2) == hd, "qk_norm_rope: q_out must be bf16 [T, nq, hd]");
  const c10::cuda::CUDAGuard guard(q.device());
  atlas::QkNormRopeArgs a{};
  a.q = q.data_ptr(); a.k = k.data_ptr(); a.v = v.data_ptr();
  a.q_stride_t = q.stride(0); a.q_stride_h = q.stride(1);
  a.k_stride_t = k.stride(0); a.k_stride_h = k.stride(1);
  a.v_stride_t = v.stride(0); a.v_stride_h = v.stride(1);
  a.q_norm_weight = q_norm_weight.data_ptr(); a.k_norm_weight = k_norm_weight.data_ptr();
  a.weight_f32 = q_norm_weight.scalar_type() == torch::kFloat;
  a.positions = positions.data_ptr<int64_t>(); a.slot_mapping = slot_mapping.data_ptr<int64_t>();
  a.q_out = q_out.data_ptr(); a.k_cache = k_cache.data_ptr(); a.v_cache = v_cache.data_ptr();
  if (fp8) {
    for (const auto* s : {&*k_scale, &*v_scale}) {
      CHECK_CUDA_TENSOR(*s); CHECK_CONTIGUOUS(*s);
      TORCH_CHECK(s->scalar_type() == torch::kFloat && s->numel() == k_cache.size(0) * k_cache.size(1) * nkv,
                  "qk_norm_rope: k_scale, v_scale must be float32 [num_blocks, bs, nkv]");
    }
    a.k_scale = k_scale->data_ptr<float>(); a.v_scale = v_scale->data_ptr<float>();
  }
  a.num_slots = k_cache.size(0) * k_cache.size(1);
  a.num_tokens = static_cast<int>(t); a.nq = static_cast<int>(nq); a.nkv = static_cast<int>(nkv);
  a.head_dim = static_cast<int>(hd); a.rotary_dim = static_cast<int>(rotary_dim);
  a.log2_theta = std::log2(rope_theta); a.eps = static_cast<float>(eps);
  a.zero_centered = zero_centered; a.cache_fp8 = fp8;
  check_cuda(atlas::launch_qk_norm_rope(a, current_stream(q)), "qk_norm_rope");
}

void sigmoid_gate_mul(const torch::Tensor& x,      // [T, H, hd] bf16 contiguous
                      const torch::Tensor& gate,   // [T, H, hd] bf16, strided, inner contiguous
                      torch::Tensor& out) {        // [T, H, hd] bf16 (out, may alias x)
  CHECK_CUDA_TENSOR(x); CHECK_CUDA_TENSOR(gate); CHECK_CONTIGUOUS(x); CHECK_CONTIGUOUS(out);
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kBFloat16 && gate.sizes() == x.sizes() &&
              gate.scalar_type() == torch::kBFloat16 && out.sizes() == x.sizes() && out.scalar_type() == torch::kBFloat16,
              "sigmoid_gate_mul: x, gate, out must be bf16 [T, H, hd]");
  TORCH_CHECK(x.size(2) % 8 == 0 && gate.stride(2) == 1 && gate.stride(0) % 8 == 0 && gate.stride(1) % 8 == 0 &&
              reinterpret_cast<uintptr_t>(gate.data_ptr()) % 16 == 0,
              "sigmoid_gate_mul: hd % 8 == 0, gate rows contiguous with strides % 8 == 0 and 16-byte aligned");
  const c10::cuda::CUDAGuard guard(x.device());
  atlas::SigmoidGateArgs a{};
  a.x = x.data_ptr(); a.gate = gate.data_ptr(); a.out = out.data_ptr();
  a.tokens = x.size(0); a.heads = x.size(1); a.head_dim = x.size(2);
  a.gate_stride_t = gate.stride(0); a.gate_stride_h = gate.stride(1);
  check_cuda(atlas::launch_sigmoid_gate_mul(a, current_stream(x)), "sigmoid_gate_mul");
}


// -- argmax / moe_route / embedding (MTP work) --
void argmax(const torch::Tensor& logits,     // [R, V] bf16|f32, inner dim contiguous
            torch::Tensor& ids,              // [R] int64 (out)
            torch::Tensor& prob,             // [R] f32 (out)
            torch::Tensor& partials) {       // [3, R, ceil(V / kArgmaxChunk)] f32 (scratch)
  CHECK_CUDA_TENSOR(logits); CHECK_CONTIGUOUS(ids); CHECK_CONTIGUOUS(prob); CHECK_CONTIGUOUS(partials);
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 &&
              (logits.scalar_type() == torch::kBFloat16 || logits.scalar_type() == torch::kFloat),
              "argmax: logits must be bf16|f32 [R, V] with a contiguous last dim");
  const int64_t r = logits.size(0), v = logits.size(1);
  TORCH_CHECK(ids.numel() == r && ids.scalar_type() == torch::kInt64, "argmax: ids must be int64 [R]");
  TORCH_CHECK(prob.numel() == r && prob.scalar_type() == torch::kFloat, "argmax: prob must be f32 [R]");
  TORCH_CHECK(partials.numel() == 3 * r * ((v + atlas::kArgmaxChunk - 1) / atlas::kArgmaxChunk) &&
              partials.scalar_type() == torch::kFloat, "argmax: partials must be f32 [3, R, ceil(V / chunk)]");
  const c10::cuda::CUDAGuard guard(logits.device());
  atlas::ArgmaxArgs a{};
  a.logits = logits.data_ptr();
  a.dtype = logits.scalar_type() == torch::kBFloat16 ? atlas::DType::kBF16 : atlas::DType::kF32;
  a.rows = r; a.vocab = v; a.row_stride = r > 1 ? logits.stride(0) : v;
  a.partials = partials.data_ptr<float>(); a.ids = ids.data_ptr<int64_t>(); a.prob = prob.data_ptr<float>();
  check_cuda(atlas::launch_argmax(a, current_stream(logits)), "argmax");
}

void moe_router(const torch::Tensor& x,       // [T, h] bf16, contiguous, 16-byte aligned
                const torch::Tensor& gates,   // [R, h] bf16, contiguous, 16-byte aligned (R = E | E + 1)
                torch::Tensor& logits,        // [T, R] bf16 (out)
                torch::Tensor& ids,           // [T, k (+1)] int32 (out)
                torch::Tensor& weights,       // [T, k (+1)] f32 (out)
                int64_t num_experts, bool renormalize, bool shared_slot) {
  CHECK_CUDA_TENSOR(x); CHECK_CUDA_TENSOR(gates); CHECK_CONTIGUOUS(x); CHECK_CONTIGUOUS(gates);
  CHECK_CONTIGUOUS(logits); CHECK_CONTIGUOUS(ids); CHECK_CONTIGUOUS(weights);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "moe_router: x must be bf16 [T, h]");
  TORCH_CHECK(gates.dim() == 2 && gates.scalar_type() == torch::kBFloat16 && gates.size(1) == x.size(1),
              "moe_router: gates must be bf16 [R, h] with x's h");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(gates.data_ptr()) % 16 == 0,
              "moe_router: x and gates must start 16-byte aligned");
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == x.size(0) && logits.size(1) == gates.size(0) &&
              logits.scalar_type() == torch::kBFloat16, "moe_router: logits must be bf16 [T, R]");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == torch::kInt32,
              "moe_router: ids must be int32 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == torch::kFloat, "moe_router: weights must be f32 [T, k]");
  const c10::cuda::CUDAGuard guard(x.device());
  atlas::MoeRouterArgs a{};
  a.x = x.data_ptr(); a.gates = gates.data_ptr();
  a.num_tokens = x.size(0); a.hidden = static_cast<int>(x.size(1)); a.rows = static_cast<int>(gates.size(0));
  a.num_experts = static_cast<int>(num_experts);
  a.top_k = static_cast<int>(ids.size(1)) - (shared_slot ? 1 : 0);
  a.renormalize = renormalize; a.shared_slot = shared_slot;
  a.logits = logits.data_ptr(); a.ids = ids.data_ptr<int32_t>(); a.weights = weights.data_ptr<float>();
  check_cuda(atlas::launch_moe_router(a, current_stream(x)), "moe_router");
}

void moe_route(const torch::Tensor& logits,   // [T, E (+1 shared gate)] bf16|f32, last dim contiguous
               torch::Tensor& ids,            // [T, k (+1)] int32 (out)
               torch::Tensor& weights,        // [T, k (+1)] f32 (out)
               bool renormalize, bool shared_slot) {
  CHECK_CUDA_TENSOR(logits); CHECK_CONTIGUOUS(ids); CHECK_CONTIGUOUS(weights);
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 &&
              (logits.scalar_type() == torch::kBFloat16 || logits.scalar_type() == torch::kFloat),
              "moe_route: logits must be bf16|f32 [T, E] with a contiguous last dim");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == logits.size(0) && ids.scalar_type() == torch::kInt32,
              "moe_route: ids must be int32 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == torch::kFloat, "moe_route: weights must be f32 [T, k]");
  const c10::cuda::CUDAGuard guard(logits.device());
  atlas::MoeRouteArgs a{};
  a.logits = logits.data_ptr();
  a.dtype = logits.scalar_type() == torch::kBFloat16 ? atlas::DType::kBF16 : atlas::DType::kF32;
  const int extra = shared_slot ? 1 : 0;   // shared slot: column E of the logits, slot k of the outputs
  a.num_tokens = logits.size(0); a.num_experts = static_cast<int>(logits.size(1)) - extra;
  a.top_k = static_cast<int>(ids.size(1)) - extra;
  a.row_stride = logits.size(0) > 1 ? logits.stride(0) : logits.size(1);
  a.renormalize = renormalize; a.shared_slot = shared_slot;
  a.ids = ids.data_ptr<int32_t>(); a.weights = weights.data_ptr<float>();
  check_cuda(atlas::launch_moe_route(a, current_stream(logits)), "moe_route");
}

void embedding(const torch::Tensor& table,   // [V, h] bf16 contiguous
               const torch::Tensor& ids,     // [T] int32|int64 contiguous
               torch::Tensor& out) {         // [T, h] bf16 (out)
  CHECK_CUDA_TENSOR(table); CHECK_CUDA_TENSOR(ids); CHECK_CONTIGUOUS(table); CHECK_CONTIGUOUS(ids); CHECK_CONTIGUOUS(out);
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == torch::kBFloat16, "embedding: table must be bf16 [V, h]");
  TORCH_CHECK(ids.dim() == 1 && (ids.scalar_type() == torch::kInt32 || ids.scalar_type() == torch::kInt64),
              "embedding: ids must be int32|int64 [T]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == ids.size(0) && out.size(1) == table.size(1) &&
              out.scalar_type() == torch::kBFloat16, "embedding: out must be bf16 [T, h]");
  const c10::cuda::CUDAGuard guard(table.device());
  atlas::EmbeddingArgs a{};
  a.table = table.data_ptr(); a.ids = ids.data_ptr(); a.ids_int64 = ids.scalar_type() == torch::kInt64;
  a.out = out.data_ptr(); a.num_tokens = ids.size(0); a.vocab = table.size(0); a.hidden = table.size(1);
  check_cuda(atlas::launch_embedding(a, current_stream(table)), "embedding");
}

void embedding_norm_concat(const torch::Tensor& table,      // [V, h] bf16 contiguous
                           const torch::Tensor& ids,        // [T] int32|int64 contiguous
                           const torch::Tensor& hidden,     // [T, h] bf16, rows strided
                           const torch::Tensor& w_embed,    // [h] f32
                           const torch::Tensor& w_hidden,   // [h] f32
                           torch::Tensor& out,              // [T, 2h] bf16 (out)
                           double eps, bool zero_centered) {
  CHECK_CUDA_TENSOR(table); CHECK_CUDA_TENSOR(ids); CHECK_CUDA_TENSOR(hidden); CHECK_CONTIGUOUS(table);
  CHECK_CONTIGUOUS(ids); CHECK_CONTIGUOUS(w_embed); CHECK_CONTIGUOUS(w_hidden); CHECK_CONTIGUOUS(out);
  const int64_t t = ids.size(0), h = table.size(1);
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == torch::kBFloat16, "embedding_norm_concat: table must be bf16 [V, h]");
  TORCH_CHECK(ids.dim() == 1 && (ids.scalar_type() == torch::kInt32 || ids.scalar_type() == torch::kInt64),
              "embedding_norm_concat: ids must be int32|int64 [T]");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == t && hidden.size(1) == h && hidden.stride(1) == 1 &&
              hidden.scalar_type() == torch::kBFloat16, "embedding_norm_concat: hidden must be bf16 [T, h]");
  TORCH_CHECK(w_embed.numel() == h && w_hidden.numel() == h && w_embed.scalar_type() == torch::kFloat &&
              w_hidden.scalar_type() == torch::kFloat, "embedding_norm_concat: norm weights must be f32 [h]");
  TORCH_CHECK(out.numel() == t * 2 * h && out.scalar_type() == torch::kBFloat16, "embedding_norm_concat: out must be bf16 [T, 2h]");
  const c10::cuda::CUDAGuard guard(table.device());
  atlas::EmbeddingNormConcatArgs a{};
  a.table = table.data_ptr(); a.ids = ids.data_ptr(); a.ids_int64 = ids.scalar_type() == torch::kInt64;
  a.hidden = hidden.data_ptr(); a.hidden_stride = t > 1 ? hidden.stride(0) : h;
  a.w_embed = w_embed.data_ptr<float>(); a.w_hidden = w_hidden.data_ptr<float>(); a.out = out.data_ptr();
  a.num_tokens = t; a.vocab = table.size(0); a.hidden_size = static_cast<int>(h);
  a.eps = static_cast<float>(eps); a.zero_centered = zero_centered;
  check_cuda(atlas::launch_embedding_norm_concat(a, current_stream(table)), "embedding_norm_concat");
}

namespace moe {
// The NVFP4 stack layouts (atlas/nvfp4.py): 0 checkpoint words, packed [E, N, K/2] + scales
// [E, N, K/16], both contiguous; 1 words in the GEMV bit order (expert_words_for_gemv), packed
// [E, N, K/8, 4] + the same scales; 2 tiled (tile_expert_stack), packed [E, N, K/128, 64] with
// strides (N·K/2, 64, N·64, 1) + scales [E, N, K/128, 8] with strides (N·K/16, 8, N·8, 1): the
// views of per-expert chunk-major buffers.
enum StackLayout { kCheckpointWords = 0, kGemvWords = 1, kTiled = 2 };

// [E, n, k/128, b] with the strides above (any stride on a size-1 dim)
bool tiled_view(const torch::Tensor& t, int64_t n, int64_t k, int64_t b) {
  if (t.dim() != 4 || k % 128 != 0 || t.size(1) != n || t.size(2) != k / 128 || t.size(3) != b) return false;
  const int64_t want[4] = {n * k / 128 * b, b, n * b, 1};
  for (int d = 0; d < 4; ++d) {
    if (t.size(d) != 1 && t.stride(d) != want[d]) return false;
  }
  return true;
}

// One expert stack: bf16 [E, N, K] (scale, gs undefined) or NVFP4 packed + e4m3 scales + f32 [E]
// global scales in one of the layouts above (*layout).
atlas::ExpertStack stack(const torch::Tensor& w, const c10::optional<torch::Tensor>& scale,
                         const c10::optional<torch::Tensor>& gs, bool nvfp4, int64_t n, int64_t k, const char* name,
                         int* layout) {
  CHECK_CUDA_TENSOR(w);
  *layout = !nvfp4 || w.dim() == 3 ? kCheckpointWords : w.dim() == 4 && w.size(-1) == 64 ? kTiled : kGemvWords;
  if (*layout != kTiled) CHECK_CONTIGUOUS(w);
  TORCH_CHECK((w.dim() == 3 || (nvfp4 && w.dim() == 4)) && w.size(1) == n, "moe_experts: ", name, " must be [E, ",
              num(n), ", K] (NVFP4: [E, N, K/2], [E, N, K/8, 4] or tiled [E, N, K/128, 64])");
  atlas::ExpertStack s{};
  s.weight = w.data_ptr();
  if (nvfp4) {
    const bool packed_k = *layout == kTiled      ? tiled_view(w, n, k, 64)
                          : *layout == kGemvWords ? w.size(2) == k / 8 && w.size(3) == 4
                                                  : w.size(2) == k / 2;
    TORCH_CHECK(w.scalar_type() == torch::kByte && packed_k && scale.has_value() && gs.has_value(),
                "moe_experts: ", name, " must be NVFP4 (packed, block_scale, global_scale)",
                *layout == kTiled ? " (tiled: the views tile_expert_stack returns)" : "");
    const bool scale_ok = *layout == kTiled ? tiled_view(*scale, n, k, 8)
                                            : scale->is_contiguous() && scale->dim() == 3 && scale->size(1) == n &&
                                                  scale->size(2) == k / 16;
    TORCH_CHECK(scale_ok && scale->size(0) == w.size(0) && scale->scalar_type() == torch::kFloat8_e4m3fn &&
                gs->is_contiguous() && gs->numel() == w.size(0) && gs->scalar_type() == torch::kFloat,
                "moe_experts: ", name, " scales must be e4m3 ",
                *layout == kTiled ? "[E, N, K/128, 8] (tiled)" : "[E, N, K/16]", " and f32 [E]");
    s.block_scale = reinterpret_cast<const uint8_t*>(scale->data_ptr());
    s.global_scale = gs->data_ptr<float>();
  } else {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.size(2) == k, "moe_experts: ", name, " must be bf16 [E, N, K]");
  }
  return s;
}
}  // namespace moe

void moe_experts(const torch::Tensor& x,        // [T, h] bf16
                 const torch::Tensor& ids,      // [T, k] int32
                 const torch::Tensor& weights,  // [T, k] f32
                 const torch::Tensor& gate, const c10::optional<torch::Tensor>& gate_scale,
                 const c10::optional<torch::Tensor>& gate_gs,   // [E, I, h]
                 const torch::Tensor& up, const c10::optional<torch::Tensor>& up_scale,
                 const c10::optional<torch::Tensor>& up_gs,     // [E, I, h]
                 const torch::Tensor& down, const c10::optional<torch::Tensor>& down_scale,
                 const c10::optional<torch::Tensor>& down_gs,   // [E, h, I]
                 const c10::optional<torch::Tensor>& shared,        // [T, h] bf16 or none
                 const c10::optional<torch::Tensor>& shared_gate,   // [T] bf16 (strided) or none
                 torch::Tensor& out) {          // [T, h] f32 (no shared) | bf16 (shared) (out)
  CHECK_CUDA_TENSOR(x); CHECK_CONTIGUOUS(x); CHECK_CONTIGUOUS(ids); CHECK_CONTIGUOUS(weights);
  CHECK_CONTIGUOUS(out);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "moe_experts: x must be bf16 [T, h]");
  const int64_t t = x.size(0), h = x.size(1), k = ids.size(1), inter = gate.size(1);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == t && ids.scalar_type() == torch::kInt, "moe_experts: ids must be int32 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == torch::kFloat, "moe_experts: weights must be f32 [T, k]");
  const bool with_shared = shared.has_value();
  TORCH_CHECK(out.numel() == t * h && (out.scalar_type() == torch::kBFloat16 ||
                                       (!with_shared && out.scalar_type() == torch::kFloat)),
              "moe_experts: out must be [T, h], f32 | bf16 (bf16 with a shared expert)");
  if (with_shared) {
    TORCH_CHECK(shared->is_contiguous() && shared->numel() == t * h && shared->scalar_type() == torch::kBFloat16 &&
                shared_gate.has_value() && shared_gate->dim() == 1 && shared_gate->size(0) == t &&
                shared_gate->scalar_type() == torch::kBFloat16,
                "moe_experts: shared must be bf16 [T, h] and shared_gate bf16 [T]");
  }
  const bool nvfp4 = gate.scalar_type() == torch::kByte;
  const c10::cuda::CUDAGuard guard(x.device());
  atlas::MoeExpertsArgs a{};
  a.x = x.data_ptr(); a.ids = ids.data_ptr<int32_t>(); a.weights = weights.data_ptr<float>();
  int layout[3];
  a.gate = moe::stack(gate, gate_scale, gate_gs, nvfp4, inter, h, "gate", &layout[0]);
  a.up = moe::stack(up, up_scale, up_gs, nvfp4, inter, h, "up", &layout[1]);
  a.down = moe::stack(down, down_scale, down_gs, nvfp4, h, inter, "down", &layout[2]);
  TORCH_CHECK(layout[0] == layout[1] && layout[1] == layout[2],
              "moe_experts: gate, up and down must share one NVFP4 layout (all [E, N, K/2], all [E, N, K/8, 4] "
              "or all tiled)");
  a.nvfp4 = nvfp4; a.gemv_words = layout[0] != moe::kCheckpointWords; a.tiled = layout[0] == moe::kTiled;
  a.out = out.data_ptr();
  a.out_bf16 = out.scalar_type() == torch::kBFloat16;
  if (with_shared) {
    a.shared = shared->data_ptr(); a.shared_gate = shared_gate->data_ptr(); a.shared_gate_stride = shared_gate->stride(0);
  }
  a.num_tokens = t; a.top_k = static_cast<int>(k); a.num_experts = static_cast<int>(gate.size(0));
  a.hidden = static_cast<int>(h); a.inter = static_cast<int>(inter);
  // scratch (expert groups, act, d) from the caching allocator, stream-ordered like any output
  const size_t ws_bytes = atlas::moe_experts_workspace_bytes(t, a.top_k, a.num_experts, a.hidden, a.inter);
  TORCH_CHECK(ws_bytes > 0, "moe_experts: sizes out of range (T*k <= 65535, k <= 32, E <= 4096, h, I % 32 in [32, 8192])");
  torch::Tensor workspace = torch::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(torch::kByte));
  a.workspace = workspace.data_ptr();
  check_cuda(atlas::launch_moe_experts(a, current_stream(x)), "moe_experts");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "atlas CUDA kernels (see atlas/ops.py for the validated Python API)";
  m.def("quantize_nvfp4", &quantize_nvfp4, "BF16/F16/F32 [N,K] -> NVFP4 packed, block scales, global scale");
  m.def("w4a16_gemv", &w4a16_gemv,
        "x [M<=32,K] bf16 (or bf16(silu(gate)*up)) . NVFP4 W[:n_rows]^T -> out [M,n_rows] bf16|f32; q|gate de-interleave");
  m.def("w4a16_gemv_dual", &w4a16_gemv_dual,
        "x [M<=32,K] bf16 . (W1, W2)^T -> out1 [M,N1], out2 [M,N2] in one launch; q|gate de-interleave of out1");
  m.def("w4a16_gemv_gated", &w4a16_gemv_gated,
        "bf16(x * sigmoid(gate)) [M<=32,K] (gate rows strided) . NVFP4 W^T -> out [M,N] bf16|f32");
  // ---- w4a16_gemv (owned by the GEMV work; insert defs above this line) ----
  m.def("reshape_and_cache", &reshape_and_cache,
        "K/V rows [T,nkv,hd] bf16 -> paged cache slots (bf16 copy | e4m3 + per-row f32 scale), in place");
  m.def("paged_decode", &paged_decode,
        "causal GQA attention of q_len <= 8 new tokens over the paged KV cache (bf16 | e4m3 + per-row scale), split-K; "
        "optional output gate bf16(o * sigmoid(gate))");
  // ---- reshape_and_cache / paged_decode (owned by the paged-KV work; insert defs above this line) ----
  m.def("rms_norm", &rms_norm, "x [R,D] bf16 -> rmsnorm(x) * (w | 1+w) bf16, fp32 math; optional residual += x first");
  m.def("qk_norm_rope", &qk_norm_rope,
        "per-head q/k RMSNorm + partial NeoX RoPE -> q_out; K/V into the paged cache (bf16 | e4m3 + per-row scale)");
  m.def("sigmoid_gate_mul", &sigmoid_gate_mul, "out = x * sigmoid(gate), bf16 [T,H,hd], gate strided");
  m.def("argmax", &argmax, "logits [R,V] bf16|f32 -> ids int64 [R] (lowest index wins), top-1 softmax prob f32 [R]");
  m.def("moe_route", &moe_route, "router logits [T,E] -> top-k expert ids int32 [T,k], f32 softmax weights [T,k]");
  m.def("moe_router", &moe_router, "x [T,h] bf16 . gates [E(+1),h]^T -> bf16 logits [T,E(+1)], then moe_route's ids int32 [T,k(+1)] "
        "and f32 weights, one launch");
  m.def("moe_experts", &moe_experts, "routed SwiGLU experts over device ids [T,k] (bf16|nvfp4 stacks), grouped by expert on the device -> f32|bf16 [T,h]");
  m.def("embedding_norm_concat", &embedding_norm_concat, "MTP fc input [rmsnorm(embed[ids]) | rmsnorm(hidden)] -> bf16 [T,2h]");
  m.def("embedding", &embedding, "table [V,h] bf16 rows by device ids [T] -> [T,h] bf16 (bad id -> zero row)");
  // ---- small fused kernels for layers (norm, rope, gating, argmax, moe; insert defs above this line) ----
}
