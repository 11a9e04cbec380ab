"""The autotuner's data side (no GPU): buckets, table lookup, borrowed tables, candidates."""

from __future__ import annotations

import json

import pytest

from flashcore.specs import SMEM_PER_BLOCK, TileConfig
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


def test_fp8_with_k_per_head_takes_its_own_entry_or_the_fp8_one(tables):
    ws = {"tile": [192, 128], "warps": 12, "stages": 2, "family": "wgmma_ws"}
    tables("sm_90", {
        "d64-causal-long-fp8": {"config": {"tile": [192, 64], "warps": 12, "stages": 3,
                                           "family": "wgmma_ws"}},
        "d64-causal-long-fp8khead": {"config": ws},
        "d64-full-long-fp8": {"config": ws},
    })
    assert table.lookup("sm_90", 64, True, "long", "fp8khead").tile == (192, 128)
    assert table.lookup("sm_90", 64, True, "long", "fp8").tile == (192, 64)
    assert table.lookup("sm_90", 64, False, "long", "fp8khead") == TileConfig.from_dict(ws)
    assert table.lookup("sm_90", 64, False, "short", "fp8khead") == table.DEFAULT
    specs = table.winner_specs("sm_90", precisions=("fp8khead",))
    assert [(s.precision, s.k_scale) for s in specs.values()] == [("fp8", "head")]


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
    winners = [n for n in specs if not n.endswith(":fallback")]
    # d64 and d128: 2 masks x 3 buckets; d96 and d256: the long bucket's Hopper tiles
    assert sorted(winners) == sorted(
        [f"d{d}-{m}-{b}-fp16" for d in (64, 128) for m in ("full", "causal")
         for b in ("short", "mid", "long")]
        + [f"d{d}-{m}-long-fp16" for d in (96, 256) for m in ("full", "causal")])
    for name in winners:
        d, mask, bucket, prec = name.split("-")
        assert specs[name] in set(search.candidates("sm_90", int(d[1:]), mask == "causal", prec,
                                                    bucket))
        fallback = specs.get(name + ":fallback")  # the default family's best, where needed
        assert (fallback is not None) == (specs[name].family != "mma_sync")
        assert fallback is None or fallback.family == "mma_sync"


def test_every_shipped_hopper_winner_has_its_tile_in_the_gpu_tests():
    """A tuned default must have been checked against the reference: the GPU tests run each
    Hopper winner's tile, warps and family (the stage counts share one ring code)."""
    from tests.test_gpu_wgmma import CONFIGS, FP8_CONFIGS, WGMMA_TILE_N_CONFIGS

    table.clear()
    for precision, configs in (("fp16", CONFIGS + WGMMA_TILE_N_CONFIGS), ("fp8", FP8_CONFIGS)):
        tested = {(c.tile, c.warps, c.family) for c in configs}
        for name, config in table.winner_specs("sm_90", precisions=(precision,)).items():
            if config.family != "mma_sync":
                assert (config.tile, config.warps, config.family) in tested, (name, config)


def test_decode_candidates_split_the_keys_and_bring_their_companions():
    specs = list(search.candidates("sm_90", 128, False, "fp16", "decode"))
    assert specs and all(s.split_kv and s.tile_m <= 32 for s in specs)
    every = search.all_candidates("sm_90", buckets=["decode"])
    assert {s.op for s in every} == {"attention_fwd", "attention_combine"}
    assert any(not getattr(s, "split_kv", True) for s in every)


@pytest.mark.parametrize("bucket", ["short", "mid", "long"])
def test_candidates_fit_an_l4_and_split_only_short_problems(bucket):
    specs = list(search.candidates("sm_90", 128, True, "fp16", bucket, families=("mma_sync",)))
    assert specs and not any(s.family != "mma_sync" for s in specs)
    for s in specs:
        assert s.replace(arch="sm_89").smem_bytes <= SMEM_PER_BLOCK["sm_89"]
        assert s.tile_m // s.warps <= 32
        assert s.kv_splits == 1 or (bucket == "short" and s.tile_m == 16 * s.warps)


def test_cli_refuses_unknown_buckets_and_archs_with_no_candidates(capsys):
    assert search.main(["build", "--arch", "sm_90", "--out", "x", "--buckets", "bogus"]) == 2
    assert "unknown bucket 'bogus'" in capsys.readouterr().err
    assert search.main(["build", "--arch", "sm_89", "--out", "x", "--families", "wgmma_ws"]) == 2
    assert "'wgmma_ws' does not run on sm_89" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        search.main(["build", "--arch", "sm_75", "--out", "x"])
    assert e.value.code == 2


HOPPER = {"tile": [128, 128], "warps": 8, "stages": 2, "family": "wgmma_ws"}
MMA = {"tile": [64, 128], "warps": 4, "stages": 1, "kv_splits": 1}


