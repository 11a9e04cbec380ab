"""The backward kernels as data and as compiled code, on this GPU-less host: specs, names and
JSON; every kernel compiles for sm_80, sm_89 and sm_90, fits an L4 (99 KB of shared memory),
spills nothing, has the instructions the algorithm needs and the ABI its launcher packs."""

from __future__ import annotations

import itertools
import re
import struct

import pytest

from flashcore.compiler.abi import params_for
from flashcore.errors import SpecError
from flashcore.specs import (
    BACKWARD_HEAD_DIMS,
    SMEM_PER_BLOCK,
    BackwardSpec,
    TileConfig,
    spec_from_dict,
)
from flashcore.specs.arch import swizzle_line_bytes
from flashcore.specs.backward import (
    BACKWARD_KNOBS,
    HOPPER_BWD,
    default_backward_config,
    default_warps_m,
    parse_backward_choices,
    row_lanes,
    squarest_grid,
    warp_grid,
)
from tests.kernels import assert_no_spills_in_loops, compiled_in_fresh_cache


def _main(arch: str, dtype: str, d: int, causal: bool, **masks) -> BackwardSpec:
    """The mma_sync main kernel as a call without a config builds it on ``arch`` (sm_90's d64
    and d128 default is the Hopper backward, ``HOPPER``: there sm_80's tile, which mma_sync
    ran on sm_90 before)."""
    config = default_backward_config(d, arch)
    if config.family == HOPPER_BWD:
        config = default_backward_config(d, "sm_80")
    return BackwardSpec(arch=arch, dtype=dtype, head_dim=d, config=config, causal=causal,
                        warps_m=default_warps_m(d, config), **masks)


MAINS = [
    _main("sm_80", "bfloat16", 128, True),
    _main("sm_89", "float16", 64, False),
    _main("sm_89", "bfloat16", 64, True),
    _main("sm_89", "float16", 128, False),
    _main("sm_89", "bfloat16", 128, True),
    _main("sm_90", "float16", 64, True),
    _main("sm_90", "bfloat16", 128, False),
    # the first variants: 16-row warp strips, one query block in flight
    BackwardSpec(arch="sm_90", dtype="bfloat16", head_dim=128, config=TileConfig((64, 64),
                                                                                 warps=8)),
    BackwardSpec(arch="sm_89", dtype="bfloat16", head_dim=64, causal=True,
                 config=TileConfig((64, 128), warps=8)),
    # 32 query rows in two stages: the LSE and D rows leave the struct off a 1 KB multiple
    BackwardSpec(arch="sm_90", dtype="bfloat16", head_dim=64, causal=True,
                 config=TileConfig((32, 64), warps=4, stages=2),
                 warps_m=default_warps_m(64, TileConfig((32, 64), warps=4, stages=2))),
]
# the masks, as the forward's: bottom-right causal, windows (causal or not), soft-caps
MASKED = [
    _main("sm_80", "float16", 128, True, mask_align="bottom_right", softcap=True),
    _main("sm_89", "float16", 64, True, mask_align="bottom_right"),
    _main("sm_89", "bfloat16", 128, False, mask_align="bottom_right", window=True),
    _main("sm_89", "bfloat16", 128, True, window=True, softcap=True),
    _main("sm_90", "float16", 64, True, mask_align="bottom_right", window=True, softcap=True),
    _main("sm_90", "bfloat16", 64, False, softcap=True),
    _main("sm_90", "float16", 128, False, window=True),
]
MAINS += MASKED
# dQ's adds in key-block order: the plain and windowed turn formulas, both atomics forms
DETERMINISTIC = [
    _main("sm_80", "bfloat16", 128, True, deterministic=True),
    _main("sm_89", "float16", 64, False, deterministic=True),
    _main("sm_89", "bfloat16", 128, True, window=True, deterministic=True),
    _main("sm_90", "bfloat16", 128, True, mask_align="bottom_right", deterministic=True),
    _main("sm_89", "float16", 64, True, mask_align="bottom_right", deterministic=True,
          varlen=True),
]
# a packed batch: the offsets of Q's and K's rows, the batch in the grid's z
VARLEN = [
    _main("sm_80", "bfloat16", 128, False, softcap=True, varlen=True),
    _main("sm_89", "float16", 64, False, varlen=True),
    _main("sm_89", "bfloat16", 128, True, mask_align="bottom_right", window=True, varlen=True),
    _main("sm_90", "float16", 128, True, mask_align="bottom_right", varlen=True),
]
MAINS += VARLEN
# the other head dims: 64-byte swizzle lines (d32, d96), 32-byte ones copied by four warps
# (d80), d256's 128 registers of dK and dV (and an L4's 32 x 32 tiles)
HEAD_DIMS = [
    _main("sm_80", "float16", 96, False),
    _main("sm_89", "bfloat16", 32, True, mask_align="bottom_right", window=True),
    _main("sm_89", "float16", 80, True, softcap=True),
    _main("sm_89", "bfloat16", 96, True),
    _main("sm_89", "float16", 256, True, varlen=True),
    _main("sm_90", "bfloat16", 80, False, deterministic=True),
    _main("sm_90", "float16", 256, True, mask_align="bottom_right", window=True, softcap=True),
]
MAINS += HEAD_DIMS
# the Hopper backward (sm_90): plain, every mask, dQ in turns, a packed batch, both dtypes
HOPPER_TILE = TileConfig((64, 128), warps=8, stages=2, family=HOPPER_BWD)
HOPPER = [BackwardSpec(arch="sm_90", dtype=dt, head_dim=d, config=HOPPER_TILE, causal=c, **m)
          for dt, d, c, m in (
              ("float16", 128, False, {}),
              ("bfloat16", 64, True, {}),
              ("float16", 64, True, {"mask_align": "bottom_right", "window": True,
                                     "softcap": True}),
              ("bfloat16", 128, True, {"softcap": True, "deterministic": True}),
              ("float16", 128, True, {"mask_align": "bottom_right", "varlen": True}),
              # d96: the first warpgroup's dQ alone
              ("bfloat16", 96, True, {"window": True}),
              ("float16", 96, False, {"deterministic": True}))]
