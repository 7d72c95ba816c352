"""make_probe: an instrumented copy of csrc/paged_decode.cu for driver.cu (never built into atlas).

    python3 bench/paged_probe/make_probe.py csrc/paged_decode.cu /tmp/paged_probe_kernel.cu

Record buffers travel in the kernels' Problem (two new fields), filled by launch_paged_decode
from the host globals g_probe_attn / g_probe_comb at launch time: so each call of a chain can
write its own buffers (no symbol copy, no sync between calls), and nullptr (the default, and
what the graph-timed calls capture) writes nothing.

Attention kernel (paged_decode_kernel, every instance): thread 0 of each CTA writes a record of
64 × u64 at index (z · gy + y) · gx + x:
  phases 0..7 as %globaltimer (slots 0..7) and clock64 (slots 8..15):
    0 entry     kernel start, before the v7 L2 warm-up
    1 warmed    warm-up prefetches issued (pb.warm_early; else right after entry), before pdl_wait
    2 pdl       pdl_wait + pdl_launch_dependents passed
    3 issued    seq_lens → split plan → (L1-prefetched) block ids → the first kStages − 1 tiles'
                cp.async issued (thread 0's copy issue needs its block id back)
    4 qstaged   Q (loads issued right after the wait) stored to smem, QREG fragments loaded
    5 tile0     tile 0 landed (the loop's first cp.async.wait + "tile landed" barrier)
    6 loop      last tile's P·V issued, before its finish_split (row sums, barrier, stores)
    7 end       kernel end (partials / out / fused-mode group fold written); CTAs past the split
                count stamp 7 at their early return and set flag bit 0
  slot 16 %smid, 17 n_tiles + 1 (0: not reached), 18 flags (bit 0: idle CTA, no split),
  slots 24 + 2t / 25 + 2t for tiles t < kProbeTiles = 20: clock64 at the top of tile t (before
  its cp.async.wait) and after its "tile landed" barrier.
Combine kernels (flat and grouped): thread 0 of each CTA, 8 × u64: 0 / 4 entry (globaltimer /
clock64), 1 / 5 after pdl_wait (≈ the attention grid done), 2 / 6 exit (0: returned early: no
partials), 3 %smid, 7 kind (1 flat, 2 flat fused, 3 grouped).
Host side: what the last call launched (grid, instance, registers, warm-up, resident CTAs;
combine kind, CTAs, threads, registers) in plain ints g_attn_* / g_comb_*, and g_force_warm
(-1: the launcher's choice; 0 / 1: force the v7 L2 warm-up off / on).
Compile-time variant: -DPROBE_NOMATH drops a tile's math (scores, softmax, P·V): the loop only
waits for tiles and issues the next copies — the same pipeline as a memory stream alone
(outputs are zeros; timing only).
Anchors are exact source lines (or exact runs of whole lines), each asserted to occur once:
when the kernel changes, this fails loudly (AssertionError printing the anchor) instead of
probing the wrong place.
"""
import re
import sys

src = open(sys.argv[1]).read()


def _at(anchor: str) -> int:
    """Offset of `anchor` (one or more whole lines joined by '\\n', no trailing newline), which
    must occur exactly once."""
    lines = src.split("\n")
    want = anchor.split("\n")
    hits = [i for i in range(len(lines) - len(want) + 1) if lines[i:i + len(want)] == want]
    assert len(hits) == 1, f"anchor matches {len(hits)} times, want 1:\n{anchor}"
    return sum(len(l) + 1 for l in lines[:hits[0]])


_skip = False   # True: before / after / replace do nothing (a section for code the source lacks)


def before(anchor: str, text: str) -> None:
    global src
    if _skip:
        return
    i = _at(anchor)
    src = src[:i] + text + src[i:]


def after(anchor: str, text: str) -> None:
    global src
    if _skip:
        return
    i = _at(anchor) + len(anchor) + 1
    src = src[:i] + text + src[i:]


def replace(anchor: str, text: str) -> None:
    global src
    if _skip:
        return
    i = _at(anchor)
    src = src[:i] + text + src[i + len(anchor) + 1:]


