"""The warp-specialised Hopper family (``wgmma_ws``) on the CPU: the spec counts its producer
warpgroup, its kernels compile for sm_90a to TMA loads, mbarrier waits, setmaxnreg and warpgroup
MMAs with no spills and the TMA ABI; the runtime's descriptor geometry and encoding arguments."""

from __future__ import annotations

import contextlib
import itertools
import re
import struct

import pytest

from flashcore.compiler.abi import CoordParam, TensorMapParam, params_for
from flashcore.compiler.inspect import sass, sass_opcodes
from flashcore.errors import LaunchError, SpecError
from flashcore.specs import AttentionSpec, TileConfig, dsl_arch, family
from tests.kernels import assert_no_spills_in_loops, compiled_in_fresh_cache

WS = TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws")


# the kernel modules import cutlass: imported inside the tests that use them, so that a GPU host
# running the GPU tests from a catalog (no DSL) still collects this module


def test_consumers_share_what_the_producer_gives_back():
    """setmaxnreg moves registers within the CTA's pool, each thread's share of the SM's a
    multiple of 8: every split fits it (two consumers' CTA: 168 x 384 = 64512, not the SM's
    65536: producers of 32 and consumers of 240 hung on an H200)."""
    from flashcore.kernels.wgmma_ws.layouts import consumer_regs, producer_regs, register_pool

    assert [register_pool(n) for n in (1, 2, 3)] == [65536, 64512, 65536]
    assert [consumer_regs(n) for n in (1, 2, 3)] == [240, 240, 160]
    assert [consumer_regs(n, 32) for n in (1, 2, 3)] == [240, 232, 160]
    assert [producer_regs(n, True) for n in (1, 2, 3)] == [32, 24, 32]  # paging producers
    assert [producer_regs(n, False) for n in (1, 2, 3)] == [24, 24, 24]
    for n, paging in itertools.product((1, 2, 3), (False, True)):
        p = producer_regs(n, paging)
        assert 128 * p + 128 * n * consumer_regs(n, p) <= register_pool(n)


def test_the_config_or_the_spec_names_the_family():
    by_config = AttentionSpec(arch="sm_90", head_dim=128, config=WS)
    by_spec = AttentionSpec(arch="sm_90", head_dim=128, family="wgmma_ws",
                            config=WS.replace(family=""))
    assert by_config == by_spec and by_config.family == "wgmma_ws"
    assert dsl_arch(by_config) == "sm_90a"
    assert AttentionSpec.from_json(by_config.to_json()) == by_config
    default = AttentionSpec(arch="sm_90", head_dim=128, config=TileConfig((128, 128), warps=8))
    # the default family leaves no trace in the config: names and keys as before
    assert default.family == "mma_sync" and "family" not in default.to_dict()["config"]
    assert dsl_arch(default) == "sm_90" and not default.name.endswith("mma_sync")
    explicit = AttentionSpec(arch="sm_90", head_dim=128, config=TileConfig(
        (128, 128), warps=8, family="mma_sync"))
    assert explicit == default
    with pytest.raises(SpecError, match="disagree"):
        AttentionSpec(arch="sm_90", family="mma_sync", config=WS)


def test_the_retired_wgmma_family_is_refused_naming_its_successor():
    """The non-warp-specialised ``wgmma`` family is no longer built: a config, a spec, a saved
    spec or a family lookup naming it gets a ``SpecError`` that points at ``wgmma_ws``."""
    from flashcore.specs import FAMILIES, family

    assert "wgmma" not in FAMILIES
    what = r"'wgmma' is no longer built; use family='wgmma_ws'"
    with pytest.raises(SpecError, match=what):
        TileConfig((128, 128), warps=8, stages=2, family="wgmma")
    with pytest.raises(SpecError, match=what):
        AttentionSpec(arch="sm_90", head_dim=128, family="wgmma")
    saved = AttentionSpec(arch="sm_90", head_dim=128, config=WS).to_json()
    with pytest.raises(SpecError, match=what):
        AttentionSpec.from_json(saved.replace('"wgmma_ws"', '"wgmma"'))
    with pytest.raises(SpecError, match=what):
        family("wgmma")


@pytest.mark.parametrize("bad, what", [
    ({"arch": "sm_89"}, "does not run on sm_89"),
    ({"split_kv": True}, "split_kv"),
    ({"kv_fp8": True}, "kv_fp8"),
    ({"config": WS.replace(tile=(64, 128))}, "64 rows per warpgroup"),
    ({"config": WS.replace(tile=(128, 32))}, "tile_n=32"),
    ({"config": WS.replace(stages=1)}, "stages=1"),
])
def test_what_the_family_does_not_build_is_refused(bad, what):
    with pytest.raises(SpecError, match=what):
        AttentionSpec(**{"arch": "sm_90", "head_dim": 128, "config": WS, **bad})


def test_the_spec_counts_the_producer_warpgroup():
    spec = AttentionSpec(arch="sm_90", head_dim=128, config=WS)
    assert spec.threads == 384 and spec.family == "wgmma_ws"
    assert spec.name.endswith("_m128n128_w8_s2_wgmma_ws")
    assert spec.smem_bytes == 1024 + 32 * 1024 + 2 * 2 * 32 * 1024
    one = AttentionSpec(arch="sm_90", head_dim=64, config=WS.replace(tile=(64, 64), warps=4))
    assert one.threads == 256
    with pytest.raises(SpecError, match="split_kv"):
        AttentionSpec(arch="sm_90", head_dim=128, config=WS, split_kv=True)
    with pytest.raises(SpecError, match="shared memory"):
        AttentionSpec(arch="sm_90", head_dim=128, config=WS.replace(stages=4))
    params = params_for(AttentionSpec(arch="sm_90", head_dim=128, config=WS,
                                                return_lse=True))
    assert [p.name for p in params] == ["q_tma", "q_extents", "k_tma", "k_extents", "v_tma",
                                        "v_extents", "o", "lse", "scale_log2", "q_group"]
    assert params[0] == TensorMapParam("q_tma", "q", 128) and params[1] == CoordParam("q_extents")