# d64's 128-row blocks: plain, masked, dQ in turns, a packed batch
HOPPER += [BackwardSpec(arch="sm_90", dtype=dt, head_dim=64,
                        config=HOPPER_TILE.replace(tile=(128, 128)), causal=c, **m)
           for dt, c, m in (("float16", False, {}),
                            ("bfloat16", True, {"mask_align": "bottom_right", "window": True,
                                                "softcap": True}),
                            ("float16", True, {"deterministic": True}),
                            ("bfloat16", True, {"varlen": True}))]
ROWS = [BackwardSpec(arch=a, dtype=dt, head_dim=d, op=op)
        for a, dt, d in (("sm_80", "float16", 64), ("sm_89", "bfloat16", 128),
                         ("sm_90", "float16", 128), ("sm_89", "float16", 80),
                         ("sm_90", "bfloat16", 96), ("sm_80", "bfloat16", 256))
        for op in ("attention_bwd_pre", "attention_bwd_post")]
SPECS = MAINS + ROWS + DETERMINISTIC + HOPPER


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return compiled_in_fresh_cache(SPECS, tmp_path_factory)


# -- specs as data ---------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_spec_round_trips_through_json(spec):
    again = spec_from_dict(spec.to_dict())
    assert again == spec and again.content_hash == spec.content_hash
    assert BackwardSpec.from_json(spec.to_json()) == spec


def test_names_are_unique_and_readable():
    specs = [BackwardSpec(arch=a, dtype=dt, head_dim=d, config=c, causal=causal)
             for a in ("sm_80", "sm_90") for dt in ("float16", "bfloat16")
             for d in (64, 128) for causal in (False, True)
             for c in (TileConfig((64, 64), warps=4), TileConfig((64, 64), warps=8),
                       TileConfig((64, 128), warps=8))]
    names = [s.name for s in specs] + [s.name for s in ROWS]
    assert len(set(names)) == len(names)
    assert (_main("sm_89", "float16", 64, True).name
            == "fc_attn_bwd_sm89_f16_d64_m64n128_w8_s2_a244_causal")
    assert (BackwardSpec(config=TileConfig((64, 64), warps=8)).name
            == "fc_attn_bwd_sm89_f16_d64_m64n64_w8_s1")
    assert ROWS[0].name == "fc_attn_bwd_pre_sm80_f16_d64"
    masked = [BackwardSpec(causal=c, mask_align=a, window=w, softcap=cap)
              for c in (False, True) for a in ("top_left", "bottom_right")
              for w in (False, True) for cap in (False, True) if a == "top_left" or c or w]
    assert len({s.name for s in masked}) == len(masked) == 14
    assert (MASKED[4].name
            == "fc_attn_bwd_sm90_f16_d64_m64n128_w8_s2_a244_causal_br_window_softcap")