# ---- globals (namespace atlas, outside the anonymous namespace: the driver links to them) ------
after("namespace atlas {", """\
// ---- paged_probe instrumentation (bench/paged_probe/make_probe.py) ----
unsigned long long* g_probe_attn = nullptr;   // next call's attention records [CTAs][64], or nullptr
unsigned long long* g_probe_comb = nullptr;   // next call's combine records [CTAs][8], or nullptr
int g_force_warm = -1;                        // -1 launcher; 0 / 1 v7 warm-up off / on
int g_attn_grid_x = 0, g_attn_grid_y = 0, g_attn_grid_z = 0, g_attn_hd = 0, g_attn_fp8 = 0,
    g_attn_m_tiles = 0, g_attn_qreg = 0, g_attn_splits_per_cta = 0, g_attn_warm = 0,
    g_attn_resident = 0, g_attn_regs = 0, g_attn_smem = 0, g_attn_stages = 0, g_attn_warps = 0;
int g_comb_kind = 0, g_comb_ctas = 0, g_comb_threads = 0, g_comb_regs = 0;   // kind 0: no combine
constexpr int kProbeTiles = 20;               // tiles with per-tile stamps
__device__ __forceinline__ unsigned long long probe_gtimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned probe_smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
// This CTA's record (thread 0, buffer set), else nullptr.
__device__ __forceinline__ unsigned long long* probe_record(unsigned long long* base, int words) {
  const unsigned long long cta = ((unsigned long long)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  return (base != nullptr && threadIdx.x == 0) ? base + cta * words : nullptr;
}
__device__ __forceinline__ void probe_stamp(unsigned long long* rec, int phase) {   // attention
  if (rec != nullptr) {
    rec[phase] = probe_gtimer();
    rec[8 + phase] = clock64();
  }
}
__device__ __forceinline__ void probe_clock(unsigned long long* rec, int slot) {
  if (rec != nullptr) rec[slot] = clock64();
}
// ---- end of paged_probe globals ----
""")
after("  int warm_early;      // 1: the grid is one wave → warm L2 with the prologue tiles before pdl_wait (v7)", """\
  unsigned long long* probe;          // paged_probe: attention records [CTAs][64], or nullptr
  unsigned long long* probe_combine;  // paged_probe: combine records [CTAs][8], or nullptr
""")

# ---- attention kernel ------------------------------------------------------------------------
after('  static_assert(!QREG || M_TILES == 1, "Q in registers: one row tile");', """\
  unsigned long long* const probe_rec = probe_record(pb.probe, 64);   // paged_probe
  probe_stamp(probe_rec, 0);
  if (probe_rec != nullptr) probe_rec[16] = probe_smid();
""")
# the v7 L2 warm-up runs between entry and the attention kernel's wait + trigger (the combines'
# pdl_wait lines carry a comment, so this pair is the attention kernel's)
replace("  pdl_wait();\n  pdl_launch_dependents();", """\
  probe_stamp(probe_rec, 1);                    // paged_probe: warm-up issued
  pdl_wait();
  pdl_launch_dependents();
  probe_stamp(probe_rec, 2);                    // paged_probe: PDL wait passed
""")
replace("  if (first_split >= plan.count) return;                       // whole CTA: no barrier skipped", """\
  if (first_split >= plan.count) {                             // whole CTA: no barrier skipped
    if (probe_rec != nullptr) probe_rec[18] = 1;               // paged_probe: idle CTA
    probe_stamp(probe_rec, 7);
    return;
  }
""")
after("  const int tiles_per_split = plan.chunk / Tr::kTileN;" if "plan.chunk / Tr::kTileN;" in src else
      "  const int tiles_per_split = plan.chunk / kTileN;",                       # up to v22
      "  if (probe_rec != nullptr) probe_rec[17] = n_tiles + 1;     // paged_probe\n")
after("    cp_async_commit();                          // empty groups keep the wait counts uniform\n  }",
      "  probe_stamp(probe_rec, 3);                    // paged_probe: prologue copies issued\n")
before("  // Fused mode: the canonical level-1 fold of this CTA's splits, in registers.",
       "  probe_stamp(probe_rec, 4);                    // paged_probe: Q staged\n\n")
if "\n    cp_async_wait<kStages - 2>();\n" in src:
    before("    cp_async_wait<kStages - 2>();",
           "    if (tile < kProbeTiles) probe_clock(probe_rec, 24 + 2 * tile);   // paged_probe: tile top\n")
