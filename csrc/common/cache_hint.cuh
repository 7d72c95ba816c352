// L2 eviction-priority cache policies for cp.async (PTX .L2::cache_hint). The 64-bit policy
// descriptors are CUTLASS's constants (cute/arch/copy_sm90_desc.hpp, CacheHintSm90). They reach
// the copies as an immediate or a kernel parameter, never from createpolicy: ptxas 13.x on sm_90
// can drop a createpolicy while keeping its users (common/nvfp4_mma.cuh).
#pragma once
#include <cstdint>

namespace atlas {

constexpr uint64_t kL2EvictNormal = 0x1000000000000000ull;   // the default priority
constexpr uint64_t kL2EvictFirst = 0x12F0000000000000ull;    // replaced before normal lines

// 16 bytes global → shared (.cg, 256-byte L2 prefetch) under `policy`.
__device__ __forceinline__ void cp_async16_hint(uint32_t dst, const void* src, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "l"(policy));
}
// The same with a zero-fill operand (src_bytes 0: 16 zero bytes, nothing read).
__device__ __forceinline__ void cp_async16_hint(uint32_t dst, const void* src, int src_bytes, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy));
}
// 8 bytes (.ca: .cg only moves 16), same prefetch size.
__device__ __forceinline__ void cp_async8_hint(uint32_t dst, const void* src, uint64_t policy) {
  asm volatile("cp.async.ca.shared.global.L2::cache_hint.L2::256B [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src),
               "l"(policy));
}
__device__ __forceinline__ void cp_async8_hint(uint32_t dst, const void* src, int src_bytes, uint64_t policy) {
  asm volatile("cp.async.ca.shared.global.L2::cache_hint.L2::256B [%0], [%1], 8, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy));
}

}  // namespace atlas