@pytest.mark.parametrize("d", BACKWARD_HEAD_DIMS)
def test_default_configs_fit_an_l4(d):
    for dtype in ("float16", "bfloat16"):
        spec = _main("sm_89", dtype, d, True)
        assert spec.smem_bytes <= SMEM_PER_BLOCK["sm_89"]


@pytest.mark.parametrize("bad, match", [
    ({"op": "attention_bwd_pre", "causal": True}, "takes no config"),
    ({"op": "attention_bwd_post", "config": TileConfig((64, 64), warps=8)}, "takes no config"),
    ({"op": "attention_bwd_sideways"}, "op="),
    ({"config": TileConfig((128, 128), warps=8), "head_dim": 128}, "shared memory"),
    ({"config": TileConfig((64, 64), warps=2)}, "warps=2"),
    ({"config": TileConfig((64, 64), stages=3)}, "stages=3"),
    ({"head_dim": 128, "config": TileConfig((64, 64), warps=8, stages=2)}, "shared memory"),
    ({"config": TileConfig((64, 64), warps=8), "warps_m": (3, 2, 2)}, "cannot share"),
    ({"config": TileConfig((64, 64), warps=8), "warps_m": (8, 2, 2)}, "cannot share"),
    ({"config": TileConfig((64, 64), warps=8), "warps_m": (2, 2)}, "warps_m"),
    ({"op": "attention_bwd_pre", "warps_m": (2, 2, 2)}, "takes no config"),
    ({"config": TileConfig((64, 64), warps=4, family="wgmma_ws")}, "mma_sync"),
    ({"head_dim": 48}, "head_dim"),
    ({"head_dim": 80, "config": TileConfig((64, 64), warps=8)}, "cannot share"),
    ({"arch": "sm_89", "head_dim": 256, "config": TileConfig((64, 64), warps=8)},
     "shared memory"),
    ({"mask_align": "bottom_right"}, "mask_align"),  # neither causal nor a window to align
    ({"mask_align": "sideways", "causal": True}, "mask_align"),
    ({"op": "attention_bwd_pre", "window": True}, "takes no config"),
    ({"op": "attention_bwd_post", "softcap": True}, "takes no config"),
    ({"window": 1}, "window must be a bool"),
    ({"arch": "sm_75"}, "arch"),
])
def test_invalid_specs_are_refused_naming_the_field(bad, match):
    with pytest.raises(SpecError, match=match):
        BackwardSpec(arch=bad.pop("arch", "sm_89"), **bad)


def test_defaults_fit_each_arch_and_take_the_squarest_warp_tiles():
    for arch in ("sm_80", "sm_89", "sm_90"):
        for d in BACKWARD_HEAD_DIMS:
            spec = _main(arch, "bfloat16", d, False)
            assert spec.smem_bytes <= SMEM_PER_BLOCK[arch]
    # FlashAttention-2's A100/H100 d128 layouts: 32 x 32 warp tiles of S, 32 x 64 of dK/dV
    assert default_warps_m(128, TileConfig((64, 128), warps=8, stages=2)) == (2, 4, 2)
    assert default_warps_m(64, TileConfig((128, 128), warps=8)) == (4, 4, 4)
    assert squarest_grid(16, 64, 8) == 0  # no grid of 16-wide warp tiles: the strips' rule
    assert warp_grid(64, 128, 8) == (4, 2) and warp_grid(64, 128, 8, 2) == (2, 4)


