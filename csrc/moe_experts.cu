// moe_experts: routed experts of a sparse MoE block over device-side expert ids, equal to
// atlas/reference.py::moe_experts up to float32 summation order (each bf16 rounding in the same
// place):
//
//   for every pair p = (t, j), e = ids[t, j]:
//     g = bf16(W_gate[e] · x[t]),  u = bf16(W_up[e] · x[t])          (float32 dots)
//     act[p] = bf16(silu(g) · u)                                      (float32 math)
//     d = bf16(W_down[e] · act[p])
//   out[t] = Σ_j weights[t, j] · d_j                                  (float32, j = 0..k−1)
//   with a shared expert: out[t] = bf16(that + sigmoid(shared_gate[t]) · shared[t])  (bf16 out)
//   — the whole Qwen3-Next MoE combine in the down kernel's epilogue, so the block ends in two
//   launches here plus the router GEMV, moe_route and the shared expert's two GEMVs.
//
// Why: routing stays on the device (ids from ops.moe_route), so the host never learns which
// experts to run; these kernels read the ids and each pair streams its own expert's weights.
// T·k pairs read T·k experts: at B = 1 (k = 8 of 256) that is 3% of the bank; at T·k ≥ E it
// equals reading the bank once, and pairs sharing an expert hit in L2.
//
// Decomposition (both kernels: 256 threads = 8 warps, one warp per output row, kRowsPerWarp rows
// per warp; a lane owns the 16-byte weight chunks c = lane + 32·i of the row):
//   gate_up: grid (ceil(I / 16), T·k). CTA (n-tile, y) runs pair p = pair_order[y] (pairs sorted
//     by expert id when T > 1, so CTAs of pairs that share an expert are adjacent in launch order
//     and the second read of that expert's 1.2 MB (NVFP4 gate + up) hits in L2; at 32 rows ×
//     top-8 of 256 experts that saves ≈ 100 MB of the ≈ 300 MB the pairs would read), stages x[t]
//     in shared memory (bf16), then
//     each warp computes rows n of gate AND up (same x chunk for both), xor-shuffle sums, and
//     lane 0 stores act[p, n].
//   down:    grid (T, ceil(h / 16)) — tokens fastest (v2), so the CTAs of one n-tile run back to
//     back for all T tokens and an expert hit by several tokens is read from DRAM once (its 16
//     rows of that tile, 4.6 KB NVFP4, stay in L2; v1's n-tile-fastest order streamed each
//     token's experts whole, ≈ 151 MB instead of ≈ 96 MB distinct at 32 rows × top-8).
//     CTA (t, n-tile) stages act[t·k .. t·k + k−1] (k·I bf16), ids, weights and the slots'
//     global scales; each warp computes row n for the k experts of token t in slot order and accumulates
//     weights[t, j] · bf16(dot) in float32; lane 0 stores out[t, n].
//   Weight chunk = 16 bytes: NVFP4 32 elements (+ 2 e4m3 block scales), BF16 8 elements.
//   NVFP4 decode: 4-bit code → float through a 16-entry table in shared memory (16 distinct
//   banks: lanes reading one entry broadcast, so no conflicts); a block's 16 products are summed,
//   then scaled by its e4m3 scale; the global scale multiplies the finished dot.
//
// Both kernels are launched with programmatic dependent launch (common/pdl.cuh): the e2m1 table is
// filled before waiting for the previous kernel (moe_route / the gate_up pass), every global
// access comes after the wait, and the next kernel may launch at once.
//
// Versions (bench: python bench/bench_mtp.py [--quick | --parts]; tests: tests/test_moe_route.py,
// csrc/tests/test_mtp_kernels.cu):
//   v1: one warp per output row, one dot at a time (load 1–2 chunks → math → reduce → next dot).
//   v2: load phase for all of a warp's dots before the math (bit-identical; see "v2" below);
//       ids / weights / scales staged in smem; down grid tokens-fastest.
//
// Floor: bytes = T·k · (2·I·h + h·I) · B_w (B_w = 9/16 NVFP4, 2 BF16; capped at E experts)
//   + x, act, out. 35B-A3B, B = 1, NVFP4: 8 · 3 · 512·2048 · 9/16 = 14.2 MB → 3.3 µs at 4.3 TB/s.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/checks.h"
#include "common/nvfp4.cuh"
#include "common/pdl.cuh"
#include "moe_experts.h"

