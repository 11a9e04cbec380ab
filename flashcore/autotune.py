"""Autotuner: pick tile shape and warps per (arch, head_dim, causal, sequence-length bucket).

    python -m flashcore.autotune build --arch sm_90 --out .cache/sm90   # compile candidates (CPU)
    python -m flashcore.autotune run                                     # time them (GPU)

``build`` compiles every candidate in parallel worker processes (no GPU needed) into a cache
folder that a GPU host without the DSL can use. ``run`` times each candidate with CUDA graphs at a
representative shape per bucket and writes the winners to ``flashcore/tuned/<arch>.json`` (or
``--out``). ``flashcore.ops.attention(..., tile=None)`` reads that table; an explicit tile is
always honoured. bf16 uses the fp16 winners (same kernel structure and instruction mix).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from functools import cache
from pathlib import Path

from .errors import KernelNotAvailableError
from .spec import AttentionSpec, SpecError

TUNED_DIR = Path(__file__).resolve().parent / "tuned"
DEFAULT = ((64, 64), 4, 1, 1)  # tile, warps, kv_splits, stages
# (name, upper bound of seq_q, the shape timed for it: batch, heads, seq)
BUCKETS = [("short", 1024, (1, 8, 512)), ("mid", 2048, (4, 16, 2048)), ("long", None, (4, 16, 4096))]
TILES = [(64, 64), (64, 128), (128, 64), (128, 128), (128, 32), (32, 64), (32, 128), (16, 64)]
WARPS = [1, 2, 4, 8]
KV_SPLITS = {"short": (1, 2, 4)}  # key splits pay only where the grid cannot fill the GPU
SPLIT_TILES = [(16, 64), (32, 64), (64, 64), (32, 128)]
STAGES = [1, 2]  # K/V blocks in flight


def bucket_of(seqlen: int) -> str:
    for name, bound, _ in BUCKETS:
        if bound is None or seqlen <= bound:
            return name
    raise AssertionError


def candidates(arch: str, head_dim: int, causal: bool, precision: str = "fp16",
               bucket: str | None = None):
    """Every valid spec to try; ``bucket=None``: those of every bucket."""
    splits = KV_SPLITS.get(bucket, (1,)) if bucket else sorted(set().union(*KV_SPLITS.values()))
    for tile, warps, kv_splits, stages in itertools.product(TILES, WARPS, splits, STAGES):
        if tile[0] // warps > 32:  # more rows per warp than registers hold: spills, skip early
            continue
        if bucket == "short" and tile[0] > 64:  # too few CTAs to fill the GPU
            continue
        # a split CTA holds kv_splits K/V tiles, and is for latency: small tiles, 16 rows a warp
        if kv_splits > 1 and (tile not in SPLIT_TILES or tile[0] != 16 * warps):
            continue
        try:
            spec = AttentionSpec(arch=arch, dtype="float16", head_dim=head_dim, tile=tile,
                                 warps=warps, causal=causal, precision=precision,
                                 kv_splits=kv_splits, stages=stages)
            # a config tuned on Hopper must also fit an L4 (sm_89: 99 KB of shared memory)
            spec.replace(arch="sm_89")
        except SpecError:
            continue
        yield spec


@cache
def _table(arch: str) -> dict:
    path = Path(os.environ.get("FLASHCORE_TUNED", TUNED_DIR)) / f"{arch}.json"
    try:
        return json.loads(path.read_text())["winners"]
    except (OSError, ValueError, KeyError):
        return {}


def key(head_dim: int, causal: bool, bucket: str, precision: str = "fp16") -> str:
    return f"d{head_dim}-{'causal' if causal else 'full'}-{bucket}-{precision}"


# An arch without a table of its own borrows one: there is no Ada GPU to tune on, and every
# Hopper candidate is required to fit an L4 (``candidates``; test_compile checks each winner).
BORROWED_TABLES = {"sm_89": "sm_90"}


def table_arch(arch: str) -> str:
    """The arch whose table ``tile=None`` reads on ``arch``: its own if it has one."""
    if _table(arch) or arch not in BORROWED_TABLES:
        return arch
    return BORROWED_TABLES[arch]


def lookup(arch: str, head_dim: int, causal: bool, seqlen_q: int, precision: str = "fp16"):
    """(tile, warps, kv_splits, stages) for ``tile=None``: the tuned winner (from a borrowed table
    where ``arch`` has none, see ``BORROWED_TABLES``), else ``DEFAULT``."""
    w = _table(table_arch(arch)).get(key(head_dim, causal, bucket_of(seqlen_q), precision))
    return DEFAULT if w is None else _knobs(w)


def _knobs(winner: dict) -> tuple:
    """(tile, warps, kv_splits, stages) of one table entry (older entries lack the last two)."""
    return (tuple(winner["tile"]), winner["warps"], winner.get("kv_splits", 1),
            winner.get("stages", 1))


def winner_specs(arch: str, build_arch: str | None = None,
                 precisions=("fp16", "fp8")) -> dict[str, AttentionSpec]:
    """The tuned winners of ``arch``'s table as specs for ``build_arch`` (default ``arch``), by
    table key: what ``tile=None`` runs, or its twin on another arch."""
    out = {}
    for name, w in sorted(_table(arch).items()):
        d, mask, _, prec = name.split("-")
        if prec in precisions:
            tile, warps, kv_splits, stages = _knobs(w)
            out[name] = AttentionSpec(arch=build_arch or arch, head_dim=int(d[1:]), tile=tile,
                                      warps=warps, kv_splits=kv_splits, stages=stages,
                                      causal=mask == "causal", precision=prec)
    return out


# -- build (CPU) and run (GPU) ---------------------------------------------------------------------
def all_candidates(arch: str, precisions=("fp16",), buckets=None) -> list[AttentionSpec]:
    out = []
    for d, causal, prec in itertools.product((64, 128), (False, True), precisions):
        for b in buckets or [None]:
            out += list(candidates(arch, d, causal, prec, b))
    return list(dict.fromkeys(out))


def build(arch: str, out: Path, jobs: int | None, buckets=None, fp8: bool = True) -> None:
    from .cache import KernelCache
    from .compiler import compile_many

    precisions = ("fp16", "fp8") if fp8 and arch in ("sm_89", "sm_90") else ("fp16",)
    specs = all_candidates(arch, precisions, buckets)
    compile_many(specs, jobs=jobs, cache=KernelCache(out))
    print(f"{len(specs)} candidates compiled into {out}")


def run(out: Path | None, precisions=("fp16", "fp8"), buckets=None) -> Path:
    """Time the candidates of ``buckets`` (default: all) and merge the winners into the table:
    the entries of buckets not run are kept."""
    import torch

    from .bench import fp8_kernel_only, time_kernel
    from .compiler import compile_kernel
    from .ops import attention
    from .ops._kernels import arch_of

    arch = arch_of(torch.device("cuda"))
    winners, timings = {}, {}
    for d, causal, prec in itertools.product((64, 128), (False, True), precisions):
        if prec == "fp8" and arch == "sm_80":
            continue
        for bname, _, (b, h, s) in BUCKETS:
            if buckets and bname not in buckets:
                continue
            sets = [tuple(torch.randn(b, h, s, d, device="cuda", dtype=torch.float16)
                          for _ in range(3)) for _ in range(4)]
            best = None
            for spec in candidates(arch, d, causal, prec, bname):
                try:
                    res = compile_kernel(spec).resources
                except KernelNotAvailableError:  # not in this host's catalog: not a candidate
                    print(f"  {spec.name}: not built, skipped")
                    continue
                if res.stack_frame_bytes or res.spill_store_bytes:
                    print(f"  {spec.name}: spills, skipped")
                    continue
                if prec == "fp8":  # the kernel alone, on inputs quantised beforehand
                    fn = fp8_kernel_only(spec.tile, spec.warps, spec.kv_splits, spec.stages)
                else:
                    def fn(q, k, v, c, spec=spec):
                        return attention(q, k, v, tile=spec.tile, warps=spec.warps, causal=c,
                                         kv_splits=spec.kv_splits, stages=spec.stages)
                try:
                    us = time_kernel(fn, sets, causal, reps=10)
                except Exception as e:  # noqa: BLE001 - a candidate that fails is skipped
                    print(f"  {spec.name}: failed ({type(e).__name__}: {e})")
                    continue
                timings[f"{key(d, causal, bname, prec)} {spec.tile} w{spec.warps} "
                        f"k{spec.kv_splits} s{spec.stages}"] = us
                if best is None or us < best[0]:
                    best = (us, spec)
            if best is not None:
                us, spec = best
                winners[key(d, causal, bname, prec)] = {
                    "tile": list(spec.tile), "warps": spec.warps, "kv_splits": spec.kv_splits,
                    "stages": spec.stages,
                    "us": round(us, 2),
                    "shape": [b, h, s, d],
                }
                print(f"{key(d, causal, bname, prec):28s} -> {spec.tile} w{spec.warps} "
                      f"k{spec.kv_splits} s{spec.stages}: {us:.1f} us", flush=True)
    path = out or TUNED_DIR / f"{arch}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    path.write_text(json.dumps({
        "arch": arch, "gpu": torch.cuda.get_device_name(0),
        "note": old.get("note", ""),
        "winners": dict(sorted({**old.get("winners", {}), **winners}.items())),
        "timings_us": {**old.get("timings_us", {}), **{k: round(v, 2) for k, v in timings.items()}},
    }, indent=1) + "\n")
    _table.cache_clear()
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcore.autotune", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="compile every candidate (no GPU needed)")
    b.add_argument("--arch", default="sm_90")
    b.add_argument("--out", required=True)
    b.add_argument("--jobs", type=int, default=None)
    b.add_argument("--buckets", nargs="*", default=None, help="default: every bucket")
    b.add_argument("--no-fp8", action="store_true")
    r = sub.add_parser("run", help="time the candidates on this GPU and write the winners")
    r.add_argument("--out", default=None)
    r.add_argument("--no-fp8", action="store_true")
    r.add_argument("--buckets", nargs="*", default=None, help="default: every bucket")
    a = ap.parse_args(argv)
    if a.verb == "build":
        build(a.arch, Path(a.out), a.jobs, a.buckets, fp8=not a.no_fp8)
    else:
        precisions = ("fp16",) if a.no_fp8 else ("fp16", "fp8")
        print(run(Path(a.out) if a.out else None, precisions, a.buckets))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
