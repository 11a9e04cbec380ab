"""Every kernel spec the GPU tests and the benchmark use, so they can be built ahead (in parallel,
on any machine with the DSL) and a GPU host can run them from a catalog:

    python -m tests.gpu_specs --arch sm_90 --out .cache/sm90      # on any machine with the DSL
    python -m tests.gpu_specs --check .cache/sm90                  # built from this tree?
    FLASHCORE_CACHE_DIR=.cache/sm90 pytest -m gpu                  # on the GPU host

Configs that do not fit the arch (an L4's 99 KB of shared memory for sm_89) are left out; the
tests skip them there too.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable
from pathlib import Path

from flashcore.compiler.catalog import catalog_specs
from flashcore.errors import SpecError
from flashcore.ops.plan import packed_rows_config
from flashcore.specs import FP8_ARCHS, AttentionSpec, CombineSpec, QuantizeSpec, TileConfig
from flashcore.specs import HEAD_DIMS as ALL_HEAD_DIMS
from flashcore.specs.attention import MASK_ALIGNS
from flashcore.tuned.table import BUCKETS, lookup, table_arch, winner_specs
from flashcore.tuning.search import all_candidates
from tests.gpu_utils import (
    FP8_KV_CONFIGS,
    FP8_SPLIT_CONFIGS,
    SPLIT_CONFIGS,
    STAGE_CONFIGS,
    WGMMA_CONFIGS,
    WGMMA_FP8_CONFIGS,
    WGMMA_FP8_MASK_CONFIGS,
    WGMMA_HEAD_DIM_CONFIGS,
    WGMMA_MASK_CONFIGS,
    WGMMA_PAGED_CONFIGS,
    WGMMA_TILE_N_CONFIGS,
    WGMMA_VARLEN_CONFIGS,
    wgmma_page_sizes,
)

TEST_TILES = [(64, 64), (128, 64), (64, 128), (128, 128), (32, 64), (16, 32)]
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128)
# the head dims only the 16-bit forward builds: their own group (``--only head_dims``), the
# kernels tests/test_gpu_{attention,decode,masks,serving}.py draw for them
WIDE_HEAD_DIMS = tuple(d for d in ALL_HEAD_DIMS if d not in HEAD_DIMS)


def _specs(arch: str, configs, **fixed) -> list:
    """AttentionSpecs of every config and every combination of the list-valued fields given,
    leaving out those that do not fit ``arch``."""
    lists = {k: v for k, v in fixed.items() if isinstance(v, (list, tuple))}
    out = []
    for config in configs:
        for values in itertools.product(*lists.values()):
            try:
                out.append(AttentionSpec(arch=arch, config=config,
                                         **{**fixed, **dict(zip(lists, values))}))
            except SpecError:
                pass
    return out


def _tuned(arch: str, bucket: str, head_dim: int, causal: bool, precision="fp16",
           features: tuple = ()) -> TileConfig:
    """What ``tile=None`` runs (borrowed, family-checked; a call with ``features`` its winner's
    family does not build gets the entry's fallback)."""
    return lookup(arch, head_dim, causal, bucket, precision, features)


def _packed_tiles(config: TileConfig) -> list:
    """A tuned decode config and the tiles it grows to for packed rows (17-32 and past 64,
    33-64)."""
    return list(dict.fromkeys([config, packed_rows_config(config, 2, 16),
                               packed_rows_config(config, 2, 32)]))


def prefill_specs(arch: str) -> list:
    specs = list(catalog_specs((arch,)))
    for tile in TEST_TILES:
        specs += _specs(arch, [TileConfig(tile)], head_dim=HEAD_DIMS, causal=[False, True])
    # test_matches_reference_within_sdpa_error: (64, 64) in both dtypes, split when S_q is short
    specs += _specs(arch, [TileConfig((64, 64))], dtype=DTYPES, head_dim=HEAD_DIMS,
                    causal=[False, True], split_kv=[False, True])
    for tile, warps, splits in SPLIT_CONFIGS:
        specs += _specs(arch, [TileConfig(tile, warps=warps, kv_splits=splits)],
                        head_dim=HEAD_DIMS, causal=[False, True], return_lse=True)
    for tile, warps, splits, stages in STAGE_CONFIGS:
        specs += _specs(arch, [TileConfig(tile, warps=warps, kv_splits=splits, stages=stages)],
                        dtype="bfloat16", head_dim=HEAD_DIMS, causal=[False, True],
                        return_lse=True)
    # tile=None in every bucket, both dtypes, with and without LSE (and split, as num_splits
    # may ask for it)
    for bucket, _, _ in BUCKETS:
        for d, causal in itertools.product(HEAD_DIMS, (False, True)):
            specs += _specs(arch, [_tuned(arch, bucket, d, causal)], dtype=DTYPES, head_dim=d,
                            causal=causal, return_lse=[False, True], split_kv=[False, True])
    return specs


def decode_specs(arch: str, dims=HEAD_DIMS) -> list:
    """tile=None decode (and short-prefill) kernels, FP8 KV cache, and the combines."""
    specs = []
    kv8 = [False, True] if arch in FP8_ARCHS else [False]
    for bucket in ("decode", "short"):
        for d, causal in itertools.product(dims, (False, True)):
            specs += _specs(arch, [_tuned(arch, bucket, d, causal)], dtype=DTYPES, head_dim=d,
                            causal=causal, return_lse=[False, True], split_kv=[False, True])
            if len(kv8) > 1:  # an FP8 KV cache has configs of its own
                specs += _specs(arch, [_tuned(arch, bucket, d, causal, "fp8kv")], dtype=DTYPES,
                                head_dim=d, causal=causal, return_lse=[False, True],
                                split_kv=[False, True], kv_fp8=True)
    # the tiles one token's query heads grow to (groups past 16), under either causal alignment
    for d, causal in itertools.product(dims, (False, True)):
        specs += _specs(arch, _packed_tiles(_tuned(arch, "decode", d, causal))[1:],
                        dtype=DTYPES, head_dim=d, causal=causal, return_lse=[False, True],
                        split_kv=[False, True], mask_align=list(MASK_ALIGNS))
        if len(kv8) > 1:
            specs += _specs(arch, _packed_tiles(_tuned(arch, "decode", d, causal, "fp8kv"))[1:],
                            dtype=DTYPES, head_dim=d, causal=causal, return_lse=[False, True],
                            split_kv=[False, True], kv_fp8=True, mask_align=list(MASK_ALIGNS))
    if len(kv8) > 1:  # test_fp8_kv_cache_in_every_kind_of_config (GQA of 1-5 tokens)
        specs += _specs(arch, FP8_KV_CONFIGS, dtype=DTYPES, head_dim=dims,
                        causal=[False, True], return_lse=True, split_kv=[False, True],
                        kv_fp8=True, packed_tokens=[False, True])
    # test_multi_token_gqa_decode_packs_tokens: packed tokens under every mask it draws
    for d, causal in itertools.product(dims, (False, True)):
        specs += _specs(arch, _packed_tiles(_tuned(arch, "decode", d, causal)), dtype=DTYPES,
                        head_dim=d, causal=causal, return_lse=[False, True],
                        split_kv=[False, True], mask_align=list(MASK_ALIGNS),
                        window=[False, True], packed_tokens=True)
        if len(kv8) > 1:
            specs += _specs(arch, _packed_tiles(_tuned(arch, "decode", d, causal, "fp8kv")),
                            dtype=DTYPES, head_dim=d, causal=causal, return_lse=[False, True],
                            split_kv=[False, True], kv_fp8=True, packed_tokens=True,
                            mask_align=list(MASK_ALIGNS))
    specs += [CombineSpec(arch=arch, dtype=dt, head_dim=d, return_lse=lse)
              for dt, d, lse in itertools.product(DTYPES, dims, (False, True))]
    return specs


# (causal, mask_align, window, softcap) of the masks-as-data kernels tests/test_gpu_masks.py runs
# (bottom-right without causal or a window is no spec: _specs leaves it out)
MASK_VARIANTS = [(c, a, w, sc) for c, a, w, sc in itertools.product(
    (False, True), MASK_ALIGNS, (False, True), (False, True)) if a != "top_left" or w or sc]


def mask_specs(arch: str, dims=HEAD_DIMS) -> list:
    """tile=None kernels with masks (ALiBi too): decode (split or not) and short prefill, with
    LSE (a split kernel writes its shares' LSE whatever the call asks: its spec has none); and
    the long causal window of ``test_window_kernel_walks_only_the_window``."""
    specs = []
    for bucket, lse_split in (("decode", [(True, False), (False, True)]),
                              ("short", [(True, False)])):
        for d, (causal, align, window, softcap), (lse, split) in itertools.product(
                dims, MASK_VARIANTS, lse_split):
            specs += _specs(arch, [_tuned(arch, bucket, d, causal)], dtype=DTYPES, head_dim=d,
                            causal=causal, return_lse=lse, split_kv=split, mask_align=align,
                            window=window, softcap=softcap)
            if bucket == "decode":  # GQA of a few tokens: packed rows
                specs += _specs(arch, _packed_tiles(_tuned(arch, bucket, d, causal)),
                                dtype=DTYPES, head_dim=d, causal=causal, return_lse=lse,
                                split_kv=split, mask_align=align, window=window,
                                softcap=softcap, packed_tokens=True)
        alibi = (("alibi", True),)  # test_alibi_matches_the_reference: a row per head
        for d, causal, align, softcap, (lse, split) in itertools.product(
                dims, (False, True), MASK_ALIGNS, (False, True), lse_split):
            specs += _specs(arch, [_tuned(arch, bucket, d, causal, features=alibi)],
                            dtype=DTYPES, head_dim=d, causal=causal, return_lse=lse,
                            split_kv=split, mask_align=align, softcap=softcap, alibi=True)
    if 64 in dims:
        window = (("window", True),)
        specs += _specs(arch, [_tuned(arch, "long", 64, True, features=window)], head_dim=64,
                        causal=True, window=True)
    return specs


# what a call adds to a tuned Hopper entry: the masks run on its winner (the warp-specialised
# family builds them), split keys on its fallback; scripts/mask_bench.py times the masks on the
# fallback too
TUNED_FEATURES = [{"window": True}, {"mask_align": "bottom_right"}, {"softcap": True},
                  {"split_kv": True}]


def wgmma_specs(arch: str) -> list:
    """tests/test_gpu_wgmma.py's Hopper kernels (its explicit configs, fp16 and FP8), the tuned
    Hopper entries' kernels for the features a call adds, and ``wgmma_mask_specs``."""
    both = {"dtype": DTYPES, "head_dim": HEAD_DIMS, "causal": [False, True],
            "return_lse": [False, True]}
    specs = _specs(arch, WGMMA_CONFIGS, **both)
    specs += _specs(arch, WGMMA_FP8_CONFIGS, precision="fp8", k_scale=["token", "head"], **both)
    for bucket, d, causal, feature in itertools.product(
            [b for b, _, _ in BUCKETS[1:]], HEAD_DIMS, (False, True), TUNED_FEATURES):
        config = _tuned(arch, bucket, d, causal, features=tuple(feature.items()))
        fallback = _tuned(arch, bucket, d, causal, features=(("split_kv", True),))
        specs += _specs(arch, [config, fallback], head_dim=d, causal=causal, **feature)
    return (specs + wgmma_mask_specs(arch) + wgmma_head_dim_specs(arch)
            + wgmma_varlen_specs(arch) + wgmma_paged_specs(arch)
            + wgmma_tile_n_specs(arch))


def wgmma_paged_specs(arch: str) -> list:
    """A paged cache on the Hopper family: test_gpu_serving.py's configs over the pages it
    draws (``wgmma_page_sizes``), q dense or packed (bottom-right, with LSE; plain, causal, and
    with a window and a soft-cap), scripts/sanitize_cases.py's, and the tuned entries' kernels
    for such a cache (``tile=None``; scripts/serving_bench.py's pages among them)."""
    specs = []
    for config in WGMMA_PAGED_CONFIGS:
        fixed = {"dtype": DTYPES, "head_dim": HEAD_DIMS, "paged_kv": True,
                 "page_size": list(wgmma_page_sizes(config).values()),
                 "varlen": [False, True], "return_lse": True, "mask_align": "bottom_right"}
        specs += _specs(arch, [config], causal=[False, True], **fixed)
        specs += _specs(arch, [config], causal=True, window=True, softcap=True, **fixed)
        # scripts/sanitize_cases.py's: a window alone, and a lying table without LSE (d128)
        sanitized = {**fixed, "dtype": "float16", "head_dim": 128, "causal": True}
        specs += _specs(arch, [config], **{**sanitized, "varlen": True, "window": True})
        specs += _specs(arch, [config], **{**sanitized, "varlen": False, "return_lse": False})
    for bucket, d, causal, page_size in itertools.product(
            [b for b, _, _ in BUCKETS[1:]], HEAD_DIMS, (False, True), (16, 32, 64, 128, 256)):
        features = (("paged_kv", True), ("page_size", page_size))
        config = _tuned(arch, bucket, d, causal, features=features)
        if config.family == "wgmma_ws":
            specs += _specs(arch, [config], head_dim=d, causal=causal, paged_kv=True,
                            page_size=page_size, return_lse=[False, True],
                            mask_align=["top_left", "bottom_right"])
    return list(dict.fromkeys(specs))


def wgmma_tile_n_specs(arch: str) -> list:
    """tests/test_gpu_wgmma.py's Hopper kernels of key blocks other than 64 and 128 keys, at
    every head dim each builds: with LSE, plain and causal, and with a bottom-right causal
    window (other combinations it draws compile on first use)."""
    fixed = {"dtype": DTYPES, "head_dim": [32, 64, 80, 96, 128, 256], "return_lse": True}
    specs = _specs(arch, WGMMA_TILE_N_CONFIGS, causal=[False, True], **fixed)
    specs += _specs(arch, WGMMA_TILE_N_CONFIGS, causal=True, mask_align="bottom_right",
                    window=True, **fixed)
    return specs


def wgmma_varlen_specs(arch: str) -> list:
    """Packed batches on the Hopper family: test_gpu_serving.py's configs (bottom-right, with
    LSE; plain, causal, and with a window and a soft-cap), and the tuned entries' kernels for a
    packed batch (what ``tile=None`` runs on sm_90)."""
    fixed = {"dtype": DTYPES, "head_dim": HEAD_DIMS, "varlen": True, "return_lse": True,
             "mask_align": "bottom_right"}
    specs = _specs(arch, WGMMA_VARLEN_CONFIGS, causal=[False, True], **fixed)
    specs += _specs(arch, WGMMA_VARLEN_CONFIGS, causal=True, window=True, softcap=True, **fixed)
    for bucket, d, causal in itertools.product([b for b, _, _ in BUCKETS[1:]], HEAD_DIMS,
                                               (False, True)):
        config = _tuned(arch, bucket, d, causal, features=(("varlen", True),))
        specs += _specs(arch, [config], head_dim=d, causal=causal, varlen=True,
                        return_lse=[False, True], mask_align=["top_left", "bottom_right"])
    return list(dict.fromkeys(specs))


def wgmma_head_dim_specs(arch: str) -> list:
    """tests/test_gpu_wgmma.py's Hopper kernels at head dims 32, 80, 96 and 256: its configs,
    with LSE, plain and causal, and with every mask together (a bottom-right causal window and
    a soft-cap; other combinations it draws compile on first use)."""
    dims = [32, 80, 96, 256]
    specs = _specs(arch, WGMMA_HEAD_DIM_CONFIGS, dtype=DTYPES, head_dim=dims,
                   causal=[False, True], return_lse=True)
    specs += _specs(arch, WGMMA_HEAD_DIM_CONFIGS, dtype="float16", head_dim=dims, causal=True,
                    mask_align="bottom_right", window=True, softcap=True, return_lse=True)
    return specs


def wgmma_mask_specs(arch: str) -> list:
    """The warp-specialised kernels with masks of tests/test_gpu_wgmma.py (with LSE: every
    16-bit mask variant, FP8's without a soft-cap) and of scripts/sanitize_cases.py's
    ``wgmma-masks`` (the same configs and the tuned entries' kernels above); a config that
    builds no such mask (a soft-cap beside one on 192x128 at d128) is left out."""
    specs = []
    for causal, align, window, softcap in MASK_VARIANTS:
        masks = {"causal": causal, "mask_align": align, "window": window, "softcap": softcap}
        specs += _specs(arch, WGMMA_MASK_CONFIGS, dtype=DTYPES, head_dim=HEAD_DIMS,
                        return_lse=True, **masks)
        if not softcap:
            specs += _specs(arch, WGMMA_FP8_MASK_CONFIGS, dtype=DTYPES, head_dim=HEAD_DIMS,
                            return_lse=True, precision="fp8", k_scale=["token", "head"], **masks)
    return specs


PAGE_SIZES = (16, 128)  # the whole-page sizes of tests/test_gpu_serving.py's Hypothesis tests


def serving_specs(arch: str, dims=HEAD_DIMS) -> list:
    """The varlen and paged kernels of tests/test_gpu_serving.py (the explicit (64, 64) tile,
    tuned decode kernels for paged decode; masks bottom-right, LSE) and of
    scripts/serving_bench.py (tuned, fp16, d128, no LSE), each paged one for any page size
    (gathered) and for the page sizes the tests draw (copied whole)."""
    tile = [TileConfig((64, 64))]
    pages = [0, *PAGE_SIZES]
    both = {"causal": [False, True], "head_dim": dims, "dtype": DTYPES,
            "mask_align": list(MASK_ALIGNS)}
    specs = _specs(arch, tile, varlen=True, return_lse=True, window=[False, True],
                   softcap=[False, True], **both)
    specs += _specs(arch, tile, paged_kv=True, return_lse=True, split_kv=[False, True],
                    page_size=[*pages, 256], **both)  # 256: an explicit chunked-prefill example
    specs += _specs(arch, tile, paged_kv=True, varlen=True, return_lse=True, causal=True,
                    mask_align="bottom_right", head_dim=dims, dtype=DTYPES, page_size=pages)
    for d, causal in itertools.product(dims, (False, True)):
        specs += _specs(arch, [_tuned(arch, "decode", d, causal)], paged_kv=True,
                        return_lse=[False, True], split_kv=[False, True], causal=causal,
                        mask_align=list(MASK_ALIGNS), head_dim=d, dtype=DTYPES, page_size=pages)
        # test_paged_multi_token_gqa_packs_tokens
        specs += _specs(arch, _packed_tiles(_tuned(arch, "decode", d, causal)), paged_kv=True,
                        return_lse=[False, True], split_kv=[False, True], causal=causal,
                        mask_align=list(MASK_ALIGNS), head_dim=d, dtype=DTYPES,
                        page_size=pages, packed_tokens=True)
    # the tests' diagonals are bottom-right: top-left only where there is none
    specs = [s for s in specs if s.mask_align == "bottom_right" or not (s.causal or s.window)]
    if 128 in dims:
        specs += _d128_serving_specs(arch, tile, pages)
    # an e4m3 paged cache (test_fp8_paged_cache_*: the FP8 KV config, no LSE), decode and
    # packed chunks; the benchmark's FP8 paged decode (d128, not causal) is among them
    if arch in FP8_ARCHS:
        for d, causal in itertools.product(dims, (False, True)):
            fp8kv = {"head_dim": d, "causal": causal, "dtype": DTYPES, "paged_kv": True,
                     "kv_fp8": True, "page_size": pages,
                     "mask_align": "bottom_right" if causal else "top_left"}
            config = _tuned(arch, "decode", d, causal, "fp8kv")
            specs += _specs(arch, [config], split_kv=[False, True], **fp8kv)
            specs += _specs(arch, _packed_tiles(config), split_kv=[False, True],
                            packed_tokens=True, **fp8kv)
            specs += _specs(arch, [config], varlen=True, **fp8kv)
    specs += [CombineSpec(arch=arch, dtype=dt, head_dim=d, return_lse=lse)  # split decode
              for dt, d, lse in itertools.product(DTYPES, dims, (False, True))]
    return list(dict.fromkeys(specs))


def _d128_serving_specs(arch: str, tile: list, pages: list) -> list:
    """test_every_page_size_kind (fp16, d128, not causal, every page size it draws) and the
    benchmark's paged decode (pages 16 and 128), contiguous decode and varlen prefill."""
    decode128 = [_tuned(arch, "decode", 128, False)]
    specs = []
    for config, split in ((tile, [False]), (decode128, [False, True])):
        specs += _specs(arch, config, paged_kv=True, return_lse=True, split_kv=split,
                        head_dim=128, page_size=[0, 4, 8, 32, 64, 192, 256])
    specs += _specs(arch, decode128, paged_kv=[False, True], split_kv=[False, True],
                    head_dim=128, page_size=pages)
    for bucket, _, _ in BUCKETS[1:]:
        specs += _specs(arch, [_tuned(arch, bucket, 128, True)], varlen=True, causal=True,
                        mask_align="bottom_right", head_dim=128)
    return specs


def head_dim_specs(arch: str) -> list:
    """The kernels of the head dims only the 16-bit forward builds (``WIDE_HEAD_DIMS``): what
    test_matches_reference_within_sdpa_error runs ((64, 64), split when S_q is short), the
    tuned kernels of every bucket (tile=None), and the decode, mask and serving groups' kernels
    at these dims."""
    dims = WIDE_HEAD_DIMS
    specs = _specs(arch, [TileConfig((64, 64))], dtype=DTYPES, head_dim=dims,
                   causal=[False, True], split_kv=[False, True], return_lse=[False, True])
    for bucket, _, _ in BUCKETS:
        for d, causal in itertools.product(dims, (False, True)):
            specs += _specs(arch, [_tuned(arch, bucket, d, causal)], dtype=DTYPES, head_dim=d,
                            causal=causal, return_lse=[False, True], split_kv=[False, True])
    specs += decode_specs(arch, dims) + mask_specs(arch, dims) + serving_specs(arch, dims)
    specs += backward_head_dim_specs(arch, dims)
    return list(dict.fromkeys(specs))


def backward_head_dim_specs(arch: str, dims=WIDE_HEAD_DIMS) -> list:
    """The backward kernels test_gpu_backward.py's head-dim tests run at ``dims``: plain,
    causal, bottom-right causal window with a soft-cap, and packed deterministic causal."""
    from flashcore.ops.backward import backward_specs as one_pass
    from flashcore.ops.masks import Masking
    from flashcore.specs.backward import default_backward_config

    specs = []
    for d in dims:
        config = default_backward_config(d, arch)
        specs += one_pass(arch, "float16", d, config, False)
        specs += one_pass(arch, "bfloat16", d, config, True)
        specs += one_pass(arch, "float16", d, config, True,
                          Masking("bottom_right", (100, 0), 10.0))
        masks = Masking("bottom_right", None, None)
        main = one_pass(arch, "bfloat16", d, config, True, masks)[1]
        specs.append(main.replace(varlen=True, deterministic=True))
    return specs


def fp8_specs(arch: str) -> list:
    if arch not in FP8_ARCHS:
        return []
    specs = []
    for dtype, d in itertools.product(DTYPES, HEAD_DIMS):
        specs.append(QuantizeSpec(arch=arch, dtype=dtype, head_dim=d, part="amax"))
        specs.append(QuantizeSpec(arch=arch, dtype=dtype, head_dim=d, transpose=False))
        specs.append(QuantizeSpec(arch=arch, dtype=dtype, head_dim=d, transpose=True))
        specs.append(QuantizeSpec(arch=arch, dtype=dtype, head_dim=d, granularity="token"))
    fp8 = {"precision": "fp8", "head_dim": HEAD_DIMS, "causal": [False, True]}
    specs += _specs(arch, [TileConfig(t) for t in ((64, 64), (128, 64), (128, 128))],
                    dtype=DTYPES, **fp8)
    specs += _specs(arch, [TileConfig((64, 64))], return_lse=True, **fp8)
    specs += _specs(arch, [TileConfig(t, warps=w, kv_splits=k) for t, w, k in FP8_SPLIT_CONFIGS],
                    **fp8)
    specs += _specs(arch, [TileConfig((64, 64), stages=2)], **fp8)
    specs += _specs(arch, [TileConfig((16, 64), warps=1)], split_kv=[False, True], **fp8)
    for bucket in [b for b, _, _ in BUCKETS]:  # tile=None fp8, decode splits included
        for d, causal in itertools.product(HEAD_DIMS, (False, True)):
            specs += _specs(arch, [_tuned(arch, bucket, d, causal, "fp8")], dtype=DTYPES,
                            head_dim=d, causal=causal, precision="fp8",
                            return_lse=[False, True], split_kv=[False, True])
            specs += _specs(arch, [_tuned(arch, bucket, d, causal, "fp8khead")], dtype=DTYPES,
                            head_dim=d, causal=causal, precision="fp8", k_scale="head",
                            return_lse=[False, True], split_kv=[False, True])
    # test_fp8_key_descaled_per_head's explicit tiles (and the sanitizer's fp8-khead cases)
    specs += _specs(arch, [TileConfig((64, 64)), TileConfig((16, 64), warps=1)], k_scale="head",
                    return_lse=[False, True], split_kv=[False, True], **fp8)
    return specs


# tests/test_gpu_backward.py's explicit tiles of the main backward kernel (bfloat16)
BACKWARD_TEST_CONFIGS = [TileConfig((64, 64), warps=4), TileConfig((64, 64), warps=8),
                         TileConfig((64, 128), warps=8), TileConfig((32, 32), warps=4),
                         TileConfig((128, 64), warps=8), TileConfig((64, 128), warps=8, stages=2),
                         TileConfig((32, 64), warps=4, stages=2)]


# the Hopper backward's tiles (its sm_90 default at d64, d96 and d128; d64 also builds 128 x 128)
HOPPER_BWD_CONFIGS = [TileConfig((64, 128), warps=8, stages=2, family="hopper"),
                      TileConfig((128, 128), warps=8, stages=2, family="hopper")]


# every mask combination the backward builds: (causal, mask_align, window, softcap), as
# flashcore.ops.masks.masking normalises them (bottom-right aligns a causal mask or a window)
BACKWARD_MASKS = [(c, a, w, cap) for c in (False, True) for a in ("top_left", "bottom_right")
                  for w in (False, True) for cap in (False, True) if a == "top_left" or c or w]


# the benchmark's variants of the main kernel (``python -m flashcore.bench --backward
# --bwd-variants ...``, ``FLASHCORE_BWD_CONFIG``), bfloat16 and float16, causal or not: the
# first design (16-row warp strips, one query block in flight), each new knob alone, and the
# larger tiles
BACKWARD_VARIANTS = ("64:64x128w8s1a-;128:64x64w8s1a-",   # the first defaults
                     "64:64x128w8s1;128:64x64w8s1",        # squarest warp tiles only
                     "64:64x128w8s2a-;128:64x128w8s1a-",   # stages / tile alone
                     "64:64x128w8s2;128:64x128w8s1",
                     "64:64x128w8s2;128:64x128w8s2",       # the sm_80/sm_90 defaults
                     "64:128x128w8s2",                     # spills 8 bytes
                     "64:128x128w8s1",
                     "64:128x64w8s2;128:128x64w8s2")


def backward_variant_specs(arch: str) -> list:
    """The main kernels of ``BACKWARD_VARIANTS`` that fit ``arch``."""
    from flashcore.ops.backward import backward_specs as one_pass
    from flashcore.specs.backward import parse_backward_choices

    specs = []
    for text in BACKWARD_VARIANTS:
        for d, (config, warps_m) in parse_backward_choices(text).items():
            for dtype, causal in itertools.product(DTYPES, (False, True)):
                try:
                    specs.append(one_pass(arch, dtype, d, config, causal, warps_m=warps_m)[1])
                except SpecError:
                    pass
    return specs


def backward_specs(arch: str) -> list:
    """The backward's kernels: pre, main (the arch's default config, both dtypes, every mask,
    also deterministic and for a packed batch; the tests' explicit tiles; the benchmark's
    variants) and post, of every head dim; those that fit ``arch``."""
    from flashcore.ops.backward import backward_specs as one_pass
    from flashcore.ops.masks import Masking
    from flashcore.specs.backward import HOPPER_BWD_HEAD_DIMS, default_backward_config

    specs = []
    for dtype, d, (causal, align, window, cap) in itertools.product(DTYPES, HEAD_DIMS,
                                                                    BACKWARD_MASKS):
        masks = Masking(align, (1, 0) if window else None, 1.0 if cap else None)
        specs += one_pass(arch, dtype, d, default_backward_config(d, arch), causal, masks)
    for config, d, causal in itertools.product(BACKWARD_TEST_CONFIGS, HEAD_DIMS, (False, True)):
        try:
            specs.append(one_pass(arch, "bfloat16", d, config, causal)[1])
        except SpecError:
            pass
    specs += backward_variant_specs(arch)
    # the Hopper backward's tiles (sm_90), every mask, free and ordered dQ adds, packed batches
    for config, d, dtype, (causal, align, window, cap), variant in itertools.product(
            HOPPER_BWD_CONFIGS, HOPPER_BWD_HEAD_DIMS, DTYPES, BACKWARD_MASKS,
            ({}, {"deterministic": True}, {"varlen": True})):
        masks = Masking(align, (1, 0) if window else None, 1.0 if cap else None)
        if arch != "sm_90":
            break  # another arch: none of them builds
        try:
            specs.append(one_pass(arch, dtype, d, config, causal, masks)[1].replace(**variant))
        except SpecError:
            pass  # a tile this head dim does not build
    # the deterministic and the packed-batch (varlen) main kernels of every mask
    for dtype, d, (causal, align, window, cap), variant in itertools.product(
            DTYPES, HEAD_DIMS, BACKWARD_MASKS, ({"deterministic": True}, {"varlen": True})):
        masks = Masking(align, (1, 0) if window else None, 1.0 if cap else None)
        main = one_pass(arch, dtype, d, default_backward_config(d, arch), causal, masks)[1]
        specs.append(main.replace(**variant))
    return list(dict.fromkeys(specs))


# the calls whose forward kernels the backward's GPU tests run (autograd's forward keeps the
# LSE): test_gpu_backward.py's query and key lengths and batches, windows narrower and wider
# than the keys (the planner folds the wide ones away), every head dim its tests draw, and the
# backward benchmark's shapes
BACKWARD_CALL_LENGTHS = [(sq, sk) for sq in (1, 2, 16, 17, 190, 257, 300, 333)
                         for sk in (1, 190, 257, 333)]
BACKWARD_CALL_HEADS = [(1, 1, 1), (2, 3, 4)]  # (batch, K/V heads, query heads a K/V head)
BACKWARD_CALL_WINDOWS = [(0, 0), (64, 0), (100, 0), (30, 90), (-1, 5), (5, -1), (300, 300)]
BACKWARD_BENCH_CALLS = [(4, 16, 16, 4096, 64), (4, 32, 8, 4096, 128), (4, 16, 16, 4096, 128),
                        (2, 16, 16, 8192, 128), (1, 32, 32, 32768, 128)]
BACKWARD_VARLEN_LENGTHS = [(77, 145), (0, 30), (130, 130), (1, 0), (45, 20)]
# test_head_dims_packed_and_deterministic's packed batch (an empty sequence, one longer than its
# keys), bf16 causal bottom-right, 2 K/V heads of 3 query heads each, at every wider head dim
HEAD_DIM_VARLEN_LENGTHS = [(150, 300), (0, 20), (70, 33)]


def launched_specs(arch: str, calls: Callable[[], None]) -> list:
    """The ``AttentionSpec`` of each attention kernel the launcher asks for while ``calls()``
    calls the ops on CPU tensors, the device stubbed as an ``arch`` GPU (nothing is built or
    run; the ops' memoised plans are dropped before and after, as they hold another arch's)."""
    from unittest import mock

    from flashcore.ops import eager
    from flashcore.ops.launcher import attention_spec
    from tests.device_stub import stubbed_device

    keys: list = []

    def loaded(device, key):
        keys.append(key)
        return mock.Mock(tensor_maps=(), tma_args_memo={})

    eager.forget()
    try:
        with stubbed_device([], loaded=loaded, arch=arch):
            calls()
    finally:
        eager.forget()
    return [attention_spec(arch, key) for key in keys]


def _cumulative(lengths) -> tuple:
    """A packed batch's (cu_seqlens_q, cu_seqlens_k) for (S_q, S_k) pairs (int32, CPU)."""
    import torch

    return tuple(torch.tensor([0, *itertools.accumulate(n[i] for n in lengths)],
                              dtype=torch.int32) for i in (0, 1))


@functools.cache
def _backward_forward_specs(arch: str) -> tuple:
    import torch

    from flashcore.ops import attention, attention_varlen

    masks = [{**({"window": w} if w else {}), **({"softcap": 2.0} if cap else {})}
             for w in (None, *BACKWARD_CALL_WINDOWS) for cap in (False, True)]
    masks += [{"mask_align": "bottom_right", **m} for m in masks]
    dense = []
    for dtype, d, causal, m in itertools.product(DTYPES, ALL_HEAD_DIMS, (False, True), masks):
        if (m.get("mask_align") == "bottom_right" and not causal and "window" not in m
                or d not in HEAD_DIMS and (m or dtype != "float16")):
            continue  # (bottom-right aligns a causal mask or a window; the head-dim tests: fp16)
        for (sq, sk), (b, hkv, g) in itertools.product(BACKWARD_CALL_LENGTHS,
                                                       BACKWARD_CALL_HEADS):
            dense.append((dtype, (b, hkv * g, sq, d), (b, hkv, sk, d), causal, m))
    for (b, hq, hkv, s, d), causal in itertools.product(BACKWARD_BENCH_CALLS, (False, True)):
        dense.append(("float16", (b, hq, s, d), (b, hkv, s, d), causal, {}))

    def calls():
        for dtype, qshape, kshape, causal, m in dense:
            dt = getattr(torch, dtype)
            k = torch.empty(kshape, dtype=dt)
            try:
                attention(torch.empty(qshape, dtype=dt), k, k, causal=causal, return_lse=True,
                          **m)
            except ValueError:
                pass  # a mask the call refuses (a causal window looking right)
        cu_q, cu_k = _cumulative(HEAD_DIM_VARLEN_LENGTHS)
        for d in WIDE_HEAD_DIMS:
            k = torch.empty(int(cu_k[-1]) + 5, 2, d, dtype=torch.bfloat16)
            attention_varlen(torch.empty(int(cu_q[-1]), 6, d, dtype=torch.bfloat16), k, k,
                             cu_q, cu_k, max(n[0] for n in HEAD_DIM_VARLEN_LENGTHS),
                             max(n[1] for n in HEAD_DIM_VARLEN_LENGTHS), True,
                             mask_align="bottom_right", return_lse=True, check_lengths=False)
        cu_q, cu_k = _cumulative(BACKWARD_VARLEN_LENGTHS)
        for dtype, d, causal, m in itertools.product(DTYPES, HEAD_DIMS, (False, True), masks):
            if m.get("mask_align") != "bottom_right" and (causal or "window" in m):
                continue  # a packed call's masks are FlashAttention's, bottom-right
            dt = getattr(torch, dtype)
            k = torch.empty(int(cu_k[-1]) + 5, 2, d, dtype=dt)
            try:
                attention_varlen(torch.empty(int(cu_q[-1]), 4, d, dtype=dt), k, k, cu_q, cu_k,
                                 130, 145, causal, return_lse=True, check_lengths=False, **m)
            except ValueError:
                pass

    return tuple(dict.fromkeys(launched_specs(arch, calls)))


def backward_forward_specs(arch: str) -> list:
    """The forward kernels that the backward's GPU tests and benchmark run, as the planner picks
    them for their calls on ``arch`` (``launched_specs``): dense and packed calls, every mask,
    both dtypes, every head dim (worked out once a process)."""
    return list(_backward_forward_specs(arch))


def backward_test_specs(arch: str) -> list:
    """What the backward's GPU tests and benchmark launch: its kernels and the forward's."""
    return backward_specs(arch) + backward_forward_specs(arch)


def _as_launched(spec) -> list:
    """The specs the launcher builds for ``spec``: a split-KV kernel in a CUDA graph writes its
    LSE partials whatever the caller asked (the combine kernel writes the LSE), so it is built
    without ``return_lse``; an eager call's split kernel merges its shares itself, with or
    without the caller's LSE."""
    if not getattr(spec, "split_kv", False):
        return [spec]
    return [spec.replace(return_lse=False, merge_shares=False),
            spec.replace(return_lse=False, merge_shares=True),
            spec.replace(return_lse=True, merge_shares=True)]


def gpu_test_specs(arch: str, buckets=None) -> list:
    specs = (prefill_specs(arch) + decode_specs(arch) + mask_specs(arch) + fp8_specs(arch)
             + serving_specs(arch) + wgmma_specs(arch) + backward_test_specs(arch)
             + head_dim_specs(arch))
    specs += [s for s in winner_specs(table_arch(arch), build_arch=arch).values()]
    if buckets != []:  # the autotuner's candidates
        precisions = ("fp16", "fp8") if arch in FP8_ARCHS else ("fp16",)
        try:
            specs += all_candidates(arch, precisions, buckets)
        except SpecError:
            pass
    fits = []
    for s in dict.fromkeys(x for spec in specs for x in _as_launched(spec)):
        try:
            fits.append(s.replace())  # re-validates for this arch
        except SpecError:
            pass
    return fits


GROUPS = {"prefill": prefill_specs, "decode": decode_specs, "masks": mask_specs,
          "fp8": fp8_specs, "serving": serving_specs, "wgmma": wgmma_specs,
          "wgmma-masks": wgmma_mask_specs, "wgmma-head-dims": wgmma_head_dim_specs,
          "wgmma-varlen": wgmma_varlen_specs, "wgmma-paged": wgmma_paged_specs,
          "wgmma-tile-n": wgmma_tile_n_specs,
          "backward": backward_test_specs, "head_dims": head_dim_specs}


def check_catalog(root: Path) -> int:
    """How many of the catalog's kernels were built from this tree's sources (their entries'
    source hash, ``compiler.fingerprint.source_hash``) and load as the cache loads them
    (``KernelCache.verify``: every file its checksums name, e.g. a kernel.mlir deleted to save
    space makes the entry corrupt); 1 when any was not or does not. Either is a catalog miss: a
    host with the DSL compiles the kernel again, one without fails."""
    import json

    from flashcore.compiler.cache import KernelCache
    from flashcore.compiler.fingerprint import source_hash

    kernels = json.loads((root / "index.json").read_text())["kernels"]
    ours = source_hash()
    other = [k["name"] for k in kernels if not Path(k["path"]).name.startswith(f"{ours}-")]
    print(f"{root}: {len(kernels) - len(other)} of {len(kernels)} kernels built from this tree's "
          f"sources ({ours})" + (f"; not: {other[0]} and {len(other) - 1} more" if other else ""))
    problems = KernelCache(root, read_only=True).verify()
    if problems:
        path, why = problems[0]
        print(f"{root}: {len(problems)} entries the cache would not serve; first: {path}: {why}")
    return 1 if other or problems else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out")
    ap.add_argument("--check", metavar="CATALOG",
                    help="count the catalog's kernels built from this tree's sources (exit 1 "
                    "when any was not: they would compile again)")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--buckets", nargs="*", default=None,
                    help="autotune candidates of these buckets only (default: all; none: "
                    "`--buckets` alone)")
    ap.add_argument("--only", nargs="+", choices=sorted(GROUPS), default=None,
                    help="only the kernels of these test groups")
    a = ap.parse_args()
    if a.check:
        raise SystemExit(check_catalog(Path(a.check)))
    if not a.out:
        ap.error("--out is required (or --check CATALOG)")
    from flashcore.compiler.cache import KernelCache
    from flashcore.compiler.catalog import write_catalog
    from flashcore.compiler.compiler import compile_many

    specs = (list(dict.fromkeys(x for g in a.only for s in GROUPS[g](a.arch)
                                for x in _as_launched(s)))
             if a.only else gpu_test_specs(a.arch, a.buckets))
    print(f"{len(specs)} kernels to build for {a.arch}", flush=True)
    arts = compile_many(specs, jobs=a.jobs, cache=KernelCache(Path(a.out)),
                        progress=lambda s: print("built", s.name, flush=True))
    print(write_catalog(Path(a.out), arts), len(arts), "kernels")


if __name__ == "__main__":
    main()
