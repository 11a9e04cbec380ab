"""Compile the decode-side kernels on this GPU-less host: split-KV partials, their combine, the
FP8 KV cache, and check what the PTX/SASS must contain."""

from __future__ import annotations

import re

import pytest

from flashcore.build.abi import attention_params, combine_params
from flashcore.build.inspect import local_memory_in_loops
from flashcore.spec import SMEM_PER_BLOCK, AttentionSpec, CombineSpec, TileConfig
from tests.kernels import assert_no_spills_in_loops, compiled_in_fresh_cache

DECODE = TileConfig((16, 64), warps=1, stages=2)
SPECS = [
    AttentionSpec(arch="sm_89", head_dim=128, config=DECODE, split_kv=True),
    AttentionSpec(arch="sm_89", head_dim=128, config=DECODE, kv_fp8=True, split_kv=True),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=64, config=DECODE, kv_fp8=True,
                  causal=True, return_lse=True),
    AttentionSpec(arch="sm_89", head_dim=64, config=TileConfig((32, 64), warps=2, kv_splits=2),
                  precision="fp8", split_kv=True),
    CombineSpec(arch="sm_89", dtype="bfloat16", head_dim=128, return_lse=True),
    CombineSpec(arch="sm_90", head_dim=64),
]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return compiled_in_fresh_cache(SPECS, tmp_path_factory)


def _ptx_body(art) -> str:
    return art.ptx[art.ptx.index(".entry"):]


@pytest.mark.parametrize("spec", SPECS[:4], ids=lambda s: s.name)
def test_attention_variants(artifacts, spec):
    art = artifacts[spec]
    body = _ptx_body(art)
    assert len(art.params) == len(attention_params(spec))
    assert art.smem_dynamic == spec.smem_bytes <= SMEM_PER_BLOCK["sm_89"]  # they fit an L4
    assert_no_spills_in_loops(art, spec.name)
    if spec.split_kv:  # fp32 partial rows, 8 bytes a store, and every share's LSE
        assert re.search(r"st\.global\.v2\.(b32|f32)", body)
        assert "lse" in [p.name for p in attention_params(spec)]
    if spec.kv_fp8:
        # e4m3 K/V rows in 16-byte cp.async, their descales in 4-byte ones, converted in shared
        # memory 16 bytes in, 32 bytes out, with the hardware's e4m3 conversion
        assert re.search(r"cp\.async\.cg\.shared\.global(\.L2::\d+B)? \[[^]]+\], \[[^]]+\], 16", body)
        assert re.search(r"cp\.async\.ca\.shared\.global(\.L2::\d+B)? \[[^]]+\], \[[^]]+\], 4", body)
        assert "cvt.rn.f16x2.e4m3x2" in body
        assert "ld.shared.v4" in body and "st.shared.v4" in body
        dt = {"float16": "f16", "bfloat16": "bf16"}[spec.dtype]
        assert re.search(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{dt}\.{dt}\.f32", body)
    if spec.arch == "sm_90":
        assert body.index("griddepcontrol.wait;") < body.index("cp.async")


@pytest.mark.parametrize("spec", SPECS[4:], ids=lambda s: s.name)
def test_combine_kernel(artifacts, spec):
    art = artifacts[spec]
    body = _ptx_body(art)
    assert len(art.params) == len(combine_params(spec))
    assert art.block == (32 * spec.rows_per_cta, 1, 1)
    assert "shfl.sync.bfly" in body  # the shares' max and sum over the warp
    assert "ex2.approx" in body  # exp2 of the shares' LSEs (the log is computed exactly)
    assert_no_spills_in_loops(art, spec.name)
    if spec.arch == "sm_90":  # reads what the grid before it wrote: waits for it first
        assert body.index("griddepcontrol.wait;") < body.index("ld.global")


def test_local_memory_in_loops_sees_a_spill_in_a_loop():
    sass = """
        /*0000*/                   STL [R1], R2 ;
.L_x_0:
        /*0010*/                   FADD R3, R3, R4 ;
        /*0020*/                   LDL R5, [R1] ;
        /*0030*/               @P0 BRA `(.L_x_0) ;
        /*0040*/                   LDL.LU R6, [R1+0x4] ;
        /*0050*/                   EXIT ;
"""
    assert local_memory_in_loops(sass) == 1
    assert local_memory_in_loops(sass.replace("LDL R5, [R1]", "MOV R5, R6")) == 0