def test_every_valid_spec_copies_whole_rows_a_pass():
    """The kernel's loads and stores cover ``threads`` / (a swizzle line's 16-byte copies) rows
    a pass (``mma_sync.layouts.line_elems``, as the forward's): every tile the warp grids
    accept holds whole passes (d80's 32-byte lines take four warps)."""
    seen = set()
    for d, tm, tn, w in itertools.product(BACKWARD_HEAD_DIMS, *(BACKWARD_KNOBS[k] for k in
                                                              ("tile_m", "tile_n", "warps"))):
        try:
            BackwardSpec(arch="sm_90", head_dim=d, config=TileConfig((tm, tn), warps=w))
        except SpecError:
            continue
        per_pass = 32 * w // (swizzle_line_bytes(2 * d) // 16)
        assert tm % per_pass == 0 and tn % per_pass == 0, (d, tm, tn, w)
        seen.add(d)
    assert seen == set(BACKWARD_HEAD_DIMS)


def test_backward_choices_parse():
    got = parse_backward_choices("128:64x128w8s2a242; 64:64x128w8s1a-;128x128w8s2")
    assert got[128] == (TileConfig((64, 128), warps=8, stages=2), (2, 4, 2))
    assert got[64] == (TileConfig((64, 128), warps=8), ())
    assert got[None] == (TileConfig((128, 128), warps=8, stages=2), None)
    with pytest.raises(SpecError, match="MxNwWsS"):
        parse_backward_choices("64x128")


def test_every_knob_value_builds_some_spec():
    for knob, values in BACKWARD_KNOBS.items():
        assert values, knob
    BackwardSpec(config=TileConfig((32, 32), warps=4))
    BackwardSpec(arch="sm_90", head_dim=128, config=TileConfig((128, 128), warps=8))


