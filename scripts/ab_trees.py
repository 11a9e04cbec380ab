"""Kernel time of two flashcore trees in one run: does a change slow anything down?

Each pass runs one tree in a fresh process (``PYTHONPATH=TREE``) and times, in a CUDA graph,
``flashcore.ops.attention(q, k, v, tile=None, causal=...)`` (the public call, the same in every
tree) and SDPA's flash backend as a control, over the benchmark's quick prefill shapes. Passes
alternate A B A B ..., so drift of the GPU clock shows up in the control; the table gives each
tree's best median and the ratio new / old, normalised by the control.

    python scripts/ab_trees.py --old .scratch/old --new . --passes 2
    python scripts/ab_trees.py --old .scratch/old --new . --passes 6 --shapes 1,8,512,64
    python scripts/ab_trees.py --old .scratch/old --new . --passes 4 --serving

``--serving`` times the serving calls instead (dense and paged decode, 16-bit and e4m3 caches,
pages of 16, 128 and a gathered 24; varlen prefill), with SDPA's flash decode as the control.
``--backward`` times ``flashcore.ops.backward.attention_backward`` of each shape (its ``out``
and ``lse`` from the tree's own forward), with SDPA's flash forward of the shape as the
control (a clock, not a peer: the backward's peers are ``python -m flashcore.bench
--backward``'s).

    python scripts/ab_trees.py --old .scratch/old --new . --passes 4 --backward \
        --shapes 4,16,4096,128 4,16,4096,128,causal
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

SHAPES = [(1, 8, 512, 64, False), (4, 16, 4096, 64, False), (4, 16, 4096, 128, False),
          (2, 16, 8192, 128, False), (4, 16, 4096, 64, True), (4, 16, 4096, 128, True)]


def child() -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashcore
    from flashcore.ops import attention
    from flashcore.ops.backward import attention_backward

    # kernel time from flashcore.tuning.timing of the tree this script sits in, loaded by path
    # (the tree under test may be older and lack it; its own ``flashcore`` stays the one imported)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "flashcore", "tuning",
                        "timing.py")
    spec = importlib.util.spec_from_file_location("ab_timing", path)
    timing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timing)

    def graph_us(fn, sets):
        return timing.time_kernel(fn, sets, reps=30)

    def sdpa_flash(q, k, v, causal):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    out = {"tree": os.path.dirname(os.path.dirname(flashcore.__file__)), "times": {}}
    torch.manual_seed(0)
    if os.environ.get("AB_SERVING"):
        for key, ours, ctrl, sets in serving_cases():
            out["times"][key] = (graph_us(ours, sets), graph_us(ctrl, sets))
        print("AB " + json.dumps(out), flush=True)
        return
    shapes = [tuple(x) for x in json.loads(os.environ["AB_SHAPES"])] if "AB_SHAPES" in os.environ \
        else SHAPES
    backward = bool(os.environ.get("AB_BACKWARD"))
    for b, h, s, d, causal in shapes:
        tensors = 6 if backward else 4  # Q, K, V (dO, O, LSE) and the output
        nbytes = tensors * b * h * s * d * 2
        n = max(2, min(32, -(-3 * 50 * 2**20 // nbytes)))  # inputs past the L2
        sets = [tuple(torch.randn(b, h, s, d, device="cuda", dtype=torch.float16)
                      for _ in range(4 if backward else 3)) for _ in range(n)]
        key = f"{b},{h},{s},{d}{' causal' if causal else ''}"
        if backward:
            sets = [(q, k, v, do, *attention(q, k, v, causal=causal, return_lse=True))
                    for q, k, v, do in sets]
            ours = graph_us(lambda q, k, v, do, o, lse, c=causal: attention_backward(
                do, q, k, v, o, lse, c), sets)
        else:
            ours = graph_us(lambda q, k, v, c=causal: attention(q, k, v, tile=None, causal=c),
                            sets)
        ctrl = graph_us(lambda q, k, v, *_, c=causal: sdpa_flash(q, k, v, c), sets)
        out["times"][key] = (ours, ctrl)
        del sets
    print("AB " + json.dumps(out), flush=True)


def serving_cases():
    """(name, ours, control, input sets) of the serving calls ``--serving`` times."""
    import random

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashcore.ops import attention, attention_paged, attention_varlen
    from flashcore.ops.fp8 import quantize_paged_cache

    def flash_decode(q, k, v, *_):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1),
                                                  v.repeat_interleave(4, 1))

    dev, dt, d = "cuda", torch.float16, 128
    dense = [(torch.randn(1, 32, 1, d, device=dev, dtype=dt),
              *(torch.randn(1, 8, 8192, d, device=dev, dtype=dt) for _ in range(2)))
             for _ in range(4)]
    yield ("decode 1,32/8,8192", lambda q, k, v: attention(q, k, v), flash_decode, dense)
    batch, keys = 16, 4096
    for page_size, fp8 in ((16, False), (128, False), (24, False), (16, True)):
        pages = batch * -(-keys // page_size)
        sets = []
        for _ in range(2):
            perm = list(range(pages))
            random.Random(0).shuffle(perm)
            table = torch.tensor(perm, dtype=torch.int32, device=dev).view(batch, -1)
            caches = [torch.randn(pages, page_size, 8, d, device=dev, dtype=dt) for _ in range(2)]
            extra = ()
            if fp8:
                (k8, kd), (v8, vd) = (quantize_paged_cache(c) for c in caches)
                caches, extra = [k8, v8], (kd, vd)
            lens = torch.full((batch,), keys, dtype=torch.int32, device=dev)
            q = torch.randn(batch, 32, 1, d, device=dev, dtype=dt)
            sets.append((q, *caches, table, lens, *extra))

        def paged(q, kc, vc, table, lens, *descales):
            kw = {"k_descale": descales[0], "v_descale": descales[1]} if descales else {}
            return attention_paged(q, kc, vc, table, lens, **kw)

        yield (f"paged {batch},32/8,{keys} p{page_size}{' e4m3' if fp8 else ''}", paged,
               lambda *_: flash_decode(*dense[0]), sets)
    lens = [random.Random(1).randint(128, 4096) for _ in range(16)]
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(16)], dtype=torch.int32,
                      device=dev)
    total = sum(lens)
    sets = [(torch.randn(total, 32, d, device=dev, dtype=dt),
             *(torch.randn(total, 8, d, device=dev, dtype=dt) for _ in range(2)))
            for _ in range(2)]
    yield ("varlen 16 seqs causal 32/8", lambda q, k, v: attention_varlen(
        q, k, v, cu, cu, max(lens), max(lens), causal=True, check_lengths=False),
        lambda *_: flash_decode(*dense[0]), sets)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--old-cache", default=None, help="FLASHCORE_CACHE_DIR for the old tree")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="B,H,S,D[,causal]",
                    help="prefill shapes to time instead of the benchmark's quick ones")
    ap.add_argument("--serving", action="store_true", help="time the serving calls instead")
    ap.add_argument("--backward", action="store_true",
                    help="time the backward pass of each shape instead of the forward")
    a = ap.parse_args()
    trees = {"old": os.path.abspath(a.old), "new": os.path.abspath(a.new)}
    shapes = None
    if a.shapes:
        shapes = [[int(x) for x in sh.split(",")[:4]] + [sh.endswith(",causal")]
                  for sh in a.shapes]

    def env_of(tag: str) -> dict:
        env = dict(os.environ)
        if shapes:
            env["AB_SHAPES"] = json.dumps(shapes)
        if a.serving:
            env["AB_SERVING"] = "1"
        if a.backward:
            env["AB_BACKWARD"] = "1"
        env["PYTHONPATH"] = trees[tag] + os.pathsep + env.get("PYTHONPATH", "")
        if tag == "old" and a.old_cache:
            env["FLASHCORE_CACHE_DIR"] = a.old_cache
        return env

    # a first pass of both trees at once, untimed: compiles (or loads) every kernel; each
    # process runs in its own tree, so no tree's compile worker imports the other's package
    me = os.path.abspath(__file__)
    warm = [subprocess.Popen([sys.executable, me, "--child"], env=env_of(t), cwd=trees[t],
                             stdout=subprocess.DEVNULL) for t in trees]
    if any(w.wait() for w in warm):
        print("warm-up pass failed")
        return 1
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for p in range(a.passes):
        for tag, tree in trees.items():
            r = subprocess.run([sys.executable, me, "--child"], env=env_of(tag), cwd=tree,
                               text=True, capture_output=True, check=False)
            line = [x for x in r.stdout.splitlines() if x.startswith("AB ")]
            if r.returncode or not line:
                print(f"pass {p} {tag} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
                return 1
            res = json.loads(line[0][3:])
            runs[tag].append(res)
            print(f"pass {p} {tag:3s} {res['tree']}: " + "  ".join(
                f"{k} {v[0]:.1f}/{v[1]:.1f}" for k, v in res["times"].items()), flush=True)
    print(f"\n{'shape':24s} {'old us':>9s} {'new us':>9s} {'ctrl old':>9s} {'ctrl new':>9s}"
          f" {'new/old':>8s} {'normalised':>10s}")
    for key in runs["old"][0]["times"]:
        o = min(r["times"][key][0] for r in runs["old"])
        n = min(r["times"][key][0] for r in runs["new"])
        co = min(r["times"][key][1] for r in runs["old"])
        cn = min(r["times"][key][1] for r in runs["new"])
        print(f"{key:24s} {o:9.1f} {n:9.1f} {co:9.1f} {cn:9.1f} {n / o:8.3f} "
              f"{(n / cn) / (o / co):10.3f}")
    return 0


if __name__ == "__main__":
    if "--child" in sys.argv:
        child()
    else:
        raise SystemExit(main())
