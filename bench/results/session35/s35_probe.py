"""session 35: does the LM head gain from an L2-resident prefix? (isolated, no chain)"""
import os, sys, statistics
import torch
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
from bench_mtp import build, measure
from atlas import ops
from atlas._timing import l2_flusher

head = build("35b-a3b", "nvfp4", 32)
dev = head.device
flush = l2_flusher(dev)
packed, scale = head.lm_head.gemv_operands()
x = torch.randn(1, 2048, device=dev).bfloat16()
per_row = 2048 * 9 // 16
l2 = torch.cuda.get_device_properties(dev).L2_cache_size
print("L2", l2 / 2**20, "MiB")

def timed(fn, pre, iters=30):
    ts = []
    for i in range(iters + 3):
        flush()
        pre()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        if i >= 3: ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts)

lm = lambda: head.logits(x)
for mb in (0, 8, 16, 32, 48):
    rows = int(mb * 2**20 // per_row) // 16 * 16
    for last in (True, False):
        if mb == 0 and not last: continue
        def pre():
            if rows:
                ops.l2_prefetch(packed[:rows], scale[:rows], evict_last=last)
            torch.cuda._sleep(200000)     # ~100 us: let the prefetch land
        t = timed(lm, pre)
        # the prefetch kernel's own duration
        tp = timed(lambda: ops.l2_prefetch(packed[:rows], scale[:rows], evict_last=last), lambda: None) if rows else 0
        # a plain read of the same prefix after the prefetch (sum over chunk-major storage rows)
        print(f"prefetch {mb:3d} MB evict_last={last}: LM head {t:6.1f} us   prefetch kernel {tp:5.1f} us", flush=True)

# the graph structure's cost: fork/join with a tiny prefetch
for at, nbytes in ((None, 0), ("attention", 20000), ("start", 20000), ("ffn", 20000)):
    head._lm_prefetch_at, head._lm_prefetch_bytes, head._graphs = at, nbytes, {}
    us, fl = measure(head, 1, 1, 20)
    print(f"B=1 fork at {at} {nbytes} B: {us:.1f} us/draft", flush=True)