namespace atlas {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = 2;
constexpr int kRowsPerCta = kWarps * kRowsPerWarp;   // 16 output rows per CTA

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// Streaming 16-byte load of a weight chunk read exactly once (do not keep it in L1).
__device__ __forceinline__ uint4 load_weight16(const void* p) {
  return __ldcs(reinterpret_cast<const uint4*>(p));
}

// v2: every dot is split into a LOAD phase (the lane's chunks of one window of K, for all the
// dots a warp owns, issued back to back) and an ACCUMULATE phase (the v1 arithmetic, unchanged).
// v1 ran one dot at a time — load 1–2 chunks, multiply, xor-reduce, next dot — so a warp paid
// one full memory latency per dot: the down pass at B = 1 chained 2 rows × 9 experts = 18
// latencies (≈ 18 µs for 5 MB, floor 1.3 µs), gate_up 2 rows × (gate, up) = 4. Now the down
// pass issues all ≤ kDownGroup experts' chunks of a row at once (2 latencies per warp at B = 1),
// gate_up all 4 dots' chunks at once (1). Numerics are bit-identical to v1: a window holds the
// chunks c = lane + 32·i in the order v1's loop visited them, and each dot keeps its own float32
// accumulator updated in that same order with the same fmaf sequence.
//
// Fragment of one dot for one lane over one window: chunks c = c0 + lane + 32·i, i < kCpl.
template <int kCpl>
struct Frag {
  uint4 w[kCpl];
  uint16_t s[kCpl];   // NVFP4: the chunk's two e4m3 block scales (low byte = first block)
};

// Weight policies: kElemsPerChunk, load(frag) and accumulate(frag, acc) of one window,
// global_scale(e) (1 for BF16) and finish(gs, sum) (× it). The dot of `vec` (K bf16 values in
// shared memory) with weight row n of expert e is:
//   acc = 0; for each window {load; accumulate}; finish(global_scale(e), warp_sum(acc)).
struct Bf16Weights {
  static constexpr int kElemsPerChunk = 8;
  template <int kCpl>
  __device__ __forceinline__ static void load(const ExpertStack& s, int64_t e, int64_t n, int64_t rows, int k,
                                              int c0, Frag<kCpl>& f) {
    const char* row = static_cast<const char*>(s.weight) + ((e * rows + n) * k) * 2;
    const int chunks = k / kElemsPerChunk;
#pragma unroll
    for (int i = 0; i < kCpl; ++i) {
      const int c = c0 + threadIdx.x % 32 + 32 * i;
      if (c < chunks) f.w[i] = load_weight16(row + c * 16);
    }
  }
  template <int kCpl>
  __device__ __forceinline__ static float accumulate(const Frag<kCpl>& f, int k, int c0, const __nv_bfloat16* vec,
                                                     const float*, float acc) {
    const int chunks = k / kElemsPerChunk;
#pragma unroll
    for (int i = 0; i < kCpl; ++i) {
      const int c = c0 + threadIdx.x % 32 + 32 * i;
      if (c >= chunks) break;
      const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&f.w[i]);
      const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(vec + c * kElemsPerChunk);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 wf = __bfloat1622float2(w2[j]), xf = __bfloat1622float2(x2[j]);
        acc = fmaf(wf.x, xf.x, acc);
        acc = fmaf(wf.y, xf.y, acc);
      }
    }
    return acc;
  }
  __device__ __forceinline__ static float global_scale(const ExpertStack&, int64_t) { return 1.f; }
  __device__ __forceinline__ static float finish(float, float sum) { return sum; }
};

