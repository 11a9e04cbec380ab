"""The autotuner's data side (no GPU): buckets, table lookup, borrowed tables, candidates."""

from __future__ import annotations

import json

import pytest

from flashcore import autotune
from flashcore.spec import SMEM_PER_BLOCK


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """A private tuned-table folder; returns a function that writes one arch's table."""
    monkeypatch.setenv("FLASHCORE_TUNED", str(tmp_path))
    autotune._table.cache_clear()

    def write(arch: str, winners: dict) -> None:
        (tmp_path / f"{arch}.json").write_text(json.dumps({"arch": arch, "winners": winners}))
        autotune._table.cache_clear()

    yield write
    autotune._table.cache_clear()


def test_buckets_cover_every_length():
    assert autotune.bucket_of(1) == "short"
    assert autotune.bucket_of(1024) == "short"
    assert autotune.bucket_of(1025) == "mid"
    assert autotune.bucket_of(2048) == "mid"
    assert autotune.bucket_of(2049) == "long"
    assert autotune.bucket_of(10**6) == "long"


def test_lookup_reads_the_bucket_winner_and_defaults_elsewhere(tables):
    tables("sm_90", {
        "d64-full-short-fp16": {"tile": [32, 64], "warps": 2, "kv_splits": 2, "stages": 1},
        "d128-causal-long-fp16": {"tile": [64, 128], "warps": 4},  # older entry: no splits/stages
    })
    assert autotune.lookup("sm_90", 64, False, 512) == ((32, 64), 2, 2, 1)
    assert autotune.lookup("sm_90", 128, True, 8192) == ((64, 128), 4, 1, 1)
    assert autotune.lookup("sm_90", 64, False, 4096) == autotune.DEFAULT  # not tuned
    assert autotune.lookup("sm_90", 64, False, 512, "fp8") == autotune.DEFAULT


def test_ada_borrows_the_hopper_table_until_it_has_its_own(tables):
    tables("sm_90", {"d64-full-short-fp16": {"tile": [32, 64], "warps": 2, "kv_splits": 2,
                                             "stages": 1}})
    assert autotune.table_arch("sm_89") == "sm_90"
    assert autotune.lookup("sm_89", 64, False, 512) == ((32, 64), 2, 2, 1)
    assert autotune.table_arch("sm_80") == "sm_80"  # not borrowed: no fit check for A100
    assert autotune.lookup("sm_80", 64, False, 512) == autotune.DEFAULT
    tables("sm_89", {"d64-full-short-fp16": {"tile": [64, 64], "warps": 4}})
    assert autotune.table_arch("sm_89") == "sm_89"
    assert autotune.lookup("sm_89", 64, False, 512) == ((64, 64), 4, 1, 1)


def test_shipped_table_is_read_and_its_winners_are_candidates():
    autotune._table.cache_clear()
    specs = autotune.winner_specs("sm_90", precisions=("fp16",))
    assert len(specs) == 12  # 2 head dims x 2 masks x 3 buckets
    for name, spec in specs.items():
        d, mask, bucket, prec = name.split("-")
        assert spec in set(autotune.candidates("sm_90", int(d[1:]), mask == "causal", prec, bucket))


@pytest.mark.parametrize("bucket", ["short", "mid", "long"])
def test_candidates_fit_an_l4_and_split_only_short_problems(bucket):
    specs = list(autotune.candidates("sm_90", 128, True, "fp16", bucket))
    assert specs
    for s in specs:
        assert s.replace(arch="sm_89").smem_bytes <= SMEM_PER_BLOCK["sm_89"]
        assert s.tile_m // s.warps <= 32
        assert s.kv_splits == 1 or (bucket == "short" and s.tile_m == 16 * s.warps)