def test_masks_and_serving_layouts_are_built():
    """Bottom-right alignment, windows and soft-capping are specs of the family (FP8 with its
    masks), their run-time sizes after ``q_group`` in the ABI; a packed batch (``varlen``)
    takes its two offset tables last, a paged cache its block table and lengths, with its
    page size compiled in as whole key blocks or whole TMA boxes of a block (16 rows or more);
    soft-capping beside a mask where P goes through shared memory, other page sizes, FP8
    serving layouts and split keys are refused."""
    spec = AttentionSpec(arch="sm_90", head_dim=128, causal=True, mask_align="bottom_right",
                         window=True, softcap=True, return_lse=True, config=WS)
    assert spec.name.endswith("_wgmma_ws_causal_lse_br_window_softcap")
    names = [p.name for p in params_for(spec)]
    assert names[-6:] == ["scale_log2", "q_group", "window_left", "window_right", "softcap_in",
                          "softcap_out"]
    fp8 = spec.replace(softcap=False, precision="fp8")
    assert [p.name for p in params_for(fp8)][-4:] == ["scale_log2", "q_group",
                                                               "window_left", "window_right"]
    assert [p.name for p in params_for(spec.replace(window=False))][-3:] == [
        "q_group", "softcap_in", "softcap_out"]
    shared = WS.replace(tile=(192, 128), warps=12)
    AttentionSpec(arch="sm_90", head_dim=128, softcap=True, config=shared)
    AttentionSpec(arch="sm_90", head_dim=64, causal=True, softcap=True, config=shared)
    for masks in ({"causal": True}, {"window": True}):
        with pytest.raises(SpecError, match="softcap=True beside a causal mask or a window"):
            AttentionSpec(arch="sm_90", head_dim=128, softcap=True, config=shared, **masks)
    with pytest.raises(SpecError, match="split_kv"):
        spec.replace(split_kv=True)
    packed = spec.replace(varlen=True)
    assert packed.name.endswith("_softcap_varlen")
    assert [p.name for p in params_for(packed)][-2:] == ["cu_seqlens_q", "cu_seqlens_k"]
    with pytest.raises(SpecError, match="precision='fp8' is for dense tensors"):
        fp8.replace(varlen=True)
    paged = spec.replace(paged_kv=True, page_size=256)
    assert paged.name.endswith("_softcap_paged256")
    assert [p.name for p in params_for(paged)][-2:] == ["block_table", "seqlens_k"]
    assert [p.name for p in params_for(paged.replace(varlen=True))][-3:] == [
        "cu_seqlens_q", "block_table", "seqlens_k"]
    ws = family("wgmma_ws")
    for page_size in (128, 256, 16, 32, 64):  # whole blocks, or whole boxes of 16+ rows
        assert ws.copies_whole_pages(paged, page_size)
        small = spec.replace(paged_kv=True, page_size=page_size)
        box = min(page_size, 128)  # K's and V's TMA boxes: a page's rows where it is smaller
        assert [(p.name, p.box_rows) for p in params_for(small) if isinstance(p, TensorMapParam)
                ] == [("q_tma", 128), ("k_tma", box), ("v_tma", box)]
    for page_size in (0, 8, 24, 48, 192):  # 0: any size, gathered; 8: too small a box
        assert not ws.copies_whole_pages(paged, page_size)
        with pytest.raises(SpecError, match="page size compiled in, a multiple of tile_n=128"):
            spec.replace(paged_kv=True, page_size=page_size)
    spec.replace(paged_kv=True, page_size=64, config=WS.replace(tile=(128, 64)))
    spec.replace(paged_kv=True, page_size=48, config=WS.replace(tile=(128, 144)))
    with pytest.raises(SpecError, match="precision='fp8' is for dense tensors"):
        fp8.replace(paged_kv=True, page_size=128)
    with pytest.raises(SpecError, match="kv_fp8"):
        paged.replace(kv_fp8=True)


def test_fp8_specs_describe_byte_tiles_and_a_transposed_v():
    """FP8 operands: e4m3 boxes as wide as a row's swizzle span (128 bytes, or 64 for rows of
    64 elements), Vᵀ walked as head_dim rows of keys, the descales after O; a separate 16-bit
    output tile in the shared-memory budget."""
    spec = AttentionSpec(arch="sm_90", head_dim=64, precision="fp8",
                         config=WS.replace(tile=(128, 64)))
    params = params_for(spec)
    assert [p.name for p in params] == ["q_tma", "q_extents", "k_tma", "k_extents", "vt_tma",
                                        "vt_extents", "o", "q_descale", "k_descale",
                                        "v_descale", "scale_log2", "q_group"]
    q, k, vt = params[0], params[2], params[4]
    assert (q.box_rows, q.box_cols, q.swizzle, q.dtype) == (128, 64, 64, "float8_e4m3fn")
    assert (k.box_rows, k.box_cols, k.swizzle, k.transposed) == (64, 64, 64, False)
    assert (vt.box_rows, vt.box_cols, vt.swizzle, vt.transposed) == (64, 64, 64, True)
    d128 = params_for(spec.replace(head_dim=128, config=WS))
    assert (d128[0].box_cols, d128[0].swizzle) == (128, 128)
    assert (d128[4].box_rows, d128[4].box_cols, d128[4].swizzle) == (128, 128, 128)
    # mbarriers, e4m3 Q, two stages of e4m3 K and Vᵀ, the fp16 output tile
    assert spec.smem_bytes == 1024 + 8 * 1024 + 2 * 2 * 4 * 1024 + 16 * 1024
    # causal: the row sums' ones too (8 x 64 e4m3, aligned to 1 KB)
    assert spec.replace(causal=True).smem_bytes == spec.smem_bytes + 1024


