# ruff: noqa: B023 - a record of the probe as it ran; its closures run within their loop step
"""26th session sweep: (1) one-token GQA/MQA decode with groups of 32-64 (query heads of a K/V
head packed as rows): 16 / 32 / 64-row tiles, the model's split counts and others; (2) FP8 KV
packed multi-token decode: the tuned 16x64 k2 tile against grown tiles. Graph us, errors
against float64 (the dequantised cache for FP8 KV)."""
import json
import sys

import torch
from torch.nn.attention import SDPBackend

from flashcore import reference
from flashcore.ops import attention, plan
from flashcore.ops.fp8 import quantize_fp8
from flashcore.spec import TileConfig
from flashcore.tuning.peers import _sdpa
from flashcore.tuning.timing import n_sets, time_kernel

T = lambda m, w, k=1: TileConfig((m, 64), warps=w, stages=2, kv_splits=k)
ONE = [(1, 32, 1, 8192), (1, 32, 1, 16384), (1, 32, 1, 32768), (1, 32, 1, 131072), (2, 32, 1, 8192),
       (4, 32, 1, 8192), (8, 32, 1, 8192), (16, 32, 1, 4096), (1, 64, 2, 8192), (1, 64, 2, 32768),
       (1, 64, 1, 8192), (1, 64, 1, 32768), (4, 64, 1, 8192), (1, 32, 2, 8192), (1, 32, 2, 32768)]
FP8 = [(1, 32, 8, 2, 8192), (1, 32, 8, 4, 8192), (1, 32, 8, 8, 8192), (1, 32, 8, 16, 8192),
       (16, 32, 8, 4, 4096), (16, 32, 8, 16, 4096), (1, 64, 8, 4, 32768), (1, 32, 1, 4, 8192)]


def one_token(cudnn, l2, slots):
    for b, hq, hkv, sk in ONE:
        g = hq // hkv
        mk = lambda: (torch.randn(b, hq, 1, 128, device="cuda", dtype=torch.float16),
                      torch.randn(b, hkv, sk, 128, device="cuda", dtype=torch.float16),
                      torch.randn(b, hkv, sk, 128, device="cuda", dtype=torch.float16))
        sets = [mk() for _ in range(n_sets(2 * b * hkv * sk * 128 * 2, l2))]
        q, k, v = sets[0]
        ref = reference.attention(q, k, v, device=q.device)
        variants = []
        for m, w in ((16, 1), (32, 2), (64, 4)):
            ctas = b * hkv * -(-g // m)
            auto = plan.num_splits(ctas, sk // 64, slots)
            variants.append((T(m, w), None, f"m{m} auto={auto}"))
            if m == 32:
                for s in sorted({max(1, auto // 2)} - {auto}):
                    variants.append((T(m, w), s, f"m{m} s={s}"))
        row = {}
        for rnd in range(2):
            for cfg, ns, tag in (variants if rnd == 0 else variants[::-1]):
                try:
                    err = (attention(q, k, v, config=cfg, num_splits=ns).double() - ref).abs().max().item()
                    t = time_kernel(lambda q, k, v, cfg=cfg, ns=ns: attention(q, k, v, config=cfg, num_splits=ns), sets)
                except Exception as e:  # noqa: BLE001
                    row[tag] = str(e)[:100]; continue
                row.setdefault(tag, []).append((round(t, 1), f"{err:.1e}"))
            row.setdefault("cudnn", []).append(round(time_kernel(lambda q, k, v: cudnn(q, k, v, False), sets), 1))
        print(f"one {b},{hq}/{hkv},1x{sk} MiB={4 * b * hkv * sk * 128 // 2**20}", json.dumps(row), flush=True)
        del sets


def fp8_packed(l2):
    cfgs = [T(16, 1, 2), T(32, 2, 2), T(32, 2), T(64, 4), T(64, 4, 2)]
    for b, hq, hkv, sq, sk in FP8:
        def mk():
            q = torch.randn(b, hq, sq, 128, device="cuda", dtype=torch.float16)
            k8, kd = quantize_fp8(torch.randn(b, hkv, sk, 128, device="cuda", dtype=torch.float16), granularity="token")
            v8, vd = quantize_fp8(torch.randn(b, hkv, sk, 128, device="cuda", dtype=torch.float16), granularity="token")
            return q, k8, kd, v8, vd
        sets = [mk() for _ in range(n_sets(2 * b * hkv * sk * 128, l2))]
        q, k8, kd, v8, vd = sets[0]
        deq = lambda x8, d: (x8.float() * d[..., None]).half()
        ref = reference.attention(q, deq(k8, kd), deq(v8, vd), device=q.device)
        row = {}
        for rnd in range(2):
            for cfg in (cfgs if rnd == 0 else cfgs[::-1]):
                f = lambda q, k8, kd, v8, vd, cfg=cfg: attention(q, k8, v8, k_descale=kd, v_descale=vd, config=cfg)
                try:
                    err = (f(*sets[0]).double() - ref).abs().max().item()
                    t = time_kernel(f, sets)
                except Exception as e:  # noqa: BLE001
                    row[cfg.tag] = str(e)[:100]; continue
                row.setdefault(cfg.tag, []).append((round(t, 1), f"{err:.1e}"))
        print(f"fp8kv {b},{hq}/{hkv},{sq}x{sk}", json.dumps(row), flush=True)
        del sets


if __name__ == "__main__":
    torch.manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    slots = plan.sm_count(0)
    which = sys.argv[1:] or ["one", "fp8"]
    if "fp8" in which:
        fp8_packed(l2)
    if "one" in which:
        one_token(_sdpa(SDPBackend.CUDNN_ATTENTION), l2, slots)