def test_a_hopper_winner_gives_way_to_its_fallback_where_its_family_cannot_run(tables):
    tables("sm_90", {"d128-full-long-fp16": {"config": HOPPER, "fallback": {"config": MMA}}})
    hopper, mma = TileConfig.from_dict(HOPPER), TileConfig.from_dict(MMA)
    assert table.lookup("sm_90", 128, False, "long") == hopper
    # features the Hopper family does not build: pages of any size (gathered), pages neither
    # whole key blocks nor whole 16-row boxes of one, split keys
    for features in [(("paged_kv", True),), (("paged_kv", True), ("page_size", 24)),
                     (("split_kv", True),)]:
        assert table.lookup("sm_90", 128, False, "long", "fp16", features) == mma, features
    # its masks, packed batches and the paged caches it builds
    for features in [(("window", True),), (("softcap", True),), (("window", False),),
                     (("varlen", True),), (("paged_kv", True), ("page_size", 256)),
                     (("paged_kv", True), ("page_size", 16))]:
        assert table.lookup("sm_90", 128, False, "long", "fp16", features) == hopper, features
    assert table.lookup("sm_89", 128, False, "long") == mma  # borrowed: no wgmma on an L4
    specs = table.winner_specs("sm_90", precisions=("fp16",))
    assert specs["d128-full-long-fp16"].family == "wgmma_ws"
    assert specs["d128-full-long-fp16:fallback"].config == mma
    ada = table.winner_specs("sm_90", build_arch="sm_89", precisions=("fp16",))
    assert list(ada) == ["d128-full-long-fp16:fallback"]


def test_the_tuner_draws_from_every_family_of_the_arch_and_keeps_a_fallback():
    hopper = [s for s in search.candidates("sm_90", 128, False, "fp16", "long")
              if s.family == "wgmma_ws"]
    # the search grid, where each consumer warpgroup owns 64 rows and the rings fit 227 KB:
    # 64- and 128-key blocks, and d128's widest, 176 (two stages fit, not beside 192 rows)
    tiles = {(64, 64): (2, 3, 4), (64, 128): (2, 3), (128, 64): (2, 3, 4), (128, 128): (2, 3),
             (192, 64): (2, 3, 4), (192, 128): (2,), (64, 176): (2,), (128, 176): (2,)}
    assert {s.config.tag for s in hopper} == {
        f"m{m}n{n}_w{m // 16}_s{st}_wgmma_ws" for (m, n), stages in tiles.items()
        for st in stages}
    # the widest block of each head dim: d256's 80 (shared memory full at two stages)
    wide = {s.config.tile for s in search.candidates("sm_90", 256, True, "fp16", "long")
            if s.family == "wgmma_ws"}
    assert wide == {(64, 64), (64, 80), (128, 64), (128, 80), (192, 64)}
    assert not any(s.family == "wgmma_ws" for s in search.candidates(
        "sm_89", 128, False, "fp16", "long"))
    assert not any(s.family == "wgmma_ws" for s in search.candidates(
        "sm_90", 128, False, "fp16", "decode"))
    specs = {s.config.tag: s for s in search.candidates("sm_90", 128, False, "fp16", "long")}
    fast, slow = specs["m128n128_w8_s2_wgmma_ws"], specs["m64n128_w4_s1"]
    entry = search.table_entry([(900.0, slow), (700.0, fast), (950.0, specs["m64n64_w4_s1"])],
                               [4, 16, 16, 4096, 4096, 128])
    assert entry["config"] == fast.config.to_dict() and entry["us"] == 700.0
    assert entry["fallback"] == {"config": slow.config.to_dict(), "us": 900.0}
    assert "fallback" not in search.table_entry([(900.0, slow)], [])
    with pytest.raises(SystemExit, match="no default-family kernel"):
        search.table_entry([(700.0, fast)], [])


def test_eager_calls_pass_their_features_to_the_table(tables):
    """``resolve_config`` (what every eager call runs with ``tile=None``): masks and explicit or
    decode key splits reach the lookup, so the calls the winner does not build run the
    fallback (a window beside a soft-cap, where a 192x128 tile at d128 passes P through shared
    memory; key splits)."""
    from flashcore.ops.eager import resolve_config
    from flashcore.ops.masks import Masking, call_masking

    wide = {**HOPPER, "tile": [192, 128], "warps": 12}
    tables("sm_90", {"d128-full-long-fp16": {"config": wide, "fallback": {"config": MMA}},
                     "d128-full-decode-fp16": {"config": HOPPER, "fallback": {"config": MMA}}})

    def tuned(seqlen_q, features=()):
        return resolve_config(None, None, None, None, None, arch="sm_90", head_dim=128,
                              causal=False, seqlen_q=seqlen_q, precision="fp16",
                              features=features)

    hopper, mma = TileConfig.from_dict(wide), TileConfig.from_dict(MMA)
    assert tuned(4096, call_masking(False, "top_left", None, None).features) == hopper
    assert tuned(4096, Masking(window=(128, 128)).features) == hopper
    assert tuned(4096, Masking(softcap=30.0).features) == hopper
    assert tuned(4096, Masking(window=(128, 128), softcap=30.0).features) == mma
    assert tuned(4096, (("split_kv", True),)) == mma
    assert tuned(1) == mma  # decode asks for a family that splits keys
