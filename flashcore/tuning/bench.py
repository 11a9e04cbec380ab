"""Benchmark harness: flashcore against every peer on this machine, side by side in one run.

    python -m flashcore.bench                 # the full suite
    python -m flashcore.bench --quick         # the mission shape, the large shapes, decode
    python -m flashcore.bench --decode        # the decode (and GQA prefill) section only
    python -m flashcore.bench --backward      # training: forward + backward, backward alone
    python -m flashcore.bench --host          # eager host time a call, keys growing, vs SDPA
    python -m flashcore.bench --out DIR       # records go to DIR (default: ./bench-results)

For each shape: kernel time (median over CUDA-graph replays of several launches, inputs rotated so
the L2 cache does not flatter; ``--rounds N`` times every implementation N times in turn and
keeps the median), and at the mission shape the eager call time (median per call with CUDA
events, host overhead included). Decode shapes also get read floors: one launch that only reads
K's and V's bytes (16-bit, and e4m3), what streaming the cache costs on this GPU. Peers: torch
SDPA forced to each backend (``enable_gqa`` where K/V have fewer heads), FlashAttention-4 when
importable, NVIDIA's CuTe DSL FA2 example when ``FLASHCORE_NV_FA2`` names a copy. Writes a JSON
record (flashcore's source hash, git SHA, GPU, driver, versions, every figure) and a PNG chart,
and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import platform
import statistics
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..compiler.fingerprint import PACKAGE, dsl_fingerprint, hash_files, source_hash
from ..specs import TileConfig
from .peers import (
    Impl,
    _flashcore,
    _flashcore_kv_expanded,
    _flashcore_plain,
    fp8_kernel_only,
    fp8_kv_cache,
    implementations,
    read_floor,
)
from .records import result_row, write_record
from .shape import Shape
from .timing import alternating, n_sets, time_eager, time_kernel

MISSION = Shape(1, 8, 512, 64)
# the decode issue's shapes: B, H_q, H_kv, S_k, D with one query token
DECODE = [Shape(1, 8, 32768, 128, kv_heads=8, seq_q=1), Shape(1, 32, 8192, 128, kv_heads=8, seq_q=1),
          Shape(16, 32, 4096, 128, kv_heads=8, seq_q=1)]
# decode with more query heads a K/V head than a tile's 16 rows (MQA-like: 32 heads over one),
# and a few tokens a sequence (speculative drafts): their rows are packed into grown tiles
DECODE_PACKED = [Shape(8, 32, 8192, 128, kv_heads=1, seq_q=1),
                 Shape(1, 32, 8192, 128, kv_heads=8, seq_q=8)]
GQA_PREFILL = [Shape(4, 32, 4096, 128, True, kv_heads=8)]


def suite(quick: bool, decode: bool = True) -> list[Shape]:
    shapes = [MISSION, Shape(4, 16, 4096, 64), Shape(4, 16, 4096, 128), Shape(2, 16, 8192, 128)]
    shapes += [Shape(4, 16, 4096, 64, True), Shape(4, 16, 4096, 128, True)]
    if decode:
        shapes += DECODE + [Shape(**{**asdict(s), "dtype": "bfloat16"}) for s in DECODE]
        shapes += GQA_PREFILL
    if quick:
        return shapes
    for s in (512, 1024, 2048, 16384):
        for d in (64, 128):
            b = max(1, 16384 // s)
            shapes.append(Shape(b, 16, s, d))
    shapes += [Shape(2, 16, 8192, 128, True), Shape(4, 16, 4096, 128, False, "bfloat16")]
    for d in (96, 256):  # the other head dims models use (Phi's 96, Gemma's 256)
        shapes += [Shape(4, 16, 4096, d), Shape(4, 16, 4096, d, True)]
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

    @property
    def tbps(self) -> float | None:
        """Minimum bytes over kernel time (FP8-KV rows count e4m3 K/V)."""
        if self.kernel_us is None:
            return None
        return self.shape.min_bytes(1 if "fp8kv" in self.impl else 2) / self.kernel_us / 1e6


def _parse_shape(text: str) -> Shape:
    """B,H,S,D[,causal] or B,Hq/Hkv,SqxSk,D[,causal]."""
    parts = text.split(",")
    heads, _, kv = parts[1].partition("/")
    sq, _, sk = parts[2].rpartition("x")
    return Shape(int(parts[0]), int(heads), int(sk), int(parts[3]),
                 causal=len(parts) > 4 and parts[4] in ("1", "causal", "true"),
                 kv_heads=int(kv) if kv else None, seq_q=int(sq) if sq else None)


def _applies(name: str, shape: Shape) -> bool:
    """The FP8 KV cache and the read floors are for decode; pre-expanded K/V for GQA prefill."""
    if "fp8kv" in name or name.startswith("read-floor"):
        return shape.decode
    if "expanded" in name:
        return not shape.decode and shape.hkv != shape.heads
    return True


def measure(shapes: list[Shape], impls: dict[str, Impl], eager: bool = True,
            rounds: int = 1) -> list[Result]:
    """Each shape's implementations timed in turn, ``rounds`` times over (every other round
    in reverse order, ABBA, so a drift in clocks or temperature favours no one; the median
    kept, each round's figure in ``extra["rounds_us"]``): a GPU at its power cap runs the
    same kernel 3-8% apart from minute to minute, and alternating keeps a close pair's
    comparison from riding on which came first."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results = []
    for shape in shapes:
        sets = [shape.inputs() for _ in range(n_sets(int(shape.min_bytes()), l2))]
        mine = {name: Result(shape, name) for name in impls if _applies(name, shape)}
        times: dict[str, list[float]] = {name: [] for name in mine}
        for turn, name, r in alternating(mine, rounds):
            if r.error:
                continue
            fn = impls[name]

            def call(q, k, v, fn=fn, causal=shape.causal):
                return fn(q, k, v, causal)

            try:
                with getattr(fn, "context", contextlib.nullcontext)():
                    times[name].append(time_kernel(call, sets))
                    if eager and shape == MISSION and turn == 0:  # host overhead shows
                        r.eager_us = time_eager(call, sets)  # only at small shapes
            except Exception as e:  # a peer without support for this shape: record, go on
                r.error = (f"{type(e).__name__}: "
                           f"{str(e).splitlines()[0][:160] if str(e) else ''}")
        for name, r in mine.items():
            if times[name] and not r.error:
                r.kernel_us = statistics.median(times[name])
                if rounds > 1:
                    r.extra["rounds_us"] = times[name]
            results.append(r)
        del sets
        torch.cuda.empty_cache()
    return results


