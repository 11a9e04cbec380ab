"""CPU properties of the E4M3 quantisation the FP8 path uses (reference arithmetic), of the
replay of the FP8 kernel's block loop (``reference.attention_fp8_online``), and the FP8 kernel's
compile checks."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcore import reference
from flashcore.ops.fp8 import key_permutation
from flashcore.specs import AttentionSpec, QuantizeSpec, SpecError, TileConfig
from tests.kernels import assert_no_spills_in_loops


def _tensor(seed, shape, log_mag, dtype, outlier, pattern):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10.0**log_mag
    if pattern == "constant":
        x = torch.full(shape, 10.0**log_mag)
    elif pattern == "alternating":
        x = torch.ones(shape) * 10.0**log_mag
        x[..., 1::2] *= -1
    if outlier:
        x[0, 0, 0, 0] = 10.0 ** (log_mag + 4)
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    s=st.integers(1, 70),
    log_mag=st.floats(-3, 30),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    outlier=st.booleans(),
    pattern=st.sampled_from(["randn", "constant", "alternating"]),
)
def test_scales_never_saturate_and_round_trip_within_e4m3_spacing(
    seed, b, h, s, log_mag, dtype, outlier, pattern
):
    if dtype == torch.float16:
        log_mag = min(log_mag, 4.0)  # fp16 tops out at 65504
    x = _tensor(seed, (b, h, s, 64), log_mag, dtype, outlier, pattern)
    assert torch.isfinite(x.float()).all()
    codes, descale = reference.quantize_e4m3(x)
    assert torch.isfinite(codes).all() and torch.isfinite(descale).all()
    assert (descale > 0).all()
    # every code within the e4m3 range, and the head's largest value lands on (or next to) 448
    assert codes.abs().max() <= reference.E4M3_MAX
    amax = x.float().abs().amax(dim=(2, 3))
    big = amax > reference.AMAX_FLOOR
    assert (codes.abs().amax(dim=(2, 3))[big] >= 416).all()  # 416: the e4m3 step below 448
    # round trip: within half an e4m3 step (relative 2^-4 for normals; 2^-10 absolute for the
    # subnormal range, in units of the scale)
    xs = x.double()
    back = reference.dequantize_e4m3(codes, descale)
    d = descale.double()[:, :, None, None]
    bound = torch.maximum(xs.abs() * 2.0**-4, d * 2.0**-10) * (1 + 1e-6)
    assert ((back - xs).abs() <= bound).all()


def test_e4m3_round_saturates_instead_of_nan():
    x = torch.tensor([500.0, -1e9, 448.0, 0.0])
    assert reference.e4m3_round(x).tolist() == [448.0, -448.0, 448.0, 0.0]


def test_fp8_reference_is_close_to_exact_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = ((torch.randn(1, 2, 96, 64, generator=g) * 300).to(torch.bfloat16) for _ in range(3))
    # raw values far beyond ±448; the softmax scale keeps the logits O(1), as a model's would
    scale = 1.0 / (8.0 * 300 * 300)
    exact = reference.attention(q, k, v, causal=True, softmax_scale=scale)
    sim = reference.attention_fp8(q, k, v, causal=True, softmax_scale=scale)
    rel = ((sim - exact).norm() / exact.norm()).item()
    assert 0 < rel < 5e-2


# -- the kernel's block loop (reference.attention_fp8_online) ---------------------------------------
TILES = [(16, 16), (64, 64), (128, 32), (32, 128), (64, 16), (128, 128)]


def _qkv_fp8(seed, b, h, sq, sk, d, dtype, mag=1.0):
    """fp16/bf16 q, k, v and their e4m3 (codes, descale) pairs as the quantiser makes them."""
    g = torch.Generator().manual_seed(seed)
    limit = torch.finfo(dtype).max
    q, k, v = ((torch.randn(b, h, s, d, generator=g, dtype=torch.float64) * mag)
               .clamp(-limit, limit).to(dtype) for s in (sq, sk, sk))
    codes = [reference.quantize_e4m3(t, gr) for t, gr in ((q, "token"), (k, "token"), (v, "head"))]
    return (q, k, v), codes


def _online(codes, **kw):
    (qc, qd), (kc, kd), (vc, vd) = codes
    return reference.attention_fp8_online(qc, qd, kc, kd, vc, vd, **kw)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _kernel_loop(codes, causal, scale, tile, round_p, kv_splits=1, sum_rounded_p=False):
    """The kernel's loop written out row by row from its description, independently of the
    vectorised one. With one split every key block is visited, those a causal tile skips being
    fully masked; with several, split g of a tile walks its share of the tile's blocks.
    ``sum_rounded_p``: the row sum adds P as the P·V product reads it (the Hopper kernel's
    tensor cores sum the rows)."""
    (qc, qd), (kc, kd), (vc, vd) = codes
    tile_m, tile_n = tile
    b_, h_, sq, _ = qc.shape
    sk = kc.shape[2]
    n_all = -(-sk // tile_n)
    out = torch.zeros(b_, h_, sq, vc.shape[-1], dtype=torch.float64)
    for b, h, i in itertools.product(range(b_), range(h_), range(sq)):
        rs = scale * math.log2(math.e) * qd[b, h, i].item()
        if kv_splits == 1:
            shares = [range(n_all)]
        else:
            n_max = min(n_all, math.ceil((i // tile_m + 1) * tile_m / tile_n)) if causal else n_all
            per = math.ceil(n_max / kv_splits)
            shares = [range(g * per, min((g + 1) * per, n_max)) for g in range(kv_splits)]
        states = []
        for share in shares:
            m, l, acc = -math.inf, 0.0, torch.zeros(vc.shape[-1], dtype=torch.float64)
            for n in reversed(share):
                k0, k1 = n * tile_n, min((n + 1) * tile_n, sk)
                s = (kc[b, h, k0:k1] @ qc[b, h, i]) * kd[b, h, k0:k1]
                s = torch.where(torch.tensor([causal and j > i for j in range(k0, k1)]),
                                -math.inf, s)
                cur = max(m, s.max().item())
                safe = 0.0 if cur == -math.inf else cur
                p = torch.exp2(s * rs - safe * rs)
                corr = 0.0 if m == -math.inf else 2.0 ** (m * rs - safe * rs)
                pv = p * reference.P_SCALE
                pr = reference.e4m3_round(pv) if round_p else pv
                l = l * corr + (pr.sum().item() / reference.P_SCALE if sum_rounded_p
                                else p.sum().item())
                acc = acc * corr + pr @ vc[b, h, k0:k1]
                m = cur
            states.append((m, l, acc))
        top = max(m for m, _, _ in states)
        safe = 0.0 if top == -math.inf else top
        w = [0.0 if m == -math.inf else 2.0 ** (m * rs - safe * rs) for m, _, _ in states]
        l = sum(wi * st_[1] for wi, st_ in zip(w, states))
        acc = sum(wi * st_[2] for wi, st_ in zip(w, states))
        if l > 0:
            out[b, h, i] = acc / l * (vd[b, h].item() / reference.P_SCALE)
    return out


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    sq=st.integers(1, 40),
    sk=st.integers(1, 70),
    tile=st.sampled_from(TILES),
    kv_splits=st.sampled_from([1, 1, 2, 4]),
    causal=st.booleans(),
    round_p=st.booleans(),
    sum_rounded_p=st.booleans(),
)
def test_online_simulation_matches_the_loop_written_out(
    seed, sq, sk, tile, kv_splits, causal, round_p, sum_rounded_p
):
    # with one split this also shows that skipping a causal tile's blocks above its diagonal is
    # the same as visiting them fully masked
    _, codes = _qkv_fp8(seed, 1, 2, sq, sk, 16, torch.bfloat16)
    got = _online(codes, causal=causal, softmax_scale=0.3, tile=tile, kv_splits=kv_splits,
                  round_p=round_p, sum_rounded_p=sum_rounded_p)
    want = _kernel_loop(codes, causal, 0.3, tile, round_p, kv_splits, sum_rounded_p)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * want.abs().max().item())


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    sq=st.integers(1, 150),
    sk=st.integers(1, 300),
    d=st.sampled_from([16, 64]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    tile=st.sampled_from(TILES),
    kv_splits=st.sampled_from([1, 2, 4]),
    causal=st.booleans(),
)
def test_online_without_p_rounding_is_exact_softmax(
    seed, b, h, sq, sk, d, dtype, tile, kv_splits, causal
):
    # the online rescaling is exact arithmetic up to float64 rounding: only P's e4m3 rounding
    # can tell the block loop from the final-max computation
    _, codes = _qkv_fp8(seed, b, h, sq, sk, d, dtype)
    got = _online(codes, causal=causal, softmax_scale=None, tile=tile, kv_splits=kv_splits,
                  round_p=False)
    want = reference.attention(*(reference.dequantize_e4m3(*c) for c in codes), causal=causal)
    assert got.dtype == torch.float64 and got.shape == want.shape
    assert _rel(got, want) < 1e-12
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12 * want.abs().max().item())


@pytest.mark.parametrize("causal", [False, True])
def test_per_head_k_simulation_quantises_k_per_head(causal):
    """``k_scale="head"``: the replay quantises K with one scale per (batch, head) and, without
    P's rounding, is exact attention of those dequantised codes; an outlier token costs the
    other keys precision (a per-token K keeps them closer to exact attention)."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 3, s, 64, generator=g).half() for s in (70, 150, 150))
    k[:, :, 7] *= 100.0
    got = reference.attention_fp8(q, k, v, causal=causal, tile=(64, 64), round_p=False,
                                  k_scale="head")
    codes = [reference.quantize_e4m3(t, g) for t, g in ((q, "token"), (k, "head"), (v, "head"))]
    assert codes[1][1].shape == (2, 3)
    want = reference.attention(*(reference.dequantize_e4m3(*c) for c in codes), causal=causal)
    assert _rel(got, want.to(q.dtype).double()) < 1e-12
    others = torch.ones(150, dtype=torch.bool)
    others[7] = False
    per_head = reference.dequantize_e4m3(*codes[1])[:, :, others]
    per_token = reference.dequantize_e4m3(*reference.quantize_e4m3(k, "token"))[:, :, others]
    assert _rel(per_token, k[:, :, others]) < _rel(per_head, k[:, :, others])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile", [(64, 64), (128, 128)])
