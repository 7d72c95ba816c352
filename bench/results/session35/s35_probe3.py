"""session 35 call 4: (a) is the M = 1 LM-head GEMV DRAM-bound? cold vs L2-resident weights at a
vocab prefix that fits the 60 MiB L2; (b) does l2_prefetch land bytes? a copy's read side."""
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

def med(fn, pre, iters=30):
    ts = []
    for i in range(iters + 3):
        pre()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        if i >= 3: ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts)

def graph_of(fn, calls):
    g = torch.cuda.CUDAGraph()
    fn(); torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(calls): fn()
    return g

for m in (1, 32):
    x = torch.randn(m, 2048, device=dev).bfloat16()
    for rows in (16384, 32768, 49152, 248320):
        fn = lambda: ops.w4a16_gemv(x, head.lm_head, n_rows=rows)
        g1, g8 = graph_of(fn, 1), graph_of(fn, 8)
        cold = med(g1.replay, flush)
        warm = med(g8.replay, lambda: None) / 8
        mb = rows * 2048 * 9 / 16 / 1e6
        print(f"M={m:2d} LM head rows {rows:6d} ({mb:5.1f} MB): cold {cold:6.1f} us, 8 back-to-back (L2-warm if it fits) {warm:6.1f} us/call", flush=True)

src = torch.ones(48 << 20, dtype=torch.uint8, device=dev); dst = torch.empty(48 << 20, dtype=torch.uint8, device=dev)
cp = lambda: dst.copy_(src)
cold = med(cp, lambda: (flush(), torch.cuda._sleep(200000)))
pf = med(cp, lambda: (flush(), ops.l2_prefetch(src), torch.cuda._sleep(200000)))
warm = med(cp, lambda: (flush(), cp(), torch.cuda._sleep(200000)))
print(f"copy 48 MB: cold {cold:.1f} us, after l2_prefetch {pf:.1f}, after a copy {warm:.1f}", flush=True)
