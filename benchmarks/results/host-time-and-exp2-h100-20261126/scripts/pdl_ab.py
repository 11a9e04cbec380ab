"""PDL on/off in CUDA graphs of back-to-back calls, the tuned table's kernels (fp16 and FP8 K/head),
toggled within one process, order alternating per round; graph us medians."""
import os, statistics, sys, json
import torch
sys.path.insert(0, os.getcwd())
from flashcore.ops import attention
from flashcore.ops.fp8 import attention_fp8, quantize_fp8
from flashcore.runtime import loader
from flashcore.tuning.timing import n_sets, time_kernel
import warnings; warnings.simplefilter("ignore")
SHAPES = [("1,8,512,64", 1, 8, 8, 512, 64, False), ("4,16,4096,64", 4, 16, 16, 4096, 64, False),
          ("4,16,4096,128", 4, 16, 16, 4096, 128, False), ("2,16,8192,128", 2, 16, 16, 8192, 128, False),
          ("4,16,4096,64 causal", 4, 16, 16, 4096, 64, True), ("4,16,4096,128 causal", 4, 16, 16, 4096, 128, True),
          ("4,32/8,4096,128 causal", 4, 32, 8, 4096, 128, True)]
l2 = torch.cuda.get_device_properties(0).L2_cache_size
res = {}
rounds = int(os.environ.get("ROUNDS", 4))
torch.manual_seed(0)
for label, b, hq, hkv, s, d, causal in SHAPES:
    sets, per = [], 0
    while True:
        q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.float16)
        k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.float16)
        v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.float16)
        sets.append((q, k, v))
        if sum(t.numel() * 2 for t in sets[0]) * len(sets) > 3 * l2 or len(sets) >= 64:
            break
    q8sets = []
    for q, k, v in sets:
        q8, qd = quantize_fp8(q, granularity="token"); k8, kd = quantize_fp8(k); vt8, vd = quantize_fp8(v, transpose=True)
        q8sets.append((q8, k8, vt8, qd, kd, vd))
    for kind, fn, ss in (("fp16", lambda q, k, v: attention(q, k, v, causal=causal), sets),
                         ("fp8 K/head", lambda *a: attention_fp8(*a, causal=causal), q8sets)):
        try:
            fn(*ss[0]); torch.cuda.synchronize()
        except Exception as e:
            print(label, kind, "skipped:", type(e).__name__, flush=True); continue
        for r in range(rounds):
            for pdl in ((True, False) if r % 2 == 0 else (False, True)):
                loader._pdl_enabled[0] = pdl
                t = time_kernel(fn, ss)
                res.setdefault(f"{label} | {kind} | {'pdl' if pdl else 'no-pdl'}", []).append(t)
        on, off = (statistics.median(res[f"{label} | {kind} | {p}"]) for p in ("pdl", "no-pdl"))
        print(f"{label:26s} {kind:10s} PDL {on:8.1f}  no PDL {off:8.1f}  off/on {off / on:.3f}   "
              f"{[round(x, 1) for x in res[f'{label} | {kind} | pdl']]} {[round(x, 1) for x in res[f'{label} | {kind} | no-pdl']]}", flush=True)
    del sets, q8sets
loader._pdl_enabled[0] = True
print("RESULT " + json.dumps(res))