else:   # v25 (TMA): the wait is an mbarrier or cp.async one, chosen per instance
    after("  auto run_tile = [&](int tile) {",
          "    if (tile < kProbeTiles) probe_clock(probe_rec, 24 + 2 * tile);   // paged_probe: tile top\n")
after("                                                // stage (tile − 1) % kStages free again", """\
    if (tile < kProbeTiles) probe_clock(probe_rec, 25 + 2 * tile);   // paged_probe: tile landed
    if (tile == 0) probe_stamp(probe_rec, 5);
#ifdef PROBE_NOMATH
    // paged_probe variant: no math, the pipeline alone (the next copies issued at once; the
    // stages are never read, so the "tile landed" barrier alone orders their reuse).
    if (tile + kStages - 1 < n_tiles) load_tile(tile + kStages - 1, (tile + kStages - 1) % kStages);
    cp_async_commit();
#else
""")
# the tile body's end: before the per-tile split test (up to v19), or the end of run_tile (the
# split_loop.patch form: splits as an outer loop, tiles as an inner one)
_tile_end = ("    if constexpr (M_TILES == 1) {               // fused mode ends splits inside the CTA's range"
             if "// fused mode ends splits inside the CTA's range" in src else
             "  };\n  if constexpr (M_TILES == 1) {                 // fused or streamed splits end inside the CTA's range")
before(_tile_end, """\
#endif  // PROBE_NOMATH
    if (tile == n_tiles - 1) probe_stamp(probe_rec, 6);   // paged_probe: last P·V issued
""")
# kernel end: the fused-mode epilogue's closing braces, then the grouped combine's banner
replace("""\
    }
  }
}

// ---- grouped combine (v4): long split-mode tables ---------------------------------------------""", """\
    }
  }
  probe_stamp(probe_rec, 7);                    // paged_probe: kernel end
}

// ---- grouped combine (v4): long split-mode tables ---------------------------------------------
""")

# ---- warp-split kernel (v14; same record layout: phases, slot 17 = warp 0's items + 1, per-item
#      stamps of warp 0 in the tile slots) ----------------------------------------------------------
_skip = "paged_decode_warp_kernel" not in src   # sources without the warp kernel: no-ops
after("  constexpr int kMT = Wt::kMTiles;", """\
  unsigned long long* const probe_rec = probe_record(pb.probe, 64);   // paged_probe
  probe_stamp(probe_rec, 0);
  if (probe_rec != nullptr) probe_rec[16] = probe_smid();
""")
replace("  pdl_wait();                                   // (warp kernel) previous kernel's writes visible\n"
        "  pdl_launch_dependents();", """\
  probe_stamp(probe_rec, 1);                    // paged_probe: warm-up issued
  pdl_wait();                                   // (warp kernel) previous kernel's writes visible
  pdl_launch_dependents();
  probe_stamp(probe_rec, 2);                    // paged_probe: PDL wait passed
""")
replace("  if (first_split >= plan.count) return;        // whole CTA", """\
  if (first_split >= plan.count) {              // whole CTA
    if (probe_rec != nullptr) probe_rec[18] = 1;
    probe_stamp(probe_rec, 7);
    return;
  }
""")
after("  const int kv_end = min(last_split * plan.chunk, seq_len);", """\
  if (probe_rec != nullptr) probe_rec[17] = (kv_end - first_split * plan.chunk + 31) / 32 + 1;   // paged_probe
  probe_clock(probe_rec, 19);                   // paged_probe: seq_len and the split plan known
""")
replace("      if (pro_start[s] < kv_end) load(pro_start[s], pro_blk[s], s);", """\
      if (pro_start[s] < kv_end) load(pro_start[s], pro_blk[s], s);
      if (s == 0) probe_clock(probe_rec, 20);   // paged_probe: first item's copies issued
""")
before("  auto load_next = [&](int stage) {             // the next item, then the following one's lookup",
       "  probe_stamp(probe_rec, 3);                    // paged_probe: prologue copies issued\n")
after("  __syncthreads();                              // (Q read) ml_smem free for the split ends",
      "  probe_stamp(probe_rec, 4);                    // paged_probe: Q staged\n")
