# ruff: noqa: B023 - a record of the probe as it ran; its closures run within their loop step
"""Split counts of decode calls with few CTAs (one-token and packed-token GQA/MQA, one head):
graph us per share count, errors against float64. Fits the split model's cost of a share."""
import json

import torch

from flashcore import reference
from flashcore.ops import attention, plan
from flashcore.ops.fp8 import quantize_fp8
from flashcore.spec import TileConfig
from flashcore.tuning.timing import n_sets, time_kernel

T = lambda m, w, k=1: TileConfig((m, 64), warps=w, stages=2, kv_splits=k)
# (b, hq, hkv, sq, sk, config, fp8kv, share counts)
CASES = [
    (1, 32, 1, 1, 8192, T(32, 2), False, [16, 22, 32, 43, 64, 128]),
    (1, 32, 1, 1, 16384, T(32, 2), False, [32, 43, 64, 86, 128]),
    (1, 32, 1, 1, 32768, T(32, 2), False, [43, 64, 86, 128]),
    (1, 32, 1, 1, 8192, T(16, 1), False, [16, 22, 32, 43, 64]),
    (1, 64, 1, 1, 8192, T(64, 4), False, [22, 32, 43, 64, 128]),
    (1, 64, 1, 1, 8192, T(32, 2), False, [22, 32, 43, 64]),
    (1, 1, 1, 1, 8192, T(16, 1), False, [16, 22, 32, 43, 64, 128]),
    (1, 1, 1, 1, 32768, T(16, 1), False, [32, 43, 64, 128]),
    (1, 8, 8, 1, 8192, T(16, 1), False, [8, 11, 16]),
    (2, 8, 8, 1, 8192, T(16, 1), False, [4, 6, 8]),
    (1, 32, 1, 4, 8192, T(64, 4), False, [16, 22, 32, 43, 64]),
    (1, 32, 1, 4, 8192, T(32, 2), False, [11, 16, 22, 33]),
    (1, 32, 1, 4, 8192, T(64, 4, 2), True, [16, 22, 33, 66]),
    (1, 32, 1, 4, 8192, T(32, 2, 2), True, [11, 16, 22, 33]),
    (1, 32, 8, 16, 8192, T(64, 4), False, [8, 11, 16]),
    (1, 32, 8, 16, 8192, T(64, 4, 2), True, [4, 8, 11, 16]),
    (1, 32, 8, 16, 8192, T(32, 2, 2), True, [4, 8, 11]),
]


if __name__ == "__main__":
    torch.manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    slots = plan.sm_count(0)
    for b, hq, hkv, sq, sk, cfg, fp8, counts in CASES:
        def mk():
            q = torch.randn(b, hq, sq, 128, device="cuda", dtype=torch.float16)
            k = torch.randn(b, hkv, sk, 128, device="cuda", dtype=torch.float16)
            v = torch.randn(b, hkv, sk, 128, device="cuda", dtype=torch.float16)
            if not fp8:
                return q, k, v, None, None
            k8, kd = quantize_fp8(k, granularity="token")
            v8, vd = quantize_fp8(v, granularity="token")
            return q, k8, v8, kd, vd
        sets = [mk() for _ in range(n_sets(2 * b * hkv * sk * 128 * (1 if fp8 else 2), l2))]
        q, k, v, kd, vd = sets[0]
        if fp8:
            deq = lambda x8, d: (x8.float() * d[..., None]).half()
            ref = reference.attention(q, deq(k, kd), deq(v, vd), device=q.device)
        else:
            ref = reference.attention(q, k, v, device=q.device)
        rows = sq * (hq // hkv)
        ctas = b * hkv * -(-rows // cfg.tile_m)
        auto = plan.num_splits(ctas, sk // 64, slots, fp8, cfg.kv_splits)
        row = {"ctas": ctas, "blocks": sk // 64, "auto": auto}
        for rnd in range(2):
            for s in (counts if rnd == 0 else counts[::-1]):
                f = lambda q, k, v, kd, vd, s=s: attention(q, k, v, k_descale=kd, v_descale=vd, config=cfg, num_splits=s)
                try:
                    err = (f(*sets[0]).double() - ref).abs().max().item()
                    t = time_kernel(f, sets)
                except Exception as e:  # noqa: BLE001
                    row[s] = str(e)[:100]; continue
                row.setdefault(s, []).append(round(t, 2))
                row.setdefault("err", f"{err:.1e}")
        print(f"{b},{hq}/{hkv},{sq}x{sk} {cfg.tag}{' fp8kv' if fp8 else ''}", json.dumps(row), flush=True)
        del sets