def test_online_with_one_key_block_rounds_p_as_the_final_max_reference(causal, tile):
    # every row meets its final max in its first (only) block, so P rounds identically
    _, codes = _qkv_fp8(7, 2, 2, 50, tile[1] - 3, 64, torch.float16)
    got = _online(codes, causal=causal, softmax_scale=None, tile=tile)
    deq = (reference.dequantize_e4m3(*c) for c in codes)
    want = reference.attention(
        *deq, causal=causal,
        p_round=lambda p: reference.e4m3_round(p * reference.P_SCALE) / reference.P_SCALE,
    )
    assert _rel(got, want) < 1e-12


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    sq=st.integers(16, 150),
    blocks=st.integers(3, 5),
    ragged=st.integers(0, 15),
    d=st.sampled_from([64, 128]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    tile=st.sampled_from([(64, 64), (128, 32), (64, 16), (128, 128)]),
    causal=st.booleans(),
)
def test_running_max_rounding_differs_from_final_max_by_a_few_percent(
    seed, sq, blocks, ragged, d, dtype, tile, causal
):
    sk = blocks * tile[1] - ragged
    sq = max(sq, sk) if causal else sq  # causal: let most rows reach several blocks
    (q, k, v), _ = _qkv_fp8(seed, 1, 2, sq, sk, d, dtype)
    online = reference.attention_fp8(q, k, v, causal=causal, tile=tile)
    final = reference.attention_fp8(q, k, v, causal=causal)
    assert torch.isfinite(online).all() and online.dtype == torch.float64
    # the output is rounded to q's dtype, as the kernel writes it
    assert torch.equal(online, online.to(dtype).to(torch.float64))
    rel = _rel(online, final)
    assert 0 < rel < 4e-2, rel


