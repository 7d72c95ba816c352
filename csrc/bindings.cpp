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
// (each kernel family adds its header include here)

namespace {

cudaStream_t current_stream(const torch::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

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

// ---- reshape_and_cache / paged_decode bindings (paged KV family) --------------------------

// ---- small fused layer kernels (norm, rope, gating, argmax, embedding, moe routing) ---------

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "atlas CUDA kernels (see atlas/ops.py for the validated Python API)";
  m.def("quantize_nvfp4", &quantize_nvfp4, "BF16/F16/F32 [N,K] -> NVFP4 packed, block scales, global scale");
  // ---- w4a16_gemv (owned by the GEMV work; insert defs above this line) ----
  // ---- reshape_and_cache / paged_decode (owned by the paged-KV work; insert defs above this line) ----
  // ---- small fused kernels for layers (norm, rope, gating, argmax, moe; insert defs above this line) ----
}