# masks as data on the tuned Hopper tiles: bottom-right causal (chunked prefill), windows, and
# soft-capping, alone and together; FP8 with its masks (it has no soft-cap)
MASK_SPECS = [
    AttentionSpec(arch="sm_90", head_dim=128, causal=True, mask_align="bottom_right",
                  return_lse=True, config=WS),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=64, causal=True, window=True,
                  mask_align="bottom_right", softcap=True, config=WS.replace(stages=4)),
    AttentionSpec(arch="sm_90", head_dim=64, window=True, softcap=True,
                  config=WS.replace(tile=(192, 128), warps=12, stages=3)),
    # P through shared memory: soft-capping alone (with a mask it spills, and is refused)
    AttentionSpec(arch="sm_90", head_dim=128, softcap=True,
                  config=WS.replace(tile=(192, 128), warps=12)),
    AttentionSpec(arch="sm_90", head_dim=128, causal=True, window=True, softcap=True,
                  return_lse=True, config=WS.replace(tile=(192, 64), warps=12)),
    AttentionSpec(arch="sm_90", head_dim=128, window=True, mask_align="bottom_right",
                  return_lse=True, config=WS.replace(tile=(64, 64), warps=4)),
    AttentionSpec(arch="sm_90", head_dim=128, causal=True, window=True, return_lse=True,
                  mask_align="bottom_right", precision="fp8", config=WS),
    AttentionSpec(arch="sm_90", head_dim=64, causal=True, window=True, precision="fp8",
                  k_scale="head", config=WS.replace(tile=(192, 128), warps=12)),
]

# pages smaller than a key block: a TMA box from each page a block spans
SMALL_PAGE_SPECS = [
    AttentionSpec(arch="sm_90", head_dim=128, paged_kv=True, page_size=16, causal=True,
                  mask_align="bottom_right", return_lse=True, config=WS),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=64, varlen=True, paged_kv=True,
                  page_size=64, causal=True, mask_align="bottom_right", window=True,
                  softcap=True, return_lse=True, config=WS),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=64, varlen=True, paged_kv=True,
                  page_size=32, causal=True, mask_align="bottom_right", window=True,
                  config=WS.replace(tile=(192, 128), warps=12)),
]
WS_SPECS = [
    AttentionSpec(arch="sm_90", head_dim=128, config=WS),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=64, causal=True, return_lse=True,
                  config=WS.replace(tile=(128, 64), stages=3)),
    AttentionSpec(arch="sm_90", head_dim=128, causal=True,
                  config=WS.replace(tile=(64, 64), warps=4)),
    # three consumer warpgroups (160 registers each after setmaxnreg)
    AttentionSpec(arch="sm_90", head_dim=64, config=WS.replace(tile=(192, 128), warps=12)),
    AttentionSpec(arch="sm_90", head_dim=128, causal=True,
                  config=WS.replace(tile=(192, 64), warps=12)),
    # three consumers at d128: P through shared memory (the fp16 d128 long winner)
    AttentionSpec(arch="sm_90", head_dim=128, config=WS.replace(tile=(192, 128), warps=12)),
    # causal 192-row tiles meet the diagonal in two 128-key steps (it spilled 352 B when those
    # steps had a loop of their own)
    AttentionSpec(arch="sm_90", head_dim=64, causal=True,
                  config=WS.replace(tile=(192, 128), warps=12)),
    # FP8 operands: e4m3 wgmma; 128-byte rows, and 64-byte ones (d64 Q/K, 64-key Vᵀ tiles)
    AttentionSpec(arch="sm_90", head_dim=128, causal=True, return_lse=True, precision="fp8",
                  config=WS),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=64, precision="fp8",
                  config=WS.replace(tile=(128, 64), stages=3)),
    # K descaled per head: folded into the rows' exp2 scales
    AttentionSpec(arch="sm_90", head_dim=128, causal=True, return_lse=True, precision="fp8",
                  k_scale="head", config=WS),
    AttentionSpec(arch="sm_90", head_dim=64, precision="fp8", k_scale="head",
                  config=WS.replace(tile=(192, 128), warps=12)),
    AttentionSpec(arch="sm_90", head_dim=64, causal=True, precision="fp8", k_scale="head",
                  config=WS.replace(tile=(192, 128), warps=12)),  # the d64 causal winner
    # three consumers at d128: P through shared memory
    AttentionSpec(arch="sm_90", head_dim=128, precision="fp8", k_scale="head",
                  config=WS.replace(tile=(192, 128), warps=12, stages=4)),
    AttentionSpec(arch="sm_90", head_dim=128, causal=True, precision="fp8", k_scale="head",
                  config=WS.replace(tile=(192, 64), warps=12, stages=3)),  # P in registers
    # the other head dims: rows of 64, 160, 192 and 512 bytes (swizzles of 64, 32, 64, 128)
    AttentionSpec(arch="sm_90", head_dim=32, config=WS),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=80, causal=True, return_lse=True,
                  config=WS.replace(tile=(192, 128), warps=12)),  # P through shared memory
    AttentionSpec(arch="sm_90", head_dim=96, causal=True, mask_align="bottom_right",
                  window=True, softcap=True, return_lse=True, config=WS),
    AttentionSpec(arch="sm_90", head_dim=96, config=WS.replace(tile=(192, 128), warps=12)),
    AttentionSpec(arch="sm_90", head_dim=256, causal=True, return_lse=True,
                  config=WS.replace(tile=(128, 64))),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=256, window=True, softcap=True,
                  config=WS.replace(tile=(64, 64), warps=4)),
    # key blocks other than 64 and 128 keys: d256's 80 (shared memory full), d128's 176,
    # three consumers of 192 (d64) and 144 (d96) with P through shared memory
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=256, causal=True,
                  mask_align="bottom_right", return_lse=True, config=WS.replace(tile=(128, 80))),
    AttentionSpec(arch="sm_90", head_dim=128, config=WS.replace(tile=(128, 176))),
    AttentionSpec(arch="sm_90", head_dim=64, causal=True,
                  config=WS.replace(tile=(192, 192), warps=12)),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=96, window=True, return_lse=True,
                  config=WS.replace(tile=(192, 144), warps=12)),
    # packed batches: each sequence's rows through TMA coordinates offset to its start
    AttentionSpec(arch="sm_90", head_dim=128, varlen=True, causal=True,
                  mask_align="bottom_right", return_lse=True, config=WS),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=64, varlen=True, window=True,
                  softcap=True, config=WS.replace(tile=(192, 128), warps=12)),
    # a paged cache: each key block one page's rows at its offset, by TMA
    AttentionSpec(arch="sm_90", head_dim=128, paged_kv=True, page_size=128, causal=True,
                  mask_align="bottom_right", return_lse=True, config=WS),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=64, varlen=True, paged_kv=True,
                  page_size=256, window=True, softcap=True,
                  config=WS.replace(tile=(192, 128), warps=12)),
    *SMALL_PAGE_SPECS,
    *MASK_SPECS,
]


