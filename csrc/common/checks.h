// Launcher-side helpers shared by every kernel .cu (CUDA headers only, no torch).
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace atlas {

// Ceil division for grid sizes: ceil_div(10, 4) = 3.
template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }

// Return the first error of a launch (configuration errors surface here, not at sync).
inline cudaError_t last_launch_error() { return cudaGetLastError(); }

}  // namespace atlas

// In a launcher: `ATLAS_RETURN_IF_ERROR(cudaMemsetAsync(...));`
#define ATLAS_RETURN_IF_ERROR(expr)            \
  do {                                         \
    cudaError_t atlas_err_ = (expr);           \
    if (atlas_err_ != cudaSuccess) return atlas_err_; \
  } while (0)