def test_rows_whose_first_blocks_are_all_masked():
    # causal tile_m=128, tile_n=16: query tile 0 starts at key block 7 (keys 112..), so rows
    # 0..111 begin with fully masked blocks and keep max -inf until they reach a visible key
    tile, sq, sk = (128, 16), 200, 160
    _, codes = _qkv_fp8(3, 2, 2, sq, sk, 64, torch.float16)
    deq = [reference.dequantize_e4m3(*c) for c in codes]
    got = _online(codes, causal=True, softmax_scale=None, tile=tile)
    want = reference.attention(*deq, causal=True)
    assert torch.isfinite(got).all()
    # row 0 sees key 0 alone: P = 1 is exact in e4m3, so the output is v_0 exactly
    torch.testing.assert_close(got[:, :, 0], deq[2][:, :, 0], rtol=1e-15, atol=0)
    # P rounding moves each row by at most half an e4m3 step: 2^-4 of each p_j (normals) or
    # 2^-10 / P_SCALE (subnormals), against l >= 1
    vis = deq[2].abs().unsqueeze(2).expand(-1, -1, sq, -1, -1).clone()  # (B, H, Sq, Sk, D)
    vis[:, :, torch.ones(sq, sk, dtype=torch.bool).triu(1)] = 0
    bound = 2.0**-4 * vis.amax(dim=3) + 2.0**-18 * vis.sum(dim=3)
    assert ((got - want).abs() <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("dtype, mag", [(torch.float16, 1e4), (torch.bfloat16, 1e4),
                                        (torch.bfloat16, 1e30)])
@pytest.mark.parametrize("causal", [False, True])
def test_online_simulation_of_huge_inputs_is_finite(dtype, mag, causal):
    (q, k, v), _ = _qkv_fp8(11, 1, 2, 70, 150, 64, dtype, mag)
    # default scale: logits of ~mag^2, softmax a hard argmax
    hard = reference.attention_fp8(q, k, v, causal=causal, tile=(64, 32))
    assert torch.isfinite(hard).all() and hard.abs().max() > 0
    # a scale that keeps the logits O(1), as a model's would
    soft = reference.attention_fp8(q, k, v, causal=causal, tile=(64, 32),
                                   softmax_scale=1.0 / (8.0 * mag * mag))
    assert torch.isfinite(soft).all()
    assert _rel(soft, reference.attention_fp8(q, k, v, causal=causal,
                                              softmax_scale=1.0 / (8.0 * mag * mag))) < 4e-2


def test_key_permutation_is_a_permutation_matching_the_mma_register_order():
    perm = key_permutation()
    assert sorted(perm) == list(range(32))
    # thread t of a quad holds accumulator columns {2t, 2t+1} of every n8 tile; A-operand
    # position 16h + 4t + i must hold tile (2h + i//2), column 2t + i%2
    for p in range(32):
        h, rest = divmod(p, 16)
        t, i = divmod(rest, 4)
        assert perm[p] == 8 * (2 * h + i // 2) + 2 * t + i % 2


def test_fp8_specs_refuse_sm80():
    with pytest.raises(SpecError, match="sm_80 does not have"):
        AttentionSpec(arch="sm_80", precision="fp8")
    with pytest.raises(SpecError, match="e4m3 needs"):
        QuantizeSpec(arch="sm_80")


@pytest.mark.parametrize("arch", ["sm_89", "sm_90"])
def test_fp8_kernel_compiles_with_e4m3_mma(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path))
    from flashcore.compiler.compiler import compile_many

    att = AttentionSpec(arch=arch, head_dim=128, causal=True, precision="fp8", config=TileConfig((128, 64), warps=8))
    quant = QuantizeSpec(arch=arch, dtype="bfloat16", head_dim=128, transpose=True)
    a, qz = compile_many([att, quant], jobs=2)
    n_mma = a.ptx.count("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32")
    # the block loop is emitted once per masked step (causal 128x64: 2) plus once unmasked;
    # per block: S (rows/16 x n/8 x d/32) and O (rows/16 x d/8 x n/32) per warp
    rows = 128 // 8
    per_block = (rows // 16) * (64 // 8) * (128 // 32) + (rows // 16) * (128 // 8) * (64 // 32)
    assert n_mma == 3 * per_block
    assert "mma.sync.aligned.m16n8k16" not in a.ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in a.ptx  # P to e4m3
    # at most a few values parked across the key loop (as in test_compile), none inside it
    assert_no_spills_in_loops(a, att.name)
    assert "cvt.rn.satfinite.e4m3x2.f32" in qz.ptx
    assert math.isclose(a.smem_dynamic, att.smem_bytes)
    from flashcore.compiler.inspect import sass, sass_opcodes

    text = sass(a.cubin)
    if text is None:
        return  # nvdisasm not installed: the PTX checks above are all we can do
    ops = sass_opcodes(text)
    qmma = sum(op.startswith("QMMA.16832") for op in ops)
    hmma = sum(op.startswith("HMMA") for op in ops)
    if arch == "sm_89":  # Ada: native e4m3 tensor-core MMA, one QMMA per mma.sync
        assert qmma == n_mma and hmma == 0
    else:
        # Hopper has e4m3 only in wgmma: ptxas lowers each e4m3 mma.sync to unpacks to f16 and
        # two HMMA.16816, so this kernel cannot beat the fp16 one there (docs/tried-and-dropped.md)
        assert qmma == 0 and hmma == 2 * n_mma
        assert any(op.startswith("F2FP.F16.E4M3.UNPACK") for op in ops)


def test_per_head_scales_take_an_amax_pass_then_a_cast_of_many_ctas(tmp_path, monkeypatch):
    """A per-(batch, head) scale is two kernels: ``AMAX_SHARES`` CTAs per (batch, head) write
    partial maxima (16-byte loads), then the cast runs a CTA per block of rows (or keys) and
    reduces the shares itself (one warp's shuffles) before a single 16-byte load a thread. The
    ABI names the shares' tensor; ``part="amax"`` is only the per-head scale's first pass."""
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path))
    from flashcore.compiler.abi import params_for
    from flashcore.compiler.compiler import compile_many
    from flashcore.compiler.inspect import sass, sass_opcodes
    from flashcore.specs.quantize import AMAX_SHARES

    assert AMAX_SHARES == 32  # a warp's lanes: lane i reads share i
    with pytest.raises(SpecError, match="first pass"):
        QuantizeSpec(arch="sm_90", granularity="token", part="amax")
    with pytest.raises(SpecError, match="first pass"):
        QuantizeSpec(arch="sm_90", transpose=True, part="amax")
    amax, cast, vt = (QuantizeSpec(arch="sm_89", head_dim=128, **kw)
                      for kw in ({"part": "amax"}, {}, {"transpose": True}))
    assert amax.name.endswith("_amax") and amax.smem_bytes == 4 * 8 and cast.smem_bytes == 0
    assert [p.name for p in params_for(amax)] == ["x", "partial"]
    assert [p.name for p in params_for(cast)] == [p.name for p in params_for(vt)] == [
        "x", "out", "partial", "descale"]
    arts = compile_many([amax, cast, vt], jobs=2)
    for art in arts[1:]:
        assert "shfl.sync.bfly" in art.ptx  # the shares' max, in every warp
        assert "bar.sync" not in art.ptx  # no CTA-wide reduction left in the casts
    assert "bar.sync" in arts[0].ptx
    text = sass(arts[0].cubin)
    if text is not None:
        assert "LDG.E.128" in sass_opcodes(text)