after("  int stage = 0;                                // stage of the next item to compute",
      "  int probe_it = 0;                             // paged_probe\n")
before("      cp_async_wait<kStages - 2>();",
       "      if (probe_it < kProbeTiles) probe_clock(probe_rec, 24 + 2 * probe_it);   // paged_probe: item top\n")
after("      __syncwarp();                             // (tile landed) every lane's copies visible", """\
      if (probe_it < kProbeTiles) probe_clock(probe_rec, 25 + 2 * probe_it);   // paged_probe: item landed
      if (probe_it == 0) probe_stamp(probe_rec, 5);
      ++probe_it;
""")
replace("      tile_math(stage, start);", """\
#ifndef PROBE_NOMATH
      tile_math(stage, start);
#endif
""")
replace("    finish_split(split);\n  }", """\
    if (split == last_split - 1) probe_stamp(probe_rec, 6);   // paged_probe: last item's math issued
    finish_split(split);
  }
""")
replace("    }\n  }\n}\n\n// ---- launcher -------------------------------------------------------------------------------", """\
    }
  }
  probe_stamp(probe_rec, 7);                    // paged_probe: kernel end
}

// ---- launcher -------------------------------------------------------------------------------
""")
replace("  return launch_pdl(paged_decode_warp_kernel<HD, FP8>, grid, dim3(kWThreads), smem, stream, p);", """\
  if (g_force_warm >= 0) p.warm_early = g_force_warm;   // paged_probe override
  {                                                     // paged_probe: what this call launches
    static cudaFuncAttributes fa{};
    if (fa.numRegs == 0) (void)cudaFuncGetAttributes(&fa, paged_decode_warp_kernel<HD, FP8>);
    g_attn_grid_x = grid.x; g_attn_grid_y = grid.y; g_attn_grid_z = grid.z;
    g_attn_hd = HD; g_attn_fp8 = FP8; g_attn_m_tiles = 0; g_attn_qreg = 1; g_attn_warps = kWThreads / 32;   // m_tiles 0: the warp kernel
    g_attn_splits_per_cta = pb.splits_per_cta; g_attn_warm = p.warm_early;
    g_attn_resident = (int)resident; g_attn_regs = fa.numRegs; g_attn_smem = (int)smem;
    g_attn_stages = WarpTraits<HD, FP8>::kStages;
    g_comb_kind = g_comb_ctas = g_comb_threads = g_comb_regs = 0;
  }
  return launch_pdl(paged_decode_warp_kernel<HD, FP8>, grid, dim3(kWThreads), smem, stream, p);
""")
_skip = False

# ---- combine kernels -------------------------------------------------------------------------
COMB_ENTRY = """\
  unsigned long long* const probe_crec = probe_record(pb.probe_combine, 8);   // paged_probe
  if (probe_crec != nullptr) {
    probe_crec[0] = probe_gtimer();
    probe_crec[4] = clock64();
    probe_crec[3] = probe_smid();
    probe_crec[7] = {kind};
  }
"""
COMB_WAIT = """\
  if (probe_crec != nullptr) {                  // paged_probe: the attention grid is done
    probe_crec[1] = probe_gtimer();
    probe_crec[5] = clock64();
  }
"""
COMB_EXIT = """\
  if (probe_crec != nullptr) {                  // paged_probe: combine CTA done
    probe_crec[2] = probe_gtimer();
    probe_crec[6] = clock64();
  }
"""
after("  const int e_cta = blockIdx.x * kGcCols;                      // row · hd + first column",
      COMB_ENTRY.replace("{kind}", "3"))
after("  const int e0 = blockIdx.x * kFlatElems + 4 * threadIdx.x;  // row · hd + column, column % 4 == 0",
      COMB_ENTRY.replace("{kind}", "kFused ? 2 : 1"))
