"""FP8 KV decode of one lone CTA of many rows: graph us per share count (the FP8 cache's split rule has no partials term)."""
import json

import torch

from flashcore import reference
from flashcore.ops import attention
from flashcore.ops.fp8 import quantize_fp8
from flashcore.tuning.timing import n_sets, time_kernel

CASES = [(1, 64, 1, 1, 8192, [16, 22, 32, 43, 64]), (1, 32, 1, 1, 8192, [16, 22, 32, 43, 64]),
         (1, 64, 1, 1, 32768, [32, 43, 64, 86, 128]), (1, 32, 1, 1, 32768, [32, 43, 64, 86, 128]),
         (2, 64, 1, 1, 8192, [16, 22, 32, 43, 64]), (1, 32, 1, 4, 8192, [16, 22, 33])]
torch.manual_seed(0)
l2 = torch.cuda.get_device_properties(0).L2_cache_size
for b, hq, hkv, sq, sk, counts in CASES:
    def mk(b=b, hq=hq, hkv=hkv, sq=sq, sk=sk):
        q = torch.randn(b, hq, sq, 128, device="cuda", dtype=torch.float16)
        k8, kd = quantize_fp8(torch.randn(b, hkv, sk, 128, device="cuda", dtype=torch.float16), granularity="token")
        v8, vd = quantize_fp8(torch.randn(b, hkv, sk, 128, device="cuda", dtype=torch.float16), granularity="token")
        return q, k8, v8, kd, vd
    sets = [mk() for _ in range(n_sets(2 * b * hkv * sk * 128, l2))]
    q, k8, v8, kd, vd = sets[0]
    deq = lambda x8, d: (x8.float() * d[..., None]).half()
    ref = reference.attention(q, deq(k8, kd), deq(v8, vd), device=q.device)
    row = {}
    for rnd in range(2):
        for s in (counts + [None] if rnd == 0 else [None] + counts[::-1]):
            f = lambda q, k, v, kd, vd, s=s: attention(q, k, v, k_descale=kd, v_descale=vd, num_splits=s)
            err = (f(*sets[0]).double() - ref).abs().max().item()
            row.setdefault(str(s), []).append(round(time_kernel(f, sets), 2))
            row["err"] = f"{err:.1e}"
    print(f"fp8kv {b},{hq}/{hkv},{sq}x{sk}", json.dumps(row), flush=True)
    del sets
