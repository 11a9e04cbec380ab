"""The ops layer's CPU-side logic: split counts, GQA packing views, config resolution, and the
checks on what users pass (no GPU needed)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashcore.kernels.common.block_info import KeyBounds, key_range, share
from flashcore.ops import plan
from flashcore.ops.eager import resolve_config
from flashcore.ops.inputs import E4M3
from flashcore.ops.validate import _ranges_overlap, _self_overlapping, check_qkv, signed_query
from flashcore.specs import TileConfig
from flashcore.tuned.table import DECODE_DEFAULT
from tests.device_stub import stubbed_device


@given(ctas=st.integers(1, 4000), n_blocks=st.integers(1, 2000), slots=st.integers(8, 600),
       rows=st.sampled_from([16, 32, 64]), head_dim=st.sampled_from([64, 128]))
def test_num_splits_is_the_cheapest_in_the_model(ctas, n_blocks, slots, rows, head_dim):
    s = plan.num_splits(ctas, n_blocks, slots, rows=rows, head_dim=head_dim)
    assert 1 <= s <= min(plan.MAX_SPLITS, n_blocks)

    def cost(x):  # waves x (blocks a share + its fixed cost) + the partials' traffic
        partials = x * ctas * rows * head_dim * 8 / plan.PARTIAL_BYTES_PER_BLOCK
        waves = math.ceil(ctas * x / slots)
        return waves * (math.ceil(n_blocks / x) + plan.SHARE_OVERHEAD) + partials

    if ctas >= slots:  # the grid already fills the GPU
        assert s == 1
    else:
        costs = [cost(x) for x in range(1, min(plan.MAX_SPLITS, n_blocks) + 1)]
        assert cost(s) == min(costs) and costs.index(min(costs)) == s - 1  # the fewest best


def test_num_splits_of_the_issue_shapes():
    """The counts the H100 sweep found best (scripts/decode_sweep.py, 132 SMs)."""
    # 1,8,8,32768,128: 8 CTAs over 512 key blocks of 64 -> 16 shares of 32 blocks
    assert plan.num_splits(8, 512, 132) == 16
    # 1,32,8,8192,128, query heads packed: 8 CTAs over 128 blocks -> 16 shares of 8
    assert plan.num_splits(8, 128, 132) == 16
    # 16,32,8,4096,128 packed: 128 CTAs nearly fill the GPU -> no split
    assert plan.num_splits(128, 64, 132) == 1


def test_num_splits_of_few_ctas_stop_before_one_block_a_share():
    """A few CTAs over a short cache (MQA, one head): shares of a block each are slower than
    shares of two to four (on the H100's share sweeps), the more so the more rows a CTA's
    partials carry, so the split model stops before them."""
    # one 32-row CTA (1,32/1,8192): 64 shares, not 128 of one block each
    assert plan.num_splits(1, 128, 132, rows=32) == 64
    # one 64-row CTA (1,64/1,8192): its partial rows cost twice as much
    assert plan.num_splits(1, 128, 132, rows=64) == 43
    # one 16-row CTA (1,1/1,8192), and over 512 blocks
    assert plan.num_splits(1, 128, 132) == 64
    assert plan.num_splits(1, 512, 132) == 128
    # one 32-row CTA over 256 blocks (1,32/1,16384)
    assert plan.num_splits(1, 256, 132, rows=32) == 86
    # a head dimension of 64 carries half the partial bytes a row
    assert plan.num_splits(1, 128, 132, rows=64, head_dim=64) == 64


@given(n=st.integers(0, 300), parts=st.integers(1, 64))
def test_shares_partition_the_blocks(n, parts):
    covered = []
    for i in range(parts):
        lo, hi = share(n, parts, i)
        assert 0 <= lo <= hi <= n
        covered += range(lo, hi)
    assert covered == list(range(n))


@given(sq=st.integers(1, 300), sk=st.integers(1, 300), causal=st.booleans(),
       splits=st.integers(1, 8), groups=st.sampled_from([1, 2, 4]))
def test_key_ranges_cover_exactly_the_visible_blocks(sq, sk, causal, splits, groups):
    tm, tn = 64, 32
    for mb in range(-(-sq // tm)):
        blocks = []
        for s in range(splits):
            for g in range(groups):
                lo, hi, _ = key_range(mb, tm, tn, sk, KeyBounds(causal), 1, s, splits, g,
                                      groups)
                blocks += range(lo, hi)
        last_row = min((mb + 1) * tm, sq) - 1
        visible = -(-min(sk, last_row + 1) // tn) if causal else -(-sk // tn)
        assert sorted(blocks) == list(range(visible)) or (causal and blocks == list(
            range(-(-min(sk, (mb + 1) * tm) // tn))))


def test_packed_views_put_a_kv_heads_queries_in_rows():
    q = torch.arange(2 * 1 * 8 * 4, dtype=torch.float32).reshape(2, 1, 8, 4).transpose(1, 2)
    p = plan.packed(q, 2)  # (2, 8, 1, 4) -> (2, 2, 4, 4)
    assert p.shape == (2, 2, 4, 4)
    for b, h in ((0, 5), (1, 7)):
        assert torch.equal(p[b, h // 4, h % 4], q[b, h, 0])
    lse = torch.arange(2 * 8, dtype=torch.float32).reshape(2, 8, 1)
    assert torch.equal(plan.packed(lse, 2)[1, 1], lse[1, 4:, 0])  # K/V head 1: query heads 4-7
    assert plan.packs_heads(1, 8, 2) and not plan.packs_heads(2, 8, 2)
    assert not plan.packs_heads(1, 8, 8)


def test_multi_token_gqa_rows_are_the_callers_tensors():
    """What the launcher hands the kernels for each kind of decode call: packed tokens keep
    the caller's q, out and lse arguments (the kernel gathers and scatters the rows), with
    K/V heads as the grid's heads and S_q * group rows; one token packs its heads as views'
    arguments; the combine (or, in an eager call, the split kernel whose last share merges)
    always writes the caller's tensors; a family that builds no
    packed tokens (and FP8 operands) keeps a row per (head, token)."""
    from unittest import mock

    from flashcore.ops import launcher
    from flashcore.ops.inputs import rows_arg, tensor_arg
    from flashcore.ops.masks import NO_MASK

    b, hq, hkv, d = 2, 32, 8, 128
    k = torch.randn(b, hkv, 100, d)

    def launched(sq, config=DECODE_DEFAULT, precision="fp16", num_splits=1, eager=False):
        q = torch.randn(b, sq, hq, d).transpose(1, 2)  # (B, S, H, D) memory
        out, lse = torch.empty_like(q), torch.empty(b, hq, sq)
        args = (tensor_arg(q), tensor_arg(k), tensor_arg(k))
        descales = ((torch.rand(b, hq, sq), torch.rand(b, hkv, 100), torch.rand(b, hkv))
                    if precision == "fp8" else ())
        with (mock.patch.object(launcher, "arch_of", return_value="sm_90"),
              mock.patch.object(plan, "sm_count", return_value=132),
              mock.patch.object(launcher, "loaded_kernel"),
              mock.patch.object(launcher, "combine_kernel")):
            p = launcher.plan_launch(0, b, hq, sq, d, hkv, 2, torch.float16, config, False,
                                     True, precision, False, False, NO_MASK, False, 0, 0, 0,
                                     num_splits, 0.125, host_bound=eager)
        calls = []
        with mock.patch.object(launcher, "launch",
                               side_effect=lambda kern, grid, a, dev: calls.append((grid, a))):
            launcher.launch_plan(p, out, lse, args, descales)
        return p, calls, args, out, lse

    p, [(grid, a)], args, out, lse = launched(4)
    assert p.packing == launcher.TOKENS and a[:3] == args
    assert a[3:5] == (tensor_arg(out), rows_arg(lse))
    assert grid[0] == b * hkv and a[6] == (4,)  # one 16-row tile of each K/V head; q_group
    p, [(grid, a)], args, out, lse = launched(1)
    assert p.packing == launcher.HEADS and grid[0] == b * hkv and a[6] == (4,)
    assert a[3] == plan.packed_arg(tensor_arg(out), hkv)
    assert a[0] == plan.packed_arg(args[0], hkv) and a[1:3] == args[1:]
    p, [_, (grid, a)], args, out, lse = launched(1, num_splits=3)  # the combine
    assert a[2:4] == (tensor_arg(out), rows_arg(lse)) and a[4:] == ((4,), (3,))
    assert grid == (b * hq, 1, 1)
    p, [(grid, a)], args, out, lse = launched(1, num_splits=3, eager=True)  # one launch
    assert p.merged and grid == (b * hkv, 3, 1) and a[0] == plan.packed_arg(args[0], hkv)
    n = b * hkv  # counters: one per query tile, zero
    assert a[3][1:] == (3 * b, hkv, 4, hkv * 4 * d, 4 * d, d) and a[6:8] == ((4,), (3,))
    assert a[-3:-1] == (tensor_arg(out), rows_arg(lse)) and a[-1][1] >= n
    hopper = TileConfig((128, 128), warps=8, family="wgmma_ws")
    for sq, config, precision in ((4, hopper, "fp16"), (16, DECODE_DEFAULT, "fp16"),
                                  (4, DECODE_DEFAULT, "fp8")):
        with mock.patch.object(launcher, "tma_args", side_effect=lambda kern, a, *_: a):
            p, [(grid, a)], *_ = launched(sq, config, precision)
        assert p.packing == launcher.AS_IS and a[6 if precision != "fp8" else 9] == (1,)


def test_packed_rows_tiles_hold_a_kv_heads_rows():
    """A tuned one-warp decode tile (with or without in-CTA key groups) grows to 32 or 64 rows
    to hold a K/V head's packed rows, one token's heads or a few tokens' (token, head) pairs,
    and to 32 rows past 64; no group, prefill lengths, 16 rows or fewer and any other config
    stay as they are; the grown tile still packs."""
    cfg = DECODE_DEFAULT
    assert cfg.tile == (16, 64) and cfg.warps == 1
    for base in (cfg, cfg.replace(kv_splits=2)):  # the FP8 KV cache's tuned tile has two groups
        for sq, group, rows in ((2, 4, 16), (2, 8, 16), (4, 8, 32), (8, 4, 32), (16, 4, 64),
                                (5, 7, 64), (3, 6, 32), (2, 9, 32), (1, 32, 32), (1, 64, 64),
                                (1, 24, 32), (1, 48, 64), (16, 32, 32), (12, 8, 32),
                                (1, 128, 32), (3, 22, 32)):
            got = plan.packed_rows_config(base, sq, group)
            assert got.tile == (rows, cfg.tile_n) and got.warps == rows // 16
            assert got.stages == base.stages and got.kv_splits == base.kv_splits
            if sq == 1:
                assert plan.packs_heads(sq, 8 * group, 8)
            else:
                assert plan.packs_tokens(sq, 8 * group, 8, got.tile_m, got.tile_n, False)
    for sq, group in ((1, 16), (1, 8), (4, 1), (17, 8)):
        assert plan.packed_rows_config(cfg, sq, group) is cfg
    for other in (TileConfig((64, 64)), TileConfig((32, 64), warps=2),
                  TileConfig((16, 64), warps=2)):
        assert plan.packed_rows_config(other, 8, 8) is other
    kw = {"arch": "sm_90", "head_dim": 128, "causal": False, "seqlen_q": 8}
    assert resolve_config(None, None, None, None, None, precision="fp16", group=8,
                          **kw).tile == (64, 64)
    fp8kv = resolve_config(None, None, None, None, None, precision="fp8kv", group=8, **kw)
    assert fp8kv.tile == (64, 64) and fp8kv.kv_splits == 2  # its key groups kept
    assert resolve_config(None, None, None, None, None, precision="fp16", group=32,
                          **{**kw, "seqlen_q": 1}).tile == (32, 64)  # one token's 32 heads
    assert resolve_config(None, None, None, 2, None, precision="fp16", group=8,
                          **kw).tile_m == 16  # the caller's knobs on the tuned tile
    # an L4 has no room for an FP8 KV cache's 64-row tile of two key groups at head_dim 128
    # (115 KB of shared memory): 32 rows there
    assert resolve_config(None, None, None, None, None, precision="fp8kv", group=8,
                          **{**kw, "arch": "sm_89"}).tile == (32, 64)
    assert resolve_config(None, None, None, None, None, precision="fp8", group=8,
                          **kw) == plan.tuned_config("sm_90", 128, False, 8, "fp8")  # FP8
    # operands pack no rows: their decode tile stays the tuned one-warp tile


def test_which_decode_calls_pack_tokens():
    assert plan.packs_tokens(4, 32, 8, 16, 64, False)  # 16 rows: one tile for four heads
    assert plan.packs_tokens(2, 8, 1, 16, 64, True)  # top-left causal: every token in block 0
    assert not plan.packs_tokens(1, 32, 8, 16, 64, False)  # one token: packed as heads
    assert not plan.packs_tokens(4, 8, 8, 16, 64, False)  # no group
    assert not plan.packs_tokens(16, 32, 8, 16, 64, False)  # as many tiles as heads
    assert not plan.packs_tokens(17, 32, 8, 16, 64, False)  # prefill
    assert not plan.packs_tokens(16, 64, 2, 16, 8, True)  # a diagonal past the first block


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_packed_arguments_are_the_packed_views_arguments(layout):
    """The launcher packs kernel arguments, not views: each must be what the view would give."""
    from flashcore.ops.inputs import rows_arg, tensor_arg

    x = torch.randn(3, 1, 12, 64).transpose(1, 2) if layout == "bshd" else torch.randn(3, 12, 1, 64)
    for hkv in (1, 2, 3, 4, 6, 12):
        assert plan.packed_arg(tensor_arg(x), hkv) == tensor_arg(plan.packed(x, hkv))
    lse = torch.randn(3, 12, 2)[:, :, :1]  # a strided (B, H, 1) view
    for hkv in (1, 4, 12):
        assert plan.packed_arg(rows_arg(lse), hkv) == rows_arg(plan.packed(lse, hkv))


def test_resolve_config():
    kw = {"arch": "sm_90", "head_dim": 64, "causal": False, "seqlen_q": 1, "precision": "fp16"}
    assert resolve_config(None, None, None, None, None, **kw) == DECODE_DEFAULT
    assert resolve_config(None, (32, 64), None, None, None, **kw) == TileConfig((32, 64))
    assert resolve_config(None, None, None, 3, None, **kw) == DECODE_DEFAULT.replace(stages=3)
    cfg = TileConfig((128, 64), warps=8)
    assert resolve_config(cfg, None, None, None, None, **kw) is cfg
    with pytest.raises(ValueError, match="either config or"):
        resolve_config(cfg, (64, 64), None, None, None, **kw)
    with pytest.raises(TypeError, match="must be a TileConfig"):
        resolve_config((64, 64), None, None, None, None, **kw)


def test_overlap_checks():
    base = torch.zeros(4, 8, 16, 64)
    assert _ranges_overlap(base[:2], base[1:3]) and not _ranges_overlap(base[:2], base[2:])
    assert not _ranges_overlap(base, torch.zeros(4, 8, 16, 64))
    assert _self_overlapping(torch.zeros(4, 1, 16, 64).expand(4, 8, 16, 64))
    assert not _self_overlapping(base.transpose(1, 2))


def test_cpu_tensors_and_bad_shapes_are_named():
    q = torch.zeros(1, 4, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="q is on cpu"):
        check_qkv(q, q, q)
    with pytest.raises(ValueError, match="whole multiple of the key/value heads"):
        check_qkv(q, q[:, :3], q[:, :3])
    with pytest.raises(ValueError, match="k .* and v .* differ in shape"):
        check_qkv(q, q[:, :2], q[:, :1])
    with pytest.raises(TypeError, match="dtypes differ"):
        check_qkv(q, q.float(), q.float())
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        check_qkv(q, None, q)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, E4M3])
def test_a_negative_scale_runs_as_the_negated_query(dtype):
    """The kernels need scale >= 0; -q with |scale| gives the same logits, exactly (e4m3: the
    sign bit, NaN kept); a scale >= 0 (zero, -0.0 included) passes q through untouched."""
    q = (torch.randn(2, 3, 5, 64) * 100).to(dtype)
    q.view(-1)[0] = float("nan")
    for scale in (0.0, -0.0, 0.125):
        assert signed_query(q, scale)[0] is q
    neg, scale = signed_query(q, -0.25)
    assert scale == 0.25 and neg.dtype == dtype and neg.shape == q.shape
    assert torch.isnan(neg.float().view(-1)[0])
    assert torch.equal(neg.float().view(-1)[1:], -q.float().view(-1)[1:])
    strided = q.transpose(1, 2)
    torch.testing.assert_close(signed_query(strided, -1.0)[0].float(), -strided.float(),
                               rtol=0, atol=0, equal_nan=True)


def test_fp8_kv_cache_splits_for_two_warp_groups_a_sm():
    # the decode shapes of the H100 sweep (16x64 tiles, two warp groups a CTA, 132 SMs)
    assert plan.num_splits(8, 512, 132, kv_fp8=True, groups=2) == 16  # 1,8/8,32768
    assert plan.num_splits(8, 128, 132, kv_fp8=True, groups=2) == 16  # 1,32/8,8192
    assert plan.num_splits(128, 64, 132, kv_fp8=True, groups=2) == 1  # 16,32/8,4096
    assert plan.num_splits(8, 128, 132, kv_fp8=True) == 33  # one group a CTA: twice the shares
    assert plan.num_splits(8, 128, 58, kv_fp8=True, groups=2) == 7  # an L4's 58 SMs
    # never more shares than warp groups can each take a block, never over MAX_SPLITS
    assert plan.num_splits(1, 3, 132, kv_fp8=True, groups=2) == 2
    assert plan.num_splits(1, 10**6, 132, kv_fp8=True) == plan.MAX_SPLITS
    assert plan.num_splits(16 * 132, 128, 132, kv_fp8=True, groups=2) == 1  # a full grid


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90"])
def test_a_decode_calls_tile_is_a_spec_of_its_arch(arch):
    """Whatever packed rows a decode call has, the tile ``tile=None`` resolves to builds on its
    arch (split or not, its rows packed or not), for 16-bit K/V and an FP8 KV cache."""
    from flashcore.specs import FP8_ARCHS, AttentionSpec

    for precision, d, causal in itertools.product(("fp16", "fp8kv"), (64, 128), (False, True)):
        if precision == "fp8kv" and arch not in FP8_ARCHS:
            continue
        for sq, group in itertools.product((1, 2, 3, 5, 8, 16), (2, 4, 8, 16, 24, 32, 64)):
            cfg = resolve_config(None, None, None, None, None, arch=arch, head_dim=d,
                                 causal=causal, seqlen_q=sq, precision=precision, group=group)
            for split, packed in itertools.product((False, True), (False, sq > 1)):
                AttentionSpec(arch=arch, head_dim=d, config=cfg, causal=causal,
                              kv_fp8=precision == "fp8kv", split_kv=split, packed_tokens=packed)


def test_hopper_mask_calls_take_the_tuned_wgmma_ws_winner():
    """On sm_90 a prefill call with bottom-right causal, a window or a soft-cap runs the tuned
    table's winner (the warp-specialised family builds those masks); what it does not build
    (split keys, soft-capping beside a mask where P goes through shared memory) runs the
    entry's fallback."""
    from flashcore.ops.masks import masking
    from flashcore.tuned import table

    calls = [(True, masking(True, "bottom_right", None, None)),
             (True, masking(True, "top_left", (255, 0), None)),
             (False, masking(False, "top_left", None, 30.0)),
             (True, masking(True, "bottom_right", (100, 0), 50.0)),
             (False, masking(False, "bottom_right", (64, 64), None)),
             (False, masking(False, "top_left", (64, -1), 30.0))]
    checked = 0
    for d, sq, (causal, mask) in itertools.product((64, 128), (1500, 4096), calls):
        tuned = table.entries("sm_90").get(table.key(d, causal, table.bucket_of(sq)))
        if tuned is None or tuned.config.family != "wgmma_ws":
            continue
        kw = {"arch": "sm_90", "head_dim": d, "causal": causal, "seqlen_q": sq,
              "precision": "fp16"}
        got = resolve_config(None, None, None, None, None, features=mask.features, **kw)
        shared = d == 128 and tuned.config.tile == (192, 128) and tuned.config.warps == 12
        refused = shared and mask.softcap is not None and (causal or mask.window is not None)
        assert got == (tuned.fallback if refused else tuned.config), (d, sq, mask)
        split = resolve_config(None, None, None, None, None,
                               features=mask.features + (("split_kv", True),), **kw)
        assert split == tuned.fallback and split.family != "wgmma_ws"
        checked += 1
    assert checked >= 16
    # FP8 operands: their masks on the warp-specialised winner too
    fp8 = plan.tuned_config("sm_90", 128, True, 4096, "fp8",
                            masking(True, "bottom_right", (300, 0), None).features)
    assert fp8 == table.entries("sm_90")[table.key(128, True, "long", "fp8")].config
    assert fp8.family == "wgmma_ws"


def test_wgmma_ws_launches_pass_the_masks_sizes_in_abi_order():
    """The launcher hands a warp-specialised kernel its descriptors, O, LSE, the softmax scale
    and q_group, then the masks' sizes (no key shares): one value per ABI parameter."""
    from unittest import mock

    from flashcore.compiler.abi import LOG2_E, params_for
    from flashcore.ops import launcher
    from flashcore.ops.inputs import rows_arg, tensor_arg
    from flashcore.ops.masks import masking
    from flashcore.specs import AttentionSpec

    config = TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws")
    q, k = torch.randn(2, 8, 300, 128).half(), torch.randn(2, 2, 500, 128).half()
    out, lse = torch.empty_like(q), torch.empty(2, 8, 300)
    mask = masking(True, "bottom_right", (100, 0), 20.0)
    spec = AttentionSpec(arch="sm_90", head_dim=128, config=config, causal=True,
                         return_lse=True, mask_align="bottom_right", window=True, softcap=True)
    kern = mock.Mock()
    kern.artifact.spec = spec
    launched = []
    with (mock.patch.object(launcher, "loaded_kernel", return_value=kern) as loaded,
          mock.patch.object(launcher, "tma_args",
                            return_value=((b"q",), (300, 8, 2), (b"k",), (500, 2, 2), (b"v",),
                                          (500, 2, 2))),
          mock.patch.object(launcher, "launch",
                            side_effect=lambda kern, grid, args, dev: launched.append(args)),
          mock.patch.object(torch.Tensor, "get_device", return_value=0)):
        launcher.launch_attention(q, k, out, lse, (tensor_arg(q), tensor_arg(k), tensor_arg(k)),
                                  (), config, True, 0.125, None, mask=mask)
    assert loaded.call_args.args[1].masks == ("bottom_right", True, True, False)  # its fields
    (args,) = launched
    assert len(args) == len(params_for(spec))
    assert args[6:8] == (tensor_arg(out), rows_arg(lse))
    assert args[8:] == ((0.125 * LOG2_E,), (1,), (100,), (0,), (0.125 / 20.0,), (20.0 / 0.125,))


def test_plans_are_memoised_per_key_block_count():
    """A decode loop whose keys grow by one plans once per key block: calls whose key lengths
    fill the same number of blocks share a plan (and launch the same way); one more block
    plans again, and its split count may differ."""
    from unittest import mock

    from flashcore.ops import launcher
    from flashcore.ops.inputs import tensor_arg

    q = torch.randn(1, 32, 1, 64).half()
    out = torch.empty_like(q)
    planned, launched = [], []
    real_plan = launcher.plan_launch

    def counting_plan(*key):
        planned.append(key)
        return real_plan(*key)

    with (mock.patch.object(launcher, "arch_of", return_value="sm_90"),
          mock.patch.object(plan, "sm_count", return_value=132),
          mock.patch.object(launcher, "loaded_kernel"),
          mock.patch.object(launcher, "combine_kernel"),
          mock.patch.object(launcher, "plan_launch", side_effect=counting_plan),
          mock.patch.object(launcher, "launch",
                            side_effect=lambda kern, grid, a, dev: launched.append((grid, a))),
          mock.patch.object(torch.Tensor, "get_device", return_value=0)):
        launcher.forget()
        for sk in (4097, 4100, 4160, 4161):
            k = torch.randn(1, 8, sk, 64).half()
            launcher.launch_attention(q, k, out, None, (tensor_arg(q), tensor_arg(k),
                                                        tensor_arg(k)), (), DECODE_DEFAULT,
                                      False, 0.125, None)
    assert [key[6] for key in planned] == [65, 66]  # 64-key blocks: 4097-4160 are 65
    # one launch a call: an eager split kernel merges its shares itself
    assert len(launched) == 4 and launched[0][0][1] > 1
    assert launched[0][0] == launched[1][0] == launched[2][0]  # the same grid: one plan
    launcher.forget()


def _big_ints_dropped(args: tuple) -> tuple:
    """Launch arguments without pointers (each call's output and scratch are fresh memory)."""
    return tuple(tuple(x for x in a if not (isinstance(x, int) and x > 2**24)) for a in args)


def test_a_repeated_call_is_checked_and_configured_once():
    """An eager loop of one call whose keys grow (decode) runs the checks and the config look-up
    once, plans once per key block, and launches exactly what the unmemoised path launches;
    what the memo is keyed on still gets every check (a float knob equal to a memoised int, a
    v that no longer matches k), a negative scale still negates q, and the masks fold anew
    for each key length."""
    from unittest import mock

    from flashcore.ops import eager, launcher

    q = torch.randn(1, 32, 1, 64).half()
    launched, kernels = [], []

    def loaded(device, key):
        kernels.append(key)
        return mock.Mock()

    with (stubbed_device(launched, loaded=loaded),
          mock.patch.object(eager, "check_qkv", wraps=eager.check_qkv) as checks,
          mock.patch.object(eager, "resolve_config", wraps=eager.resolve_config) as configs,
          mock.patch.object(launcher, "plan_launch", wraps=launcher.plan_launch) as plans):
        eager.forget()

        def call(k, scale=None, causal=False, num_splits=None, v=None):
            return eager.run(q, k, k if v is None else v, None, causal, scale, False, None,
                             None, None, None, num_splits, None, "fp16", None, None)

        for sk in range(4097, 4162):
            call(torch.randn(1, 8, sk, 64).half())
        assert (checks.call_count, configs.call_count, plans.call_count) == (1, 1, 2)
        k = torch.randn(1, 8, 4161, 64).half()
        launched.clear()
        call(k)
        eager._checked(q, k, k, None, False, None, False, None, None, None, None, None, None,
                       "fp16", None, None, "top_left", None, None, None)  # never memoised
        # split, one launch each (its last share merges)
        assert len(launched) == 2 and launched[0][0] == launched[1][0] and launched[0][0][1] > 1
        assert _big_ints_dropped(launched[0][1]) == _big_ints_dropped(launched[1][1])

        with pytest.raises(ValueError, match="differ in shape"):
            call(k, v=k[:, :, :-1])
        call(k, num_splits=2)
        with pytest.raises(ValueError, match="num_splits"):
            call(k, num_splits=2.0)
        checks.reset_mock()
        for _ in range(3):  # out= of one layout: checked once, its addresses every call
            out = torch.empty(1, 1, 32, 64).half().transpose(1, 2)
            assert eager.run(q, k, k, None, False, None, False, None, None, None, None, None,
                             out, "fp16", None, None) is out
        assert checks.call_count == 1
        clash = k.as_strided(out.shape, out.stride(), 64 * 100)  # the memoised layout, in k
        with pytest.raises(ValueError, match="shares memory with k"):
            eager.run(q, k, k.clone(), None, False, None, False, None, None, None, None, None,
                      clash, "fp16", None, None)
        for _ in range(2):  # checked, then memoised: q negated both times
            launched.clear()
            call(k, scale=-0.125)
            assert launched[0][1][0][0] != q.data_ptr()  # the query is a negated copy
        from flashcore.tuned import table

        configs.reset_mock()
        call(k)
        table.clear()  # a new tuned table (autotune): memoised configs are read again
        call(k)
        assert configs.call_count == 1
        kernels.clear()
        for sk in (1, 2, 1):  # one key: the causal diagonal hides nothing
            call(torch.randn(1, 8, sk, 64).half(), causal=True)
        assert [key.causal for key in kernels] == [False, True]
        eager.forget()


def test_alibi_calls_keep_a_row_per_head_and_pass_their_slopes_after_the_masks():
    """ALiBi's slope is one per (batch, head) a CTA: a GQA decode with it packs no heads or
    tokens; its slopes (pointer, batch, heads, batch stride 0 for one a head) follow the mask
    arguments; what it cannot run is refused by name, and so is an input that requires grad."""

    from flashcore.ops import attention, launcher
    from flashcore.ops.masks import masking

    launched = []
    q = torch.randn(1, 8, 1, 64).half()
    k = torch.randn(1, 2, 300, 64).half()
    slopes = torch.rand(8)
    with stubbed_device(launched, capturing=True):  # split over CTAs, as a graph runs it
        alibi = masking(True, "top_left", None, None, True)
        for sq, d in itertools.product((1, 100, 1000, 4096), (64, 96, 128, 256)):
            # the Hopper family builds no ALiBi: its tuned winners give way to their fallbacks
            assert plan.tuned_config("sm_90", d, True, sq, "fp16", alibi.features).family != (
                "wgmma_ws")
        p = launcher.plan_launch(0, 1, 8, 1, 64, 2, 5, torch.float16, DECODE_DEFAULT, False,
                                 False, "fp16", False, False,
                                 masking(False, "top_left", None, None, True), False, 0, 0, 0,
                                 None, 0.125)
        assert p.packing == launcher.AS_IS and p.grid[0] == 8  # a CTA per (batch, head)
        launcher.forget()
        attention(q, k, k, causal=True, alibi_slopes=slopes)
        split = launched[0][1]
        assert split[-1] == (slopes.data_ptr(), 1, 8, 0)  # after the softmax scalars
        per_batch = torch.rand(1, 8)
        attention(q, k, k, causal=True, alibi_slopes=per_batch)
        assert launched[-2][1][-1] == (per_batch.data_ptr(), 1, 8, 8)
        for bad, what in (({"alibi_slopes": torch.rand(4)}, "alibi_slopes must be float32"),
                          ({"alibi_slopes": slopes.double()}, "alibi_slopes must be float32"),
                          ({"alibi_slopes": slopes, "softmax_scale": 0.0}, "alibi_slopes"),
                          ({"alibi_slopes": slopes, "precision": "fp8"}, "alibi_slopes")):
            with pytest.raises(ValueError, match=what):
                attention(q, k, k, **bad)
        with pytest.raises(RuntimeError, match="ALiBi"):
            attention(q.requires_grad_(), k, k, alibi_slopes=slopes)
        launcher.forget()


def test_every_registered_op_reports_its_outputs_under_fake_tensors():
    """Each registered op's fake (made from its one signature) gives the shapes and dtypes the
    op returns, whether its arguments come by position or by name."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import flashcore.ops.library  # noqa: F401  (registers the ops)

    ops = torch.ops.flashcore
    e4m3 = torch.float8_e4m3fn
    with FakeTensorMode():
        q = torch.empty(2, 8, 300, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(2, 2, 500, 64, device="cuda", dtype=torch.bfloat16)
        out, lse = ops.attention(q, k, k, True, None, True)  # by position
        assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 8, 300)
        out, lse = ops.attention(q, k, k, causal=True, window=[3, 0])
        assert out.shape == q.shape and lse.numel() == 0
        q8, k8 = q.to(e4m3), k.to(e4m3)
        vt8 = torch.empty(2, 2, 64, 512, device="cuda", dtype=e4m3)
        qd, kd, vd = (torch.empty(s, device="cuda") for s in ((2, 8, 300), (2, 2), (2, 2)))
        out, lse = ops.attention_fp8(q8, k8, vt8, qd, kd, vd, return_lse=True,
                                     out_dtype=torch.bfloat16)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (2, 8, 300)
        x8, descale = ops.quantize_fp8(k, True)
        assert x8.shape == (2, 2, 64, 512) and x8.dtype == e4m3 and descale.shape == (2, 2)
        x8, descale = ops.quantize_fp8(k, granularity="token")
        assert x8.shape == k.shape and descale.shape == (2, 2, 500)


def test_an_eager_short_decode_runs_unsplit_and_a_captured_one_splits():
    """Eager (no graph being captured), a decode grid whose unsplit walk takes at most
    ``EAGER_ONE_LAUNCH_BLOCKS`` runs as one launch (no shares, no combine: the launches' host
    time is what such a call costs); a graph capturing the same call splits it as the model
    says (two launches: the split kernel and the combine), and long caches split either way,
    eagerly in one launch whose last share merges."""
    from flashcore.ops import attention, launcher

    assert plan.num_splits(8, 8, 132) > 1 and plan.num_splits(8, 8, 132, host_bound=True) == 1
    # 13 blocks + 2 of overhead + the partials' traffic: within 16
    assert plan.num_splits(8, 13, 132, host_bound=True) == 1
    assert plan.num_splits(8, 14, 132, host_bound=True) == plan.num_splits(8, 14, 132) > 1
    assert plan.num_splits(8, 128, 132, host_bound=True) == plan.num_splits(8, 128, 132) == 16
    q = torch.randn(1, 32, 1, 64).half()
    short, long = torch.randn(1, 8, 512, 64).half(), torch.randn(1, 8, 8192, 64).half()
    for capturing, k, launches, split in ((False, short, 1, False), (True, short, 2, True),
                                          (False, long, 1, True), (True, long, 2, True)):
        launched: list = []
        with stubbed_device(launched, capturing=capturing):
            launcher.forget()
            for _ in range(2):  # checked, then memoised: the same plan
                launched.clear()
                attention(q, k, k)
                assert len(launched) == launches, (capturing, k.shape)
                assert (launched[0][0][1] > 1) == split


def test_short_prefill_over_many_heads_takes_the_mid_buckets_tile():
    """The short bucket's small tiles are for small grids: a call whose grid in the mid
    bucket's tiles fills about half the SMs runs the mid config (an eager call's own batch and
    heads decide); a small grid, or fewer query rows than one mid tile, keeps the short one;
    decode and FP8 keep theirs."""
    from unittest import mock

    from flashcore.ops import attention, launcher
    from flashcore.tuned import table

    def short_and_mid(d, causal):
        return (table.lookup("sm_90", d, causal, "short"), table.lookup("sm_90", d, causal, "mid"))

    for d, causal in itertools.product((64, 128), (False, True)):
        short, mid = short_and_mid(d, causal)
        assert short.tile_m < mid.tile_m
        tiles, least = -(-512 // mid.tile_m), plan.SHORT_TO_MID_WAVES * 132
        many = math.ceil(least / tiles)  # the fewest pairs whose mid grid is that many waves
        few = many - 1
        assert plan.tuned_config("sm_90", d, causal, 512, "fp16", pairs=few, slots=132) == short
        assert plan.tuned_config("sm_90", d, causal, 512, "fp16", pairs=many, slots=132) == mid
        assert plan.tuned_config("sm_90", d, causal, 512, "fp16") == short  # no grid given
        # fewer query rows than one mid tile: the short tile, on any grid
        rows = mid.tile_m - 1
        assert plan.tuned_config("sm_90", d, causal, rows, "fp16", pairs=1 << 14,
                                 slots=132) == short
        assert plan.tuned_config("sm_90", d, causal, 4, "fp16", pairs=4096, slots=132) == \
            table.lookup("sm_90", d, causal, "decode", "fp16", (("split_kv", True),))
    fp8 = table.lookup("sm_90", 128, True, "short", "fp8")
    assert plan.tuned_config("sm_90", 128, True, 512, "fp8", pairs=4096, slots=132) == fp8
    # through an eager call: (8, 16) pairs at 512 tokens take the mid tile, (1, 8) the short one
    short, mid = short_and_mid(128, True)
    for b, h, want in ((8, 16, mid), (1, 8, short)):
        launched: list = []
        configs = []

        def loaded(device, key, configs=configs):
            configs.append(key.config)
            return mock.Mock(tma_args_memo={}, tensor_maps=())

        q = torch.randn(b, h, 512, 128).half()
        k = torch.randn(b, 4 if h == 16 else h, 512, 128).half()
        with stubbed_device(launched, loaded=loaded):
            launcher.forget()
            attention(q, k, k, causal=True)
        assert configs == [want], (b, h)


def test_eager_split_calls_merge_where_the_host_bounds_them():
    """An eager split call merges its shares in its last CTA (one launch) where its modelled
    time is short of the host's work, and keeps the combine where the GPU bounds it. The H100
    figures behind the line (``scripts/eager_split_bench.py``, host and GPU µs a call, merged
    against the combine): 1,32/8,1x4096 d128 25.6 against 31.0 (GPU 12.6, 9.8); 2,32/8,1x16384
    d64 32.7 against 38.9 (GPU 32.4, 31.8); 1,8/8,1x32768 d128 53.4 against 51.0 (GPU 52.9,
    50.6); 4,32/8,1x8192 d128 52.5 against 52.0."""
    def merges(b, hkv, group, keys, d):
        ctas = b * hkv * -(-group // 16)  # a K/V head's packed query heads, 16 rows a tile
        n_blocks = -(-keys // 64)
        splits = plan.num_splits(ctas, n_blocks, 132, rows=16, head_dim=d, host_bound=True)
        return splits > 1 and plan.merges_shares(splits, ctas, n_blocks, 132, 16, d)

    assert merges(1, 8, 4, 4096, 128) and merges(1, 8, 4, 8192, 128)
    assert merges(1, 4, 4, 2048, 128) and merges(2, 8, 4, 16384, 64)
    assert not merges(1, 8, 1, 32768, 128) and not merges(4, 8, 4, 8192, 128)