@pytest.fixture(scope="module")
def ws_artifacts(tmp_path_factory):
    return compiled_in_fresh_cache(WS_SPECS, tmp_path_factory)


@pytest.mark.parametrize("spec", SMALL_PAGE_SPECS, ids=lambda s: s.name)
def test_pages_smaller_than_a_block_are_loaded_a_box_a_page(ws_artifacts, spec):
    """K and V of a key block are a TMA box for each of its pages and 128-byte column span,
    the pages dealt to the producer warpgroup's four warps (each warp's code: at least its
    share of copies besides Q's one a span, however the loop is unrolled), each of its
    pages' block-table entries read from global memory; those producers keep 24 registers
    beside two consumers (32 would leave them less than 240) and 32 beside three."""
    from flashcore.kernels.wgmma_ws.layouts import producer_regs

    art, c = ws_artifacts[spec], spec.config
    body = art.ptx[art.ptx.index(".entry"):]
    spans, turns = spec.head_dim // 64, -(-(c.tile_n // spec.page_size) // 4)
    assert len(re.findall(r"cp\.async\.bulk\.tensor", body)) - spans >= 2 * turns * spans
    assert len(re.findall(r"ld\.global", body)) >= turns
    regs = producer_regs(c.warps // 4, True)
    assert regs == (24 if c.warps == 8 else 32)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{regs};", body)


@pytest.mark.parametrize("spec", WS_SPECS, ids=lambda s: s.name)
def test_ws_kernels_load_with_tma_and_compute_with_wgmma(ws_artifacts, spec):
    from flashcore.kernels.wgmma_ws.layouts import consumer_regs, producer_regs, register_pool
    from flashcore.kernels.wgmma_ws.turns import takes_turns
    from flashcore.specs.families import WgmmaWs

    art = ws_artifacts[spec]
    assert len(art.params) == len(params_for(spec))  # checked against the .entry
    assert art.block == (spec.threads, 1, 1) and art.smem_dynamic == spec.smem_bytes
    assert spec.smem_bytes <= 227 * 1024
    assert_no_spills_in_loops(art, spec.name)
    body = art.ptx[art.ptx.index(".entry"):]
    for needle in ("cp.async.bulk.tensor", "mbarrier.try_wait", "setmaxnreg.inc",
                   "setmaxnreg.dec", "wgmma.mma_async", "prefetch.tensormap"):
        assert needle in body, needle
    consumers = spec.config.warps // 4
    producer = producer_regs(consumers, WgmmaWs.key_box_rows(spec) < spec.config.tile_n)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{consumer_regs(consumers)};", body)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{producer};", body)
    # within the CTA's register pool, what setmaxnreg moves registers within (a consumer
    # asking for more than there is waits forever)
    assert (128 * producer + 128 * consumers * consumer_regs(consumers)
            <= register_pool(consumers))
    assert "cp.async.cg" not in body and "mma.sync" not in body
    fp8 = spec.precision == "fp8"
    sixteen = re.search(r"wgmma\.mma_async\S*\.f32\.b?f16\.b?f16", body) is not None
    assert (re.search(r"wgmma\.mma_async\S*\.f32\.e4m3\.e4m3", body) is not None) == fp8
    assert sixteen != fp8
    # the CTA barrier once after the mbarriers' init; else named barriers of consumer threads
    # only: a warpgroup's own in the epilogue (128), turns between two (256) with ping-pong,
    # and a paged cache's: every consumer's, once the first block's V rows past the keys are 0
    bars = re.findall(r"bar\.(sync|arrive)\s+([^,;]+)(?:,\s*(\d+))?;", body)
    assert bars.count(("sync", "0", "")) == 1
    if spec.paged_kv:
        all_consumers = ("sync", "7", str(spec.config.warps * 32))
        assert bars.count(all_consumers) == 1
        bars.remove(all_consumers)
    counts = {n for kind, _, n in bars if n}
    turns = takes_turns(consumers, spec.config.tile_n)
    assert counts == ({"128", "256"} if turns else {"128"})
    assert any(kind == "arrive" for kind, _, _ in bars) == turns
    text = sass(art.cubin)
    if text is not None:
        ops = [op.split(".")[0] for op in sass_opcodes(text)]
        assert "UTMALDG" in ops and "HMMA" not in ops
        assert ("QGMMA" in ops) == fp8 and ("HGMMA" in ops) != fp8


