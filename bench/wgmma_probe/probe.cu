// wgmma_probe: can the staged w4a16_gemv kernel (M > 16) move its tensor-core work from
// mma.sync.m16n8k16 to wgmma.m64nNk16 (A = the dequantized weights from registers, B = the
// activations from shared memory) without changing a single output bit, and what does it buy?
// Torch-free; build: nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -O3 -o /tmp/wgp probe.cu && /tmp/wgp
//
// (1) bits: D[64 × 32] = A[64 × K] · B[32 × K]^T, K = 2048, bf16 inputs with exponents spread
//     over 2^±12, f32 accumulation in 128 k16 steps, computed (a) by mma.sync, 4 warps × 4 n8
//     tiles, fragments straight from global memory; (b) by wgmma m64n32k16, A fragments in the
//     same registers, B in shared memory in the no-swizzle K-major canonical layout (core matrix
//     = 8 rows × 16 B), with the descriptor's (LBO, SBO) = (K step, N step) and swapped. Prints
//     mismatching bits of (b) vs (a) and ‖·−ref‖/‖ref‖ vs a float64 host reference.
// (2) rate: back-to-back tensor work of every SM (4 CTAs × 4 warps each, operands in
//     registers / shared memory): mma.sync m16n8k16 (8 independent accumulators per warp) vs
//     wgmma m64n32k16 (16 per commit group), TFLOP/s.
#include <cuda_bf16.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); exit(1); } } while (0)

constexpr int kM = 64, kN = 32, kK = 2048;

__device__ __forceinline__ uint32_t ld32(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }

__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void wgmma_rs_n32(float (&d)[16], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t bdesc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, 1, 1, 1, 0;\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(bdesc));
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }
template <int N> __device__ __forceinline__ void reg_fence(float (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(a[i]) :: "memory");
}

// No-swizzle descriptor: start address, LBO, SBO (bytes, >> 4), layout type 0.
__device__ __forceinline__ uint64_t desc_noswizzle(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((saddr >> 4) & 0x3FFF) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
         ((uint64_t)((sbo >> 4) & 0x3FFF) << 32);
}

// The A fragment of warp w, k16 step s (mma.m16n8k16 row-major A; the same registers wgmma
// reads for rows 16w..16w+15 of its m64 A).
__device__ __forceinline__ void a_frag(const __nv_bfloat16* A, int w, int s, int lane, uint32_t (&a)[4]) {
  const int g = lane / 4, t = lane % 4, r = 16 * w + g, k = 16 * s + 2 * t;
  a[0] = ld32(A + r * kK + k);
  a[1] = ld32(A + (r + 8) * kK + k);
  a[2] = ld32(A + r * kK + k + 8);
  a[3] = ld32(A + (r + 8) * kK + k + 8);
}

// D layout (both paths): warp w, n8 tile j: d[4j + 0/1] = (row 16w+g, col 8j+2t / +1),
// d[4j + 2/3] = row + 8.
__device__ __forceinline__ void store_d(float* D, int w, int lane, const float* d) {
  const int g = lane / 4, t = lane % 4;
  for (int j = 0; j < 4; ++j) {
    D[(16 * w + g) * kN + 8 * j + 2 * t] = d[4 * j];
    D[(16 * w + g) * kN + 8 * j + 2 * t + 1] = d[4 * j + 1];
    D[(16 * w + g + 8) * kN + 8 * j + 2 * t] = d[4 * j + 2];
    D[(16 * w + g + 8) * kN + 8 * j + 2 * t + 1] = d[4 * j + 3];
  }
}

__global__ void bits_mma(const __nv_bfloat16* A, const __nv_bfloat16* B, float* D) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float d[16] = {};
  for (int s = 0; s < kK / 16; ++s) {
    uint32_t a[4];
    a_frag(A, w, s, lane, a);
    for (int j = 0; j < 4; ++j) {
      const __nv_bfloat16* b = B + (8 * j + g) * kK + 16 * s + 2 * t;
      float (&dj)[4] = *reinterpret_cast<float (*)[4]>(d + 4 * j);
      mma16816(dj, a[0], a[1], a[2], a[3], ld32(b), ld32(b + 8));
    }
  }
  store_d(D, w, lane, d);
}

// B in shared memory: element (n, k) at (k / 8) · 512 + n · 16 + (k % 8) · 2 — core matrices
// (8 n × 8 k, 128 B) are 512 B apart along K and 128 B apart along N.
__global__ void bits_wgmma(const __nv_bfloat16* A, const __nv_bfloat16* B, float* D, int swap) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < kN * kK / 8; i += blockDim.x) {   // 16-byte units (n, k8)
    const int n = i / (kK / 8), k8 = i % (kK / 8);
    *reinterpret_cast<uint4*>(smem + k8 * 512 + n * 16) = *reinterpret_cast<const uint4*>(B + n * kK + 8 * k8);
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t lbo = swap ? 128 : 512, sbo = swap ? 512 : 128;
  float d[16] = {};
  for (int s = 0; s < kK / 16; ++s) {
    uint32_t a[4];
    a_frag(A, w, s, lane, a);
    wg_fence();
    wgmma_rs_n32(d, a[0], a[1], a[2], a[3], desc_noswizzle(base + s * 1024, lbo, sbo));
    wg_commit();
    wg_wait<0>();
    reg_fence(d);
  }
  store_d(D, w, lane, d);
}

