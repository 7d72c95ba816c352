// l2_prefetch: start streaming byte regions of device memory into L2 — no result, no effect on
// memory, only on where a later kernel finds the bytes. Used to fill L2 with the first rows of a
// large weight (the MTP head's LM head) while a chain of latency-bound kernels leaves DRAM idle.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace atlas {

constexpr int kL2PrefetchMaxRegions = 8;

// `runs` runs of `run_bytes` contiguous bytes, `stride` bytes apart, from `base` (a strided view:
// e.g. a row prefix of a chunk-major weight is one run per chunk). base, run_bytes and stride are
// multiples of 16 (cp.async.bulk's granule).
struct L2PrefetchRegion {
  const uint8_t* base = nullptr;
  int64_t run_bytes = 0;
  int64_t stride = 0;
  int64_t runs = 0;
};

struct L2PrefetchArgs {
  L2PrefetchRegion region[kL2PrefetchMaxRegions];
  int count = 0;          // regions used, 1..kL2PrefetchMaxRegions
  int blocks = 0;         // each run is cut into `blocks` pieces; pieces go out block-major (all
                          // runs' first pieces, then their second, …), so a cut-short prefetch
                          // has covered a prefix of every run. ≥ 1.
  bool evict_last = true; // L2 policy of the prefetched lines: evict_last (kept over the lines
                          // the kernels in between read with the normal policy) or evict_normal
};

// One launch on `stream`; never syncs. cudaErrorInvalidValue for a bad region (alignment,
// sizes), else the launch error.
cudaError_t launch_l2_prefetch(const L2PrefetchArgs& args, cudaStream_t stream);

}  // namespace atlas