@pytest.mark.parametrize("spec", MASK_SPECS, ids=lambda s: s.name)
def test_mask_kernels_read_their_sizes_and_cap_in_full_precision(ws_artifacts, spec):
    """Each mask's run-time parameters are read (a window's sizes by the producer's key range
    and the consumers' masks alike; a causal window's right side is 0, never read),
    soft-capping is the full-precision tanh (one more exp2 a score than the softmax's), and
    the masked kernels stay within the register budget of their top-left twins (no spill in
    any loop: ``test_ws_kernels_load_with_tma...``)."""
    art = ws_artifacts[spec]
    body = art.ptx[art.ptx.index(".entry"):]
    params = params_for(spec)
    read = {"window_left", "softcap_in", "softcap_out"}
    if not spec.causal:
        read.add("window_right")
    for i, p in enumerate(params):
        loaded = re.search(rf"ld\.param\.\w+\s+%\w+,\s*\[\w+_param_{i}\]", body)
        if p.name in read:
            assert loaded, p.name
        elif p.name == "window_right":
            assert not loaded
    assert "tanh.approx" not in body
    if spec.softcap:
        scores = spec.config.tile_m * spec.config.tile_n // spec.config.threads
        assert body.count("ex2.approx") >= 2 * 2 * scores  # step 0 and the loop's step
    assert art.resources.registers <= 168


@pytest.mark.parametrize("spec", WS_SPECS, ids=lambda s: s.name)
def test_each_walk_of_the_keys_has_one_copy_of_the_step(ws_artifacts, spec):
    """Step 0's Q·Kᵀ, one loop of overlapped steps whose first ones mask at run time, the last
    P·V: the wgmma of two steps a walk (a loop of masked steps beside one of unmasked ones was a
    second copy of the step, and spilled the 192-row causal tiles). FP8 with K per head walks
    in either softmax form; FP8's P·V group sums P's rows too (P times ones)."""
    from flashcore.specs.families import WgmmaWs

    k = 32 if spec.precision == "fp8" else 16  # an MMA's K: e4m3 k32, 16-bit k16
    sums = WgmmaWs.sums_by_mma(spec)
    assert sums == (spec.precision == "fp8" and (spec.head_dim == 128 or spec.causal))
    # Q·Kᵀ, then P·V (and P·ones)
    step = spec.head_dim // k + (2 if sums else 1) * spec.config.tile_n // k
    walks = 2 if spec.precision == "fp8" and spec.k_scale == "head" else 1
    body = ws_artifacts[spec].ptx
    assert len(re.findall(r"wgmma\.mma_async", body[body.index(".entry"):])) == walks * 2 * step


@pytest.mark.parametrize("spec", WS_SPECS, ids=lambda s: s.name)
def test_the_wait_for_p_v_comes_after_the_row_max(ws_artifacts, spec):
    """In each overlapped step the wait for the previous block's P·V (``wait_group(0)``) comes
    after the row max of the block's scores, so the max overlaps P·V. ptxas hoists that wait as
    far as it may; with K's stage released before the softmax it went to the top of the block
    after a masking branch (bottom-right, windows: two FMNMX before it, 13.6% of the chunked
    prefill's stall samples there and 1.04x its time)."""
    text = sass(ws_artifacts[spec].cubin)
    if text is None:
        pytest.skip("nvdisasm is not installed")
    # a thread holds a quarter of each of its rows' scores: one row's max is tile_n/4 - 1 FMNMX
    need = spec.config.tile_n // 4 - 1
    gaps, counting, fmnmx = [], False, 0
    for line in text.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            counting, fmnmx = True, 0
        elif counting and "FMNMX" in line:
            fmnmx += 1
        elif counting and "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            gaps.append(fmnmx)
            counting = False
    assert gaps and min(gaps) >= need, (gaps, need)