struct Nvfp4Weights {
  static constexpr int kElemsPerChunk = 32;   // 16 bytes of codes = 2 blocks of 16
  template <int kCpl>
  __device__ __forceinline__ static void load(const ExpertStack& s, int64_t e, int64_t n, int64_t rows, int k,
                                              int c0, Frag<kCpl>& f) {
    const int64_t r = e * rows + n;
    const uint8_t* codes = static_cast<const uint8_t*>(s.weight) + r * (k / 2);
    // k % 32 == 0, so a row's k/16 scales start 2-byte aligned: one 16-bit load per chunk
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(s.block_scale + r * (k / kNvfp4Block));
    const int chunks = k / kElemsPerChunk;
#pragma unroll
    for (int i = 0; i < kCpl; ++i) {
      const int c = c0 + threadIdx.x % 32 + 32 * i;
      if (c < chunks) {
        f.w[i] = load_weight16(codes + c * 16);
        f.s[i] = __ldcs(scales + c);
      }
    }
  }
  template <int kCpl>
  __device__ __forceinline__ static float accumulate(const Frag<kCpl>& f, int k, int c0, const __nv_bfloat16* vec,
                                                     const float* lut, float acc) {
    const int chunks = k / kElemsPerChunk;
#pragma unroll
    for (int i = 0; i < kCpl; ++i) {
      const int c = c0 + threadIdx.x % 32 + 32 * i;
      if (c >= chunks) break;
      const uint32_t words[4] = {f.w[i].x, f.w[i].y, f.w[i].z, f.w[i].w};
      const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(vec + c * kElemsPerChunk);
#pragma unroll
      for (int half = 0; half < 2; ++half) {          // one 16-element block each
        float block = 0.f;
#pragma unroll
        for (int wi = 0; wi < 2; ++wi) {
          const uint32_t word = words[half * 2 + wi];  // 8 codes: element 2b low nibble, 2b+1 high
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const float2 xf = __bfloat1622float2(x2[half * 8 + wi * 4 + b]);
            block = fmaf(lut[(word >> (8 * b)) & 0xF], xf.x, block);
            block = fmaf(lut[(word >> (8 * b + 4)) & 0xF], xf.y, block);
          }
        }
        acc = fmaf(block, e4m3_decode(static_cast<uint8_t>(f.s[i] >> (8 * half))), acc);
      }
    }
    return acc;
  }
  __device__ __forceinline__ static float global_scale(const ExpertStack& s, int64_t e) { return s.global_scale[e]; }
  __device__ __forceinline__ static float finish(float gs, float sum) { return sum * gs; }
};

// Chunks per lane per window: gate_up holds 4 dots × 2 (NVFP4 h = 2048 = 64 chunks: one window),
// down holds kDownGroup dots × 1 (NVFP4 I = 512 = 16 chunks: one window; BF16 I = 512: two).
constexpr int kGateUpCpl = 2;
constexpr int kDownCpl = 1;
// Experts of one token whose chunks a down warp loads together: ≥ 9 = Qwen3.5/3.6's top-8 + the
// shared slot, so a row is one group. ptxas (sm_90, no spills): gate_up 80 registers under
// __launch_bounds__(256, 3) (3 CTAs/SM; 124 unbounded = 2 CTAs/SM, and the B = 1 grid of 288
// CTAs would spill into a second wave of 264 slots); down 100 NVFP4 / 86 BF16 (2 CTAs/SM).
// Bytes in flight per SM, NVFP4 35B-A3B: gate_up 24 warps × 4 dots × 1 KB ≈ 96 KB, down 16 warps
// × 9 dots × 256 B ≈ 37 KB — above the ≈ 32 KB Little's law asks for (v1: one dot per warp at a
// time, ≤ 16 KB at full occupancy, and at B = 1 only 128 down CTAs × 8 warps × 256 B = 2 KB/SM).
constexpr int kDownGroup = 12;

