"""Autotuner: the best ``TileConfig`` per (arch, head dim, masking, sequence-length bucket).

    python -m flashcore.autotune build --arch sm_90 --out .cache/sm90   # compile candidates (CPU)
    python -m flashcore.autotune run                                     # time them (GPU)

``build`` compiles every candidate in parallel worker processes (no GPU needed) into a cache
folder that a GPU host without the DSL can use. ``run`` times each candidate with CUDA graphs at a
representative shape per bucket and writes the winners to ``flashcore/tuned/<arch>.json`` (or
``--out``); ``flashcore.tuned.table`` reads them for ``tile=None``. bf16 uses the fp16 winners
(same kernel structure and instruction mix).

Candidates come from every kernel family that runs on the arch (``--families`` narrows them):
the default family's from the curated lists below (each must also fit an L4, which borrows the
Hopper table), another family's from its knob grid (``flashcore.specs.families``). The table's
current entry is timed again with them, so a winner always beats the incumbent in the same run.
A winner of a non-default family is written with the default family's best as its fallback.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from ..errors import KernelNotAvailableError, SpecError
from ..specs import DEFAULT_FAMILY, FAMILIES, FP8_ARCHS, HEAD_DIMS, AttentionSpec, TileConfig
from ..tuned.table import BUCKETS, DECODE_DEFAULT, DEFAULT, TUNED_DIR, clear, entries, key

TILES = [(64, 64), (64, 128), (128, 64), (128, 128), (128, 32), (32, 64), (32, 128), (16, 64)]
WARPS = [1, 2, 4, 8]
KV_SPLITS = {"short": (1, 2, 4)}  # key splits pay only where the grid cannot fill the GPU
SPLIT_TILES = [(16, 64), (32, 64), (64, 64), (32, 128)]
STAGES = [1, 2]  # K/V blocks in flight
# decode: 16-32 rows (one query token, or the query heads of one K/V head), keys streamed
DECODE_TILES = [(16, 32), (16, 64), (16, 128), (32, 64)]
DECODE_STAGES = [1, 2, 3]
# the head dims tuned unless asked for others (the rest run stand-ins: ``tuned.table``)
TUNED_HEAD_DIMS = (64, 128)


def candidate_configs(bucket: str | None = None) -> list[TileConfig]:
    """The configs worth timing for ``bucket`` (None: every bucket's)."""
    if bucket == "decode":
        return [TileConfig(tile, warps=tile[0] // 16, stages=stages, kv_splits=kv_splits)
                for tile, stages, kv_splits in itertools.product(DECODE_TILES, DECODE_STAGES,
                                                                 (1, 2))]
    if bucket is None:
        return list(dict.fromkeys(c for b, _, _ in BUCKETS for c in candidate_configs(b)))
    splits = KV_SPLITS.get(bucket, (1,))
    out = []
    for tile, warps, kv_splits, stages in itertools.product(TILES, WARPS, splits, STAGES):
        if tile[0] // warps > 32:  # more rows per warp than registers hold: spills, skip early
            continue
        if bucket == "short" and tile[0] > 64:  # too few CTAs to fill the GPU
            continue
        # a split CTA holds kv_splits K/V tiles, and is for latency: small tiles, 16 rows a warp
        if kv_splits > 1 and (tile not in SPLIT_TILES or tile[0] != 16 * warps):
            continue
        out.append(TileConfig(tile, warps=warps, stages=stages, kv_splits=kv_splits))
    return out


def family_configs(name: str, head_dim: int, bucket: str | None = None) -> list[TileConfig]:
    """Every point of a non-default family's search grid at ``head_dim`` (validity is the
    spec's to check); none for decode where the family cannot split keys (``bucket=None``:
    every bucket's)."""
    fam = FAMILIES[name]
    if bucket == "decode" and not fam.splits_keys:
        return []
    knobs = fam.search_grid(head_dim)
    return [TileConfig((m, n), warps=w, stages=s, kv_splits=k, family=name)
            for m, n, w, s, k in itertools.product(knobs["tile_m"], knobs["tile_n"],
                                                   knobs["warps"], knobs["stages"],
                                                   knobs["kv_splits"])]


def candidates(arch: str, head_dim: int, causal: bool, precision: str = "fp16",
               bucket: str | None = None, families: tuple[str, ...] | None = None):
    """Every valid spec to try; ``bucket=None``: those of every bucket; ``families``: the kernel
    families to draw from (default: every one that runs on ``arch``). Decode candidates come
    as the kernel that writes split-KV partials (what decode runs when it splits the keys)."""
    default = DEFAULT_FAMILY.get(arch, "mma_sync")
    names = families or [n for n, f in FAMILIES.items() if arch in f.archs]
    configs = candidate_configs(bucket) if default in names else []
    for name in names:
        if name != default:
            configs += family_configs(name, head_dim, bucket)
    for config in dict.fromkeys(configs):
        try:
            spec = AttentionSpec(arch=arch, dtype="float16", head_dim=head_dim, config=config,
                                 causal=causal, precision=precision)
            if not config.family:  # the default family's winners must also fit an L4 (sm_89:
                spec.replace(arch="sm_89")  # 99 KB of shared memory), which borrows the table
        except SpecError:
            continue
        yield spec.replace(split_kv=True) if bucket == "decode" else spec


def decode_specs(spec: AttentionSpec) -> list:
    """The kernels a decode config runs: split-KV partials and their combine, or the whole
    rows when the keys are not split (a large batch fills the GPU)."""
    from ..specs import CombineSpec

    return [spec.replace(split_kv=True), spec.replace(split_kv=False),
            CombineSpec(arch=spec.arch, dtype=spec.dtype, head_dim=spec.head_dim)]


def all_candidates(arch: str, precisions=("fp16",), buckets=None, families=None,
                   head_dims=TUNED_HEAD_DIMS) -> list:
    """Every spec the tuner may time (decode candidates with their companion kernels), the
    table's incumbents included."""
    out = []
    for d, causal, prec in itertools.product(head_dims, (False, True), precisions):
        for b in buckets or [name for name, _, _ in BUCKETS]:
            for spec in [*candidates(arch, d, causal, prec, b, families),
                         *incumbents(arch, d, causal, prec, b)]:
                out += decode_specs(spec) if b == "decode" else [spec]
    return list(dict.fromkeys(out))


def _check_buckets(buckets) -> None:
    names = [b for b, _, _ in BUCKETS]
    for b in buckets or []:
        if b not in names:
            raise SpecError(f"unknown bucket {b!r}; choose from {names}")


def _check_families(arch: str, families) -> None:
    for name in families or []:
        if arch not in FAMILIES[name].archs:
            raise SpecError(f"kernel family {name!r} does not run on {arch} "
                            f"(it runs on {', '.join(FAMILIES[name].archs)})")


def build(arch: str, out: Path, jobs: int | None, buckets=None,
          precisions: tuple[str, ...] = ("fp16", "fp8"), families=None,
          head_dims=TUNED_HEAD_DIMS) -> int:
    from ..compiler.cache import KernelCache
    from ..compiler.compiler import compile_many

    _check_families(arch, families)
    precisions = tuple(p for p in precisions if p == "fp16" or arch in FP8_ARCHS)
    specs = all_candidates(arch, precisions, buckets, families, head_dims)
    if not specs:
        raise SystemExit(f"autotune: no candidate compiles for {arch}")
    compile_many(specs, jobs=jobs, cache=KernelCache(out))
    print(f"{len(specs)} candidates compiled into {out}")
    return len(specs)


def incumbents(arch: str, head_dim: int, causal: bool, precision: str, bucket: str) -> list:
    """The table's current entry for this key (winner and fallback) as specs, timed again with
    the candidates; the default config where there is no entry."""
    tuned = entries(arch).get(key(head_dim, causal, bucket, precision))
    configs = ([DECODE_DEFAULT if bucket == "decode" else DEFAULT] if tuned is None
               else [c for c in (tuned.config, tuned.fallback) if c is not None])
    out = []
    for config in configs:
        try:
            spec = AttentionSpec(arch=arch, dtype="float16", head_dim=head_dim, config=config,
                                 causal=causal, precision=precision)
        except SpecError:
            continue
        out.append(spec.replace(split_kv=True) if bucket == "decode" else spec)
    return out


def table_entry(timed: list, shape: list) -> dict:
    """The table entry of one key from its (µs, spec) timings: the fastest, and where that one
    is of a non-default family, the default family's fastest as its fallback."""
    us, spec = min(timed, key=lambda t: t[0])
    entry = {"config": spec.config.to_dict(), "us": round(us, 2), "shape": shape}
    if spec.config.family:
        default = [t for t in timed if not t[1].config.family]
        if not default:
            raise SystemExit(f"autotune: {spec.name} won but no default-family kernel was timed "
                             "to fall back on")
        fus, fspec = min(default, key=lambda t: t[0])
        entry["fallback"] = {"config": fspec.config.to_dict(), "us": round(fus, 2)}
    return entry


def run(out: Path | None, precisions=("fp16", "fp8"), buckets=None,
        families: tuple[str, ...] | None = None, head_dims=TUNED_HEAD_DIMS) -> Path:
    """Time the candidates of ``buckets`` (default: all) from ``families`` (default: every one
    on this GPU's arch) with the table's incumbents, and merge the winners into the table: the
    entries of buckets not run are kept."""
    import torch

    from ..compiler.compiler import compile_kernel
    from ..ops import attention
    from ..runtime.device import arch_of
    from .peers import fp8_kernel_only
    from .timing import time_kernel

    if not torch.cuda.is_available():
        raise SystemExit("autotune run: needs a CUDA GPU")
    arch = arch_of(torch.cuda.current_device())
    _check_families(arch, families)
    winners, timings = {}, {}
    for d, causal, prec in itertools.product(head_dims, (False, True), precisions):
        if prec == "fp8" and arch not in FP8_ARCHS:
            continue
        for bname, _, (b, h, hkv, sq, sk) in BUCKETS:
            if buckets and bname not in buckets:
                continue
            sets = [(torch.randn(b, h, sq, d, device="cuda", dtype=torch.float16),
                     torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.float16),
                     torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.float16))
                    for _ in range(4)]
            timed = []
            specs = [*candidates(arch, d, causal, prec, bname, families),
                     *incumbents(arch, d, causal, prec, bname)]
            for spec in dict.fromkeys(specs):
                try:
                    res = compile_kernel(spec).resources
                except KernelNotAvailableError:  # not in this host's catalog: not a candidate
                    print(f"  {spec.name}: not built, skipped")
                    continue
                if res.stack_frame_bytes or res.spill_store_bytes:
                    print(f"  {spec.name}: spills, skipped")
                    continue
                if prec == "fp8":  # the kernel alone, on inputs quantised beforehand
                    fn = fp8_kernel_only(spec.config)

                    def call(q, k, v, fn=fn, causal=causal):
                        return fn(q, k, v, causal)
                else:
                    def call(q, k, v, spec=spec, causal=causal):
                        return attention(q, k, v, config=spec.config, causal=causal)
                try:
                    us = time_kernel(call, sets, reps=10)
                except Exception as e:  # noqa: BLE001 - a candidate that fails is skipped
                    print(f"  {spec.name}: failed ({type(e).__name__}: {e})")
                    continue
                timings[f"{key(d, causal, bname, prec)} {spec.config.tag}"] = us
                timed.append((us, spec))
            if timed:
                entry = winners[key(d, causal, bname, prec)] = table_entry(
                    timed, [b, h, hkv, sq, sk, d])
                print(f"{key(d, causal, bname, prec):28s} -> "
                      f"{TileConfig.from_dict(entry['config']).tag}: {entry['us']:.1f} us",
                      flush=True)
    path = out or TUNED_DIR / f"{arch}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    path.write_text(json.dumps({
        "arch": arch, "gpu": torch.cuda.get_device_name(0), "format": 2,
        "note": old.get("note", ""),
        "winners": dict(sorted({**old.get("winners", {}), **winners}.items())),
        "timings_us": {**old.get("timings_us", {}), **{k: round(v, 2) for k, v in timings.items()}},
    }, indent=1) + "\n")
    clear()
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcore.autotune",
                                 description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="compile every candidate (no GPU needed)")
    b.add_argument("--arch", default="sm_90", choices=("sm_80", "sm_89", "sm_90"))
    b.add_argument("--out", required=True, help="cache folder to compile into")
    b.add_argument("--jobs", type=int, default=None, help="parallel compile workers")
    b.add_argument("--buckets", nargs="*", default=None, help="default: every bucket")
    r = sub.add_parser("run", help="time the candidates on this GPU and write the winners")
    r.add_argument("--out", default=None, help="table to write (default flashcore/tuned/)")
    r.add_argument("--buckets", nargs="*", default=None, help="default: every bucket")
    for p in (b, r):
        p.add_argument("--no-fp8", action="store_true", help="fp16 candidates only")
        p.add_argument("--only-fp8", action="store_true", help="FP8 (e4m3 operand) candidates only")
        p.add_argument("--families", nargs="*", default=None, choices=sorted(FAMILIES),
                       help="kernel families to draw candidates from (default: every one)")
        p.add_argument("--head-dims", nargs="+", type=int, default=list(TUNED_HEAD_DIMS),
                       choices=HEAD_DIMS, help=f"default: {TUNED_HEAD_DIMS}")
    a = ap.parse_args(argv)
    import sys

    from ..errors import FlashcoreError

    # Every error: one line naming it, exit status 2, no traceback.
    try:
        _check_buckets(a.buckets)
        if a.no_fp8 and a.only_fp8:
            raise SystemExit("--no-fp8 and --only-fp8 leave nothing to tune")
        precisions = ("fp16",) if a.no_fp8 else ("fp8",) if a.only_fp8 else ("fp16", "fp8")
        if a.verb == "build":
            build(a.arch, Path(a.out), a.jobs, a.buckets, precisions, families=a.families,
                  head_dims=tuple(a.head_dims))
        else:
            try:
                import torch

                has_gpu = torch.cuda.is_available()
            except ImportError:
                has_gpu = False
            if not has_gpu:
                raise SystemExit("needs a CUDA GPU (torch sees none); `build` needs none")
            print(run(Path(a.out) if a.out else None, precisions, a.buckets,
                      tuple(a.families) if a.families else None, tuple(a.head_dims)))
    except (FlashcoreError, OSError) as e:
        print(f"autotune {a.verb}: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        print(f"autotune {a.verb}: {e.code.removeprefix('autotune: ')}", file=sys.stderr)
        return 2
    return 0
