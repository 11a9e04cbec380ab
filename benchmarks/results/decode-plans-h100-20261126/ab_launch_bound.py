# ruff: noqa: B023, PLW1508, PLW1510 - a record of the probe as it ran; its closures run within their loop step
"""Packed-token decode tiles of 32 and 64 rows with and without the one-CTA-a-SM launch bound:
A = HEAD (no bound on grown tiles), B = treeB (bound), ABBA over processes; errors checked."""
import json
import os
import statistics
import subprocess
import sys


def child():
    import torch

    from flashcore import reference
    from flashcore.ops import attention
    from flashcore.tuning.timing import n_sets, time_kernel
    torch.manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    res = {}
    cases = [(1, 32, 8, 8, 8192, False), (1, 32, 8, 16, 8192, False), (16, 32, 8, 8, 4096, False),
             (16, 32, 8, 16, 4096, False), (1, 64, 8, 4, 32768, True), (16, 32, 8, 16, 4096, True),
             (4, 32, 8, 8, 8192, False)]
    for b, hq, hkv, sq, sk, causal in cases:
        mk = lambda: (torch.randn(b, hq, sq, 128, device="cuda", dtype=torch.float16),
                      torch.randn(b, hkv, sk, 128, device="cuda", dtype=torch.float16),
                      torch.randn(b, hkv, sk, 128, device="cuda", dtype=torch.float16))
        sets = [mk() for _ in range(n_sets(2 * b * hkv * sk * 128 * 2, l2))]
        q, k, v = sets[0]
        kw = {"causal": True, "mask_align": "bottom_right"} if causal else {}
        ref = reference.attention(q, k, v, device=q.device, **kw)
        err = (attention(q, k, v, **kw).double() - ref).abs().max().item()
        res[f"{b},{hq}/{hkv},{sq}x{sk}{' br-causal' if causal else ''}"] = {
            "err": err, "ours": time_kernel(lambda q, k, v: attention(q, k, v, **kw), sets)}
        del sets
    print("RESULT " + json.dumps(res), flush=True)

if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "child":
    child(); sys.exit(0)
trees = {"A": (".", "/tmp/catS"), "B": (".scratch/p26/treeB", "/tmp/catBB")}
res = {"A": [], "B": []}
for i in range(int(os.environ.get("ROUNDS", 2))):
    for name in (("A", "B") if i % 2 == 0 else ("B", "A")):
        tree, cat = trees[name]
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree) + ":/tmp/site", FLASHCORE_CACHE_DIR=cat)
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "child"], env=env, capture_output=True, text=True, cwd=os.path.abspath(tree))
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        if not line:
            print(name, "FAILED", p.stdout[-1500:], p.stderr[-2500:], flush=True); continue
        r = json.loads(line[0][7:]); res[name].append(r); print(name, i, json.dumps(r), flush=True)
print("\nmedians (graph us; A = HEAD, B = launch bound on packed-token tiles)")
for s in res["A"][0]:
    a = [r[s]["ours"] for r in res["A"]]; b = [r[s]["ours"] for r in res["B"]]
    if a and b:
        print(f"{s:30s} A {statistics.median(a):7.1f}  B {statistics.median(b):7.1f}  B/A {statistics.median(b)/statistics.median(a):.3f}  err A {res['A'][0][s]['err']:.1e} B {res['B'][0][s]['err']:.1e}")
