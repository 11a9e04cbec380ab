"""Decode on the GPU: flashcore's decode configs and split counts, fp16 and an FP8 (e4m3) KV
cache, against SDPA's backends (and FlashAttention-4 when importable), kernel time in a CUDA
graph, one table per shape. Writes JSON to $OUT (default: bench-results/, git-ignored).

    python scripts/decode_sweep.py [--quick] [--fp8kv-only] [--dtypes float16 bfloat16]

``--combine-probe`` also times each tuned split call with its combine launch left out (the
output is then wrong: a timing probe of what the second kernel costs, nothing else). Each
shape also times the benchmark's read floors (``flashcore.tuning.peers.read_floor``): one
launch that only reads as many bytes as K and V hold, 16-bit and e4m3.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from flashcore.ops import attention
from flashcore.ops.fp8 import quantize_fp8
from flashcore.specs import TileConfig
from flashcore.tuning.bench import DECODE, Shape
from flashcore.tuning.peers import _fa4, _sdpa, read_floor
from flashcore.tuning.timing import n_sets, time_kernel

FP16_CONFIGS = [TileConfig((16, t), warps=1, stages=s) for t in (32, 64, 128) for s in (1, 2, 3)]
# warp groups over their own keys, each with its own K/V ring (the last two exceed an L4's 99 KB;
# on the H100 none beats the tuned 16x64 s2 by more than a run's noise)
FP16_CONFIGS += [TileConfig((16, t), warps=1, stages=s, kv_splits=k)
                 for t, s, k in ((64, 1, 2), (32, 2, 2), (32, 1, 4), (64, 2, 2), (32, 3, 2))]
FP8KV_CONFIGS = [TileConfig((16, t), warps=1, stages=s, kv_splits=k)
                 for t, s, k in ((32, 1, 1), (32, 2, 1), (32, 3, 1), (64, 1, 1), (64, 2, 1),
                                 (64, 3, 1), (64, 2, 2), (64, 2, 4), (128, 1, 1), (128, 2, 1),
                                 (128, 3, 1), (128, 2, 2))]
SPLITS = [None, 4, 8, 16, 32, 64, 128]
TB_S = 3.0e6  # bytes per µs: the 3.0 TB/s


def fp8kv_bytes(s: Shape) -> float:
    """e4m3 K and V, their per-token fp32 descales, 16-bit q and out."""
    kv = s.batch * s.hkv * s.seq
    return 2 * kv * s.head_dim + 2 * 4 * kv + 2 * 2 * s.batch * s.heads * s.sq * s.head_dim


@contextlib.contextmanager
def without_combine():
    """Launch split calls' first kernel only (a timing probe: the output is not combined)."""
    from flashcore.ops import launcher
    from flashcore.specs import CombineSpec

    real = launcher.launch

    def launch(kern, *a, **kw):
        if not isinstance(kern.artifact.spec, CombineSpec):
            real(kern, *a, **kw)

    launcher.launch = launch
    try:
        yield
    finally:
        launcher.launch = real


def timed(fn, sets) -> float | str:
    try:
        return time_kernel(fn, sets)
    except Exception as e:  # noqa: BLE001 - a config or peer that cannot run: recorded
        return f"{type(e).__name__}: {str(e)[:90]}"


def sweep(shape: Shape, a, peers) -> dict:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sets = [shape.inputs() for _ in range(n_sets(int(shape.min_bytes()), l2))]
    res: dict[str, float | str] = {}
    for name, fn in peers.items():
        ctx = fn.context() if hasattr(fn, "context") else torch.no_grad()
        with ctx:
            res[name] = timed(lambda q, k, v, fn=fn: fn(q, k, v, False), sets)
    res["fc tuned"] = timed(lambda q, k, v: attention(q, k, v), sets)
    for name, floor in (("read floor", read_floor()), ("read floor e4m3", read_floor(0.5))):
        res[name] = timed(lambda q, k, v, f=floor: f(q, k, v, False), sets)
    if a.combine_probe:
        with without_combine():
            res["fc tuned, split kernel only"] = timed(lambda q, k, v: attention(q, k, v), sets)
    if not a.fp8kv_only:
        for cfg in FP16_CONFIGS[:3] if a.quick else FP16_CONFIGS:
            for splits in SPLITS:
                res[f"fc {cfg.tag} splits={splits}"] = timed(
                    lambda q, k, v, c=cfg, s=splits: attention(q, k, v, config=c, num_splits=s),
                    sets)
    kv8 = [(q, *quantize_fp8(k, granularity="token"), *quantize_fp8(v, granularity="token"))
           for q, k, v in sets]
    del sets
    res["fc-fp8kv tuned"] = timed(lambda q, k8, kd, v8, vd: attention(
        q, k8, v8, k_descale=kd, v_descale=vd), kv8)
    if a.combine_probe:
        with without_combine():
            res["fc-fp8kv tuned, split kernel only"] = timed(
                lambda q, k8, kd, v8, vd: attention(q, k8, v8, k_descale=kd, v_descale=vd), kv8)
    for cfg in FP8KV_CONFIGS[:4] if a.quick else FP8KV_CONFIGS:
        for splits in a.splits:
            res[f"fc-fp8kv {cfg.tag} splits={splits}"] = timed(
                lambda q, k8, kd, v8, vd, c=cfg, s=splits: attention(
                    q, k8, v8, config=c, num_splits=s, k_descale=kd, v_descale=vd), kv8)
    return res


