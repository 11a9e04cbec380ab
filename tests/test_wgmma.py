"""The Hopper family (``wgmma``) on the CPU: the spec selects it and checks what it builds, and
its kernels compile for sm_90a to warpgroup MMAs (wgmma in the PTX, HGMMA in the SASS) with no
spills, the shared memory the spec budgets and the attention ABI."""

from __future__ import annotations

import pytest

from flashcore.compiler.abi import attention_params
from flashcore.compiler.inspect import sass, sass_opcodes
from flashcore.errors import SpecError
from flashcore.specs import AttentionSpec, TileConfig, dsl_arch
from tests.kernels import assert_no_spills_in_loops, compiled_in_fresh_cache

HOPPER = TileConfig((128, 128), warps=8, stages=2, family="wgmma")


def test_the_config_or_the_spec_names_the_family():
    by_config = AttentionSpec(arch="sm_90", head_dim=128, config=HOPPER)
    by_spec = AttentionSpec(arch="sm_90", head_dim=128, family="wgmma",
                            config=HOPPER.replace(family=""))
    assert by_config == by_spec and by_config.family == "wgmma"
    assert by_config.name.endswith("_m128n128_w8_s2_wgmma") and dsl_arch(by_config) == "sm_90a"
    assert AttentionSpec.from_json(by_config.to_json()) == by_config
    default = AttentionSpec(arch="sm_90", head_dim=128, config=TileConfig((128, 128), warps=8))
    # the default family leaves no trace in the config: names and keys as before
    assert default.family == "mma_sync" and "family" not in default.to_dict()["config"]
    assert dsl_arch(default) == "sm_90" and not default.name.endswith("mma_sync")
    explicit = AttentionSpec(arch="sm_90", head_dim=128, config=TileConfig(
        (128, 128), warps=8, family="mma_sync"))
    assert explicit == default
    with pytest.raises(SpecError, match="disagree"):
        AttentionSpec(arch="sm_90", family="mma_sync", config=HOPPER)


@pytest.mark.parametrize("bad, what", [
    ({"arch": "sm_89"}, "does not run on sm_89"),
    ({"split_kv": True}, "split_kv"),
    ({"kv_fp8": True}, "kv_fp8"),
    ({"causal": True, "mask_align": "bottom_right"}, "mask_align"),
    ({"config": TileConfig((64, 128), warps=8, stages=2, family="wgmma")},
     "64 rows per warpgroup"),
    ({"config": TileConfig((128, 32), warps=8, stages=2, family="wgmma")}, "tile_n=32"),
    ({"config": TileConfig((128, 128), warps=8, stages=1, family="wgmma")}, "stages=1"),
])
def test_what_the_family_does_not_build_is_refused(bad, what):
    with pytest.raises(SpecError, match=what):
        AttentionSpec(**{"arch": "sm_90", "head_dim": 128, "config": HOPPER, **bad})


WGMMA_SPECS = [
    AttentionSpec(arch="sm_90", head_dim=64, config=HOPPER),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=128, causal=True, return_lse=True,
                  config=HOPPER),
    AttentionSpec(arch="sm_90", head_dim=128, causal=True,
                  config=TileConfig((64, 128), warps=4, stages=2, family="wgmma")),
    # three-stage rings: 224 KB of shared memory at d128, within sm_90's 227 KB
    AttentionSpec(arch="sm_90", head_dim=128, config=HOPPER.replace(stages=3)),
    AttentionSpec(arch="sm_90", head_dim=64, causal=True,
                  config=TileConfig((128, 64), warps=8, stages=3, family="wgmma")),
]


@pytest.fixture(scope="module")
def wgmma_artifacts(tmp_path_factory):
    return compiled_in_fresh_cache(WGMMA_SPECS, tmp_path_factory)


@pytest.mark.parametrize("spec", WGMMA_SPECS, ids=lambda s: s.name)
def test_wgmma_kernels_compile_to_warpgroup_mmas(wgmma_artifacts, spec):
    art = wgmma_artifacts[spec]
    assert len(art.params) == len(attention_params(spec))  # checked against the PTX .entry
    assert art.smem_dynamic == spec.smem_bytes <= 227 * 1024
    assert_no_spills_in_loops(art, spec.name)
    body = art.ptx[art.ptx.index(".entry"):]
    assert ".target sm_90a" in art.ptx
    c = spec.config
    # per key block: head_dim / 16 k-steps of Q·Kᵀ and tile_n / 16 of P·V; each written once
    # per masked (unrolled) step and once in the loop, P·V one step late (the last after it)
    per_block = spec.head_dim // 16 + c.tile_n // 16
    masked = -(-c.tile_m // c.tile_n) if spec.causal else 1
    assert body.count("wgmma.mma_async") == (masked + 1) * per_block
    assert "fence.proxy.async.shared::cta" in body and "wgmma.wait_group" in body
    assert "mma.sync" not in body  # no warp-level MMA left
    text = sass(art.cubin)
    if text is not None:
        ops = [op.split(".")[0] for op in sass_opcodes(text)]
        assert ops.count("HGMMA") == (masked + 1) * per_block and "HMMA" not in ops