# -- reporting ---------------------------------------------------------------------------------
def _tree_hash() -> str:
    """sha256 (16 hex) of every file of the flashcore package as it is on disk: the code that ran
    (a device copy's .git may lag its work tree)."""
    return hash_files([p for p in sorted(PACKAGE.rglob("*"))
                       if p.is_file() and "__pycache__" not in p.parts])


def environment() -> dict:
    from .. import __version__
    from ..runtime.loader import programmatic_launch_enabled

    def git(*args: str) -> str | None:
        with contextlib.suppress(Exception):
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                                  cwd=PACKAGE).stdout.strip()
        return None

    props = torch.cuda.get_device_properties(0)
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "flashcore": __version__,
        "flashcore_tree": _tree_hash(),
        "flashcore_build_sources": source_hash(),
        "git_sha": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--", ".")),
        "gpu": props.name,
        "sm": f"sm_{props.major}{props.minor}",
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "flashcore_pdl": programmatic_launch_enabled(),
        "nvidia-cutlass-dsl": dsl_fingerprint(),
    }
    with contextlib.suppress(Exception):
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    with contextlib.suppress(Exception):
        env["flash-attn-4"] = importlib.metadata.version("flash-attn-4")
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
            r = by.get((s, i))
            if r is None:
                cell = "-"
            elif r.error:
                cell = "n/a"
            else:
                cell = (f"{r.kernel_us:.1f}us {r.tbps:.2f}TB/s" if s.decode
                        else f"{r.kernel_us:.1f}us {r.tflops:.0f}TF")
                if r.eager_us is not None and s == MISSION:
                    cell = f"{r.kernel_us:.1f}/{r.eager_us:.1f}us"
                if i != ours and base is not None and base.kernel_us and not base.error:
                    cell += f" x{r.kernel_us / base.kernel_us:.2f}"
            row += f"{cell:>22s}"
        lines.append(row)
    lines.append("cells: graph kernel time and TFLOP/s (decode: TB/s of the minimum bytes; mission "
                 f"shape: graph/eager µs); xN = peer time / {ours} time (>1: {ours} faster)")
    return "\n".join(lines)


