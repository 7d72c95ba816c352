// argmax_probe driver: ops.argmax (csrc/argmax.cu: split pass + merge pass) timed without torch,
// so variants of the kernel can be compared in one device call (built by run.sh).
//
// Per dtype (bf16, f32) and R ∈ {1, 8, 32} rows of V = 248 320 logits (the Qwen3.6 vocabulary;
// also V = 248 077 with an odd row stride, the element-load path): graph-replayed µs per call
// (20 calls per graph on the same logits, left in L2 as the LM-head GEMV leaves them in a
// propose), beside R·V·elem / 4.2 TB/s (the DRAM floor; from L2 the bytes cost less).
//   driver      every dtype, V and R above
//   driver R    bf16, V = 248 320, R rows only (one configuration: for ncu)
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "../probe_common.cuh"
#include "argmax.h"

using namespace atlas;

int main(int argc, char** argv) {
  const int only_rows = argc > 1 ? std::atoi(argv[1]) : 0;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  printf("%-6s %7s %7s %4s %8s %9s\n", "dtype", "V", "stride", "R", "us", "floor_us");
  for (const int elem : {2, 4}) {
    for (const int64_t vocab : {248320, 248077}) {
      const int64_t stride = vocab == 248320 ? vocab : vocab + 3;   // odd: unaligned rows
      for (const int rows : {1, 8, 32}) {
        if (only_rows > 0 && (elem != 2 || vocab != 248320 || rows != only_rows)) continue;
        uint8_t* logits;
        float* partials;
        int64_t* ids;
        float* prob;
        const size_t bytes = size_t(rows) * stride * elem;
        const int64_t splits = (vocab + kArgmaxChunk - 1) / kArgmaxChunk;
        CK(cudaMalloc(&logits, bytes));
        CK(cudaMalloc(&partials, size_t(3) * rows * splits * 4));
        CK(cudaMalloc(&ids, rows * 8));
        CK(cudaMalloc(&prob, rows * 4));
        // finite values of either dtype: bf16 / f32 bit patterns with exponent bits kept small
        fill_bytes<<<256, 256, 0, s>>>(logits, bytes, 3);
        if (elem == 2) {
          CK(cudaMemset2DAsync(logits + 1, 2, 0x3c, 1, bytes / 2, s));   // bf16 high byte: |x| ~ 2^-7..2^-6
        } else {
          CK(cudaMemset2DAsync(logits + 3, 4, 0x3c, 1, bytes / 4, s));   // f32 high byte
        }
        ArgmaxArgs a{};
        a.logits = logits;
        a.dtype = elem == 2 ? DType::kBF16 : DType::kF32;
        a.rows = rows;
        a.vocab = vocab;
        a.row_stride = stride;
        a.partials = partials;
        a.ids = ids;
        a.prob = prob;
        CK(launch_argmax(a, s));
        CK(cudaStreamSynchronize(s));
        const float us = graph_us(s, 20, [&](int) { CK(launch_argmax(a, s)); });
        printf("%-6s %7lld %7lld %4d %8.2f %9.2f\n", elem == 2 ? "bf16" : "f32", (long long)vocab,
               (long long)stride, rows, us, double(rows) * vocab * elem / 4.2e6);
        CK(cudaFree(logits)); CK(cudaFree(partials)); CK(cudaFree(ids)); CK(cudaFree(prob));
      }
    }
  }
  return 0;
}
