"""Specs as data: TileConfig, the family registry, AttentionSpec validation, JSON, names, hashes."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from flashcore.errors import SpecError
from flashcore.specs import (
    ARCHS,
    DTYPES,
    HEAD_DIMS,
    PRECISIONS,
    SMEM_PER_BLOCK,
    AttentionSpec,
    CombineSpec,
    QuantizeSpec,
    TileConfig,
    family,
    spec_from_dict,
)
from flashcore.specs import arch as arch_mod

MMA = family("mma_sync")
CONFIGS = [
    TileConfig((m, n), warps=w, stages=s, kv_splits=k)
    for (m, n), w, s, k in itertools.product(
        itertools.product(MMA.knobs["tile_m"], MMA.knobs["tile_n"]), MMA.knobs["warps"],
        MMA.knobs["stages"], MMA.knobs["kv_splits"])
]
CHOICES = {
    "arch": ARCHS,
    "dtype": DTYPES,
    "precision": PRECISIONS,
    "head_dim": HEAD_DIMS,
    "config": CONFIGS,
    "causal": (False, True),
    "return_lse": (False, True),
    "kv_fp8": (False, True),
    "split_kv": (False, True),
}


def _valid(fields) -> AttentionSpec | None:
    try:
        return AttentionSpec(**fields)
    except SpecError:
        return None


# a deterministic sample of the valid space (the whole product is ~100k specs)
SAMPLE = [s for s in (
    _valid(dict(zip(CHOICES, values)))
    for i, values in enumerate(itertools.product(*CHOICES.values())) if i % 7 == 0
) if s is not None]


# -- TileConfig --------------------------------------------------------------------------------
def test_tile_config_defaults_live_in_one_place():
    c = TileConfig()
    assert (c.tile, c.warps, c.stages, c.kv_splits) == ((64, 64), 4, 1, 1)
    assert TileConfig((128, 64)).warps == 8 and TileConfig((16, 64)).warps == 1
    assert TileConfig([32, 64]).tile == (32, 64)  # lists from JSON
    assert TileConfig.from_dict(c.to_dict()) == c and hash(TileConfig()) == hash(c)
    assert c.tag == "m64n64_w4_s1" and TileConfig((32, 64), kv_splits=2).tag.endswith("_k2")


@pytest.mark.parametrize("kwargs, match", [
    ({"tile": (64,)}, "tile must be a pair"),
    ({"tile": (64.0, 64)}, "tile must be a pair"),
    ({"tile": (True, 64)}, "tile must be a pair"),
    ({"tile": "64x64"}, "tile must be a pair"),
    ({"warps": "4"}, "warps must be an int"),
    ({"stages": None}, "stages must be an int"),
    ({"kv_splits": 0}, "kv_splits=0 must be at least 1"),
])
def test_tile_config_rejects(kwargs, match):
    with pytest.raises(SpecError, match=match):
        TileConfig(**kwargs)


# -- families ----------------------------------------------------------------------------------
def test_family_is_implied_by_arch_and_validates_its_knobs():
    s = AttentionSpec(arch="sm_90")
    assert s.family == "mma_sync"
    with pytest.raises(SpecError, match="unknown kernel family 'wgmma9'"):
        AttentionSpec(family="wgmma9")
    for knob, allowed in MMA.knobs.items():
        bad = max(allowed) * 2 if knob != "tile_n" else 16
        cfg = TileConfig(**({"tile": (bad, 64)} if knob == "tile_m" else
                            {"tile": (64, bad)} if knob == "tile_n" else {knob: bad}))
        with pytest.raises(SpecError, match=f"{knob}={bad} is not supported"):
            AttentionSpec(config=cfg)


# -- AttentionSpec -----------------------------------------------------------------------------
def test_default_is_valid():
    s = AttentionSpec()
    assert s.threads == 32 * s.warps and (s.tile_m, s.tile_n) == s.tile


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("op", "attention_bwd", "op='attention_bwd'"),
        ("arch", "sm_75", "arch='sm_75'"),
        ("arch", "sm90", "arch='sm90'"),
        ("dtype", "float32", "dtype='float32'"),
        ("precision", "int8", "precision='int8'"),
        ("head_dim", 48, "head_dim=48"),
        ("head_dim", 64.0, "head_dim must be an int"),
        ("head_dim", True, "head_dim must be an int"),
        ("config", (64, 64), "config must be a TileConfig"),
        ("causal", 1, "causal must be a bool"),
        ("return_lse", "yes", "return_lse must be a bool"),
        ("kv_fp8", 1, "kv_fp8 must be a bool"),
        ("split_kv", None, "split_kv must be a bool"),
        ("packed_tokens", 1, "packed_tokens must be a bool"),
    ],
)
def test_each_bad_field_rejected(field, value, match):
    with pytest.raises(SpecError, match=match):
        AttentionSpec(**{field: value})


def test_spec_error_is_a_value_error():
    with pytest.raises(ValueError):
        AttentionSpec(arch="sm_75")


def test_tile_m_must_cover_whole_warps():
    with pytest.raises(SpecError, match="multiple of 16 \\* warps = 64"):
        AttentionSpec(config=TileConfig((32, 64), warps=4))
    AttentionSpec(config=TileConfig((64, 64), warps=4))


def test_fp8_needs_fp8_arch():
    with pytest.raises(SpecError, match="precision='fp8'.*sm_80"):
        AttentionSpec(arch="sm_80", precision="fp8")
    with pytest.raises(SpecError, match="kv_fp8=True.*sm_80"):
        AttentionSpec(arch="sm_80", kv_fp8=True)
    with pytest.raises(SpecError, match="already reads e4m3"):
        AttentionSpec(arch="sm_89", precision="fp8", kv_fp8=True)


def test_k_scale_is_for_fp8_operands_and_named():
    per_head = AttentionSpec(arch="sm_89", precision="fp8", k_scale="head")
    per_token = AttentionSpec(arch="sm_89", precision="fp8")
    assert per_token.k_scale == "token" and per_head.name == per_token.name + "_khead"
    assert per_head.content_hash != per_token.content_hash
    assert AttentionSpec.from_json(per_head.to_json()) == per_head
    with pytest.raises(SpecError, match="k_scale='head' is for precision='fp8'"):
        AttentionSpec(arch="sm_89", k_scale="head")
    with pytest.raises(SpecError, match="k_scale='channel' is not supported"):
        AttentionSpec(arch="sm_89", precision="fp8", k_scale="channel")


def test_uneven_copy_split_rejected():
    # 32 keys of d64 e4m3 K are 128 16-byte copies: 256 threads cannot share them
    with pytest.raises(SpecError, match="K/V tile.*cannot share evenly"):
        AttentionSpec(arch="sm_89", precision="fp8", config=TileConfig((128, 32), warps=8))


def test_shared_memory_budget_names_the_knobs(monkeypatch):
    big = AttentionSpec(arch="sm_90", head_dim=128, config=TileConfig((128, 128), warps=8,
                                                                      stages=3))
    assert big.smem_bytes > SMEM_PER_BLOCK["sm_89"]
    with pytest.raises(SpecError, match=r"over sm_89's per-block budget.*stages=3.*kv_splits"):
        big.replace(arch="sm_89")
    monkeypatch.setitem(arch_mod.SMEM_PER_BLOCK, "sm_90", big.smem_bytes - 1)
    with pytest.raises(SpecError, match=f"needs {big.smem_bytes} bytes of shared memory"):
        big.replace()  # re-validates
    AttentionSpec(arch="sm_89", head_dim=64)  # small ones still fit


def test_every_valid_spec_within_its_budget():
    assert len(SAMPLE) > 1000
    for s in SAMPLE:
        assert 0 < s.smem_bytes <= SMEM_PER_BLOCK[s.arch]
        assert s.smem_bytes % 1024 == 0


def test_names_and_hashes_unique():
    names = [s.name for s in SAMPLE]
    hashes = [s.content_hash for s in SAMPLE]
    assert len(set(names)) == len(names) == len(set(SAMPLE))
    assert len(set(hashes)) == len(hashes)
    for s in SAMPLE:
        assert s.name.isidentifier() and s.name.startswith("fc_attn_fwd_")
        assert len(s.content_hash) == 16 and int(s.content_hash, 16) >= 0


def test_hash_is_sha256_of_canonical_json():
    s = AttentionSpec(arch="sm_90", head_dim=128, causal=True)
    assert s.content_hash == hashlib.sha256(s.to_json().encode()).hexdigest()[:16]
    # the same spec built another way (fields in another order, config as a dict) hashes the same
    d = s.to_dict()
    shuffled = dict(reversed(list(d.items())))
    assert AttentionSpec.from_dict(shuffled).content_hash == s.content_hash
    assert AttentionSpec(**{**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)},
                            "config": {"tile": [64, 64]}}) == s


def test_hash_pinned():
    # The cache is keyed by these; if this fails, a spec change alters every cache key. Update
    # the value only on purpose (old caches then miss, which is safe). Last: TileConfig, family,
    # kv_fp8 and split_kv; then mask_align, window, softcap; then varlen, paged_kv; page_size;
    # k_scale; packed_tokens.
    assert AttentionSpec().name == "fc_attn_fwd_sm89_f16_d64_m64n64_w4_s1"
    assert AttentionSpec().content_hash == "ceb607a7ec8b362e"


# most drawn combinations are invalid (a tile too large for its arch, FP8 at a dim it lacks):
# they are assumed away
@settings(suppress_health_check=[HealthCheck.filter_too_much])
@given(st.fixed_dictionaries({k: st.sampled_from(v) for k, v in CHOICES.items()}))
def test_json_round_trip_any_valid(fields):
    s = _valid(fields)
    assume(s is not None)
    again = AttentionSpec.from_json(s.to_json())
    assert again == s and hash(again) == hash(s)
    assert again.name == s.name and again.content_hash == s.content_hash
    assert spec_from_dict(json.loads(s.to_json())) == s
    assert json.loads(s.to_json())["config"]["tile"] == list(s.tile)


def test_specs_written_before_tile_config_still_load():
    old = {"arch": "sm_90", "dtype": "float16", "head_dim": 128, "tile": [128, 64], "warps": 8,
           "stages": 1, "kv_splits": 1, "causal": True, "return_lse": False,
           "precision": "fp16", "op": "attention_fwd", "spec_version": 1}
    s = AttentionSpec.from_dict(old)
    assert s.config == TileConfig((128, 64), warps=8) and s.causal and s.family == "mma_sync"
    with pytest.raises(SpecError, match="both 'config' and"):
        AttentionSpec.from_dict({**s.to_dict(), "warps": 8})


def test_from_json_errors():
    with pytest.raises(SpecError, match="not valid JSON"):
        AttentionSpec.from_json("{")
    with pytest.raises(SpecError, match="must be an object"):
        AttentionSpec.from_json("[1, 2]")
    with pytest.raises(SpecError, match="unknown fields \\['colour'\\]"):
        AttentionSpec.from_dict({**AttentionSpec().to_dict(), "colour": "red"})
    with pytest.raises(SpecError, match="spec_version 99"):
        AttentionSpec.from_dict({**AttentionSpec().to_dict(), "spec_version": 99})
    with pytest.raises(SpecError, match="head_dim=48"):
        AttentionSpec.from_json(json.dumps({**AttentionSpec().to_dict(), "head_dim": 48}))
    with pytest.raises(SpecError, match="TileConfig: unknown fields"):
        AttentionSpec.from_dict({**AttentionSpec().to_dict(), "config": {"tiles": [64, 64]}})


def test_frozen_and_replace():
    s = AttentionSpec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.arch = "sm_90"  # type: ignore[misc]
    t = s.replace(causal=True)
    assert t.causal and not s.causal and t.name == s.name + "_causal"
    assert s.replace(tile=(128, 64), warps=8).config == TileConfig((128, 64), warps=8)
    with pytest.raises(SpecError):
        s.replace(warps=5)


def test_kv_splits_threads_smem_and_name():
    one = AttentionSpec(arch="sm_89", config=TileConfig((32, 64), warps=2))
    four = one.replace(kv_splits=4)
    assert (four.threads, four.group_threads) == (256, 64)
    assert four.name == one.name + "_k4"
    # K and V per split, plus each split's row stats and three fp32 partial outputs
    assert four.smem_bytes == one.smem_bytes + 2 * 3 * 64 * 64 * 2 + 1024 + 3 * 32 * 64 * 4
    assert AttentionSpec.from_json(four.to_json()) == four
    with pytest.raises(SpecError, match="kv_splits=3"):
        one.replace(kv_splits=3)
    with pytest.raises(SpecError, match="over 512"):
        AttentionSpec(arch="sm_90", config=TileConfig((128, 64), warps=8, kv_splits=4))
    with pytest.raises(SpecError, match="shared memory"):
        AttentionSpec(arch="sm_89", head_dim=128, config=TileConfig((64, 128), kv_splits=4))


def test_kv_fp8_and_split_kv_in_name_and_smem():
    base = AttentionSpec(arch="sm_89", head_dim=128, config=TileConfig((16, 64), warps=1,
                                                                       stages=2))
    kv8 = base.replace(kv_fp8=True)
    assert kv8.name == base.name + "_kvfp8"
    # the e4m3 ring is half the bytes (its codes are converted in registers); the ring's
    # per-key descales (one KB-aligned buffer each for K and V) come on top
    assert kv8.smem_bytes == base.smem_bytes - 2 * 2 * 64 * 128 + 2 * 1024
    split = base.replace(split_kv=True)
    assert split.name == base.name + "_split" and split.smem_bytes == base.smem_bytes


def test_merge_shares_is_a_split_kernels_and_keeps_the_old_keys():
    """``merge_shares``: the last share's CTA merges a split kernel's shares (named, in the
    JSON only when on, so every other spec keeps its cache key); not without split_kv, and not
    in the Hopper family (it splits no keys)."""
    split = AttentionSpec(arch="sm_89", head_dim=128, config=TileConfig((16, 64), warps=1),
                          split_kv=True)
    merged = split.replace(merge_shares=True)
    assert merged.name == split.name + "_merge" and "merge_shares" not in split.to_dict()
    assert AttentionSpec.from_dict(merged.to_dict()) == merged
    assert merged.content_hash != split.content_hash and merged.smem_bytes == split.smem_bytes
    with pytest.raises(SpecError, match="merge_shares=True merges the shares of a split_kv"):
        split.replace(split_kv=False, merge_shares=True)
    with pytest.raises(SpecError, match="merge_shares must be a bool"):
        split.replace(merge_shares=1)
    with pytest.raises(SpecError, match="not built yet: split_kv"):
        AttentionSpec(arch="sm_90", head_dim=128, split_kv=True, merge_shares=True,
                      config=TileConfig((128, 128), warps=8, family="wgmma_ws"))


def test_other_spec_kinds_round_trip():
    for s in (QuantizeSpec(arch="sm_90", transpose=True), CombineSpec(arch="sm_90",
                                                                     return_lse=True)):
        assert spec_from_dict(json.loads(s.to_json())) == s
    with pytest.raises(SpecError, match="unknown kernel op 'x'"):
        spec_from_dict({"op": "x"})
    with pytest.raises(SpecError, match="warps=3"):
        CombineSpec(warps=3)


def test_packed_tokens_specs():
    """Multi-token GQA decode's packed rows: named, for dense and paged 16-bit decode of the
    mma_sync family only."""
    s = AttentionSpec(arch="sm_89", config=TileConfig((16, 64)), packed_tokens=True,
                      split_kv=True, paged_kv=True)
    assert s.name.endswith("_split_paged_ptok")
    assert AttentionSpec.from_dict(s.to_dict()) == s and s.content_hash != s.replace(
        packed_tokens=False).content_hash
    for bad, match in (({"varlen": True}, "varlen batches and precision='fp8'"),
                       ({"precision": "fp8"}, "varlen batches and precision='fp8'"),
                       ({"arch": "sm_90", "config": TileConfig((128, 128), warps=8,
                                                               family="wgmma_ws")},
                        "not built yet: packed_tokens")):
        with pytest.raises(SpecError, match=match):
            AttentionSpec(**{"packed_tokens": True, **bad})


def test_each_family_names_where_its_e4m3_mma_is_an_instruction():
    """FP8 warns where a family's e4m3 MMAs are emulated (``ops.eager.run_fp8``): the L4 has
    e4m3 mma.sync, Hopper only e4m3 wgmma."""
    from flashcore.specs import FAMILIES

    assert FAMILIES["mma_sync"].e4m3_mma_archs == ("sm_89",)
    assert FAMILIES["wgmma_ws"].e4m3_mma_archs == ("sm_90",)
    assert all(set(f.e4m3_mma_archs) <= set(f.archs) for f in FAMILIES.values())
