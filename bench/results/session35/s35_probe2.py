"""session 35: is the prefetch landing, and does the LM head gain from an L2-resident prefix at all?"""
import sys, statistics
import torch
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
from bench_mtp import build
from atlas import ops
from atlas._timing import l2_flusher

head = build("35b-a3b", "nvfp4", 32)
dev = head.device
flush = l2_flusher(dev)
packed, scale = head.lm_head.gemv_operands()
x = torch.randn(1, 2048, device=dev).bfloat16()
per_row = 2048 * 9 // 16
big = torch.ones(64 << 20, dtype=torch.uint8, device=dev)   # 64 MiB, contiguous

def timed(fn, pre, iters=30):
    ts = []
    for i in range(iters + 3):
        flush(); pre()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        if i >= 3: ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts)

nothing = lambda: torch.cuda._sleep(200000)
for mb in (16, 32, 48):
    v = big[: mb << 20]
    rd = lambda: v.view(torch.int32).sum()
    cold = timed(rd, nothing)
    pf = timed(rd, lambda: (ops.l2_prefetch(v), torch.cuda._sleep(200000)))
    pfn = timed(rd, lambda: (ops.l2_prefetch(v, evict_last=False), torch.cuda._sleep(200000)))
    warm = timed(rd, lambda: (rd(), torch.cuda._sleep(200000)))
    print(f"plain read {mb} MB: cold {cold:.1f} us, after l2_prefetch {pf:.1f} (normal {pfn:.1f}), after a read {warm:.1f}", flush=True)

lm = lambda: head.logits(x)
for mb in (0, 16, 32, 48):
    rows = int(mb * 2**20 // per_row) // 16 * 16
    def pre():
        if rows:
            packed[:rows].sum(); scale[:rows].view(torch.uint8).sum()
        torch.cuda._sleep(200000)
    def pre_pf():
        if rows:
            ops.l2_prefetch(packed[:rows], scale[:rows])
        torch.cuda._sleep(200000)
    print(f"LM head after reading its first {mb} MB: {timed(lm, pre):.1f} us; after l2_prefetch {timed(lm, pre_pf):.1f}", flush=True)