__device__ __forceinline__ void fill_e2m1_table(float* lut) {
  if (threadIdx.x < 16) {   // magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; bit 3 = sign
    const int m = threadIdx.x & 7;
    const float mag = m < 4 ? 0.5f * m : (m == 4 ? 2.f : m == 5 ? 3.f : m == 6 ? 4.f : 6.f);
    lut[threadIdx.x] = (threadIdx.x & 8) ? -mag : mag;
  }
}

// Stage `count` bf16 values (count % 8 == 0, 16-byte aligned) into shared memory.
__device__ __forceinline__ void stage(__nv_bfloat16* dst, const __nv_bfloat16* src, int count) {
  for (int i = threadIdx.x; i < count / 8; i += kThreads) {
    reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  }
}

// grid (ceil(I / kRowsPerCta), T·k): act[p, n] = bf16(silu(bf16(gate·x)) · bf16(up·x)).
// A warp owns rows n0, n0+1 (kRowsPerWarp = 2) and their 4 dots (gate, up of each row): per
// window of K it loads the 4 fragments, then accumulates them in v1's order.
// 3 CTAs per SM (≤ 80 registers, no spills; 124 unbounded = 2 CTAs): the B = 1 grid of
// 32 × 9 = 288 CTAs then fits one wave of 132 × 3.
template <typename W>
__global__ void __launch_bounds__(kThreads, 3) moe_gate_up_kernel(
    const __nv_bfloat16* __restrict__ x,   // [T, h]
    const int32_t* __restrict__ ids,       // [T·k]
    const int32_t* __restrict__ pair_order,   // [T·k] or nullptr
    ExpertStack gate, ExpertStack up,      // [E, I, h]
    __nv_bfloat16* __restrict__ act,       // [T·k, I]
    int top_k, int num_experts, int hidden, int inter) {
  static_assert(kRowsPerWarp == 2, "the dot arrays below hold 2 rows × (gate, up)");
  extern __shared__ __align__(16) unsigned char smem[];
  float* lut = reinterpret_cast<float*>(smem);                                  // [16]
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem + 16 * sizeof(float));  // [h]
  fill_e2m1_table(lut);
  pdl_wait();                  // ids come from moe_route, x from the norm before it
  pdl_launch_dependents();
  const int64_t p = pair_order != nullptr ? pair_order[blockIdx.y] : blockIdx.y;
  const int e = ids[p];
  const bool valid = e >= 0 && e < num_experts;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = blockIdx.x * kRowsPerCta + warp * kRowsPerWarp;
  const bool live[2] = {n0 < inter, n0 + 1 < inter};
  constexpr int kWindow = 32 * kGateUpCpl;                 // chunks per window
  const int chunks = hidden / W::kElemsPerChunk;
  Frag<kGateUpCpl> f[4];                                   // [row 0 gate, row 0 up, row 1 gate, row 1 up]
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  // window 0's weights do not depend on x: issue them before staging x
  auto load_window = [&](int c0) {
#pragma unroll
    for (int d = 0; d < 4; ++d) {
      if (valid && live[d / 2]) W::load(d % 2 == 0 ? gate : up, e, n0 + d / 2, inter, hidden, c0, f[d]);
    }
  };
  load_window(0);
  stage(xs, x + (p / top_k) * hidden, hidden);
  __syncthreads();
  for (int c0 = 0; c0 < chunks; c0 += kWindow) {
    if (c0 > 0) load_window(c0);
#pragma unroll
    for (int d = 0; d < 4; ++d) {
      if (valid && live[d / 2]) acc[d] = W::accumulate(f[d], hidden, c0, xs, lut, acc[d]);
    }
  }
  // the two global scales are read here, not with the chunks: held across the window loop they
  // pushed the NVFP4 instance past 80 registers (ptxas spilled 36 bytes); one L2 hit per warp
  const float gs_gate = valid ? W::global_scale(gate, e) : 0.f, gs_up = valid ? W::global_scale(up, e) : 0.f;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    if (!live[i]) break;
    float a = 0.f;
    if (valid) {
      const float g = round_bf16(W::finish(gs_gate, warp_sum(acc[2 * i])));
      const float u = round_bf16(W::finish(gs_up, warp_sum(acc[2 * i + 1])));
      a = g / (1.f + expf(-g)) * u;
    }
    if (lane == 0) act[p * inter + n0 + i] = __float2bfloat16(a);
  }
}

