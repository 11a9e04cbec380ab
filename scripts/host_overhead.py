"""Host time of one eager call at the mission shape (1, 8, 512, 64, fp16) and of a GQA decode
step (32 query heads over 8 K/V heads of 4096 keys), for whichever flashcore is first on sys.path: the median µs per call over runs of back-to-back calls (the kernel takes
a few µs, less than the host's work, so the loop measures the host). Compare two trees by running
this twice on one machine, back to back, e.g. with PYTHONPATH pointing at an older checkout.

    python scripts/host_overhead.py --tag new
    PYTHONPATH=path/to/old python scripts/host_overhead.py --tag old
    python scripts/host_overhead.py --profile    # where an eager decode call's host time goes
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def per_call_us(fn, calls: int = 1000, reps: int = 15) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def profile(fn, calls: int = 2000) -> int:
    import cProfile
    import pstats

    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile 2000 eager decode calls and print the costliest functions")
    a = ap.parse_args()
    if "flashcore" not in sys.modules:  # a checkout next to this script, unless PYTHONPATH set
        sys.path.append(str(Path(__file__).resolve().parent.parent))
    import flashcore
    from flashcore.ops import attention

    q, k, v = (torch.randn(1, 8, 512, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    modes = {"attention(q, k, v, tile=None)": lambda: attention(q, k, v, tile=None)}
    try:
        import flashcore.ops.library

        modes["torch.ops.flashcore.attention"] = lambda: torch.ops.flashcore.attention(q, k, v)
    except ImportError:
        pass
    modes["torch SDPA (default backend)"] = lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v)
    qd = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
    kd, vd = (torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    modes["decode attention(q, k, v)"] = lambda: attention(qd, kd, vd)
    modes["decode torch SDPA (enable_gqa)"] = (
        lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True))
    if a.profile:
        return profile(lambda: attention(qd, kd, vd))
    for name, fn in modes.items():
        print(f"{a.tag:4s} {Path(flashcore.__file__).parent}: {name:34s} "
              f"{per_call_us(fn):6.2f} µs per call", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