# both combines' wait lines are identical (same comment): exactly two, stamped alike
# (v10: inside the live pass of each combine's two-pass loop, so indented by 6)
_wait = "      pdl_wait();                               // attention grid done, partials visible\n"
assert src.count(_wait) == 2, f"combine pdl_wait lines: {src.count(_wait)}, want 2"
src = src.replace(_wait, _wait + "".join("    " + l + "\n" if l else "\n" for l in COMB_WAIT.split("\n")[:-1]))
replace("""\
    __syncthreads();                            // pass 0's level 2 is done with og_s / lam_s
  }
}""", """\
    __syncthreads();                            // pass 0's level 2 is done with og_s / lam_s
  }
""" + COMB_EXIT + "}\n")
replace("""\
      if (a.lse != nullptr && col == 0) a.lse[orow] = top_lam * kLn2;
    }
  }
}""", """\
      if (a.lse != nullptr && col == 0) a.lse[orow] = top_lam * kLn2;
    }
  }
""" + COMB_EXIT + "}\n")

# ---- launcher: the record buffers, the warm-up override, what was launched ---------------------
after("  pb.a = a;", """\
  pb.probe = g_probe_attn;                      // paged_probe
  pb.probe_combine = g_probe_comb;
""")
# the attention launch, whatever its form: launch_pdl(kernel, grid, dim3(kThreads), ...) — dim3(W * 32)
# in eight_warps.patch, dim3(kThreads * KVH) in kv_pair.patch, launch_pdl_cluster(..., cluster, p) in
# cluster_fold.patch — the one return of the instance launcher that names the kernel's pdl_wait
_m = re.search(r"^  return launch_\w+\(kernel, grid, dim3\(([^)]*)\),.*// see pdl_wait in the kernel$", src, re.M)
assert _m, "the attention launch line"
_threads, _launch = _m.group(1), _m.group(0)
# the instance's Traits: a tile-size argument since v23
_traits = ("Traits<HD, FP8, kKernelTileN<FP8, M_TILES>>" if "kKernelTileN" in src else "Traits<HD, FP8>")
replace(_launch, """\
  if (g_force_warm >= 0) p.warm_early = g_force_warm;   // paged_probe override
  {                                                     // paged_probe: what this call launches
    static cudaFuncAttributes fa{};                     // queried once (first call: before any capture)
    if (fa.numRegs == 0) (void)cudaFuncGetAttributes(&fa, kernel);
    g_attn_grid_x = grid.x; g_attn_grid_y = grid.y; g_attn_grid_z = grid.z;
    g_attn_hd = HD; g_attn_fp8 = FP8; g_attn_m_tiles = M_TILES; g_attn_qreg = QREG;
    g_attn_splits_per_cta = p.splits_per_cta; g_attn_warm = p.warm_early;
    g_attn_resident = (int)resident; g_attn_regs = fa.numRegs; g_attn_smem = (int)smem;
    g_attn_stages = """ + _traits + """::kStages; g_attn_warps = (""" + _threads + """) / 32;
    g_comb_kind = g_comb_ctas = g_comb_threads = g_comb_regs = 0;   // set again if a combine follows
  }
""" + _launch + "\n")
replace("""\
    return fused ? launch_pdl(paged_decode_combine_flat_kernel<true>, grid, dim3(kFlatThreads), 0, stream, pb)""", """\
    {                                                   // paged_probe (attributes queried once each)
      static cudaFuncAttributes fa[2] = {};
      if (fa[fused].numRegs == 0)
        (void)cudaFuncGetAttributes(&fa[fused], fused ? paged_decode_combine_flat_kernel<true> : paged_decode_combine_flat_kernel<false>);
      g_comb_kind = fused ? 2 : 1; g_comb_ctas = grid.x * grid.y * grid.z; g_comb_threads = kFlatThreads;
      g_comb_regs = fa[fused].numRegs;
    }
    return fused ? launch_pdl(paged_decode_combine_flat_kernel<true>, grid, dim3(kFlatThreads), 0, stream, pb)
""")
replace("  return launch_pdl(paged_decode_combine_groups_kernel, grid, dim3(threads), 0, stream, pb);", """\
  {                                                     // paged_probe (attributes queried once)
    static cudaFuncAttributes fa{};
    if (fa.numRegs == 0) (void)cudaFuncGetAttributes(&fa, paged_decode_combine_groups_kernel);
    g_comb_kind = 3; g_comb_ctas = grid.x * grid.y * grid.z; g_comb_threads = threads; g_comb_regs = fa.numRegs;
  }
  return launch_pdl(paged_decode_combine_groups_kernel, grid, dim3(threads), 0, stream, pb);
""")
open(sys.argv[2], "w").write(src)
