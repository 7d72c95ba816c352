// Shared by the torch-free C++ test drivers in csrc/tests/ (run by ctest, e.g. under
// compute-sanitizer): the error check and the "no GPU → skipped" rule.
#pragma once
#include <cuda_runtime.h>
#include <cstdio>

// In a function returning int: print where a CUDA call failed and return 1.
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); return 1; } } while (0)

namespace atlas_test {

// ctest's SKIP_RETURN_CODE (CMakeLists.txt): a driver exits with it on a machine without a GPU.
constexpr int kSkipped = 77;

// True (and says so) when there is no CUDA device to run on.
inline bool no_cuda_device() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) return false;
  std::printf("no CUDA device: skipped\n");
  return true;
}

}  // namespace atlas_test