@pytest.mark.parametrize("spec", WS_SPECS, ids=lambda s: s.name)
def test_fp8_row_sums_come_from_the_tensor_cores_and_no_wgmma_is_serialised(ws_artifacts, spec):
    """FP8's row sums are an n8 wgmma of P and a tile of ones in the P·V group (16-bit kernels
    and FP8 d64 ones without a mask keep their FADDs); and ptxas serialises no kernel's wgmma
    (C7511: an accumulator register that one walk of the keys left dead did it to every FP8
    kernel, 1.27-1.30x their time)."""
    from flashcore.compiler.cubin_info import ptxas_stats
    from flashcore.specs.families import WgmmaWs

    art = ws_artifacts[spec]
    body = art.ptx[art.ptx.index(".entry"):]
    narrow = re.findall(r"wgmma\.mma_async\S*\.m64n8k(\d+)", body)
    if WgmmaWs.sums_by_mma(spec):
        walks = 2 if spec.k_scale == "head" else 1
        assert narrow == ["32"] * (walks * 2 * spec.config.tile_n // 32)
    else:
        assert narrow == []
    stats = ptxas_stats(art.ptx, "sm_90a", art.entry)
    if stats is None:
        pytest.skip("ptxas is not installed")
    assert stats.performance_losses == (), stats.performance_losses


def _key_loops(text: str) -> list[list[tuple[str, str]]]:
    """The innermost loops with warpgroup MMAs and exponentials (the key loops), each as its
    (opcode, operands) list."""
    from flashcore.compiler.inspect import loop_bodies

    lines = text.splitlines()
    instr = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
    spans = []
    for first, last in loop_bodies(text):
        body = [m.groups() for ln in lines[first:last + 1] if (m := instr.match(ln))]
        ops = [op for op, _ in body]
        if any(op.startswith(("QGMMA", "HGMMA")) for op in ops) and "MUFU.EX2" in ops:
            spans.append((first, last, body))
    return [body for first, last, body in spans
            if not any(f >= first and la <= last and (f, la) != (first, last)
                       for f, la, _ in spans)]


def _load_to_use(text: str) -> list[int]:
    """In the key loop (the smallest one): each global load's distance, in instructions, to
    the first one that reads its register, going round the loop."""
    loops = _key_loops(text)
    assert loops, "no key loop found"
    body = min(loops, key=len)
    dists = []
    for i, (op, args) in enumerate(body):
        if not op.startswith("LDG"):
            continue
        reg = args.split(",")[0].strip()
        for k in range(1, len(body) + 1):
            operands = [a.strip() for a in body[(i + k) % len(body)][1].split(",")]
            if any(re.fullmatch(rf"-?\|?{reg}\|?(\.\w+)?", a) for a in operands[1:]):
                dists.append(k)
                break
    return dists


@pytest.mark.parametrize("spec", [s for s in WS_SPECS if s.precision == "fp8"
                                  and s.k_scale == "token"], ids=lambda s: s.name)
def test_fp8_key_descales_are_loaded_a_block_ahead(ws_artifacts, spec):
    """A global load takes longer than an e4m3 Q·Kᵀ: the key loop loads the next block's
    descales while this block's softmax runs (a load issued beside the Q·Kᵀ stalls the
    kernel at its first use)."""
    text = sass(ws_artifacts[spec].cubin)
    if text is None:
        pytest.skip("nvdisasm is not installed")
    dists = _load_to_use(text)
    assert len(dists) >= spec.config.tile_n // 4, dists  # one per key this thread scales
    assert min(dists) >= 200, sorted(dists)[:8]


def test_tma_geometry_walks_head_dim_seq_heads_batch():
    from flashcore.runtime.tensor_map import tma_geometry

    # (B, H, S, D) = (2, 8, 1000, 128) contiguous fp16: strides in elements 8*1000*128, ...
    arg = (0x10000, 2, 8, 1000, 8 * 1000 * 128, 1000 * 128, 128)
    dims, strides = tma_geometry(arg, 128, 2)
    assert dims == [128, 1000, 8, 2] and strides == [256, 256 * 1000, 256 * 1000 * 8]
    # a batch of one: its stride is never used, any legal one is written
    dims, strides = tma_geometry((0x10000, 1, 8, 1000, 7, 1000 * 128, 128), 128, 2)
    assert strides[2] % 16 == 0 and strides[2] > 0
    with pytest.raises(LaunchError, match="16-byte"):
        tma_geometry((0x10008, 2, 8, 1000, 8 * 1000 * 128, 1000 * 128, 128), 128, 2)
    with pytest.raises(LaunchError, match="16-byte"):
        tma_geometry((0x10000, 2, 8, 1000, 8 * 1000 * 68, 1000 * 68, 68), 64, 2)


def test_encode_asks_the_driver_for_the_kernels_box_and_caches(monkeypatch):
    from flashcore.runtime import tensor_map

    real_encode, calls = tensor_map.cu.cuTensorMapEncodeTiled, []

    class FakeMap:  # the binding hands back cuuint64_t words, not ints
        opaque = [tensor_map.cu.cuuint64_t(1 << 21 | 7)] * 16

    def fake_encode(*args):
        # the binding converts the arguments before it looks for a driver: a TypeError here
        # is the call's fault; anything else is this host's (no driver, no such pointer)
        with contextlib.suppress(RuntimeError, OSError, ImportError):
            real_encode(*args)
        calls.append(args)
        return (tensor_map.cu.CUresult.CUDA_SUCCESS, FakeMap())

    monkeypatch.setattr(tensor_map.cu, "cuTensorMapEncodeTiled", fake_encode)
    monkeypatch.setattr(tensor_map, "_driver_version", [13000])
    tensor_map.clear()
    arg = (0x20000, 1, 2, 64, 2 * 64 * 64, 64 * 64, 64)  # a small tensor: 16 KiB
    desc = tensor_map.encode(arg, "bfloat16", 64, 128)
    assert tensor_map.encode(arg, "bfloat16", 64, 128) is desc and len(calls) == 1
    dtype, rank, ptr, *lists = calls[0]
    dims, strides, box, elem = ([int(x) for x in xs] for xs in lists[:4])
    assert strides == [128, 8192, 16384]  # the batch of one gets a legal stride
    assert int(rank) == 4 and ptr == 0x20000 and dims == [64, 64, 2, 1]
    assert box == [64, 128, 1, 1] and elem == [1, 1, 1, 1] and "BFLOAT16" in str(dtype)
    words = struct.unpack("<16Q", desc)
    assert words[1] == 7 and words[0] == 1 << 21 | 7  # bit 21 of word 1 cleared (< 128 KiB)
    # FP8 Vᵀ (B, H, D, keys) = (1, 2, 64, 256) e4m3: keys innermost, 64-byte boxes and swizzle
    from flashcore.ops import launcher

    class FakeKernel:
        tensor_maps = (TensorMapParam("vt_tma", "vt", 64, 64, "float8_e4m3fn", 64, True),)

        def __init__(self):
            self.tma_args_memo = {}

    vt = (0x40000, 1, 2, 256, 2 * 64 * 256, 64 * 256, 256)  # ops.inputs.transposed_arg
    (desc,), extents = launcher.tma_args(FakeKernel(), (vt,), "float16", 64)
    assert extents == (256, 2, 1) and len(desc) == 128
    dtype, rank, ptr, *lists = calls[-1]
    dims, strides, box = ([int(x) for x in xs] for xs in lists[:3])
    assert dims == [256, 64, 2, 1] and strides[:2] == [256, 64 * 256] and box == [64, 64, 1, 1]
    assert "UINT8" in str(dtype) and "SWIZZLE_64B" in str(calls[-1][-3])
    # each swizzle a head dim's rows can take (d80's 160-byte rows: 32) is a driver mode
    tensor_map.clear()
    for span in (32, 64, 128):
        tensor_map.encode(arg, "bfloat16", 64, 128, span // 2, span)
        assert calls[-1][-3].name == f"CU_TENSOR_MAP_SWIZZLE_{span}B"


@pytest.mark.parametrize("address_word", [lambda p: p, lambda p: p >> 4, lambda p: p | 1 << 60])
def test_new_pointers_of_a_geometry_are_written_into_its_descriptor(monkeypatch, address_word):
    """Fresh tensors of one geometry: the driver encodes the first two; where those differ
    only in a first word that is their pointer, later pointers are written there (the same
    bytes the driver gives); any other layout keeps the driver encoding each pointer."""
    from flashcore.runtime import tensor_map

    calls = []

    def fake_encode(dtype, rank, ptr, dims, strides, box, *rest):
        calls.append(ptr)
        words = [address_word(ptr), 7, *(int(d) for d in dims), *(int(b) for b in box)]
        words += [0] * (16 - len(words))
        opaque = [tensor_map.cu.cuuint64_t(w) for w in words]
        return (tensor_map.cu.CUresult.CUDA_SUCCESS, type("Map", (), {"opaque": opaque}))

    monkeypatch.setattr(tensor_map.cu, "cuTensorMapEncodeTiled", fake_encode)
    monkeypatch.setattr(tensor_map, "_driver_version", [13020])
    tensor_map.clear()
    geometry = (1, 2, 64, 2 * 64 * 64, 64 * 64, 64)
    pointers = [0x20000 + 0x100000 * i for i in range(6)]
    descs = [tensor_map.encode((p, *geometry), "bfloat16", 64, 128) for p in pointers]
    plain = address_word(12345) == 12345
    assert calls == (pointers[:2] if plain else pointers)
    for p, desc in zip(pointers, descs):
        assert struct.unpack("<16Q", desc)[:4] == (address_word(p), 7, 64, 64)
    # another geometry (more keys) is learnt apart
    tensor_map.encode((pointers[0], 1, 2, 96, 2 * 64 * 96, 64 * 96, 64), "bfloat16", 64, 128)
    assert calls[-1] == pointers[0]
    if plain:
        with pytest.raises(LaunchError, match="16-byte"):
            tensor_map.encode((0x20008, *geometry), "bfloat16", 64, 128)
    tensor_map.clear()


@pytest.mark.parametrize("spec", WS_SPECS, ids=lambda s: s.name)
def test_every_tensor_map_a_spec_declares_has_a_driver_swizzle(spec):
    from flashcore.runtime import tensor_map

    maps = [p for p in params_for(spec) if isinstance(p, TensorMapParam)]
    assert maps and all(p.swizzle in tensor_map._SWIZZLES for p in maps)


def test_tma_arguments_are_built_once_per_kernel_and_buffers(monkeypatch):
    """An eager loop over the same buffers looks its three descriptors up once a call, not three
    times (three look-ups a call cost a short eager call microseconds of host time); other
    buffers, or another dtype, get their own; the memo stays bounded."""
    from flashcore.ops import launcher
    from flashcore.runtime import tensor_map

    encoded = []

    def fake_encode(rows, dtype, inner, box_rows, box_cols, swizzle):
        encoded.append((rows[0], dtype))
        return bytes([len(encoded)]) * 128

    monkeypatch.setattr(tensor_map, "encode", fake_encode)

    class FakeKernel:
        tensor_maps = (TensorMapParam("q_tma", "q", 64), TensorMapParam("k_tma", "k", 64),
                       TensorMapParam("v_tma", "v", 64))

        def __init__(self):
            self.tma_args_memo = {}

    def qkv(base):
        return tuple((base + i * 0x100000, 1, 8, 512, 8 * 512 * 64, 512 * 64, 64)
                     for i in range(3))

    kern = FakeKernel()
    first = launcher.tma_args(kern, qkv(0x10000), "float16", 64)
    assert len(encoded) == 3 and [e[0] for e in encoded] == [a[0] for a in qkv(0x10000)]
    assert launcher.tma_args(kern, qkv(0x10000), "float16", 64) is first and len(encoded) == 3
    other = launcher.tma_args(kern, qkv(0x90000), "float16", 64)
    assert len(encoded) == 6 and other[0] != first[0]
    launcher.tma_args(kern, qkv(0x10000), "bfloat16", 64)
    assert len(encoded) == 9 and encoded[-1][1] == "bfloat16"
    again = launcher.tma_args(FakeKernel(), qkv(0x10000), "float16", 64)  # its own memo
    assert len(encoded) == 12 and again[1::2] == first[1::2]
    for i in range(launcher._TMA_MEMO_SIZE + 5):
        launcher.tma_args(kern, qkv(0x1000000 * (i + 1)), "float16", 64)
    assert len(kern.tma_args_memo) <= launcher._TMA_MEMO_SIZE


@pytest.mark.parametrize("spec", [s for s in WS_SPECS if s.k_scale == "head"],
                         ids=lambda s: s.name)
def test_fp8_per_head_key_descale_leaves_the_key_loop_without_loads(ws_artifacts, spec):
    """A per-head K descale is one (batch, heads) float32 parameter, folded into each row's
    exp2 scale before the loop: the key loop loads nothing from global memory and scales no
    score column (that scaling is what makes per-token K slower)."""
    params = {p.name: p for p in params_for(spec)}
    assert params["k_descale"].dynamic_shapes == 2 and params["q_descale"].dynamic_shapes == 3
    text = sass(ws_artifacts[spec].cubin)
    if text is None:
        pytest.skip("nvdisasm is not installed")
    assert _load_to_use(text) == []


@pytest.mark.parametrize("spec", [s for s in WS_SPECS if s.precision == "fp8"],
                         ids=lambda s: s.name)
def test_fp8_walks_keys_with_a_rounded_offset_where_k_is_descaled_per_head(ws_artifacts, spec):
    """K per head puts every scale of a row's scores in its exp2 scale, and e4m3 operands bound
    the scores: a warpgroup whose rows' |max * scale| stays under 2**16 (one
    ``bar.red.and.pred``) walks its keys with the offset rounded up (``mul.rp``, ``add.rp``),
    one FMA a score; the other loop subtracts the max exactly, one FADD a score more. K per
    token has no such bound: one exact loop."""
    body = ws_artifacts[spec].ptx
    head = spec.k_scale == "head"
    assert ("bar.red.and.pred" in body) == head and ("mul.rp.f32" in body) == head
    text = sass(ws_artifacts[spec].cubin)
    if text is None:
        pytest.skip("nvdisasm is not installed")
    # FADDs a key loop (unmasked or masked) spends on this thread's n scores of a block (64
    # rows x tile_n over 128 threads): the exact form one a score (s - max), the rounded form
    # none (the row sums are the tensor cores', ``WgmmaWs.sums_by_mma``: before, one FADD a
    # score more in each form)
    from flashcore.specs.families import WgmmaWs

    n = spec.config.tile_n // 2
    sums = 0 if WgmmaWs.sums_by_mma(spec) else n  # a FADD a score where the rows sum P
    fadds = [sum(op == "FADD" for op, _ in loop) for loop in _key_loops(text)]
    assert min(fadds) >= n + sums or head, fadds
    assert max(fadds) < 1.5 * n + sums, fadds
    if head:
        assert min(fadds) < 0.25 * n + sums and max(fadds) >= n + sums, fadds


def test_p_words_follow_the_key_permutation_of_v():
    """P's shared tile must hold p of key perm[x] at byte x of each 32 (V's rows are stored in
    that order). The e4m3 A operand's register a_v of k32 step kk holds key 32kk + perm[16h +
    4t + i] for v = i + 4r + 8h (``acc_as_fp8_operand_a``); word v // 4 goes to row half r at
    byte 16 * chunk + 4t: it must be byte 32kk + 16h + 4t + i of its row."""
    from flashcore.kernels.wgmma_ws.consumer import p_word_place

    for kk, v, t in itertools.product(range(128 // 32), range(16), range(4)):
        i, r, h = v % 4, v // 4 % 2, v // 8
        row_half, chunk = p_word_place(4 * kk + v // 4)
        assert row_half == r
        assert 16 * chunk + 4 * t + i == 32 * kk + 16 * h + 4 * t + i


def _p_operand_loops(art, spec, mma: str) -> tuple[bool, list]:
    """Whether P goes to P·V through its shared tile (``WgmmaWs.p_in_shared``: three consumers
    of 128-key steps at d80 to d128, of 144 at d96, of 192 at d64), checked against the key
    loops' ``mma`` instructions: S = Q·Kᵀ reads both operands through descriptors, P·V reads P
    from registers unless it is shared. Returns (shared, the key loops); skips where nvdisasm
    is missing."""
    from flashcore.specs.families import WgmmaWs

    shared = WgmmaWs.p_in_shared(spec)
    c, d = spec.config, spec.head_dim
    assert shared == (c.warps == 12 and (
        (80 <= d <= 128 and c.tile_n >= 128) or (d == 64 and c.tile_n > 128)))
    text = sass(art.cubin)
    if text is None:
        pytest.skip("nvdisasm is not installed")
    loops = _key_loops(text)
    assert loops
    for body in loops:
        mmas = [args for op, args in body if op.startswith(mma)]
        register_a = [a for a in mmas if re.search(r"R\d+, R\d+, gdesc", a)]
        assert (not register_a) == shared, mmas
    return shared, loops


@pytest.mark.parametrize("spec", [s for s in WS_SPECS if s.precision != "fp8"],
                         ids=lambda s: s.name)
def test_16bit_p_reaches_p_v_in_registers_or_through_its_shared_tile(ws_artifacts, spec):
    """Three consumers of 128-key steps at d128 (``WgmmaWs.p_in_shared``): the P·V HGMMAs read
    P through a descriptor, after a ``stmatrix`` x4 a 16 keys of a step and an async-proxy fence,
    with no spills; else P is the register A operand. The shared-memory budget counts P's
    16-bit tile."""
    from flashcore.specs.families import WgmmaWs

    art, c = ws_artifacts[spec], spec.config
    base = spec.replace(config=c.replace(tile=(128, c.tile_n), warps=8))  # P in registers
    p_tile = c.tile_m * c.tile_n * 2 if WgmmaWs.p_in_shared(spec) else 0
    assert spec.smem_bytes - (c.tile_m - 128) * spec.head_dim * 2 - base.smem_bytes == p_tile
    assert art.resources.spill_store_bytes == 0
    shared, loops = _p_operand_loops(art, spec, "HGMMA")
    for body in loops:
        stores = [op for op, _ in body if op.startswith("STSM")]
        assert len(stores) == (c.tile_n // 16 if shared else 0), stores  # x4: 16 keys each
    body = art.ptx[art.ptx.index(".entry"):]
    # (a paged cache's first V block is fenced after its rows past the keys are zeroed)
    assert ("fence.proxy.async.shared::cta" in body) == (shared or spec.paged_kv)


@pytest.mark.parametrize("spec", [s for s in WS_SPECS if s.precision == "fp8"],
                         ids=lambda s: s.name)
def test_fp8_p_reaches_p_v_in_registers_or_through_its_shared_tile(ws_artifacts, spec):
    """Three consumers at d128 (``WgmmaWs.p_in_shared``): the P·V QGMMAs read P through a
    descriptor, after 32-bit stores of its words (16 a key step) and an async-proxy fence; else
    P is the register A operand. The spec's shared-memory budget counts P's tile."""
    from flashcore.specs.families import WgmmaWs

    art = ws_artifacts[spec]
    shared, _ = _p_operand_loops(art, spec, "QGMMA")
    body = art.ptx[art.ptx.index(".entry"):]
    # the row sums' ones: each thread's words of the tile (8 e4m3 a key), one fence
    sums = WgmmaWs.sums_by_mma(spec)
    ones = -(-2 * spec.config.tile_n // spec.threads) if sums else 0
    # 16 words a key step: step 0 and the loop's step, in each softmax form
    words = len(re.findall(r"st\.shared\.b32", body)) - ones
    assert words % 16 == 0 and (words >= 48) == shared, words
    fences = body.count("fence.proxy.async.shared::cta") - sums  # P's, after the ones' one
    assert (fences > 0) == shared and fences >= 0, fences
