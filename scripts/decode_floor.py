"""What streaming a KV cache costs on this GPU, and where our decode stands against it.

Two measurements, in one process, kernel time in a CUDA graph over rotating inputs
(``flashcore.tuning.timing.time_kernel``):

1. **Read ceiling.** One launch that only reads N bytes (``flashcore.tuning.read_floor``, a
   Triton kernel) swept over warps, loads in flight and CTAs a SM, its best config per size
   (the benchmark's read floor uses the winner). A line t = a + N / bw fitted over the sizes
   gives the steady-state read bandwidth and the fixed cost of one launch.
2. **Our decode against key length.** ``attention`` at B=1, H=8/8, D=128 and growing S_k, whole
   call and split kernel alone (the combine launch left out: timing only), fp16 and the FP8 KV
   cache, fitted the same way. (The decode shapes against the peers: ``python -m
   flashcore.bench --decode``; configs and split counts: ``scripts/decode_sweep.py``.)

    python scripts/decode_floor.py [--quick]      # on the GPU host; needs Triton

Not a test: it prints tables and writes ``$OUT/decode-floor.json`` (default: ``bench-results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from flashcore.ops import attention
from flashcore.ops.fp8 import quantize_fp8
from flashcore.tuning.bench import Shape
from flashcore.tuning.read_floor import streaming_read
from flashcore.tuning.timing import n_sets, time_kernel
from scripts.decode_sweep import without_combine

MB = 1 << 20


def read_configs(quick: bool):
    for warps in (4, 8):
        for vecs in (1, 2, 4):
            for unroll in ((2, 4) if quick else (2, 4, 8)):
                for per_sm in ((2, 4) if quick else (1, 2, 4, 8)):
                    yield warps, vecs, unroll, per_sm


def buffers(nbytes: int, l2: int):
    return [(torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32,
                           device="cuda"),) for _ in range(n_sets(nbytes, l2))]


def sweep_reads(sizes_mb, quick: bool, l2: int) -> dict:
    """Best read time per size: every config at the first two sizes, the best 6 at the rest."""
    rows, ranked = {}, None
    for i, mb in enumerate(sizes_mb):
        sets = buffers(int(mb * MB), l2)
        configs = list(read_configs(quick)) if ranked is None or i < 2 else ranked[:6]
        times = {}
        for cfg in configs:
            fn = streaming_read(*cfg)
            try:
                times[cfg] = time_kernel(fn, sets)
            except Exception as e:  # noqa: BLE001 - a config Triton cannot build here
                print(f"  read {cfg} failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
        # the kernel must really read every word: its XOR against numpy's
        cfg = min(times, key=times.get)
        x = sets[0][0]
        got = _xor_all(streaming_read(*cfg)(x))
        want = _xor_all(x)
        assert got == want, f"read kernel {cfg} missed words: {got} != {want}"
        ranked = sorted(times, key=times.get)
        rows[mb] = {"best_us": times[cfg], "config": cfg,
                    "tbps": mb * MB / times[cfg] / 1e6,
                    "all": {str(k): v for k, v in sorted(times.items(), key=lambda kv: kv[1])}}
        print(f"read {mb:7.1f} MiB: {times[cfg]:7.1f} us ({rows[mb]['tbps']:.2f} TB/s) "
              f"warps,vecs,unroll,per_sm={cfg}; next {[round(times[c], 1) for c in ranked[1:4]]}",
              flush=True)
        del sets
    return rows


def _xor_all(t: torch.Tensor) -> int:
    return int(np.bitwise_xor.reduce(t.cpu().numpy().view("uint32")))


def fit(points: dict) -> tuple[float, float]:
    """Least-squares t = a + b * x: (a in us, 1 / b in bytes per us = MB/s)."""
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, 1 / b


def decode_series(keys, l2: int, fp8kv: bool) -> dict:
    """Our decode at 1,8/8,S_k,128: whole call and split kernel alone."""
    rows = {}
    for sk in keys:
        shape = Shape(1, 8, sk, 128, kv_heads=8, seq_q=1)
        sets = [shape.inputs() for _ in range(n_sets(int(shape.min_bytes()), l2))]
        if fp8kv:
            sets = [(q, *quantize_fp8(k, granularity="token"), *quantize_fp8(v, granularity="token"))
                    for q, k, v in sets]

            def call(q, k8, kd, v8, vd):
                return attention(q, k8, v8, k_descale=kd, v_descale=vd)
        else:
            def call(q, k, v):
                return attention(q, k, v)
        whole = time_kernel(call, sets)
        with without_combine():
            alone = time_kernel(call, sets)
        nbytes = shape.min_bytes(1 if fp8kv else 2)
        rows[sk] = {"bytes": nbytes, "whole_us": whole, "split_only_us": alone}
        print(f"decode {'fp8kv' if fp8kv else 'fp16 '} 1,8/8,{sk:6d}: {whole:7.1f} us whole, "
              f"{alone:7.1f} split kernel ({nbytes / whole / 1e6:.2f} TB/s whole)", flush=True)
        del sets
    return rows


def specs(arch: str) -> list:
    """Every kernel this script launches (as launched: split kernels carry no LSE), for a
    catalog built ahead on a host with the DSL."""
    from flashcore.specs import AttentionSpec, CombineSpec, QuantizeSpec, SpecError
    from flashcore.tuned.table import lookup

    out = []
    for dtype in ("float16",):
        tuned = [lookup(arch, 128, False, "decode", p) for p in ("fp16", "fp8kv")]
        for cfg, kv8 in [(tuned[0], False), (tuned[1], True)]:
            for split in (False, True):
                try:
                    out.append(AttentionSpec(arch=arch, dtype=dtype, head_dim=128, config=cfg,
                                             kv_fp8=kv8, split_kv=split))
                except SpecError:
                    pass
        out.append(CombineSpec(arch=arch, dtype=dtype, head_dim=128, return_lse=False))
        out.append(QuantizeSpec(arch=arch, dtype=dtype, head_dim=128, granularity="token"))
    return list(dict.fromkeys(out))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--build", metavar="DIR", help="compile the kernels this script launches for "
                    "--arch into a catalog at DIR (a host with the DSL; no GPU needed), then stop")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    if a.build:
        from flashcore.compiler.cache import KernelCache
        from flashcore.compiler.catalog import write_catalog
        from flashcore.compiler.compiler import compile_many

        todo = specs(a.arch)
        arts = compile_many(todo, jobs=a.jobs, cache=KernelCache(Path(a.build)))
        print(write_catalog(Path(a.build), arts), len(arts), "kernels")
        return 0
    props = torch.cuda.get_device_properties(0)
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    print(f"{props.name}: {sms} SMs, L2 {l2 / MB:.0f} MB", flush=True)
    # the decode shapes' K/V bytes: 16.8 (FP8 1,32/8,8k), 33.6, 67.1, 134.2, 268.4 MB
    sizes = [128, 32, 16, 64, 256] if not a.quick else [128, 32]
    reads = sweep_reads(sizes, a.quick, l2)
    a_us, bw = fit({mb * MB: r["best_us"] for mb, r in reads.items()})
    print(f"read ceiling fit: {a_us:.2f} us + bytes / {bw / 1e6:.3f} TB/s", flush=True)
    keys = [8192, 16384, 32768, 65536, 131072]
    series = {"fp16": decode_series(keys, l2, False), "fp8kv": decode_series(keys, l2, True)}
    fits = {}
    for kind, rows in series.items():
        for col in ("whole_us", "split_only_us"):
            fa, fb = fit({r["bytes"]: r[col] for r in rows.values()})
            fits[f"{kind} {col}"] = (fa, fb / 1e6)
            print(f"decode {kind} {col} fit: {fa:.2f} us + bytes / {fb / 1e6:.3f} TB/s",
                  flush=True)
    out = Path(os.environ.get("OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode-floor.json").write_text(json.dumps(
        {"device": props.name, "reads": {str(k): v for k, v in reads.items()},
         "read_fit": [a_us, bw / 1e6], "decode": series, "decode_fits": fits}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
