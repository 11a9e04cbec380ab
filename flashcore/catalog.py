"""The catalog: the specs flashcore builds ahead of time, as data."""

from __future__ import annotations

import itertools

from .spec import AttentionSpec

# Tiles shipped per head dim: the default (64, 64) and a larger-tile option per head dim.
CATALOG_TILES = {64: [((64, 64), 4), ((128, 64), 8)], 128: [((64, 64), 4), ((128, 64), 8)]}


def catalog_specs(archs: tuple[str, ...] = ("sm_80", "sm_89", "sm_90")) -> list[AttentionSpec]:
    specs = []
    for arch, dtype, d, causal, lse in itertools.product(
        archs, ("float16", "bfloat16"), (64, 128), (False, True), (False, True)
    ):
        for tile, warps in CATALOG_TILES[d]:
            specs.append(
                AttentionSpec(
                    arch=arch, dtype=dtype, head_dim=d, tile=tile, warps=warps, causal=causal,
                    return_lse=lse,
                )
            )
    return specs