def show(shape: Shape, res: dict) -> None:
    floor16, floor8 = shape.min_bytes() / TB_S, fp8kv_bytes(shape) / TB_S
    peer = min((v for k, v in res.items()
                if not k.startswith(("fc", "read floor")) and isinstance(v, float)),
               default=float("nan"))
    ours16 = res.get("fc tuned")
    print(f"\n{shape.label}: floor fp16 {floor16:.1f} us, fp8 KV {floor8:.1f} us (3.0 TB/s); "
          f"best peer {peer:.1f} us")
    for k, v in sorted(res.items(), key=lambda kv: kv[1] if isinstance(kv[1], float) else 1e9):
        if not isinstance(v, float):
            print(f"  {k:44s} {v}")
            continue
        floor = floor8 if k.startswith("fc-fp8kv") else floor16
        vs16 = f"  {ours16 / v:4.2f}x fc fp16" if isinstance(ours16, float) else ""
        print(f"  {k:44s} {v:8.1f} us  {floor / v:5.0%} of floor  {peer / v:4.2f}x peer{vs16}")


def sweep_specs(arch: str, dtypes) -> list:
    """Every kernel the sweep can launch (d128, no LSE): each config split and unsplit, with
    and without an FP8 KV cache, the tuned decode kernels and the combines."""
    from flashcore.specs import AttentionSpec, CombineSpec, SpecError
    from flashcore.tuned.table import lookup

    specs = []
    for dtype in dtypes:
        tuned = [lookup(arch, 128, False, "decode", p) for p in ("fp16", "fp8kv")]
        for cfg, kv8 in [(c, False) for c in FP16_CONFIGS + tuned[:1]] + \
                [(c, True) for c in FP8KV_CONFIGS + tuned[1:]]:
            for split in (False, True):
                with contextlib.suppress(SpecError):
                    specs.append(AttentionSpec(arch=arch, dtype=dtype, head_dim=128, config=cfg,
                                               kv_fp8=kv8, split_kv=split))
        specs.append(CombineSpec(arch=arch, dtype=dtype, head_dim=128, return_lse=False))
    return list(dict.fromkeys(specs))


def build(arch: str, dtypes, jobs: int) -> None:
    """Compile the sweep's kernels in parallel into $FLASHCORE_CACHE_DIR's cache."""
    from flashcore.compiler.compiler import compile_many

    specs = sweep_specs(arch, dtypes)
    compile_many(specs, jobs=jobs)
    print(f"built {len(specs)} kernels", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fp8kv-only", action="store_true", help="no fp16 config sweep")
    ap.add_argument("--combine-probe", action="store_true")
    ap.add_argument("--dtypes", nargs="+", default=["float16"])
    ap.add_argument("--splits", nargs="+", default=SPLITS,
                    type=lambda s: None if s == "None" else int(s))
    ap.add_argument("--build-jobs", type=int, default=0,
                    help="first compile the sweep's kernels with this many workers")
    a = ap.parse_args()
    if a.build_jobs:
        from flashcore.runtime.device import arch_of

        build(arch_of(0), a.dtypes, a.build_jobs)
    from torch.nn.attention import SDPBackend

    peers = {"sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION),
             "sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
             "sdpa-efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION)}
    fa4 = _fa4()
    if fa4 is not None:
        peers["fa4"] = fa4
    rows = []
    for dtype in a.dtypes:
        for base in DECODE:
            shape = Shape(**{**asdict(base), "dtype": dtype})
            res = sweep(shape, a, peers)
            show(shape, res)
            rows.append({"shape": shape.label, "floor_us": shape.min_bytes() / TB_S,
                         "fp8kv_floor_us": fp8kv_bytes(shape) / TB_S, "results": res})
    out = Path(os.environ.get("OUT", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode-sweep.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
