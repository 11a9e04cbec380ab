# ruff: noqa: B023, PLW1508, PLW1510 - a record of the probe as it ran; its closures run within their loop step
"""Decode plans, two trees on the same kernels (A: HEAD; C: the split model's partials term and
packed-row tiles for one token's heads, FP8 KV caches and rows past 64), ABBA over processes;
errors against float64 (the dequantised cache for FP8 KV) checked in each."""
import json
import os
import statistics
import subprocess
import sys

CASES = [  # b, hq, hkv, sq, sk, d, dtype, fp8kv
    (1, 8, 8, 1, 32768, 128, "float16", False), (1, 32, 8, 1, 8192, 128, "float16", False),
    (16, 32, 8, 1, 4096, 128, "float16", False), (1, 8, 8, 1, 8192, 128, "float16", False),
    (1, 1, 1, 1, 8192, 128, "float16", False), (1, 1, 1, 1, 32768, 128, "float16", False),
    (1, 32, 1, 1, 8192, 128, "float16", False), (1, 32, 1, 1, 32768, 128, "float16", False),
    (8, 32, 1, 1, 8192, 128, "float16", False), (1, 64, 2, 1, 32768, 128, "float16", False),
    (1, 64, 1, 1, 8192, 128, "float16", False), (4, 64, 1, 1, 8192, 128, "float16", False),
    (1, 32, 1, 1, 8192, 128, "bfloat16", False), (1, 32, 8, 1, 8192, 64, "float16", False),
    (1, 32, 1, 1, 8192, 64, "float16", False),
    (1, 32, 1, 4, 8192, 128, "float16", False), (1, 32, 8, 16, 8192, 128, "float16", False),
    (1, 32, 8, 8, 8192, 128, "float16", False),
    (1, 32, 8, 1, 8192, 128, "float16", True), (1, 8, 8, 1, 32768, 128, "float16", True),
    (1, 32, 8, 8, 8192, 128, "float16", True), (1, 32, 8, 16, 8192, 128, "float16", True),
    (16, 32, 8, 16, 4096, 128, "float16", True), (1, 64, 8, 4, 32768, 128, "float16", True),
    (1, 32, 1, 4, 8192, 128, "float16", True), (1, 32, 1, 1, 8192, 128, "float16", True),
    (8, 32, 1, 1, 8192, 128, "float16", True), (1, 64, 1, 1, 8192, 128, "float16", True),
]


def child():
    import torch
    from torch.nn.attention import SDPBackend

    from flashcore import reference
    from flashcore.ops import attention
    from flashcore.ops.fp8 import quantize_fp8
    from flashcore.tuning.peers import _sdpa
    from flashcore.tuning.timing import n_sets, time_kernel
    torch.manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION)
    res = {}
    for b, hq, hkv, sq, sk, d, dt, fp8 in CASES:
        dtype = getattr(torch, dt)
        def mk():
            q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
            k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
            v = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
            if not fp8:
                return q, k, v, None, None
            k8, kd = quantize_fp8(k, granularity="token")
            v8, vd = quantize_fp8(v, granularity="token")
            return q, k8, v8, kd, vd
        sets = [mk() for _ in range(n_sets(2 * b * hkv * sk * d * (1 if fp8 else 2), l2))]
        q, k, v, kd, vd = sets[0]
        if fp8:
            deq = lambda x8, s: (x8.float() * s[..., None]).to(dtype)
            ref = reference.attention(q, deq(k, kd), deq(v, vd), device=q.device)
        else:
            ref = reference.attention(q, k, v, device=q.device)
        f = lambda q, k, v, kd, vd: attention(q, k, v, k_descale=kd, v_descale=vd)
        err = (f(*sets[0]).double() - ref).abs().max().item()
        row = {"err": err, "ours": time_kernel(f, sets)}
        if not fp8 and sq == 1 and hq // hkv >= 16:
            row["cudnn"] = time_kernel(lambda q, k, v, kd, vd: cudnn(q, k, v, False), sets)
        res[f"{b},{hq}/{hkv},{sq}x{sk} d{d} {dt[:4]}{' fp8kv' if fp8 else ''}"] = row
        del sets
    print("RESULT " + json.dumps(res), flush=True)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    trees = {"A": os.path.join(here, "treeA"), "C": os.path.join(here, "treeC")}
    res = {"A": [], "C": []}
    for i in range(int(os.environ.get("ROUNDS", 2))):
        for name in (("A", "C") if i % 2 == 0 else ("C", "A")):
            env = dict(os.environ, PYTHONPATH=trees[name] + ":/tmp/site", FLASHCORE_CACHE_DIR="/tmp/catS")
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "child"], env=env,
                               capture_output=True, text=True, cwd=trees[name])
            line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            if not line:
                print(name, "FAILED", p.stdout[-1500:], p.stderr[-2500:], flush=True); continue
            r = json.loads(line[0][7:]); res[name].append(r); print(name, i, json.dumps(r), flush=True)
    print("\nmedians (graph us; A = HEAD, C = this tree's plans)")
    for s in res["A"][0]:
        a = [r[s]["ours"] for r in res["A"]]; c = [r[s]["ours"] for r in res["C"]]
        cu = [r[s]["cudnn"] for r in res["A"] + res["C"] if "cudnn" in r[s]]
        extra = f"  cuDNN {statistics.median(cu):6.1f}" if cu else ""
        print(f"{s:34s} A {statistics.median(a):7.1f}  C {statistics.median(c):7.1f}  C/A {statistics.median(c)/statistics.median(a):.3f}"
              f"  err A {res['A'][0][s]['err']:.1e} C {res['C'][0][s]['err']:.1e}{extra}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child()
    else:
        main()