def chart(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = list(dict.fromkeys(r.impl for r in results))
    shapes = [s for s in dict.fromkeys(r.shape for r in results) if s != MISSION and not s.decode]
    by = {(r.shape, r.impl): r for r in results}
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(shapes)), 4.5))
    w = 0.8 / len(impls)
    for j, i in enumerate(impls):
        ys = [(by[(s, i)].tflops or 0) if (s, i) in by else 0 for s in shapes]
        ax.bar([x + j * w for x in range(len(shapes))], ys, w, label=i)
    ax.set_xticks([x + 0.4 - w / 2 for x in range(len(shapes))])
    ax.set_xticklabels([s.label for s in shapes], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s (CUDA graph)")
    ax.legend(fontsize=8)
    ax.set_title(torch.cuda.get_device_name(0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# Records of runs stay out of the source tree: this folder (relative to the working directory)
# is git-ignored; --out names another.
DEFAULT_OUT = "bench-results"


def record(results: list[Result], out: Path, tag: str = "bench") -> Path:
    path = write_record(out, tag, environment(),
                        [result_row(r, tflops=r.tflops, tbps=r.tbps) for r in results])
    with contextlib.suppress(Exception):
        chart(results, path.with_suffix(".png"))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcore.bench",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="mission shape, large shapes and decode only (a few minutes)")
    ap.add_argument("--decode", action="store_true", help="the decode and GQA section only")
    ap.add_argument("--backward", action="store_true",
                    help="the backward section only: forward + backward and the backward alone "
                         "against SDPA, FlashAttention-4 and FlexAttention, with peak memory "
                         "(--quick: three shapes)")
    ap.add_argument("--host", action="store_true",
                    help="the host-time section only: eager calls back to back, keys growing "
                         "by one a call as in generation, against SDPA in the same loop")
    ap.add_argument("--bwd-variants", nargs="*", default=[], metavar="CHOICE",
                    help="--backward: also ours with each of these main-kernel choices, e.g. "
                         "'128:64x128w8s2a242;64:64x128w8s2' (FLASHCORE_BWD_CONFIG's form)")
    ap.add_argument("--out", default=DEFAULT_OUT,
                    help=f"folder for the JSON and PNG (default: {DEFAULT_OUT}, git-ignored)")
    ap.add_argument("--no-eager", action="store_true", help="skip eager timings")
    ap.add_argument("--tile", type=int, nargs=2, default=None,
                    help="force our tile (default: the tuned config)")
    ap.add_argument("--fp8", action="store_true",
                    help="also our FP8 path (with and without quantising; the kernel alone with K "
                         "descaled per token and per head)")
    ap.add_argument("--wgmma", action="store_true",
                    help="also the Hopper family (sm_90): wgmma_ws tiles of 128 and 192 query "
                         "rows and 64 to 192 keys")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time each shape's implementations this many times in turn, keep the "
                         "median (close comparisons: 3)")
    ap.add_argument("--shapes", default=None,
                    help="B,H,S,D[,causal] or B,Hq/Hkv,SqxSk,D[,causal], separated by ';'")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    if a.backward:
        return backward_main(a)
    if a.host:
        return host_main(a)
    tile = {"tile": tuple(a.tile)} if a.tile else {}
    ours = {"flashcore": _flashcore(**tile)}
    if torch.cuda.get_device_capability() >= (9, 0):  # Hopper kernels launch with PDL
        ours["flashcore-no-pdl"] = _flashcore_plain(**tile)
    ours["flashcore-fp8kv"] = fp8_kv_cache()
    ours["flashcore-kv-expanded"] = _flashcore_kv_expanded()
    ours["read-floor"] = read_floor()  # decode shapes: not attention, the cost of one read
    ours["read-floor-fp8kv"] = read_floor(0.5)
    if a.wgmma:
        for tm, tn, stages in ((128, 128, 2), (128, 64, 3), (128, 64, 2), (192, 64, 2),
                               (192, 128, 2), (128, 80, 2), (128, 176, 2), (192, 144, 2),
                               (192, 192, 2)):  # d256 fits (128, 64|80, 2) only of these
            name = f"flashcore-ws-n{tn}-s{stages}" if tm == 128 else f"flashcore-ws-m{tm}-n{tn}"
            ours[name] = _flashcore(config=TileConfig((tm, tn), warps=tm // 16, stages=stages,
                                                      family="wgmma_ws"))
    if a.fp8:
        ours["flashcore-fp8"] = _flashcore(precision="fp8", **tile)
        ours["flashcore-fp8-kernel"] = fp8_kernel_only()
        ours["flashcore-fp8-kernel-khead"] = fp8_kernel_only(k_scale="head")
    if a.shapes:
        shapes = [_parse_shape(x) for x in a.shapes.split(";")]
    elif a.decode:
        shapes = DECODE + [Shape(**{**asdict(s), "dtype": "bfloat16"}) for s in DECODE] \
            + DECODE_PACKED + GQA_PREFILL
    else:
        shapes = suite(a.quick)
    results = measure(shapes, implementations(ours), eager=not a.no_eager,
                      rounds=a.rounds)
    path = record(results, Path(a.out))
    print(table(results))
    print(f"record: {path}")
    return 0


def host_main(a: argparse.Namespace) -> int:
    """``--host``: eager host time a call (``host_bench``)."""
    from .host_bench import HOST_HEADER, host_row, measure_host, record_host

    print(HOST_HEADER, flush=True)  # a row a case as it is measured
    results = measure_host(report=lambda r: print(host_row(r), flush=True))
    path = record_host(results, Path(a.out), environment())
    print(f"record: {path}")
    return 0


def backward_main(a: argparse.Namespace) -> int:
    """``--backward``: the training section (``backward_bench``)."""
    from .backward_bench import (
        backward_implementations,
        backward_suite,
        backward_table,
        measure_backward,
        record_backward,
        variant_implementation,
    )

    shapes = ([_parse_shape(x) for x in a.shapes.split(";")] if a.shapes
              else backward_suite(a.quick))
    impls = backward_implementations()
    for text in a.bwd_variants:
        impls[f"fc[{text}]"] = variant_implementation(text)
    results = measure_backward(shapes, impls, rounds=a.rounds)
    path = record_backward(results, Path(a.out), environment())
    print(backward_table(results))
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