// grid (T, ceil(h / kRowsPerCta)): out[t, n] = Σ_j weights[t, j] · bf16(down_{ids[t,j]}[n] · act[t·k+j]).
// A warp owns rows n0, n0+1; per row, per group of ≤ kDownGroup slots, per window of I: it loads
// the group's fragments, then accumulates them; the weighted sum runs over j in slot order (v1).
template <typename W>
__global__ void __launch_bounds__(kThreads) moe_down_kernel(
    const __nv_bfloat16* __restrict__ act,   // [T·k, I]
    const int32_t* __restrict__ ids,         // [T, k]
    const float* __restrict__ weights,       // [T, k]
    ExpertStack down,                        // [E, h, I]
    const __nv_bfloat16* __restrict__ shared,        // [T, h] or nullptr
    const __nv_bfloat16* __restrict__ shared_gate,   // [T] (stride shared_gate_stride)
    int64_t shared_gate_stride,
    bool out_bf16,
    void* __restrict__ out,                  // [T, h] f32 | bf16 (shared or out_bf16)
    int top_k, int num_experts, int hidden, int inter) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* lut = reinterpret_cast<float*>(smem);                                  // [16]
  __nv_bfloat16* as = reinterpret_cast<__nv_bfloat16*>(smem + 16 * sizeof(float));  // [k, I]
  int32_t* ids_s = reinterpret_cast<int32_t*>(as + top_k * inter);              // [k]
  float* w_s = reinterpret_cast<float*>(ids_s + top_k);                         // [k]
  float* gs_s = w_s + top_k;                                                    // [k] global scales
  const int64_t t = blockIdx.x;
  fill_e2m1_table(lut);
  pdl_wait();                  // act comes from the gate_up pass
  pdl_launch_dependents();
  stage(as, act + t * top_k * inter, top_k * inter);
  if (threadIdx.x < top_k) {
    ids_s[threadIdx.x] = ids[t * top_k + threadIdx.x];
    w_s[threadIdx.x] = weights[t * top_k + threadIdx.x];
    const int e = ids[t * top_k + threadIdx.x];
    gs_s[threadIdx.x] = e >= 0 && e < num_experts ? W::global_scale(down, e) : 0.f;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kWindow = 32 * kDownCpl;
  const int chunks = inter / W::kElemsPerChunk;
#pragma unroll 1
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int n = blockIdx.y * kRowsPerCta + warp * kRowsPerWarp + i;
    if (n >= hidden) break;
    float acc = 0.f;
#pragma unroll 1
    for (int j0 = 0; j0 < top_k; j0 += kDownGroup) {
      Frag<kDownCpl> f[kDownGroup];
      float dot[kDownGroup];
#pragma unroll
      for (int g = 0; g < kDownGroup; ++g) dot[g] = 0.f;
#pragma unroll 1
      for (int c0 = 0; c0 < chunks; c0 += kWindow) {
#pragma unroll
        for (int g = 0; g < kDownGroup; ++g) {
          const int j = j0 + g, e = j < top_k ? ids_s[j] : -1;
          if (e >= 0 && e < num_experts) W::load(down, e, n, hidden, inter, c0, f[g]);
        }
#pragma unroll
        for (int g = 0; g < kDownGroup; ++g) {
          const int j = j0 + g, e = j < top_k ? ids_s[j] : -1;
          if (e >= 0 && e < num_experts) dot[g] = W::accumulate(f[g], inter, c0, as + j * inter, lut, dot[g]);
        }
      }
#pragma unroll
      for (int g = 0; g < kDownGroup; ++g) {
        const int j = j0 + g, e = j < top_k ? ids_s[j] : -1;
        if (e < 0 || e >= num_experts) continue;
        const float d = round_bf16(W::finish(gs_s[j], warp_sum(dot[g])));
        acc = fmaf(w_s[j], d, acc);
      }
    }
    if (lane == 0) {
      if (shared == nullptr) {
        if (out_bf16) {
          static_cast<__nv_bfloat16*>(out)[t * hidden + n] = __float2bfloat16(acc);
        } else {
          static_cast<float*>(out)[t * hidden + n] = acc;
        }
      } else {
        const float sg = __bfloat162float(shared_gate[t * shared_gate_stride]);
        const float v = acc + __bfloat162float(shared[t * hidden + n]) / (1.f + expf(-sg));
        static_cast<__nv_bfloat16*>(out)[t * hidden + n] = __float2bfloat16(v);
      }
    }
  }
}