def test_sums_of_rounded_p_weigh_v_by_weights_that_sum_to_one():
    """Summing P as the P·V product reads it normalises the rounded weights exactly: a V of
    ones gives exactly 1 in every row (times its descale), where the sums of unrounded P
    leave each row off by its P's rounding (percents with few keys)."""
    _, codes = _qkv_fp8(5, 1, 2, 9, 5, 16, torch.float16)
    (qc, qd), (kc, kd), _ = codes
    ones = torch.ones_like(codes[2][0])  # e4m3 1.0 codes, descale 1
    vd = torch.ones(1, 2)
    kw = {"causal": False, "softmax_scale": 2.0, "tile": (16, 16)}
    summed = reference.attention_fp8_online(qc, qd, kc, kd, ones, vd, sum_rounded_p=True, **kw)
    torch.testing.assert_close(summed, torch.ones_like(summed), rtol=1e-14, atol=0)
    unrounded = reference.attention_fp8_online(qc, qd, kc, kd, ones, vd, **kw)
    assert (unrounded - 1).abs().max() > 1e-3
    with pytest.raises(ValueError, match="sum_rounded_p"):
        reference.attention_fp8(*_qkv_fp8(5, 1, 1, 3, 3, 16, torch.float16)[0],
                                sum_rounded_p=True)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    sq=st.integers(1, 150),
    sk=st.integers(1, 300),
    tile=st.sampled_from(TILES),
    causal=st.booleans(),
    align=st.sampled_from(["top_left", "bottom_right"]),
    window=st.one_of(st.none(), st.tuples(st.integers(-1, 200), st.integers(-1, 200))),
)
def test_online_replay_with_masks_without_p_rounding_is_exact_softmax(
    seed, sq, sk, tile, causal, align, window
):
    """The replay walks the masks' key blocks (bottom-right alignment, windows) as the kernels
    do: without P's rounding it is exact attention of the codes under the same masks, rows
    that see no key 0."""
    if causal and window is not None and window[1] > 0:
        window = (window[0], 0)
    if align == "bottom_right" and not causal and window is None:
        align = "top_left"
    _, codes = _qkv_fp8(seed, 1, 2, sq, sk, 16, torch.float16)
    (qc, qd), (kc, kd), (vc, vd) = codes
    bounds = reference.key_bounds(sq, sk, causal, align, window)
    got = reference.attention_fp8_online(qc, qd, kc, kd, vc, vd, causal=causal,
                                         softmax_scale=None, tile=tile, round_p=False,
                                         bounds=bounds)
    want = reference.attention(*(reference.dequantize_e4m3(*c) for c in codes), causal=causal,
                               mask_align=align, window=window)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12 * max(1.0, want.abs().max()))
