"""``flash_attn_with_kvcache``'s decode step: one new token a row appended with rotary at each
row's length, then causal attention. Eager µs a call (host and CUDA-event time over calls back
to back) with the append and rotary as the ``kv_append`` kernel, and as the torch ops it
replaces, alternating in one process (median of three runs each).

    python scripts/kvcache_bench.py
"""

from __future__ import annotations

import time
from unittest import mock

import torch

from flashcore.integrations import flash_attn as fa
from flashcore.ops import kv_append

SHAPES = ((1, 32, 8, 128, 4096, 2000), (8, 32, 8, 128, 4096, 2000), (8, 28, 4, 128, 8192, 6000))


def _inputs(b, h, hkv, d, cap, filled):
    g = torch.Generator(device="cuda").manual_seed(0)
    kc, vc = (torch.randn(b, cap, hkv, d, device="cuda", generator=g).half() for _ in range(2))
    half = d // 2
    ang = torch.arange(cap, device="cuda")[:, None] * 10000.0 ** (
        -torch.arange(half, device="cuda") / half)
    q = torch.randn(b, 1, h, d, device="cuda", generator=g).half()
    k, v = (torch.randn(b, 1, hkv, d, device="cuda", generator=g).half() for _ in range(2))
    lens = torch.full((b,), filled, dtype=torch.int32, device="cuda")
    return q, k, v, kc, vc, ang.cos(), ang.sin(), lens


def _step(q, k, v, kc, vc, cos, sin, lens):
    def step():
        return fa.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin,
                                          cache_seqlens=lens, causal=True, check_lengths=False)

    return step


def per_call(fn, n: int = 200) -> tuple[float, float]:
    """(host µs, GPU µs) a call over ``n`` calls back to back, after a warm-up."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / n * 1e3


def main() -> None:
    for b, h, hkv, d, cap, filled in SHAPES:
        step = _step(*_inputs(b, h, hkv, d, cap, filled))

        runs: dict[str, list] = {"kernel": [], "torch": []}
        for _ in range(3):
            runs["kernel"].append(per_call(step))
            with mock.patch.object(kv_append, "fits", return_value=False):
                runs["torch"].append(per_call(step))
        (kh, kg), (th, tg) = (sorted(r)[1] for r in runs.values())
        print(f"{b},{h}/{hkv} d{d}, {filled} keys in a {cap}-key cache: kv_append kernel "
              f"{kh:.1f} us a call (GPU {kg:.1f}); torch ops {th:.1f} (GPU {tg:.1f}); "
              f"torch / kernel {th / kh:.2f}", flush=True)


if __name__ == "__main__":
    main()
