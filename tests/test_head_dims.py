"""Head dims 32, 80, 96 and 256 in the mma_sync forward: the specs that build them and those
that refuse them, the planner's configs for them, and their kernels compiled on this GPU-less
host (ABI, instructions, shared memory within an L4's 99 KB, no spills in the key loop)."""

from __future__ import annotations

import itertools
import re

import pytest

from flashcore.compiler.abi import params_for
from flashcore.ops import plan
from flashcore.specs import (
    ARCHS,
    BACKWARD_HEAD_DIMS,
    FP8_HEAD_DIMS,
    HEAD_DIMS,
    SMEM_PER_BLOCK,
    AttentionSpec,
    BackwardSpec,
    CombineSpec,
    QuantizeSpec,
    SpecError,
    TileConfig,
)
from flashcore.specs.arch import swizzle_line_bytes
from flashcore.specs.backward import default_backward_config, default_warps_m
from flashcore.tuned import table
from tests.kernels import assert_no_spills_in_loops, compiled_in_fresh_cache

NEW_DIMS = (32, 80, 96, 256)
BUCKETS = [b for b, _, _ in table.BUCKETS]
L4 = SMEM_PER_BLOCK["sm_89"]


# -- specs ----------------------------------------------------------------------------------------
def test_the_forward_builds_the_new_dims_and_the_rest_keep_theirs():
    assert set(NEW_DIMS) <= set(HEAD_DIMS)
    assert FP8_HEAD_DIMS == (64, 128) and BACKWARD_HEAD_DIMS == HEAD_DIMS


def test_swizzle_lines_tile_every_row():
    """A swizzle line is the largest power of two up to 128 bytes that divides the row: d64 and
    d128 keep their 128-byte lines (their kernels are unchanged), d96 gets 64, d80 32."""
    lines = {d: swizzle_line_bytes(2 * d) for d in HEAD_DIMS}
    assert lines == {32: 64, 64: 128, 80: 32, 96: 64, 128: 128, 256: 128}
    assert all((2 * d) % line == 0 for d, line in lines.items())
    assert swizzle_line_bytes(64) == 64 and swizzle_line_bytes(128) == 128  # e4m3 rows


@pytest.mark.parametrize("arch, d, dtype", itertools.product(ARCHS, NEW_DIMS,
                                                             ("float16", "bfloat16")))
def test_new_dims_validate_with_every_16_bit_feature(arch, d, dtype):
    config = table.default_config(d, "long")
    base = AttentionSpec(arch=arch, dtype=dtype, head_dim=d, config=config)
    for fields in ({"causal": True, "return_lse": True},
                   {"causal": True, "mask_align": "bottom_right", "window": True,
                    "softcap": True},
                   {"varlen": True, "causal": True},
                   {"paged_kv": True, "page_size": 64 if d != 80 else 0},
                   {"paged_kv": True, "varlen": True}):
        spec = base.replace(**fields)
        assert spec.smem_bytes <= SMEM_PER_BLOCK[arch]
    decode = base.replace(config=table.default_config(d, "decode"), split_kv=True,
                          paged_kv=True, packed_tokens=True)
    assert decode.smem_bytes <= L4


@pytest.mark.parametrize("d", [d for d in NEW_DIMS if d not in FP8_HEAD_DIMS])
def test_fp8_at_a_new_dim_is_refused_naming_it(d):
    with pytest.raises(SpecError, match=f"precision='fp8' is built for head_dim in .* not "
                                        f"head_dim={d}"):
        AttentionSpec(arch="sm_89", head_dim=d, precision="fp8")
    with pytest.raises(SpecError, match=f"kv_fp8=True .* head_dim={d}"):
        AttentionSpec(arch="sm_89", head_dim=d, kv_fp8=True)
    with pytest.raises(SpecError, match=f"head_dim={d}"):
        QuantizeSpec(arch="sm_89", head_dim=d)


