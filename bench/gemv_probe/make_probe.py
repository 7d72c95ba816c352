"""make_probe: an instrumented copy of csrc/w4a16_gemv.cu for driver.cu (never built into atlas).

    python bench/gemv_probe/make_probe.py csrc/w4a16_gemv.cu /tmp/probe_kernel.cu

Adds to the one-row kernel (w4a16_gemv_m1_kernel) a per-CTA record of %globaltimer and clock64
at its phase boundaries (entry, weight prologue issued, griddepcontrol.wait passed, activations
staged, warp 0's first chunk landed, main loop done, rows stored) and %smid, written when the
device pointer g_probe is set (driver: one cold call per shape); to the launcher, overrides of
the (splits, warps) choice for sweeps. Compile-time variants: -DPROBE_NOCOMPUTE (the dequant +
mma replaced by one dependent shared load: the memory stream alone), -DPROBE_NOACT (no
activation prologue). Anchors are exact source lines: when the kernel changes, this fails
loudly (AssertionError naming the line) rather than probing the wrong place.
"""
import re
import sys

src = open(sys.argv[1]).read()


def rep(old: str, new: str, count: int = 1) -> None:
    global src
    assert src.count(old) == count, (old, src.count(old))
    src = src.replace(old, new)


def rep_re(pattern: str, new: str) -> None:
    global src
    src, n = re.subn(pattern, new, src)
    assert n == 1, (pattern, n)


rep("namespace cg = cooperative_groups;\n", """namespace cg = cooperative_groups;
__device__ unsigned long long* g_probe = nullptr;   // [CTAs][16]: 0..6 globaltimer, 7 smid, 8..14 clock64
__device__ __forceinline__ unsigned long long gtimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void probe(int i) {
  if (g_probe != nullptr && threadIdx.x == 0) {
    unsigned long long* p = g_probe + (blockIdx.y * gridDim.x + blockIdx.x) * 16;
    p[i] = gtimer();
    p[8 + i] = clock64();
    if (i == 0) { unsigned s; asm volatile("mov.u32 %0, %smid;" : "=r"(s)); p[7] = s; }
  }
}
""")
rep("  const bool warp_has_rows = tile_row0 < n_rows;\n", "  const bool warp_has_rows = tile_row0 < n_rows;\n  probe(0);\n")
rep_re(r'  pdl_wait\(\);  // x / x2 and out are now safe\n  // Activations',
       '  probe(1);\n  pdl_wait();\n  probe(2);\n  // Activations')
rep("  for (int i0 = tid; i0 < units; i0 += kUnitBatch * nthreads) {",
    "#ifndef PROBE_NOACT\n  for (int i0 = tid; i0 < units; i0 += kUnitBatch * nthreads) {")
rep("  __syncthreads();\n\n  // ---- main loop: chunk cc", "#endif\n  __syncthreads();\n  probe(3);\n\n  // ---- main loop: chunk cc")
rep_re(r"        __syncwarp\(\);( +)// … every lane's; the warp is done with chunk cc − 1's stage\n"
       r"        if \(cc \+ kStagesM1 - 1 < chunks\) issue\(fill\);\n",      # the one-row kernel's (not v4's)
       "        __syncwarp();\n        if (cc == 0) probe(4);\n        if (cc + kStagesM1 - 1 < chunks) issue(fill);\n")
rep("        mma_chunk<1, kTiledBits>(sums.acc, st + lane_w, st + lane_s, xfrag);", """#ifdef PROBE_NOCOMPUTE
        sums.acc[0][0] += __int_as_float(*reinterpret_cast<const int*>(st + lane_w) & 1) + xfrag(0, 0).x * 0;
#else
        mma_chunk<1, kTiledBits>(sums.acc, st + lane_w, st + lane_s, xfrag);
#endif""")
rep_re(r'  pdl_launch_dependents\(\);\n  if \(wsplits == 1\) \{\n'
       r'    (store_rows<1>\(args, wt, plan, sums, row0, smem[^;]*\);)\n    return;\n',
       '  probe(5);\n  pdl_launch_dependents();\n  if (wsplits == 1) {\n'
       '    \\1\n    probe(6);\n    return;\n')
rep("      store_out(wt, args.out_dtype, 0, n, acc * factor);\n    }\n  }\n}\n",
    "      store_out(wt, args.out_dtype, 0, n, acc * factor);\n    }\n  }\n  probe(6);\n}\n")
# launcher overrides (applied after every rule, so a sweep sees exactly what it forces)
rep("  SplitPlan plan{seg_chunks, splits == 1 ? segs : segs / splits, segs};",
    "  if (g_force_splits > 0) { splits = g_force_splits; warp_splits = 1; }\n"
    "  if (g_force_warps > 0) { warps = g_force_warps; warp_splits = 1; }\n"
    "  if (g_force_wsplits > 0) {\n"
    "    warp_splits = g_force_wsplits; splits = 1; warps = std::max(1, kMaxWarps / warp_splits) * warp_splits;\n"
    "  }\n"
    "  g_last_splits = warp_splits > 1 ? -warp_splits : splits;   // negative: split over warps\n"
    "  g_last_warps = warps;\n"
    "  SplitPlan plan{seg_chunks, splits == 1 ? segs : segs / splits, segs};")
rep("int w4a16_gemv_k_splits(int k) {",
    "int g_force_splits = 0, g_force_warps = 0, g_force_wsplits = 0, g_last_splits = 0, g_last_warps = 0;\n"
    "int w4a16_gemv_k_splits(int k) {")
rep("}  // namespace atlas\n",
    "void set_probe(unsigned long long* p) { cudaMemcpyToSymbol(g_probe, &p, sizeof(p)); }\n}  // namespace atlas\n")
open(sys.argv[2], "w").write(src)