# -- compiled ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", MAINS, ids=lambda s: s.name)
def test_main_kernel_has_the_instructions_we_meant(artifacts, spec):
    ptx = artifacts[spec].ptx
    assert re.search(rf"\.target\s+{spec.arch}\b", ptx)
    dt = {"float16": "f16", "bfloat16": "bf16"}[spec.dtype]
    mma = re.findall(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{dt}\.{dt}\.f32", ptx)
    # five products a query block, each tile_m * tile_n * head_dim / (16 * 8 * 16) MMAs over
    # the CTA's warps: S, dP (tile_m x tile_n over d), dV, dK (tile_n x d over tile_m), dQ
    c, d = spec.config, spec.head_dim
    per_cta = 5 * c.tile_m * c.tile_n * d // (16 * 8 * 16)
    assert len(mma) * c.warps == per_cta
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx  # Pᵀ, dSᵀ, Qᵀ, dOᵀ, Kᵀ
    # dQ's fp32 atomics: pairs of columns in one on sm_90
    pairs = spec.arch == "sm_90"
    assert ("red.global.add.v2.f32" in ptx) == pairs
    assert ("red.global.add.f32" in ptx) != pairs
    assert re.search(r"cp\.async\.cg\.shared\.global(\.L2::\d+B)? \[[^]]+\], \[[^]]+\], 16", ptx)
    assert "ex2.approx" in ptx
    assert "st.global.v4" in ptx  # dK, dV: 16-byte stores
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "tanh.approx" not in ptx  # a soft-cap's tanh is the forward's full-precision one
    body = ptx[ptx.index(".entry"):]
    if spec.arch == "sm_90":  # programmatic dependent launch: wait before touching memory
        wait = body.index("griddepcontrol.wait;")
        first = min(body.index(op) for op in ("cp.async", "ld.global", "st.global", "red.global")
                    if op in body)
        assert wait < first
    else:
        assert "griddepcontrol" not in body


@pytest.mark.parametrize("spec", HOPPER, ids=lambda s: s.name)
def test_hopper_kernel_has_the_instructions_we_meant(artifacts, spec):
    ptx = artifacts[spec].ptx
    assert re.search(r"\.target\s+sm_90a\b", ptx)
    dt = {"float16": "f16", "bfloat16": "bf16"}[spec.dtype]
    # per query block and warpgroup: Sᵀ and dPᵀ (64 keys x tile_m over d: d / 16 each), dV
    # and dK (64 x d over tile_m rows: tile_m / 16 each), dQ (64 rows: its half of d over 128
    # keys, 8; d96 the first warpgroup's 64 x 96; 128 rows: each warpgroup's 64 x d); no
    # mma.sync. Warp-specialised d96: each MMA warpgroup its own copy of the block's code (the
    # second's without dQ), under its own register count
    mma = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.{dt}\.{dt}", ptx)
    d, tm = spec.head_dim, spec.config.tile_m
    dq_n = d if d == 96 or tm == 128 else d // 2
    copies = 2 if spec.warp_specialized and d == 96 else 1
    assert sorted(mma) == sorted(([str(tm)] * (2 * d // 16) + [str(d)] * (2 * tm // 16)) * copies
                                 + [str(dq_n)] * 8), mma
    assert "mma.sync" not in ptx and "ldmatrix" not in ptx
    assert ptx.count("stmatrix.sync.aligned") == tm // 16 * copies  # dSᵀ, tm / 2 values a thread
    assert "fence.proxy.async.shared::cta" in ptx
    # dQ: a bulk reduction a query block from shared memory, or (deterministic) the turns'
    # per-thread pairs
    bulk = "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in ptx
    assert bulk == spec.bulk_dq == (not spec.deterministic)
    assert ("red.global.add.v2.f32" in ptx) != bulk and "red.global.add.f32" not in ptx
    if bulk:
        assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx)
        assert re.search(r"cp\.async\.bulk\.wait_group\s+0;", ptx)
        # dQ staged as the accumulator lies (``dq_layout``): pairs at XORed addresses
        assert "st.shared.v2.f32" in ptx and "xor.b32" in ptx
    # Q, K, V and dO by TMA over dense batches, a box a swizzle span of each row (K and V
    # once; Q and dO where the first query block is copied and where each next one is), by
    # every thread's 16-byte cp.async over packed ones;
    # the LSE and D rows by 4-byte cp.async either way
    tiles = re.search(r"cp\.async\.cg\.shared\.global(\.L2::\d+B)? \[[^]]+\], \[[^]]+\], 16", ptx)
    tma = re.findall(r"cp\.async\.bulk\.tensor\.4d\.shared::\w+\.global\.tile\.mbarrier", ptx)
    assert spec.loads_by_tma == (not spec.varlen) == (tiles is None)
    boxes = spec.head_dim * 2 // (128 if spec.head_dim % 64 == 0 else 64)
    # warp-specialised (dense, bulk dQ): one copying warp (whose loop the compiler may peel:
    # some multiple of the four tiles' boxes), the LSE and D rows by 1-D bulk copies; the MMA
    # warps meet at named barriers
    ws = spec.warp_specialized
    assert ws == (spec.loads_by_tma and spec.bulk_dq
                  and (spec.config.tile_m, spec.head_dim) in ((64, 64), (128, 64), (64, 128),
                                                              (64, 96)))
    if ws:
        assert len(tma) >= 4 * boxes and len(tma) % (2 * boxes) == 0
    else:
        assert len(tma) == (6 * boxes if spec.loads_by_tma else 0)
    rows = re.search(r"cp\.async\.ca\.shared\.global(\.L2::\d+B)? \[[^]]+\], \[[^]]+\], 4", ptx)
    bulk_rows = re.findall(r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier", ptx)
    assert (rows is None) == ws and (len(bulk_rows) >= 2) == ws and len(bulk_rows) % 2 == 0
    assert ("setmaxnreg" in ptx) == ws and ("bar.arrive" in ptx) == ws
    if ws:  # one CTA-wide barrier (the mbarriers' initialisation): past it the roles never
        # meet as a whole; the MMA warps meet alone (256), or with the dQ writer warp (288)
        mma = spec.config.threads
        # (``barrier.*``: unaligned, where each MMA warpgroup runs its own copy of the loop)
        named = re.findall(r"bar(?:rier)?\.(?:sync|arrive)\s+(\S+?)(?:,\s*(\d+))?;", ptx)
        assert [n for n in named if n[1] == ""] == [("0", "")]
        assert {int(count) for _, count in named if count} == {mma, mma + 32}
        assert [(i, int(c)) for i, c in named if i in ("1", "2")] == [
            (i, mma) for i, c in named if i in ("1", "2")]
        if d == 96:  # each MMA warpgroup runs its own copy of the loop: no aligned meeting
            assert not re.search(rf"\bbar\.(?:sync|arrive)\s+\S+,\s*{mma};", ptx)
        # the producer's 24 registers, the MMA warpgroups' 240 each (d96: dQ's 256, the other
        # 224); ptxas keeps them only where it knows the count at entry (one CTA an SM)
        regs = [int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);",
                                           ptx)]
        assert sorted(regs) == ([24, 224, 256] if d == 96 else [24, 240])
        each = sorted(regs)[1:] * (1 if d == 96 else 2)  # an MMA warpgroup's
        assert 128 * (24 + sum(each)) <= 64 * 1024
        assert re.search(r"\.minnctapersm\s+1\b", ptx)
    assert "ld.local" not in ptx and "st.local" not in ptx
    body = ptx[ptx.index(".entry"):]
    wait = body.index("griddepcontrol.wait;")
    first = min(body.index(op) for op in ("cp.async", "ld.global", "st.global", "red.global")
                if op in body)
    assert wait < first


@pytest.mark.parametrize("spec", [s for s in HOPPER if s.warp_specialized], ids=lambda s: s.name)
def test_warp_specialised_kernels_keep_their_register_moves(artifacts, spec):
    """ptxas drops ``setmaxnreg`` where it cannot tell the register count at entry, and then
    fits the MMA warps into the launch's share: the SASS must keep the producer's release and
    each MMA warpgroup's claim, and the MMAs their groups (a ``gsb0`` wait on every HGMMA is
    ptxas serialising them for want of registers)."""
    from flashcore.compiler.inspect import sass, sass_opcodes

    text = sass(artifacts[spec].cubin)
    if text is None:
        pytest.skip("nvdisasm is not installed")
    moves = [op for op in sass_opcodes(text) if "SETMAXREG" in op]
    claims = 2 if spec.head_dim == 96 else 1  # d96: each MMA warpgroup its own count
    assert moves.count("USETMAXREG.DEALLOC.CTAPOOL") == 1, moves
    assert moves.count("USETMAXREG.TRY_ALLOC.CTAPOOL") == claims, moves
    hgmma = re.findall(r"HGMMA\.[^;]*;", text)
    assert hgmma and sum("gsb0" in h for h in hgmma) <= len(hgmma) // 3, hgmma


def test_hopper_backward_takes_tma_descriptors_over_dense_batches():
    """The launch ABI of the main kernel: over a dense batch the Hopper kernel takes Q, K, V
    and dO as TMA descriptors (a box of a query block's rows for Q and dO, of the key block's
    for K and V, a swizzle span wide) with their (seq, heads, batch) extents; a packed batch
    and the mma_sync family take the tensors themselves."""
    from flashcore.specs.packing import CoordParam, TensorMapParam, TensorParam
    from flashcore.specs.params import BACKWARD

    for d, tile, span in ((64, (128, 128), 128), (96, (64, 128), 64), (128, (64, 128), 128)):
        spec = BackwardSpec(arch="sm_90", head_dim=d, causal=True,
                            config=HOPPER_TILE.replace(tile=tile))
        assert spec.loads_by_tma
        packed = BACKWARD.packing(spec)
        maps = [p for p in packed if isinstance(p, TensorMapParam)]
        assert [(m.tensor, m.box_rows, m.box_cols, m.swizzle) for m in maps] == [
            (name, rows, span // 2, span)
            for name, rows in (("q", tile[0]), ("k", tile[1]), ("v", tile[1]), ("do", tile[0]))]
        assert [p.name for p in packed[:8]] == [f"{n}_{w}" for n in ("q", "k", "v", "do")
                                                for w in ("tma", "extents")]
        assert all(isinstance(p, CoordParam) for p in packed[1:8:2])
    for spec in (BackwardSpec(arch="sm_90", head_dim=128, config=HOPPER_TILE, varlen=True),
                 BackwardSpec(arch="sm_90", head_dim=128, config=HOPPER_TILE.replace(family="")),
                 BackwardSpec(arch="sm_89", head_dim=128),
                 BackwardSpec(op="attention_bwd_pre", arch="sm_90", head_dim=128)):
        assert not spec.loads_by_tma
        packed = BACKWARD.packing(spec) if spec.op == "attention_bwd" else ()
        assert not any(isinstance(p, (TensorMapParam, CoordParam)) for p in packed)
        assert all(isinstance(p, TensorParam) for p in packed[:4])


def test_hopper_defaults_and_refusals():
    for d in (64, 96, 128):
        assert default_backward_config(d, "sm_90") == HOPPER_TILE.replace(
            tile=(128 if d == 64 else 64, 128))
        assert default_backward_config(d, "sm_89").family == ""
        assert default_warps_m(d, HOPPER_TILE) == ()
    for d in (32, 80, 256):
        assert default_backward_config(d, "sm_90").family == ""
    assert parse_backward_choices("64x128w8s2-hopper")[None] == (HOPPER_TILE, None)
    with pytest.raises(SpecError, match="family 'sideways'"):
        parse_backward_choices("64x128w8s2-sideways")
    for bad, match in (({"arch": "sm_89"}, "sm_90 only"),
                       ({"head_dim": 256}, "head_dim in"),
                       ({"config": TileConfig((128, 128), warps=8, stages=2, family="hopper")},
                        "head_dim=128 for tiles \\(\\(64, 128\\),\\)"),
                       ({"config": TileConfig((64, 128), warps=8, stages=1, family="hopper")},
                        "stages=2"),
                       ({"warps_m": (2, 4, 2)}, "warps_m")):
        kw = {"arch": "sm_90", "head_dim": 128, "config": HOPPER_TILE} | bad
        with pytest.raises(SpecError, match=match):
            BackwardSpec(**kw)


@pytest.mark.parametrize("spec", MASKED, ids=lambda s: s.name)
def test_masked_kernels_take_the_forwards_mask_arguments(artifacts, spec):
    names = [p.name for p in params_for(spec)]
    assert ("window_left" in names) == ("window_right" in names) == spec.window
    assert ("softcap_in" in names) == ("softcap_out" in names) == spec.softcap
    unmasked = spec.replace(mask_align="top_left", window=False, softcap=False)
    assert len(artifacts[spec].params) == len(params_for(unmasked)) + 2 * (
        spec.window + spec.softcap)
    if spec.softcap:  # the capped scores' tanh: one more exp2 per score than P's
        body = artifacts[spec].ptx
        c = spec.config
        assert body.count("ex2.approx") >= 2 * c.tile_m * c.tile_n // spec.threads


@pytest.mark.parametrize("spec", ROWS, ids=lambda s: s.name)
def test_row_kernels_move_16_bytes_a_thread(artifacts, spec):
    ptx = artifacts[spec].ptx
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx
    if spec.op == "attention_bwd_pre":  # D's row sum over the row's lanes
        lanes = row_lanes(spec.head_dim)  # d80's ten chunks a row: 16 lanes, 4 steps
        assert lanes >= spec.head_dim // 8 and lanes & (lanes - 1) == 0
        assert ptx.count("shfl.sync.bfly") == lanes.bit_length() - 1


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_resources_within_budget(artifacts, spec):
    art = artifacts[spec]
    r = art.resources
    assert 0 < r.registers <= 255
    assert r.registers * spec.threads <= 64 * 1024  # one CTA's registers fit an SM
    assert_no_spills_in_loops(art, spec.name)
    if not (spec.deterministic or spec.varlen):  # their extra pointers may be parked across
        assert r.spill_store_bytes in (0, None) and r.stack_frame_bytes == 0, r  # the loop
    assert art.smem_dynamic == spec.smem_bytes <= SMEM_PER_BLOCK[spec.arch]
    assert art.block == (spec.threads, 1, 1)
    assert art.entry.startswith(spec.name) and "cutlass" not in art.entry


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_abi_matches_the_ptx_entry(artifacts, spec):
    art = artifacts[spec]
    params = params_for(spec)
    assert len(art.params) == len(params)
    for want, got in zip(params, art.params):
        assert (want.size, want.align) == (got.size, got.align), want.name
        assert struct.calcsize(want.fmt) == got.size


def test_resource_table(artifacts, capsys):
    """Not a check: the table the report quotes (pytest -s shows it)."""
    with capsys.disabled():
        for spec in SPECS:
            r = artifacts[spec].resources
            print(f"{spec.name:55s} regs {r.registers:3d} smem {r.smem_dynamic_bytes:6d} "
                  f"spills {r.spill_store_bytes}/{r.spill_load_bytes}")


@pytest.mark.parametrize("spec", DETERMINISTIC, ids=lambda s: s.name)
def test_deterministic_kernels_take_turns_at_each_query_block(artifacts, spec):
    """One acquire spin and one release count per query block, around the dQ adds; the counters
    are one more argument; the rest is the plain kernel's."""
    art, plain = artifacts[spec], spec.replace(deterministic=False)
    assert [p.name for p in params_for(spec)] == [p.name for p in params_for(plain)] + [
        "dq_turns"]
    assert len(art.params) == len(params_for(spec))
    body = art.ptx[art.ptx.index(".entry"):]
    assert body.count("ld.acquire.gpu.global.b32") >= 1
    assert body.count("red.release.gpu.global.add.s32") == 1
    adds = [m.start() for m in re.finditer(r"red\.global\.add(\.v2)?\.f32", body)]
    assert body.index("ld.acquire.gpu") < adds[0]
    assert adds[-1] < body.index("red.release.gpu")
    assert "_det" in spec.name and "_det" not in plain.name


def test_deterministic_is_the_main_kernels_alone():
    with pytest.raises(SpecError, match="deterministic"):
        BackwardSpec(op="attention_bwd_pre", deterministic=True)
    with pytest.raises(SpecError, match="deterministic must be a bool"):
        BackwardSpec(deterministic=1)
    assert "deterministic" not in BackwardSpec().to_dict()  # older keys hold
    spec = BackwardSpec(deterministic=True)
    assert spec_from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("spec", VARLEN, ids=lambda s: s.name)
def test_varlen_kernels_take_the_offsets_after_the_masks(artifacts, spec):
    """Two int32 offset vectors more than the dense kernel, after the masks' sizes; the batch
    from the grid's z (the x extent sizes the key blocks: the longest sequence's)."""
    dense = spec.replace(varlen=False)
    names = [p.name for p in params_for(spec)]
    assert names == [p.name for p in params_for(dense)] + ["cu_seqlens_q", "cu_seqlens_k"]
    body = artifacts[spec].ptx[artifacts[spec].ptx.index(".entry"):]
    assert "%ctaid.z" in body and "%nctaid.x" in body
    assert spec.name.endswith("_varlen")


@pytest.mark.parametrize("d", BACKWARD_HEAD_DIMS)
def test_dq_accumulator_chunks_turn_within_each_row_and_spread_a_warps_store(d):
    """The dQ accumulator's layout (``specs.backward.DQ_CHUNK_TURNS``, written by the main
    kernels and read by the post kernel through ``kernels/mma_sync_bwd/dq_layout``): each row's
    chunks are a permutation of its chunks, and where the chunks turn, a warp's store of one
    accumulator column pair (8 rows of 32 bytes, lanes 4r..4r+3 on row r) meets every bank
    window of 128 bytes twice: two wavefronts, the least 256 bytes take."""
    from flashcore.kernels.mma_sync_bwd.dq_layout import turned_chunk
    from flashcore.specs.backward import DQ_CHUNK_BYTES, dq_chunk_turns

    chunks = d * 4 // DQ_CHUNK_BYTES
    for row in range(16):
        assert sorted(turned_chunk(c, row, d) for c in range(chunks)) == list(range(chunks))
    turns = dq_chunk_turns(d)
    assert turns == (1 if d == 80 else 4)
    if turns == 1:
        return
    row_bytes = 4 * d
    for first_row in (0, 3, 8, 13):  # a packed sequence's blocks start at any row
        for c in range(chunks):
            windows = [((r * row_bytes + turned_chunk(c, r, d) * DQ_CHUNK_BYTES) % 128) // 32
                       for r in range(first_row, first_row + 8)]
            assert sorted(windows) == [0, 0, 1, 1, 2, 2, 3, 3], (first_row, c, windows)