@pytest.mark.parametrize("d", NEW_DIMS)
def test_the_hopper_family_builds_every_dim_and_the_backward_too(d):
    config = default_backward_config(d, "sm_89")
    BackwardSpec(arch="sm_89", head_dim=d, config=config, warps_m=default_warps_m(d, config))
    for config in (TileConfig((64, 64), warps=4, stages=2, family="wgmma_ws"),
                   TileConfig((128, 64), warps=8, stages=2, family="wgmma_ws")):
        spec = AttentionSpec(arch="sm_90", head_dim=d, config=config)
        assert spec.family == "wgmma_ws" and spec.smem_bytes <= 232448
    # its FP8 operands stay at 64 and 128 (the e4m3 Vᵀ and P layouts)
    with pytest.raises(SpecError, match=f"head_dim={d}"):
        AttentionSpec(arch="sm_90", head_dim=d, precision="fp8",
                      config=TileConfig((128, 64), warps=8, stages=2, family="wgmma_ws"))


def test_the_hopper_family_refuses_what_does_not_fit():
    """d256's 128-key tiles overflow shared memory; three consumers of 128-key steps at d80
    and d96 hold P in shared memory (in registers it spilled 48 and 144 bytes)."""
    from flashcore.specs.families import WgmmaWs

    with pytest.raises(SpecError, match="shared memory"):
        AttentionSpec(arch="sm_90", head_dim=256, config=TileConfig(
            (128, 128), warps=8, stages=2, family="wgmma_ws"))
    three = TileConfig((192, 128), warps=12, stages=2, family="wgmma_ws")
    for d, shared in ((32, False), (64, False), (80, True), (96, True), (128, True)):
        assert WgmmaWs.p_in_shared(AttentionSpec(arch="sm_90", head_dim=d, config=three)) \
            == shared


def test_head_dims_outside_the_list_are_still_refused():
    for d in (16, 48, 112, 160, 512):
        with pytest.raises(SpecError, match=f"head_dim={d} is not supported"):
            AttentionSpec(head_dim=d)
        with pytest.raises(SpecError, match=f"head_dim={d} is not supported by the backward"):
            BackwardSpec(head_dim=d)


def test_copy_passes_must_tile_the_rows():
    """d80's rows are five 32-byte lines: 128 threads copy 64 rows a pass, which a 32-key tile
    cannot hold; with 2 warps (32 rows a pass) it can. d32's and d96's 64-byte lines make 32
    rows a pass of 4 warps: pages of 16 are gathered a row at a time (page_size=0), a one-warp
    decode tile's 8 rows a pass copy them whole."""
    with pytest.raises(SpecError, match="16-byte copies|copy passes"):
        AttentionSpec(head_dim=80, config=TileConfig((64, 32), warps=4))
    AttentionSpec(head_dim=80, config=TileConfig((64, 32), warps=2))
    for d in (32, 96):
        with pytest.raises(SpecError, match="page_size=16 .* 32 rows per copy pass"):
            AttentionSpec(head_dim=d, paged_kv=True, page_size=16)
        AttentionSpec(head_dim=d, paged_kv=True, page_size=16,
                      config=TileConfig((16, 64), warps=1), split_kv=True)


def test_d256_tiles_that_do_not_fit_an_l4_are_refused_there():
    big = TileConfig((64, 64), warps=4, stages=2)
    with pytest.raises(SpecError, match="shared memory"):
        AttentionSpec(arch="sm_89", head_dim=256, config=big)
    assert AttentionSpec(arch="sm_90", head_dim=256, config=big).smem_bytes > L4


def test_combine_of_the_new_dims():
    """A share's row is head_dim / 4 threads: 96 leaves threads idle (5 slots of 24 of 128),
    256 needs at least 64 threads."""
    assert CombineSpec(head_dim=96).idle_threads and CombineSpec(head_dim=96).slots == 5
    assert CombineSpec(head_dim=80).slots == 6
    assert not CombineSpec(head_dim=64).idle_threads and not CombineSpec(head_dim=128).idle_threads
    assert CombineSpec(head_dim=256).slots == 2
    with pytest.raises(SpecError, match="head_dim=256"):
        CombineSpec(head_dim=256, warps=1)


