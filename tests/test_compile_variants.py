"""Compile the decode-side kernels on this GPU-less host: split-KV partials, their combine, the
FP8 KV cache, and check what the PTX/SASS must contain."""

from __future__ import annotations

import re

import pytest

from flashcore.compiler.abi import params_for
from flashcore.compiler.inspect import local_memory_in_loops, loop_bodies, sass
from flashcore.specs import SMEM_PER_BLOCK, AttentionSpec, CombineSpec, TileConfig
from tests.kernels import assert_no_spills_in_loops, compiled_in_fresh_cache

DECODE = TileConfig((16, 64), warps=1, stages=2)
SPECS = [
    AttentionSpec(arch="sm_89", head_dim=128, config=DECODE, split_kv=True),
    AttentionSpec(arch="sm_89", head_dim=128, config=DECODE, kv_fp8=True, split_kv=True),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=64, config=DECODE, kv_fp8=True,
                  causal=True, return_lse=True),
    AttentionSpec(arch="sm_89", head_dim=64, config=TileConfig((32, 64), warps=2, kv_splits=2),
                  precision="fp8", split_kv=True),
    # the tuned bf16 decode kernel: without a launch bound ptxas spilled in its key loop
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=128, config=DECODE, split_kv=True),
    # FP8 operands with K descaled per (batch, head): the L4's native e4m3 mma.sync
    AttentionSpec(arch="sm_89", head_dim=128, config=TileConfig((64, 64)), precision="fp8",
                  k_scale="head", causal=True, return_lse=True),
    # multi-token GQA decode: (token, head) rows gathered from Q, scattered to O and the LSE
    AttentionSpec(arch="sm_89", head_dim=128, config=DECODE, packed_tokens=True, causal=True,
                  mask_align="bottom_right", return_lse=True),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=64, config=DECODE, kv_fp8=True,
                  packed_tokens=True, split_kv=True),
    # a tile grown to hold 17-32 packed rows: without the launch bound ptxas capped it at 168
    # registers and spilled 12-28 B
    AttentionSpec(arch="sm_89", head_dim=128, config=TileConfig((32, 64), warps=2, stages=2),
                  packed_tokens=True, causal=True, window=True, softcap=True, split_kv=True),
    # ALiBi: a slope per (batch, head), the bias in every block (split decode, a bottom-right
    # prefill with its LSE, two key groups beside a soft-cap)
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=128, config=DECODE, split_kv=True,
                  alibi=True),
    AttentionSpec(arch="sm_89", head_dim=64, causal=True, mask_align="bottom_right",
                  return_lse=True, alibi=True),
    AttentionSpec(arch="sm_80", head_dim=64, config=TileConfig((64, 64), warps=4, kv_splits=2),
                  softcap=True, alibi=True),
    # ... and in the serving layouts: a slope per (sequence, head) of a packed batch, a paged
    # cache's split decode
    AttentionSpec(arch="sm_89", head_dim=128, config=TileConfig((64, 64)), causal=True,
                  mask_align="bottom_right", varlen=True, return_lse=True, alibi=True),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=128, config=DECODE, paged_kv=True,
                  split_kv=True, mask_align="bottom_right", alibi=True),
    # split decode in one launch: the last share's CTA merges (the output and its LSE, packed
    # rows scattered), on each arch, and beside key groups
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=128, config=DECODE, split_kv=True,
                  merge_shares=True, return_lse=True),
    AttentionSpec(arch="sm_89", head_dim=64, config=DECODE, split_kv=True, merge_shares=True,
                  packed_tokens=True, causal=True, window=True),
    AttentionSpec(arch="sm_80", head_dim=96, config=TileConfig((32, 64), warps=2, kv_splits=2),
                  split_kv=True, merge_shares=True, return_lse=True),
    CombineSpec(arch="sm_89", dtype="bfloat16", head_dim=128, return_lse=True),
    CombineSpec(arch="sm_90", head_dim=64),
]
ATTENTION = [s for s in SPECS if isinstance(s, AttentionSpec)]
COMBINES = [s for s in SPECS if isinstance(s, CombineSpec)]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return compiled_in_fresh_cache(SPECS, tmp_path_factory)


def _ptx_body(art) -> str:
    return art.ptx[art.ptx.index(".entry"):]