template <typename W>
cudaError_t launch_typed(const MoeExpertsArgs& a, cudaStream_t stream) {
  const int64_t pairs = a.num_tokens * a.top_k;
  const size_t lut_bytes = 16 * sizeof(float);
  const size_t gate_smem = lut_bytes + static_cast<size_t>(a.hidden) * 2;
  const size_t down_smem = lut_bytes + static_cast<size_t>(a.top_k) * (a.inter * 2 + 12);   // + ids, weights, scales
  if (down_smem > 48 * 1024) {
    ATLAS_RETURN_IF_ERROR(cudaFuncSetAttribute(moe_down_kernel<W>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(down_smem)));
  }
  ATLAS_RETURN_IF_ERROR(launch_pdl(moe_gate_up_kernel<W>, dim3(ceil_div(a.inter, kRowsPerCta), static_cast<unsigned>(pairs)),
                                   dim3(kThreads), gate_smem, stream, static_cast<const __nv_bfloat16*>(a.x), a.ids,
                                   a.pair_order, a.gate, a.up, static_cast<__nv_bfloat16*>(a.act), a.top_k,
                                   a.num_experts, a.hidden, a.inter));
  return launch_pdl(moe_down_kernel<W>, dim3(static_cast<unsigned>(a.num_tokens), ceil_div(a.hidden, kRowsPerCta)),
                    dim3(kThreads), down_smem, stream, static_cast<const __nv_bfloat16*>(a.act), a.ids, a.weights,
                    a.down, static_cast<const __nv_bfloat16*>(a.shared),
                    static_cast<const __nv_bfloat16*>(a.shared_gate), a.shared_gate_stride, a.out_bf16, a.out, a.top_k,
                    a.num_experts, a.hidden, a.inter);
}

}  // namespace

cudaError_t launch_moe_experts(const MoeExpertsArgs& a, cudaStream_t stream) {
  const bool dims_ok = a.hidden >= 32 && a.hidden % 32 == 0 && a.hidden <= kMoeExpertsMaxHidden &&
                       a.inter >= 32 && a.inter % 32 == 0 && a.inter <= kMoeExpertsMaxHidden;
  const int64_t down_smem = 64 + static_cast<int64_t>(a.top_k) * (a.inter * 2 + 12);
  if (!dims_ok || a.num_tokens < 1 || a.num_tokens * a.top_k > 65535 || a.top_k < 1 ||
      a.top_k > kMoeExpertsMaxTopK || a.num_experts < 1 || down_smem > 227 * 1024 || a.x == nullptr ||
      a.ids == nullptr || a.weights == nullptr || a.act == nullptr || a.out == nullptr ||
      (a.shared != nullptr && a.shared_gate == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (a.nvfp4) {
    for (const ExpertStack* s : {&a.gate, &a.up, &a.down}) {
      if (s->weight == nullptr || s->block_scale == nullptr || s->global_scale == nullptr) return cudaErrorInvalidValue;
    }
    return launch_typed<Nvfp4Weights>(a, stream);
  }
  return launch_typed<Bf16Weights>(a, stream);
}

}  // namespace atlas
