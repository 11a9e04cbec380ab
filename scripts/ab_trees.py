"""Kernel time of two flashcore trees in one run: does a change slow anything down?

Each pass runs one tree in a fresh process (``PYTHONPATH=TREE``) and times, in a CUDA graph,
``flashcore.ops.attention(q, k, v, tile=None, causal=...)`` (the public call, the same in every
tree) and SDPA's flash backend as a control, over the benchmark's quick prefill shapes. Passes
alternate A B A B ..., so drift of the GPU clock shows up in the control; the table gives each
tree's best median and the ratio new / old, normalised by the control.

    python scripts/ab_trees.py --old .scratch/old --new . --passes 2
    python scripts/ab_trees.py --old .scratch/old --new . --passes 6 --shapes 1,8,512,64
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
    shapes = [tuple(x) for x in json.loads(os.environ["AB_SHAPES"])] if "AB_SHAPES" in os.environ \
        else SHAPES
    for b, h, s, d, causal in shapes:
        nbytes = 4 * b * h * s * d * 2
        n = max(2, min(32, -(-3 * 50 * 2**20 // nbytes)))  # inputs past the L2
        sets = [tuple(torch.randn(b, h, s, d, device="cuda", dtype=torch.float16)
                      for _ in range(3)) for _ in range(n)]
        key = f"{b},{h},{s},{d}{' causal' if causal else ''}"
        ours = graph_us(lambda q, k, v, c=causal: attention(q, k, v, tile=None, causal=c), sets)
        ctrl = graph_us(lambda q, k, v, c=causal: sdpa_flash(q, k, v, c), sets)
        out["times"][key] = (ours, ctrl)
        del sets
    print("AB " + json.dumps(out), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--old-cache", default=None, help="FLASHCORE_CACHE_DIR for the old tree")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="B,H,S,D[,causal]",
                    help="prefill shapes to time instead of the benchmark's quick ones")
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
