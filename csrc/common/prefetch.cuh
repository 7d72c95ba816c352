// Cache prefetch hints (global addresses): no result, no fault, no effect on memory; they only
// start a line's trip early so a later load or copy of it finds the line nearer.
#pragma once
#include <cstdint>

namespace atlas {

// The line holding `p` into L1 (for an __ldg issued later).
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p)); }

// The line holding `p` into L2.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

// `bytes` (a multiple of 16) contiguous bytes from the 16-byte aligned `p` into L2, one
// instruction (sm_90 bulk prefetch, issued by the TMA unit: it takes no load-path slot).
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}

}  // namespace atlas
