"""Benchmark harness: flashcore against every peer on this machine, side by side in one run.

    python -m flashcore.bench                 # the full suite
    python -m flashcore.bench --quick         # the mission shape and the large shapes only
    python -m flashcore.bench --out benchmarks/results

For each shape: kernel time (median over CUDA-graph replays of several launches, inputs rotated so
the L2 cache does not flatter) and eager call time (median per call with CUDA events, host overhead
included). Peers: torch SDPA forced to each backend, FlashAttention-4 when importable. Writes a JSON
record (git SHA, GPU, driver, versions, every figure) and a PNG chart, and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import platform
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool = False
    dtype: str = "float16"

    @property
    def label(self) -> str:
        c = " causal" if self.causal else ""
        dt = "" if self.dtype == "float16" else f" {self.dtype}"
        return f"{self.batch},{self.heads},{self.seq},{self.head_dim}{c}{dt}"

    def flops(self) -> float:
        f = 4.0 * self.batch * self.heads * self.seq * self.seq * self.head_dim
        return f / 2 if self.causal else f


MISSION = Shape(1, 8, 512, 64)


def suite(quick: bool) -> list[Shape]:
    shapes = [MISSION, Shape(4, 16, 4096, 64), Shape(4, 16, 4096, 128), Shape(2, 16, 8192, 128)]
    shapes += [Shape(4, 16, 4096, 64, True), Shape(4, 16, 4096, 128, True)]
    if quick:
        return shapes
    for s in (512, 1024, 2048, 16384):
        for d in (64, 128):
            b = max(1, 16384 // s)
            shapes.append(Shape(b, 16, s, d))
    shapes += [Shape(2, 16, 8192, 128, True), Shape(4, 16, 4096, 128, False, "bfloat16")]
    return shapes


@dataclass
class Result:
    shape: Shape
    impl: str
    kernel_us: float | None = None
    eager_us: float | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def tflops(self) -> float | None:
        return None if self.kernel_us is None else self.shape.flops() / self.kernel_us / 1e6


# -- implementations ---------------------------------------------------------------------------
Impl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def _sdpa(backend) -> Impl:
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    # the backend is forced around a whole measurement, not per call: entering sdpa_kernel costs
    # more host time than the mission shape's kernel
    run.context = lambda: sdpa_kernel(backend)
    return run


def _fa4() -> Impl | None:
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception:
        return None

    def run(q, k, v, causal):
        # FA4 takes (batch, seq, heads, dim)
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)

    return run


def _flashcore(tile=None, **kw) -> Impl:
    """Our op; ``tile=None`` is the autotuned choice."""
    from flashcore.ops import attention

    def run(q, k, v, causal):
        return attention(q, k, v, tile=tile, causal=causal, **kw)

    return run


def _flashcore_plain(tile=None) -> Impl:
    """Our op launched without programmatic dependent launch (the A/B of PDL on Hopper)."""
    from flashcore.runtime.loader import plain_launches

    ours = _flashcore(tile)

    def run(q, k, v, causal):
        with plain_launches():
            return ours(q, k, v, causal)

    return run


def fp8_kernel_only(tile=None, warps=None, kv_splits=1, stages=1) -> Impl:
    """The FP8 attention kernel alone, on inputs quantised once (as a serving engine keeps them).
    ``tile=None``: the autotuned choice."""
    from flashcore.autotune import lookup
    from flashcore.ops._kernels import arch_of
    from flashcore.ops.fp8 import attention_fp8, quantize_fp8

    memo: dict = {}

    def run(q, k, v, causal):
        # keyed by the tensors themselves (kept alive here): a pointer alone can come back for
        # another tensor of the same size once the first is freed, with a stale quantisation
        key = (id(q), id(k), id(v))
        hit = memo.get(key)
        if hit is None or hit[0] is not q or hit[1] is not k or hit[2] is not v:
            hit = memo[key] = (q, k, v, *quantize_fp8(q, granularity="token"),
                               *quantize_fp8(k, granularity="token"),
                               *quantize_fp8(v, transpose=True))
        q8, qd, k8, kd, vt8, vd = hit[3:]
        t, w, ks, st = (tile, warps, kv_splits, stages)
        if t is None:
            t, w, ks, st = lookup(arch_of(q.device), q.shape[3], causal, q.shape[2], "fp8")
        return attention_fp8(q8, k8, vt8, qd, kd, vd, causal=causal, out_dtype=q.dtype,
                             tile=t, warps=w, kv_splits=ks, stages=st)

    return run


def _nvidia_fa2_example() -> Impl | None:
    """NVIDIA's CuTe DSL FA2 example (``FlashAttentionForwardAmpere`` in NVIDIA/cutlass
    examples/python/CuTeDSL/.../flash_attention_v2.py), from a copy the user fetched and named in
    ``FLASHCORE_NV_FA2`` (it is not part of flashcore), in its documented configuration: m128 n64,
    128 threads. Needs the DSL on this host."""
    import importlib.util
    import os

    path = os.environ.get("FLASHCORE_NV_FA2")
    if not path:
        return None
    try:
        spec = importlib.util.spec_from_file_location("nv_fa2_example", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        import cuda.bindings.driver as cu
        import cutlass.cute as cute
        from cutlass.cute.runtime import from_dlpack
    except Exception:  # no DSL or no file: the peer is absent
        return None
    compiled: dict = {}

    def cute_view(t, bshd=False):  # (b, h, s, d) -> the example's (b, s, h, d), no copy
        t = t if bshd else t.transpose(1, 2)
        # as the example marks its tensors: dynamic, and strides divisible by 16 bytes
        return (from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=3)
                .mark_compact_shape_dynamic(mode=3, stride_order=t.dim_order(),
                                            divisibility=128 // (8 * t.element_size())))

    def run(q, k, v, causal):
        b, h, s, d = q.shape
        out = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device)
        stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
        args = [cute_view(q), cute_view(k), cute_view(v), cute_view(out, bshd=True)]
        key = (q.dtype, d, causal)
        if key not in compiled:
            fa2 = mod.FlashAttentionForwardAmpere(d, 128, 64, 128, causal)
            compiled[key] = cute.compile(fa2, *args, 1.0 / math.sqrt(d), stream)
        compiled[key](*args, 1.0 / math.sqrt(d), stream)
        return out.transpose(1, 2)

    return run


def _parse_shape(text: str) -> Shape:
    parts = text.split(",")
    b, h, s, d = (int(x) for x in parts[:4])
    return Shape(b, h, s, d, causal=len(parts) > 4 and parts[4] in ("1", "causal", "true"))


def implementations(ours: dict[str, Impl] | None = None) -> dict[str, Impl]:
    from torch.nn.attention import SDPBackend

    impls: dict[str, Impl] = dict(ours or {"flashcore": _flashcore()})
    impls["sdpa-flash"] = _sdpa(SDPBackend.FLASH_ATTENTION)
    impls["sdpa-efficient"] = _sdpa(SDPBackend.EFFICIENT_ATTENTION)
    impls["sdpa-cudnn"] = _sdpa(SDPBackend.CUDNN_ATTENTION)
    fa4 = _fa4()
    if fa4 is not None:
        impls["fa4"] = fa4
    nv = _nvidia_fa2_example()
    if nv is not None:
        impls["nv-fa2-example"] = nv
    return impls


# -- timing ------------------------------------------------------------------------------------
def _input_sets(shape: Shape, n_sets: int) -> list[tuple[torch.Tensor, ...]]:
    dt = getattr(torch, shape.dtype)
    return [
        tuple(
            torch.randn(shape.batch, shape.heads, shape.seq, shape.head_dim, device="cuda", dtype=dt)
            for _ in range(3)
        )
        for _ in range(n_sets)
    ]


def _n_sets(shape: Shape, l2_bytes: int) -> int:
    one = 3 * shape.batch * shape.heads * shape.seq * shape.head_dim * 2
    return max(2, min(64, math.ceil(3 * l2_bytes / one)))


def time_kernel(fn: Impl, sets, causal: bool, reps: int = 20) -> float:
    """Median µs per call of a CUDA graph that replays one call per input set."""
    for q, k, v in sets:
        fn(q, k, v, causal)  # compile, load, allocate (and any per-input preparation) first
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for q, k, v in sets[:2]:
            fn(q, k, v, causal)
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for q, k, v in sets:
            fn(q, k, v, causal)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(sets))
    return statistics.median(times)


def time_eager(fn: Impl, sets, causal: bool, reps: int = 20, calls: int = 50) -> float:
    """Median µs per eager call over runs of back-to-back calls (no graph): the larger of the
    kernel time and the host time of one call (argument checks, allocation, launch)."""
    for q, k, v in sets:
        fn(q, k, v, causal)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(calls):
            q, k, v = sets[i % len(sets)]
            fn(q, k, v, causal)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def measure(shapes: list[Shape], impls: dict[str, Impl], eager: bool = True) -> list[Result]:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results = []
    for shape in shapes:
        sets = _input_sets(shape, _n_sets(shape, l2))
        for name, fn in impls.items():
            r = Result(shape, name)
            try:
                with getattr(fn, "context", contextlib.nullcontext)():
                    r.kernel_us = time_kernel(fn, sets, shape.causal)
                    if eager:
                        r.eager_us = time_eager(fn, sets, shape.causal)
            except Exception as e:  # a peer without support for this shape: record, go on
                r.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            results.append(r)
        del sets
        torch.cuda.empty_cache()
    return results


# -- reporting ---------------------------------------------------------------------------------
def environment() -> dict:
    def git_sha() -> str | None:
        with contextlib.suppress(Exception):
            return subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
        return None

    props = torch.cuda.get_device_properties(0)
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "gpu": props.name,
        "sm": f"sm_{props.major}{props.minor}",
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    with contextlib.suppress(Exception):
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    import flashcore
    from flashcore.cache import dsl_version

    env["flashcore"] = flashcore.__version__
    from flashcore.runtime.loader import programmatic_launch_enabled

    env["flashcore_pdl"] = programmatic_launch_enabled()
    env["nvidia-cutlass-dsl"] = dsl_version()
    with contextlib.suppress(Exception):
        import importlib.metadata as md

        env["flash-attn-4"] = md.version("flash-attn-4")
    return env


def table(results: list[Result], ours: str = "flashcore") -> str:
    impls = list(dict.fromkeys(r.impl for r in results))
    shapes = list(dict.fromkeys(r.shape for r in results))
    by = {(r.shape, r.impl): r for r in results}
    head = f"{'shape (B,H,S,D)':28s}" + "".join(f"{i:>22s}" for i in impls)
    lines = [head, "-" * len(head)]
    for s in shapes:
        row = f"{s.label:28s}"
        base = by.get((s, ours))
        for i in impls:
            r = by[(s, i)]
            if r.error:
                cell = "n/a"
            else:
                cell = f"{r.kernel_us:.1f}us {r.tflops:.0f}TF"
                if r.eager_us is not None and s == MISSION:
                    cell = f"{r.kernel_us:.1f}/{r.eager_us:.1f}us"
                if i != ours and base is not None and base.kernel_us and not base.error:
                    cell += f" x{r.kernel_us / base.kernel_us:.2f}"
            row += f"{cell:>22s}"
        lines.append(row)
    lines.append("cells: graph kernel time and TFLOP/s (mission shape: graph/eager µs); "
                 f"xN = peer time / {ours} time (>1: {ours} faster)")
    return "\n".join(lines)


def chart(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = list(dict.fromkeys(r.impl for r in results))
    shapes = [s for s in dict.fromkeys(r.shape for r in results) if s != MISSION]
    by = {(r.shape, r.impl): r for r in results}
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(shapes)), 4.5))
    w = 0.8 / len(impls)
    for j, i in enumerate(impls):
        ys = [by[(s, i)].tflops or 0 for s in shapes]
        ax.bar([x + j * w for x in range(len(shapes))], ys, w, label=i)
    ax.set_xticks([x + 0.4 - w / 2 for x in range(len(shapes))])
    ax.set_xticklabels([s.label for s in shapes], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s (CUDA graph)")
    ax.legend(fontsize=8)
    ax.set_title(torch.cuda.get_device_name(0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def record(results: list[Result], out: Path, tag: str = "bench") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    stamp = env["date"].replace(":", "").replace("-", "")[:15]
    path = out / f"{tag}-{env['sm']}-{stamp}.json"
    rows = []
    for r in results:
        d = asdict(r)
        d["shape"] = asdict(r.shape)
        d["tflops"] = r.tflops
        rows.append(d)
    path.write_text(json.dumps({"environment": env, "results": rows}, indent=1) + "\n")
    with contextlib.suppress(Exception):
        chart(results, path.with_suffix(".png"))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcore.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="mission shape and large shapes only")
    ap.add_argument("--out", default="benchmarks/results", help="folder for the JSON and PNG")
    ap.add_argument("--no-eager", action="store_true", help="skip eager timings")
    ap.add_argument("--tile", type=int, nargs=2, default=None, help="force our tile (default auto)")
    ap.add_argument("--fp8", action="store_true", help="also our FP8 path (with and without quantising)")
    ap.add_argument("--shapes", default=None,
                    help="B,H,S,D[,causal] list separated by ';' instead of the suite")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    ours = {"flashcore": _flashcore(tuple(a.tile) if a.tile else None)}
    if torch.cuda.get_device_capability() >= (9, 0):  # Hopper kernels launch with PDL
        ours["flashcore-no-pdl"] = _flashcore_plain(tuple(a.tile) if a.tile else None)
    if a.fp8:
        ours["flashcore-fp8"] = _flashcore(tuple(a.tile) if a.tile else None, precision="fp8")
        ours["flashcore-fp8-kernel"] = fp8_kernel_only(tuple(a.tile) if a.tile else None)
    shapes = suite(a.quick) if a.shapes is None else [_parse_shape(x) for x in a.shapes.split(";")]
    results = measure(shapes, implementations(ours), eager=not a.no_eager)
    path = record(results, Path(a.out))
    print(table(results))
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