// ---- rate ----
__global__ void __launch_bounds__(128) rate_mma(float* out, int iters) {
  const int lane = threadIdx.x % 32;
  uint32_t a0 = 0x3f803f80u ^ lane, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, b0 = 0x3f003f00u, b1 = b0 + lane;
  float d[8][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int j = 0; j < 8; ++j) mma16816(d[j], a0, a1, a2, a3, b0, b1);
  }
  float s = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) s += d[j][0] + d[j][1] + d[j][2] + d[j][3];
  if (s == 1.2345f) out[threadIdx.x] = s;
}

__global__ void __launch_bounds__(128) rate_wgmma(float* out, int iters) {
  __shared__ __align__(128) uint8_t sb[2 * 512 + 1024];
  for (int i = threadIdx.x; i < (int)sizeof(sb) / 4; i += 128) reinterpret_cast<uint32_t*>(sb)[i] = 0x3f003f00u;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const uint32_t a0 = 0x3f803f80u ^ lane, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3;
  const uint64_t desc = desc_noswizzle(static_cast<uint32_t>(__cvta_generic_to_shared(sb)), 512, 128);
  float d[16] = {};
  for (int it = 0; it < iters / 8; ++it) {   // 16 wgmma per group = 8 iterations of rate_mma's CTA (one
                                              // m64n32k16 = 16 m16n8k16)
    wg_fence();
#pragma unroll
    for (int j = 0; j < 16; ++j) wgmma_rs_n32(d, a0, a1, a2, a3, desc);
    wg_commit();
    wg_wait<0>();
    reg_fence(d);
  }
  float s = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) s += d[j];
  if (s == 1.2345f) out[threadIdx.x] = s;
}

static uint16_t f2bf(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16); }
static float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }

int main() {
  srand(12345);
  std::vector<uint16_t> hA(kM * kK), hB(kN * kK);
  auto rnd = [] {
    const float u = (rand() + 1.0f) / (RAND_MAX + 2.0f), v = (rand() + 1.0f) / (RAND_MAX + 2.0f);
    const float gauss = sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
    return gauss * ldexpf(1.0f, rand() % 25 - 12);
  };
  for (auto& x : hA) x = f2bf(rnd());
  for (auto& x : hB) x = f2bf(rnd());
  std::vector<double> ref(kM * kN, 0.0);
  for (int m = 0; m < kM; ++m)
    for (int n = 0; n < kN; ++n) {
      double s = 0;
      for (int k = 0; k < kK; ++k) s += (double)bf2f(hA[m * kK + k]) * bf2f(hB[n * kK + k]);
      ref[m * kN + n] = s;
    }
  __nv_bfloat16 *dA, *dB;
  float* dD;
  CK(cudaMalloc(&dA, hA.size() * 2)); CK(cudaMalloc(&dB, hB.size() * 2)); CK(cudaMalloc(&dD, 3 * kM * kN * 4));
  CK(cudaMemcpy(dA, hA.data(), hA.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dB, hB.data(), hB.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemset(dD, 0xFF, 3 * kM * kN * 4));   // poison
  const int smem = kN * kK * 2 + 4096;   // + slack: the swapped descriptor reads past the matrix
  CK(cudaFuncSetAttribute(bits_wgmma, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  bits_mma<<<1, 128>>>(dA, dB, dD);
  CK(cudaDeviceSynchronize());
  bits_wgmma<<<1, 128, smem>>>(dA, dB, dD + kM * kN, 0);
  CK(cudaDeviceSynchronize());
  bits_wgmma<<<1, 128, smem>>>(dA, dB, dD + 2 * kM * kN, 1);
  CK(cudaDeviceSynchronize());
  std::vector<float> hD(3 * kM * kN);
  CK(cudaMemcpy(hD.data(), dD, hD.size() * 4, cudaMemcpyDeviceToHost));
  const char* names[3] = {"mma.sync", "wgmma (LBO=K step, SBO=N step)", "wgmma (swapped)"};
  for (int v = 0; v < 3; ++v) {
    double num = 0, den = 0;
    int mism = 0;
    for (int i = 0; i < kM * kN; ++i) {
      const double e = hD[v * kM * kN + i] - ref[i];
      num += e * e; den += ref[i] * ref[i];
      uint32_t x, y;
      memcpy(&x, &hD[v * kM * kN + i], 4); memcpy(&y, &hD[i], 4);
      mism += x != y;
    }
    printf("bits %-34s rel_err %.3e  bits differing from mma.sync: %d / %d\n", names[v], sqrt(num / den), mism, kM * kN);
  }
  // rate
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  const int iters = 4096;
  for (int v = 0; v < 2; ++v) {
    for (int ctas_per_sm : {1, 2, 4}) {
      float best = 1e30f;
      for (int r = 0; r < 5; ++r) {
        CK(cudaEventRecord(e0));
        if (v == 0) rate_mma<<<sms * ctas_per_sm, 128>>>(dD, iters);
        else rate_wgmma<<<sms * ctas_per_sm, 128>>>(dD, iters);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        best = fminf(best, ms);
      }
      // per CTA and iteration: 32 m16n8k16 (or their 2 m64n32k16)
      const double flops = (double)sms * ctas_per_sm * 4 * iters * 8 * (2.0 * 16 * 8 * 16);
      printf("rate %-8s %d CTAs/SM: %.3f ms, %.0f TFLOP/s\n", v ? "wgmma" : "mma.sync", ctas_per_sm, best, flops / best / 1e9);
    }
  }
  CK(cudaGetLastError());
  return 0;
}
