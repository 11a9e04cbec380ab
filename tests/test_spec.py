"""AttentionSpec: validation of every field, JSON round trips, names and hashes."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from flashcore import spec as spec_mod
from flashcore.errors import SpecError
from flashcore.spec import AttentionSpec, spec_from_dict

# every choice the spec module offers, field by field
CHOICES = {
    "arch": spec_mod.ARCHS,
    "dtype": spec_mod.DTYPES,
    "precision": spec_mod.PRECISIONS,
    "head_dim": spec_mod.HEAD_DIMS,
    "tile": tuple(itertools.product(spec_mod.TILE_M, spec_mod.TILE_N)),
    "warps": spec_mod.WARPS,
    "stages": spec_mod.STAGES,
    "causal": (False, True),
    "return_lse": (False, True),
}


def _all_valid() -> list[AttentionSpec]:
    out = []
    for values in itertools.product(*CHOICES.values()):
        try:
            out.append(AttentionSpec(**dict(zip(CHOICES, values))))
        except SpecError:
            pass
    return out


ALL_VALID = _all_valid()


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
        ("head_dim", 96, "head_dim=96"),
        ("head_dim", 64.0, "head_dim must be an int"),
        ("head_dim", True, "head_dim must be an int"),
        ("tile", (64,), "tile must be a pair"),
        ("tile", (64, 64, 64), "tile must be a pair"),
        ("tile", (64.0, 64), "tile must be a pair"),
        ("tile", (True, 64), "tile must be a pair"),
        ("tile", "64x64", "tile must be a pair"),
        ("tile", (48, 64), "tile_m=48"),
        ("tile", (64, 16), "tile_n=16"),
        ("warps", 3, "warps=3"),
        ("warps", "4", "warps must be an int"),
        ("stages", 4, "stages=4"),
        ("stages", None, "stages must be an int"),
        ("causal", 1, "causal must be a bool"),
        ("return_lse", "yes", "return_lse must be a bool"),
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
        AttentionSpec(tile=(32, 64), warps=4)
    AttentionSpec(tile=(64, 64), warps=4)


def test_fp8_needs_fp8_arch():
    with pytest.raises(SpecError, match="precision='fp8'.*sm_80"):
        AttentionSpec(arch="sm_80", precision="fp8")


def test_uneven_copy_split_rejected(monkeypatch):
    # no spec in the allowed set trips this check, so widen the choices to reach it
    monkeypatch.setattr(spec_mod, "TILE_M", (*spec_mod.TILE_M, 256))
    monkeypatch.setattr(spec_mod, "WARPS", (*spec_mod.WARPS, 16))
    with pytest.raises(SpecError, match="cannot be split evenly over 512 threads"):
        AttentionSpec(tile=(256, 32), warps=16)


def test_shared_memory_budget(monkeypatch):
    # A spec of the allowed set over sm_89's 99 KB but within sm_90's 227 KB, where one exists
    # (none does today: the largest needs 96 KB).
    budget = spec_mod.SMEM_PER_BLOCK["sm_89"]
    over = [s for s in ALL_VALID if s.arch == "sm_90" and s.smem_bytes > budget]
    for s in over[:3]:
        with pytest.raises(SpecError, match="shared memory"):
            s.replace(arch="sm_89")
    # So also shrink sm_89's budget under a real spec's need.
    big = AttentionSpec(arch="sm_89", head_dim=128, tile=(128, 128), warps=8)
    monkeypatch.setitem(spec_mod.SMEM_PER_BLOCK, "sm_89", big.smem_bytes - 1)
    with pytest.raises(SpecError, match=f"needs {big.smem_bytes} bytes of shared memory.*sm_89"):
        big.replace()  # re-validates
    AttentionSpec(arch="sm_89", head_dim=64, tile=(64, 64))  # small ones still fit
    AttentionSpec(arch="sm_90", head_dim=128, tile=(128, 128), warps=8)  # other archs unaffected


def test_every_valid_spec_within_its_budget():
    assert ALL_VALID
    for s in ALL_VALID:
        assert 0 < s.smem_bytes <= spec_mod.SMEM_PER_BLOCK[s.arch]
        assert s.smem_bytes % 1024 == 0


def test_names_and_hashes_unique():
    names = [s.name for s in ALL_VALID]
    hashes = [s.content_hash for s in ALL_VALID]
    assert len(set(names)) == len(names) == len(set(ALL_VALID))
    assert len(set(hashes)) == len(hashes)
    for s in ALL_VALID:
        assert s.name.isidentifier() and s.name.startswith("fc_attn_fwd_")
        assert len(s.content_hash) == 16 and int(s.content_hash, 16) >= 0


def test_hash_is_sha256_of_canonical_json():
    s = AttentionSpec(arch="sm_90", head_dim=128, causal=True)
    assert s.content_hash == hashlib.sha256(s.to_json().encode()).hexdigest()[:16]
    # the same spec built another way (list tile, fields in another order) hashes the same
    d = s.to_dict()
    shuffled = dict(reversed(list(d.items())))
    assert AttentionSpec.from_dict(shuffled).content_hash == s.content_hash
    assert AttentionSpec(**{**dataclasses.asdict(s), "tile": [64, 64]}) == s


def test_hash_pinned():
    # The cache is keyed by these; if this fails, a spec change alters every cache key. Update
    # the value only on purpose (old caches then miss, which is safe). Last: kv_splits added.
    assert AttentionSpec().name == "fc_attn_fwd_sm89_f16_d64_m64n64_w4_s1"
    assert AttentionSpec().content_hash == "edf6010c6e07e5aa"


@given(
    st.fixed_dictionaries({k: st.sampled_from(v) for k, v in CHOICES.items()}),
)
def test_json_round_trip_any_valid(fields):
    try:
        s = AttentionSpec(**fields)
    except SpecError:
        assume(False)
    again = AttentionSpec.from_json(s.to_json())
    assert again == s and hash(again) == hash(s)
    assert again.name == s.name and again.content_hash == s.content_hash
    assert spec_from_dict(json.loads(s.to_json())) == s
    assert json.loads(s.to_json())["tile"] == list(s.tile)


def test_from_json_errors():
    with pytest.raises(SpecError, match="not valid JSON"):
        AttentionSpec.from_json("{")
    with pytest.raises(SpecError, match="must be an object"):
        AttentionSpec.from_json("[1, 2]")
    with pytest.raises(SpecError, match="unknown fields \\['colour'\\]"):
        AttentionSpec.from_dict({**AttentionSpec().to_dict(), "colour": "red"})
    with pytest.raises(SpecError, match="spec_version 99"):
        AttentionSpec.from_dict({**AttentionSpec().to_dict(), "spec_version": 99})
    with pytest.raises(SpecError, match="head_dim=96"):
        AttentionSpec.from_json(json.dumps({**AttentionSpec().to_dict(), "head_dim": 96}))


def test_frozen_and_replace():
    s = AttentionSpec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.arch = "sm_90"  # type: ignore[misc]
    t = s.replace(causal=True)
    assert t.causal and not s.causal and t.name == s.name + "_causal"
    with pytest.raises(SpecError):
        s.replace(warps=5)


def test_kv_splits_threads_smem_and_name():
    one = AttentionSpec(arch="sm_89", tile=(32, 64), warps=2)
    four = one.replace(kv_splits=4)
    assert (four.threads, four.group_threads) == (256, 64)
    assert four.name == one.name + "_k4"
    # K and V per split, plus each split's row stats and three fp32 partial outputs
    assert four.smem_bytes == one.smem_bytes + 2 * 3 * 64 * 64 * 2 + 1024 + 3 * 32 * 64 * 4
    assert AttentionSpec.from_json(four.to_json()) == four
    with pytest.raises(SpecError, match="kv_splits=3"):
        one.replace(kv_splits=3)
    with pytest.raises(SpecError, match="over 512"):
        AttentionSpec(arch="sm_90", tile=(128, 64), warps=8, kv_splits=4)
    with pytest.raises(SpecError, match="shared memory"):
        AttentionSpec(arch="sm_89", head_dim=128, tile=(64, 128), kv_splits=4)