# -- the planner ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, d", itertools.product(ARCHS, NEW_DIMS))
def test_planner_configs_of_new_dims_validate(arch, d):
    """tile=None at a new dim: every bucket, mask and split gives a valid spec on the arch (its
    own Hopper entry's winner on sm_90 where it builds the call, else that entry's mma_sync
    fallback; the stand-in dim's entry where it fits there, else the defaults)."""
    own = table.entries(table.table_arch(arch))
    for bucket, causal in itertools.product(BUCKETS, (False, True)):
        seqlen = {"decode": 1, "short": 512, "mid": 2048, "long": 4096}[bucket]
        entry = own.get(table.key(d, causal, bucket))
        for features in ((), (("window", True),),
                         (("mask_align", "bottom_right"), ("window", True), ("softcap", True))):
            config = plan.tuned_config(arch, d, causal, seqlen, "fp16", features)
            split = seqlen <= plan.DECODE_MAX_Q
            spec = AttentionSpec(arch=arch, head_dim=d, causal=causal, config=config,
                                 split_kv=split, **dict(features))
            if entry is not None and entry.fallback is not None:
                assert config in (entry.config, entry.fallback)
                assert arch == "sm_90" or config == entry.fallback
                continue
            assert spec.family == "mma_sync"
            for group in (4, 8, 32):  # one token's query heads packed into rows
                grown = plan.packed_rows_config(config, 1, group, arch, d)
                AttentionSpec(arch=arch, head_dim=d, config=grown, split_kv=split)


def test_d256_gets_the_wide_defaults():
    """Where the table has no d256 entry, and as the fallback of its Hopper one (long prefill
    on sm_90, which an L4 borrowing the table cannot run)."""
    for arch in ARCHS:
        assert table.lookup(arch, 256, False, "decode") == table.WIDE_DECODE_DEFAULT
        assert table.lookup(arch, 256, True, "mid") == table.WIDE_DEFAULT
        long = table.lookup(arch, 256, True, "long")
        assert (long.family == "wgmma_ws") == (arch == "sm_90")
        if arch != "sm_90":
            assert long == table.WIDE_DEFAULT
    assert table._entry("sm_90", 256, True, "long", "fp16").fallback == table.WIDE_DEFAULT


def test_the_catalog_ships_the_planners_default_of_each_new_dim():
    from flashcore.compiler.catalog import CATALOG_CONFIGS

    for d in NEW_DIMS:
        assert CATALOG_CONFIGS[d] == [table.default_config(d, "long")]


def test_tuned_dims_keep_their_entries():
    """d64 and d128 read their own entries or the old defaults, untouched by the stand-ins."""
    for arch, d, causal, bucket in itertools.product(ARCHS, (64, 128), (False, True), BUCKETS):
        default = table.DECODE_DEFAULT if bucket == "decode" else table.DEFAULT
        want = table.entries(table.table_arch(arch)).get(table.key(d, causal, bucket),
                                                         table.Tuned(default))
        assert table._entry(arch, d, causal, bucket, "fp16") == want


