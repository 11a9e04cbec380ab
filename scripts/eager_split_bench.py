"""Eager split-KV decode: the shares merged by the split kernel's last CTA (one launch) against
the combine kernel (two launches), with torch SDPA in the same run.

For each shape, calls back to back whose key length grows by one a call (as generation makes
them): the host's µs a call (``host_bench.per_call_us``) and the GPU's µs a call, the same
eager calls queued behind a sleep (``timing.time_queued``). The merge is forced on and off
through ``plan.EAGER_MERGE_BLOCKS``; each figure is the mean of two turns (ABBA).

    python scripts/eager_split_bench.py [--shapes "B,Hq/Hkv,S,D;..."] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch

from flashcore.ops import attention, eager, launcher, plan
from flashcore.tuning.host_bench import per_call_us
from flashcore.tuning.timing import time_queued

SHAPES = "1,32/8,4096,128;1,32/8,8192,128;1,8/8,32768,128;4,32/8,8192,128;1,16/4,2048,128;" \
         "2,32/8,16384,64"
GROW = 200  # calls of a run, each one key longer


def _parse(text: str) -> tuple:
    b, heads, s, d = text.split(",")
    hq, hkv = (int(x) for x in heads.split("/"))
    return int(b), hq, hkv, int(s), int(d)


def _mode(merge: bool) -> None:
    plan.EAGER_MERGE_BLOCKS = 1 << 30 if merge else 0
    eager.forget()


def measure(shape: str, dtype: torch.dtype) -> str:
    """One shape's row: host and GPU µs a call, merged, combine and SDPA; the split count."""
    b, hq, hkv, s, d = _parse(shape)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=dtype)
    cache = [torch.randn(b, hkv, s + GROW, d, device="cuda", dtype=dtype) for _ in range(2)]
    views = [(cache[0][:, :, :s + i], cache[1][:, :, :s + i]) for i in range(GROW)]

    def ours(k, v):
        return attention(q, k, v)

    def theirs(k, v):
        return sdpa(q, k, v, enable_gqa=hq != hkv)

    host: dict[str, list] = {"merged": [], "combine": [], "sdpa": []}
    gpu: dict[str, list] = {"merged": [], "combine": [], "sdpa": []}
    for name in ("merged", "combine", "sdpa", "sdpa", "combine", "merged"):
        fn = theirs if name == "sdpa" else ours
        if name != "sdpa":
            _mode(name == "merged")
        host[name].append(per_call_us(fn, views, runs=7))
        gpu[name].append(time_queued(fn, views))
    _mode(True)
    with mock.patch.object(launcher, "launch", wraps=launcher.launch) as launches:
        eager.forget()
        ours(*views[0])
    grids = [c.args[1] for c in launches.call_args_list]
    torch.cuda.synchronize()
    h, g = ({k: sum(v) / len(v) for k, v in x.items()} for x in (host, gpu))
    return (f"{shape:26s} {h['merged']:16.1f} {h['combine']:8.1f} {h['sdpa']:8.1f} | "
            f"{g['merged']:15.1f} {g['combine']:8.1f} {g['sdpa']:8.1f} | {grids[0][1]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    a = ap.parse_args()
    print(f"{'shape (keys growing)':26s} {'host µs: merged':>16s} {'combine':>8s} {'SDPA':>8s}"
          f" | {'GPU µs: merged':>15s} {'combine':>8s} {'SDPA':>8s} | splits", flush=True)
    for shape in a.shapes.split(";"):
        print(measure(shape, getattr(torch, a.dtype)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
