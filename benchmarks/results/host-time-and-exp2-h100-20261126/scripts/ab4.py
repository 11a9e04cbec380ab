"""exp2 partly by polynomial: variants = catalogs of one tree (FLASHCORE_EXP2_EVERY at build time),
rounds in rotating order over processes. Graph us at #13's shapes (fp16, FP8 K/head, optionally
FP8 per token); checks at ragged shapes against float64 (fp16) and the block-faithful FP8 simulation."""
import json, os, statistics, subprocess, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

def child(tag, check):
    import torch
    from flashcore import reference
    from flashcore.ops import attention
    from flashcore.ops.fp8 import attention_fp8, quantize_fp8
    from flashcore.spec import AttentionSpec
    from flashcore.spec.families import WgmmaWs
    from flashcore.tuning.timing import n_sets, time_kernel
    from specs_ab import CASES
    torch.manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    res = {}
    tok = os.environ.get("TOK", "0") == "1"
    for label, b, h, s, d, causal, c16, c8, c8t in CASES:
        if check:
            for sq, sk in ((333, 1000), (1, 77), (700, 555), (129, 129)):
                q = torch.randn(2, 3, sq, d, device="cuda", dtype=torch.float16)
                k = torch.randn(2, 3, sk, d, device="cuda", dtype=torch.float16) * 2
                v = torch.randn(2, 3, sk, d, device="cuda", dtype=torch.float16)
                ref = reference.attention(q, k, v, causal=causal, device=q.device)
                o = attention(q, k, v, causal=causal, config=c16)
                e16 = (o.double() - ref).abs().max().item()
                import torch.nn.functional as F
                sd = F.scaled_dot_product_attention(q, k, v, is_causal=causal) if not (causal and sq != sk) else None
                esd = (sd.double() - ref).abs().max().item() if sd is not None else float("nan")
                q8, qd = quantize_fp8(q, granularity="token"); k8, kd = quantize_fp8(k, granularity="head")
                vt8, vd = quantize_fp8(v, transpose=True)
                o8 = attention_fp8(q8, k8, vt8, qd, kd, vd, causal=causal, out_dtype=torch.float16, config=c8)
                sums = WgmmaWs.sums_by_mma(AttentionSpec(arch="sm_90", head_dim=d, causal=causal, precision="fp8", config=c8))
                kw = {"sum_rounded_p": True} if sums else {}
                sim = reference.attention_fp8(q, k, v, causal=causal, tile=c8.tile, k_scale="head", device="cuda", **kw)
                e8 = (o8.double() - sim).abs().max().item() / max(sim.abs().max().item(), 1e-30)
                ok = bool(torch.isfinite(o).all() and torch.isfinite(o8).all())
                res[f"check {label} {sq}x{sk}"] = {"fp16_err": e16, "sdpa_err": esd, "fp8_vs_sim": e8, "finite": ok}
        from flashcore.tuning.bench import Shape
        sh = Shape(b, h, s, d, causal=causal)
        sets = [sh.inputs() for _ in range(n_sets(int(sh.min_bytes()), l2))]
        t16 = time_kernel(lambda q, k, v: attention(q, k, v, causal=causal, config=c16), sets)
        out = {"fp16": t16}
        for name, gran, cfg in (("fp8", "head", c8),) + ((("fp8tok", "token", c8t),) if tok else ()):
            q8sets = []
            for q, k, v in sets:
                q8, qd = quantize_fp8(q, granularity="token"); k8, kd = quantize_fp8(k, granularity=gran)
                vt8, vd = quantize_fp8(v, transpose=True)
                q8sets.append((q8, k8, vt8, qd, kd, vd))
            out[name] = time_kernel(lambda *a: attention_fp8(*a, causal=causal, out_dtype=torch.float16, config=cfg), q8sets)
            del q8sets
        del sets
        res[label] = out
    print("RESULT " + json.dumps(res), flush=True)

if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "child":
    child(sys.argv[2], sys.argv[3] == "1"); sys.exit(0)
here = os.path.dirname(os.path.abspath(__file__))
names = os.environ.get("VARIANTS", "0 4 3 2").split()
res = {n: [] for n in names}
for i in range(int(os.environ.get("ROUNDS", 2))):
    order = names if i % 2 == 0 else names[::-1]
    for name in order:
        env = dict(os.environ, PYTHONPATH=os.getcwd() + ":/tmp/site", FLASHCORE_CACHE_DIR=f"/tmp/cat{name}")
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "child", name, "1" if i == 0 else "0"],
                           env=env, capture_output=True, text=True)
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        if not line:
            print(name, "FAILED", p.stdout[-1500:], p.stderr[-3000:], flush=True); continue
        r = json.loads(line[0][7:]); res[name].append(r); print(name, i, json.dumps(r), flush=True)
base = names[0]
print(f"\nmedians (graph us; every n-th exp2 by polynomial; ratios against {base})")
if all(res[n] for n in names):
    for s in res[base][0]:
        if s.startswith("check"):
            print(s, " | ".join(f"{n}: fp16 {res[n][0][s]['fp16_err']:.2e} (sdpa {res[n][0][s]['sdpa_err']:.2e}) fp8/sim {res[n][0][s]['fp8_vs_sim']:.2e} {res[n][0][s]['finite']}" for n in names))
            continue
        for kind in res[base][0][s]:
            med = {n: statistics.median([r[s][kind] for r in res[n] if s in r]) for n in names}
            print(f"{s:24s} {kind:6s} " + "  ".join(f"{n}: {med[n]:8.1f} ({med[n]/med[base]:.3f})" for n in names)
                  + "   all " + str({n: [round(r[s][kind], 1) for r in res[n] if s in r] for n in names}))
