"""The autotuner's data side (no GPU): buckets, table lookup, borrowed tables, candidates."""

from __future__ import annotations

import json

import pytest

from flashcore.spec import SMEM_PER_BLOCK, TileConfig
from flashcore.tuned import table
from flashcore.tuning import search


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """A private tuned-table folder; returns a function that writes one arch's table."""
    monkeypatch.setenv("FLASHCORE_TUNED", str(tmp_path))
    table.clear()

    def write(arch: str, winners: dict) -> None:
        (tmp_path / f"{arch}.json").write_text(json.dumps({"arch": arch, "winners": winners}))
        table.clear()

    yield write
    table.clear()


def test_buckets_cover_every_length():
    assert table.bucket_of(1) == "decode"
    assert table.bucket_of(16) == "decode"
    assert table.bucket_of(17) == "short"
    assert table.bucket_of(1024) == "short"
    assert table.bucket_of(1025) == "mid"
    assert table.bucket_of(2048) == "mid"
    assert table.bucket_of(2049) == "long"
    assert table.bucket_of(10**6) == "long"


def test_lookup_reads_the_bucket_winner_and_defaults_elsewhere(tables):
    tables("sm_90", {
        "d64-full-short-fp16": {"config": {"tile": [32, 64], "warps": 2, "kv_splits": 2,
                                           "stages": 1}},
        "d128-causal-long-fp16": {"tile": [64, 128], "warps": 4},  # older entry: flat, partial
    })
    assert table.lookup("sm_90", 64, False, "short") == TileConfig((32, 64), warps=2, kv_splits=2)
    assert table.lookup("sm_90", 128, True, "long") == TileConfig((64, 128), warps=4)
    assert table.lookup("sm_90", 64, False, "long") == table.DEFAULT  # not tuned
    assert table.lookup("sm_90", 64, False, "short", "fp8") == table.DEFAULT
    assert table.lookup("sm_90", 64, False, "decode") == table.DECODE_DEFAULT


def test_ada_borrows_the_hopper_table_until_it_has_its_own(tables):
    tables("sm_90", {"d64-full-short-fp16": {"config": {"tile": [32, 64], "warps": 2,
                                                        "kv_splits": 2}}})
    assert table.table_arch("sm_89") == "sm_90"
    assert table.lookup("sm_89", 64, False, "short") == TileConfig((32, 64), warps=2, kv_splits=2)
    assert table.table_arch("sm_80") == "sm_80"  # not borrowed: no fit check for A100
    assert table.lookup("sm_80", 64, False, "short") == table.DEFAULT
    tables("sm_89", {"d64-full-short-fp16": {"config": {"tile": [64, 64], "warps": 4}}})
    assert table.table_arch("sm_89") == "sm_89"
    assert table.lookup("sm_89", 64, False, "short") == TileConfig((64, 64), warps=4)


def test_a_broken_table_is_no_table(tables):
    tables("sm_90", {"d64-full-short-fp16": {"config": {"tile": [64, 64], "warps": "four"}}})
    assert table.lookup("sm_90", 64, False, "short") == table.DEFAULT


def test_shipped_table_is_read_and_its_winners_are_candidates():
    table.clear()
    specs = table.winner_specs("sm_90", precisions=("fp16",))
    assert len(specs) == 12  # 2 head dims x 2 masks x 3 buckets
    for name, spec in specs.items():
        d, mask, bucket, prec = name.split("-")
        assert spec in set(search.candidates("sm_90", int(d[1:]), mask == "causal", prec, bucket))


def test_decode_candidates_split_the_keys_and_bring_their_companions():
    specs = list(search.candidates("sm_90", 128, False, "fp16", "decode"))
    assert specs and all(s.split_kv and s.tile_m <= 32 for s in specs)
    every = search.all_candidates("sm_90", buckets=["decode"])
    assert {s.op for s in every} == {"attention_fwd", "attention_combine"}
    assert any(not getattr(s, "split_kv", True) for s in every)


@pytest.mark.parametrize("bucket", ["short", "mid", "long"])
def test_candidates_fit_an_l4_and_split_only_short_problems(bucket):
    specs = list(search.candidates("sm_90", 128, True, "fp16", bucket))
    assert specs
    for s in specs:
        assert s.replace(arch="sm_89").smem_bytes <= SMEM_PER_BLOCK["sm_89"]
        assert s.tile_m // s.warps <= 32
        assert s.kv_splits == 1 or (bucket == "short" and s.tile_m == 16 * s.warps)


def test_cli_refuses_unknown_buckets_and_archs_with_no_candidates(capsys):
    assert search.main(["build", "--arch", "sm_90", "--out", "x", "--buckets", "bogus"]) == 2
    assert "unknown bucket 'bogus'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        search.main(["build", "--arch", "sm_75", "--out", "x"])
    assert e.value.code == 2
