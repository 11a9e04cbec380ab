"""Where the short bucket's small tiles stop paying: the tuned short config against the mid
bucket's over growing grids (``flashcore.ops.plan.SHORT_TO_MID_WAVES``), with SDPA flash and
cuDNN in the same run. Kernel µs in a CUDA graph, bf16, S_q = S_k.

    python scripts/short_bucket_sweep.py [--quick]

Each row gives the mid tile's grid in waves of this GPU's SMs, both configs' times, mid/short
(< 1: the mid tile is faster), which one the planner runs, and the faster peer over that one.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashcore.ops import attention, plan
from flashcore.runtime.device import arch_of
from flashcore.tuned.table import lookup
from flashcore.tuning.timing import time_kernel

SHAPES = ((16, 4, 128), (32, 8, 64), (32, 8, 128), (8, 8, 64))  # (heads, K/V heads, head dim)


def peer(backend, causal: bool, gqa: bool):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    enable_gqa=gqa)
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="512 tokens, batch 1 and 8 only")
    a = p.parse_args()
    dev = torch.cuda.current_device()
    arch, slots = arch_of(dev), plan.sm_count(dev)
    lengths, batches = ((512,), (1, 8)) if a.quick else ((512, 1024), (1, 2, 4, 8))
    print(f"{arch}, {slots} SMs; planner: mid from {plan.SHORT_TO_MID_WAVES} waves")
    print(f"{'shape':24s} {'waves':>6s} {'short':>8s} {'mid':>8s} {'mid/short':>9s} "
          f"{'runs':>5s} {'flash':>8s} {'cudnn':>8s} {'peer/ours':>9s}")
    for (h, hkv, d), s, b, causal in ((x, s, b, c) for x in SHAPES for s in lengths
                                      for b in batches for c in (True, False)):
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(2))
        short, mid = (lookup(arch, d, causal, bucket) for bucket in ("short", "mid"))
        t = {name: time_kernel(lambda q, k, v, c=cfg, m=causal: attention(q, k, v, causal=m,
                                                                          config=c), [(q, k, v)])
             for name, cfg in (("short", short), ("mid", mid))}
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                t[name] = time_kernel(peer(backend, causal, h != hkv), [(q, k, v)])
            except RuntimeError:  # a backend that does not take this call
                t[name] = math.nan
        chosen = plan.tuned_config(arch, d, causal, s, "fp16", pairs=b * h, slots=slots)
        runs = "mid" if chosen == mid and mid != short else "short"
        waves = b * h * -(-s // mid.tile_m) / slots
        best = min(x for x in (t["flash"], t["cudnn"]) if not math.isnan(x))
        label = f"{b},{h}/{hkv},{s},{d}{' causal' if causal else ''}"
        print(f"{label:24s} {waves:6.2f} {t['short']:8.1f} {t['mid']:8.1f} "
              f"{t['mid'] / t['short']:9.2f} {runs:>5s} {t['flash']:8.1f} {t['cudnn']:8.1f} "
              f"{best / t[runs]:9.2f}", flush=True)


if __name__ == "__main__":
    main()
