"""Time flashcore's attention backward against torch SDPA's on this GPU (a tool, not a test):

    python -m tests.backward_timing                      # the default config of each head dim
    python -m tests.backward_timing --configs 64x64w8 64x128w8 64x64w4

Each line: shape, config, milliseconds of ``attention_backward`` (pre + main + post) and of
SDPA's backward (its forward excluded), the ratio. Kernels compile on first use (or come from
``FLASHCORE_CACHE_DIR``). CUDA events, median of ``--iters`` after a warm-up.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics

import torch

from flashcore.errors import SpecError
from flashcore.ops.backward import attention_backward
from flashcore.specs import TileConfig
from flashcore.specs.backward import default_backward_config

SHAPES = [(4, 16, 16, 1024, 64), (4, 16, 16, 1024, 128), (2, 32, 8, 2048, 128),
          (1, 16, 16, 4096, 64)]


def _config(text: str) -> TileConfig:
    tile, warps = text.split("w")
    m, n = tile.split("x")
    return TileConfig((int(m), int(n)), warps=int(warps))


def _time(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="*", default=None, help="e.g. 64x64w8 (default: tuned)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    for b, hq, hkv, s, d in SHAPES:
        q = torch.randn(b, hq, s, d, device="cuda", dtype=dt)
        k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=dt) for _ in range(2))
        dout = torch.randn_like(q)
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=a.causal, enable_gqa=hkv != hq)
        ms_sdpa = _time(functools.partial(torch.autograd.grad, out, (qs, ks, vs), dout,
                                          retain_graph=True), a.iters)
        scores = q.float() @ k.float().repeat_interleave(hq // hkv, 1).transpose(-1, -2)
        scores = scores / math.sqrt(d)
        if a.causal:
            scores.masked_fill_(torch.ones(s, s, device="cuda", dtype=torch.bool).triu(1),
                                -math.inf)
        lse = torch.logsumexp(scores, -1)
        del scores
        configs = [_config(c) for c in a.configs] if a.configs else [default_backward_config(d)]
        for config in configs:
            try:
                ms = _time(functools.partial(attention_backward, dout, q, k, v, out.detach(),
                                             lse, a.causal, config=config), a.iters)
            except SpecError as e:  # a config that does not fit this GPU
                print(f"{(b, hq, hkv, s, d)} {config}: {e}")
                continue
            print(f"{(b, hq, hkv, s, d)} {config} causal={a.causal}: flashcore {ms:.3f} ms, "
                  f"SDPA {ms_sdpa:.3f} ms, {ms_sdpa / ms:.2f}x", flush=True)


if __name__ == "__main__":
    main()
