"""Every kernel spec the GPU tests and the benchmark use, so a GPU host without the DSL can run
them from a catalog built elsewhere:

    python -m tests.gpu_specs --arch sm_90 --out .cache/sm90      # on any machine with the DSL
    FLASHCORE_CACHE_DIR=.cache/sm90 pytest -m gpu                  # on the GPU host
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from flashcore.build.catalog import catalog_specs
from flashcore.spec import AttentionSpec, QuantizeSpec, TileConfig
from tests.gpu_utils import FP8_SPLIT_CONFIGS, SPLIT_CONFIGS, STAGE_CONFIGS

TEST_TILES = [(64, 64), (128, 64), (64, 128), (128, 128), (32, 64), (16, 32)]


def default_warps(tile_m: int) -> int:
    return max(1, min(8, tile_m // 16))


def gpu_test_specs(arch: str, buckets=None) -> list[AttentionSpec | QuantizeSpec]:
    specs: list = list(catalog_specs((arch,)))
    for tile, causal, d in itertools.product(TEST_TILES, (False, True), (64, 128)):
        specs.append(AttentionSpec(arch=arch, head_dim=d, causal=causal, config=TileConfig(tile, warps=default_warps(tile[0]))))
    for (tile, warps, splits), causal, d in itertools.product(SPLIT_CONFIGS, (False, True), (64, 128)):
        specs.append(AttentionSpec(arch=arch, head_dim=d, causal=causal, return_lse=True, config=TileConfig(tile, warps=warps, kv_splits=splits)))
    for (tile, warps, splits, stages), causal, d in itertools.product(
        STAGE_CONFIGS, (False, True), (64, 128)
    ):
        specs.append(AttentionSpec(arch=arch, dtype="bfloat16", head_dim=d, causal=causal, return_lse=True, config=TileConfig(tile, warps=warps, kv_splits=splits, stages=stages)))
    if arch in ("sm_89", "sm_90"):
        for dtype, d in itertools.product(("float16", "bfloat16"), (64, 128)):
            specs.append(QuantizeSpec(arch=arch, dtype=dtype, head_dim=d, transpose=False))
            specs.append(QuantizeSpec(arch=arch, dtype=dtype, head_dim=d, transpose=True))
            specs.append(QuantizeSpec(arch=arch, dtype=dtype, head_dim=d, granularity="token"))
        for dtype, d, causal, tile in itertools.product(
            ("float16", "bfloat16"), (64, 128), (False, True), ((64, 64), (128, 64), (128, 128))
        ):
            specs.append(AttentionSpec(arch=arch, dtype=dtype, head_dim=d, causal=causal, precision="fp8", config=TileConfig(tile, warps=default_warps(tile[0]))))
        for d, causal in itertools.product((64, 128), (False, True)):
            specs.append(AttentionSpec(arch=arch, head_dim=d, causal=causal, return_lse=True,
                                       precision="fp8"))
        for (tile, warps, splits), causal, d in itertools.product(
            FP8_SPLIT_CONFIGS, (False, True), (64, 128)
        ):
            specs.append(AttentionSpec(arch=arch, head_dim=d, causal=causal, precision="fp8", config=TileConfig(tile, warps=warps, kv_splits=splits)))
        for causal, d in itertools.product((False, True), (64, 128)):  # test_fp8_stages
            specs.append(AttentionSpec(arch=arch, head_dim=d, causal=causal, precision="fp8", config=TileConfig((64, 64), warps=4, stages=2)))
    from flashcore.tuning.search import all_candidates

    precisions = ("fp16", "fp8") if arch in ("sm_89", "sm_90") else ("fp16",)
    from flashcore.tuning.table import winner_specs

    specs += list(winner_specs(arch).values())  # what tile=None and the benchmark run
    if buckets != []:
        specs += all_candidates(arch, precisions, buckets)
    return list(dict.fromkeys(specs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--buckets", nargs="*", default=None,
                    help="autotune candidates of these buckets only (default: all; none: "
                    "`--buckets` alone)")
    a = ap.parse_args()
    from flashcore.build.cache import KernelCache
    from flashcore.build.catalog import write_catalog
    from flashcore.build.compiler import compile_many

    specs = gpu_test_specs(a.arch, a.buckets)
    arts = compile_many(specs, jobs=a.jobs, cache=KernelCache(Path(a.out)),
                        progress=lambda s: print("built", s.name, flush=True))
    print(write_catalog(Path(a.out), arts), len(arts), "kernels")


if __name__ == "__main__":
    main()
