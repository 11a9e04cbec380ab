import os, statistics, sys, json
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from flashcore import reference
from flashcore.ops import attention
from flashcore.tuning.timing import time_kernel
from specs_sw import CFGS, SHAPES, PER_SHAPE
l2 = torch.cuda.get_device_properties(0).L2_cache_size
torch.manual_seed(0)
res = {}
for label, b, h, s, d, causal in SHAPES:
    for n in PER_SHAPE[label]:  # correctness on a ragged shape first
        q, k, v = (torch.randn(1, 3, x, d, device="cuda", dtype=torch.float16) for x in (700, 700, 700))
        o = attention(q, k, v, causal=causal, config=CFGS[n])
        e = (o.double() - reference.attention(q, k, v, causal=causal, device=q.device)).abs().max().item()
        print(f"check {label} {n}: {e:.2e}", flush=True)
    sets = []
    while True:
        sets.append(tuple(torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3)))
        if sum(t.numel() * 2 for t in sets[0]) * len(sets) > 3 * l2: break
    names = PER_SHAPE[label]
    for r in range(int(os.environ.get("ROUNDS", 4))):
        for n in (names if r % 2 == 0 else names[::-1]):
            res.setdefault(f"{label} | {n}", []).append(time_kernel(lambda q, k, v: attention(q, k, v, causal=causal, config=CFGS[n]), sets))
    for n in names:
        vals = res[f"{label} | {n}"]
        print(f"{label:24s} {n:12s} median {statistics.median(vals):8.1f}  {[round(x, 1) for x in vals]}", flush=True)
    del sets