@pytest.mark.parametrize("spec", ATTENTION, ids=lambda s: s.name)
def test_attention_variants(artifacts, spec):
    art = artifacts[spec]
    body = _ptx_body(art)
    assert len(art.params) == len(params_for(spec))
    assert art.smem_dynamic == spec.smem_bytes <= SMEM_PER_BLOCK["sm_89"]  # they fit an L4
    assert_no_spills_in_loops(art, spec.name)
    # a decode tile's CTA runs about one a SM: ptxas is told so (else it budgets registers for
    # a dozen CTAs a SM and spills)
    assert (".minnctapersm 1" in art.ptx) == (spec.tile_m == 16 or spec.packed_tokens)
    if spec.packed_tokens and spec.tile_m > 16:  # a grown tile has the registers it needs
        assert art.resources.spill_store_bytes == 0, art.resources
    if spec.split_kv:  # fp32 partial rows, 8 or 16 bytes a store, and every share's LSE
        assert re.search(r"st\.global\.v[24]\.(b32|f32)", body)
        assert "lse" in [p.name for p in params_for(spec)]
    if spec.merge_shares:
        # the rows fenced, then one acquire-release count a CTA; the last one reads the shares
        # back in 16-byte loads and writes the output (and its LSE) in the output dtype
        counted = re.search(r"fence\.acq_rel\.gpu;.*atom\.acq_rel\.gpu\.global\.add\.s32"
                            r".*fence\.acq_rel\.gpu;", body, re.DOTALL)
        assert counted and body.count("atom.") == 1
        merge = body[counted.end():]
        assert re.search(r"ld\.global\.v4\.(b32|f32)", merge)
        assert ("lse" in spec.name) == ("out_lse" in [p.name for p in params_for(spec)])
    if spec.kv_fp8:
        # e4m3 K/V rows in 16-byte cp.async, their descales in 4-byte ones; the codes read by
        # 16-bit ldmatrix (V transposed) and converted in registers by the hardware's e4m3
        # conversion: nothing is written back to shared memory before the epilogue
        assert re.search(r"cp\.async\.cg\.shared\.global(\.L2::\d+B)? \[[^]]+\], \[[^]]+\], 16", body)
        assert re.search(r"cp\.async\.ca\.shared\.global(\.L2::\d+B)? \[[^]]+\], \[[^]]+\], 4", body)
        assert "cvt.rn.f16x2.e4m3x2" in body
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in body
        assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in body
        text = sass(art.cubin)
        lines = text.splitlines()
        key_loop = max(loop_bodies(text), key=lambda fl: fl[1] - fl[0])
        key_loop_ops = "\n".join(lines[key_loop[0]:key_loop[1]])
        assert "F2FP.F16.E4M3.UNPACK_B" in key_loop_ops and "LDSM.16.MT88.4" in key_loop_ops
        # (the only stores are the zero fill of descales past the last key)
        assert not re.search(r"\bSTS\S* \[[^]]+\], R\d", key_loop_ops)
        # the MMAs multiply fp16 for either dtype (a bf16 Q is scaled into fp16's range once,
        # before the loop): the loop converts codes to fp16 and nothing to bf16
        assert re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32", body)
        assert "F2FP.BF16" not in key_loop_ops
    if spec.precision == "fp8":
        # per-token K descales are loaded in the key loop (4-byte global loads); a per-head
        # one is a (batch, heads) parameter folded into the rows' exp2 scales before it
        per_key = spec.k_scale == "token"
        k_param = {p.name: p for p in params_for(spec)}["k_descale"]
        assert k_param.dynamic_shapes == (3 if per_key else 2)
        text = sass(art.cubin)
        lines = text.splitlines()
        key_loop = max(loop_bodies(text), key=lambda fl: fl[1] - fl[0])
        key_loop_ops = "\n".join(lines[key_loop[0]:key_loop[1]])
        assert "HMMA" in key_loop_ops or "QMMA" in key_loop_ops
        assert bool(re.search(r"\bLDG\.E(\.CONSTANT)? ", key_loop_ops)) == per_key
    if spec.packed_tokens:
        # each gathered Q row and scattered O row still moves in 16-byte pieces
        assert re.search(r"cp\.async\.cg\.shared\.global(\.L2::\d+B)? \[[^]]+\], \[[^]]+\], 16", body)
        if not spec.split_kv:
            assert re.search(r"st\.global\.v4\.b32", body)
    if spec.alibi:
        # the slopes: a (batch, heads) float32 parameter read once; each score's distance
        # converted to float in the key loop
        slopes = {p.name: p for p in params_for(spec)}["alibi_slopes"]
        assert slopes.dynamic_shapes == 2
        text = sass(art.cubin)
        lines = text.splitlines()
        key_loop = max(loop_bodies(text), key=lambda fl: fl[1] - fl[0])
        assert "I2F" in "\n".join(lines[key_loop[0]:key_loop[1]])
    if spec.arch == "sm_90":
        assert body.index("griddepcontrol.wait;") < body.index("cp.async")


@pytest.mark.parametrize("spec", COMBINES, ids=lambda s: s.name)
def test_combine_kernel(artifacts, spec):
    art = artifacts[spec]
    body = _ptx_body(art)
    assert len(art.params) == len(params_for(spec))
    assert art.block == (32 * spec.warps, 1, 1)
    assert art.smem_dynamic == spec.smem_bytes
    assert "shfl.sync.bfly" in body  # the shares' max and sum over the warp
    assert "ex2.approx" in body  # exp2 of the shares' LSEs (the log is computed exactly)
    # the partial rows in 16-byte loads, several in flight: each pass of the share loop
    # issues four before it adds them up (one at a time, each share costs an L2 round trip)
    text = sass(art.cubin)
    lines = text.splitlines()
    # (into distinct registers: loads that share their destination wait for each other)
    per_pass = [set(re.findall(r"LDG\.E\.128 (R\d+)", "\n".join(lines[a:b])))
                for a, b in loop_bodies(text)]
    assert max(map(len, per_pass)) >= 4, per_pass
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