# -- kernels ------------------------------------------------------------------------------------------
def _kernel_specs(arch: str, d: int) -> list:
    """Dense (the tuned mma_sync config, not causal: a Hopper entry's fallback; bf16 causal
    with every mask and LSE), a split-KV decode of packed GQA rows, varlen, a paged decode and
    its combine."""
    tuned = table._entry(arch, d, False, "long", "fp16")
    long = tuned.fallback or tuned.config
    decode = table.lookup(arch, d, False, "decode", features=(("split_kv", True),))
    grown = plan.packed_rows_config(decode, 1, 8, arch, d)  # 8 query heads a K/V head
    masks = {"causal": True, "mask_align": "bottom_right", "window": True, "softcap": True}
    return [
        AttentionSpec(arch=arch, head_dim=d, config=long),
        AttentionSpec(arch=arch, dtype="bfloat16", head_dim=d, config=TileConfig((64, 64)),
                      return_lse=True, **masks),
        AttentionSpec(arch=arch, head_dim=d, config=grown, split_kv=True, packed_tokens=True,
                      causal=True, mask_align="bottom_right"),
        AttentionSpec(arch=arch, dtype="bfloat16", head_dim=d, config=TileConfig((64, 64)),
                      varlen=True, causal=True, mask_align="bottom_right"),
        AttentionSpec(arch=arch, head_dim=d, config=decode, split_kv=True, paged_kv=True,
                      page_size=16 if d != 80 else 0),
        CombineSpec(arch=arch, dtype="bfloat16", head_dim=d, return_lse=True),
    ]


KERNELS = list(dict.fromkeys(
    s for arch, d in itertools.product(("sm_89", "sm_90"), (32, 96, 256)) for s in
    _kernel_specs(arch, d)) | dict.fromkeys(_kernel_specs("sm_89", 80)[:2]))
ATTENTION = [s for s in KERNELS if isinstance(s, AttentionSpec)]
COMBINES = [s for s in KERNELS if isinstance(s, CombineSpec)]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return compiled_in_fresh_cache(KERNELS, tmp_path_factory, jobs=1)


@pytest.mark.parametrize("spec", ATTENTION, ids=lambda s: s.name)
def test_new_dim_kernels(artifacts, spec):
    art = artifacts[spec]
    body = art.ptx[art.ptx.index(".entry"):]
    assert len(art.params) == len(params_for(spec))
    assert art.block == (spec.threads, 1, 1)
    assert art.smem_dynamic == spec.smem_bytes <= L4  # the sm_90 ones fit an L4 too
    assert 0 < art.resources.registers <= 255
    assert_no_spills_in_loops(art, spec.name)
    dt = {"float16": "f16", "bfloat16": "bf16"}[spec.dtype]
    mma = re.findall(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{dt}\.{dt}\.f32", body)
    # Q·Kᵀ over head_dim / 16 k-steps and P·V over head_dim / 8 columns, for each code path
    rows = spec.tile_m // (16 * spec.warps)
    per_block = 2 * rows * (spec.tile_n // 8) * (spec.head_dim // 16)
    assert len(mma) % per_block == 0 and len(mma) >= per_block
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in body  # V read transposed
    assert re.search(r"cp\.async\.cg\.shared\.global(\.L2::\d+B)? \[[^]]+\], \[[^]]+\], 16", body)
    if spec.split_kv:  # fp32 partial rows
        assert re.search(r"st\.global\.v[24]\.(b32|f32)", body)
    elif not spec.packed_tokens:  # 16-byte output stores
        assert "st.global.v4.b32" in body
    if spec.arch == "sm_90":
        assert body.index("griddepcontrol.wait;") < body.index("cp.async")


@pytest.mark.parametrize("spec", COMBINES, ids=lambda s: s.name)
def test_new_dim_combines(artifacts, spec):
    art = artifacts[spec]
    assert len(art.params) == len(params_for(spec))
    assert art.smem_dynamic == spec.smem_bytes
    assert_no_spills_in_loops(art, spec.name)
    body = art.ptx[art.ptx.index(".entry"):]
    assert re.search(r"ld\.global(\.nc)?\.v4\.(f32|b32|u32)", body)  # a share's 16-byte loads


def test_every_built_head_dim_runs_and_others_are_refused_by_name():
    from flashcore.ops.validate import head_dim_problem

    assert all(head_dim_problem(d) is None for d in (32, 64, 80, 96, 128, 256))
    problem = head_dim_problem(48)
    assert "48 is not supported" in problem and "96" in problem
