"""GPU tests of grouped-query attention, decode (split-KV across CTAs and its combine) and the
FP8 KV cache, against the float64 reference.

Skipped without CUDA. The bound is the one the prefill tests use: 2x torch SDPA's own error
(SDPA with ``enable_gqa``) plus what rounding alone may do (``test_gpu_attention._allowed``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flashcore import reference
from flashcore.ops import attention
from flashcore.ops.fp8 import quantize_fp8
from flashcore.specs import MAX_SPLITS
from flashcore.tuned.table import default_config
from tests.gpu_utils import (
    FP8_KV_CONFIGS,
    allowed_error,
    check_masked_result,
    head_dims,
    max_abs,
    requires_cuda,
)

pytestmark = [pytest.mark.gpu, requires_cuda]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _qkv(b, hq, hkv, sq, sk, d, dtype, seed, magnitude=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(h, s):
        return (torch.randn(b, h, s, d, device="cuda", generator=g) * magnitude).to(dtype)

    return mk(hq, sq), mk(hkv, sk), mk(hkv, sk)


def sdpa(q, k, v, causal):
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def _check(q, k, v, causal, **knobs):
    """Poisoned output and LSE of one call against the float64 reference and SDPA's error."""
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, device=q.device)
    out = torch.full_like(q, float("nan"))
    res, lse = attention(q, k, v, causal=causal, return_lse=True, out=out, **knobs)
    torch.cuda.synchronize()
    assert res is out and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "NaN or unwritten elements"
    err = max_abs(out, ref)
    err_sdpa = max_abs(sdpa(q, k, v, causal), ref)
    allowed = allowed_error(err_sdpa, ref, q.dtype, q, k, v)
    assert err <= allowed, f"max err {err:.3g} vs SDPA's {err_sdpa:.3g} (allowed {allowed:.3g})"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "-inf LSE exactly where no key is seen"
    assert max_abs(lse[finite], ref_lse[finite]) < 1e-3 * max(1.0, ref_lse.abs().max().item())


@settings(settings.get_profile("gpu"))
@given(
    b=st.integers(1, 3),
    hkv=st.integers(1, 4),
    group=st.sampled_from([1, 2, 4, 8, 32]),
    sq=st.one_of(st.just(1), st.integers(1, 16), st.integers(17, 200)),
    sk=st.one_of(st.integers(1, 300), st.integers(1, 65536)),
    d=head_dims(),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    causal=st.booleans(),
    num_splits=st.one_of(st.none(), st.integers(1, 48)),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, hkv=8, group=4, sq=1, sk=8192, d=128, dtype="float16", causal=False,
         num_splits=None, seed=1)
@example(b=2, hkv=1, group=32, sq=1, sk=65536, d=128, dtype="bfloat16", causal=False,
         num_splits=None, seed=2)
@example(b=1, hkv=2, group=4, sq=3, sk=40, d=64, dtype="float16", causal=True, num_splits=9,
         seed=3)
@example(b=1, hkv=2, group=8, sq=1, sk=9000, d=256, dtype="bfloat16", causal=False,
         num_splits=None, seed=4)  # the wide decode tile, split and combined
@example(b=2, hkv=1, group=4, sq=1, sk=3000, d=96, dtype="float16", causal=True,
         num_splits=None, seed=5)  # a combine with idle threads (24 of a share's row)
def test_gqa_and_decode_match_reference(b, hkv, group, sq, sk, d, dtype, causal, num_splits,
                                        seed):
    # keep the float64 reference's score matrix within a few hundred MB
    while b * hkv * group * sq * sk > 2**25 and sk > 1:
        sk //= 2
    if num_splits is not None and sq > 16:
        num_splits = min(num_splits, 4)  # prefill splits are legal too, just slow here
    q, k, v = _qkv(b, hkv * group, hkv, sq, sk, d, DTYPES[dtype], seed)
    _check(q, k, v, causal, num_splits=num_splits)


@settings(settings.get_profile("gpu"))
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 4),
    group=st.sampled_from([2, 3, 4, 8]),
    sq=st.integers(2, 15),
    sk=st.one_of(st.integers(1, 300), st.integers(1, 20000)),
    d=head_dims(),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    causal=st.booleans(),
    align=st.sampled_from(["top_left", "bottom_right"]),
    window=st.one_of(st.none(), st.tuples(st.integers(-1, 600), st.integers(-1, 600))),
    bshd=st.booleans(),
    num_splits=st.one_of(st.none(), st.integers(1, 20)),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, hkv=8, group=4, sq=4, sk=8192, d=128, dtype="float16", causal=True,
         align="bottom_right", window=None, bshd=True, num_splits=None, seed=1)
@example(b=2, hkv=2, group=3, sq=5, sk=700, d=64, dtype="bfloat16", causal=True,
         align="top_left", window=None, bshd=False, num_splits=7, seed=2)
@example(b=1, hkv=1, group=8, sq=3, sk=2000, d=128, dtype="float16", causal=True,
         align="bottom_right", window=(100, 0), bshd=True, num_splits=None, seed=3)
@example(b=2, hkv=3, group=4, sq=7, sk=3001, d=64, dtype="bfloat16", causal=False,
         align="top_left", window=None, bshd=True, num_splits=None, seed=4)  # a 32-row tile
@example(b=1, hkv=2, group=8, sq=12, sk=5000, d=128, dtype="float16", causal=True,
         align="bottom_right", window=None, bshd=False, num_splits=None, seed=5)  # 96 rows: 3 of 32
@example(b=3, hkv=2, group=3, sq=15, sk=40, d=128, dtype="float16", causal=False,
         align="top_left", window=None, bshd=False, num_splits=1, seed=6)  # 45 rows, one 64-row tile, unsplit
@example(b=1, hkv=2, group=4, sq=6, sk=3000, d=256, dtype="bfloat16", causal=True,
         align="bottom_right", window=(500, 0), bshd=True, num_splits=None, seed=7)  # 24 wide rows
def test_multi_token_gqa_decode_packs_tokens(b, hkv, group, sq, sk, d, dtype, causal, align,
                                             window, bshd, num_splits, seed):
    """A few query tokens per K/V head's query heads, packed token-major into rows that the
    kernel gathers from q and scatters to out and LSE (and the combine, when split): poisoned
    output and LSE, in (B, H, S, D) or (B, S, H, D) memory, against the float64 reference and
    torch's own error with the same mask."""
    from flashcore.ops import plan

    if causal and window is not None and window[1] > 0:
        window = (window[0], 0)
    shifted = align == "bottom_right" or window is not None
    # the tuned tile grows to hold a K/V head's rows (16, 32 or 64; 32-row tiles past 64),
    # and they always pack
    cfg = plan.packed_rows_config(default_config(d, "decode"), sq, group)
    assert cfg.tile_m >= min(group * sq, 32)
    assert plan.packs_tokens(sq, hkv * group, hkv, cfg.tile_m, cfg.tile_n, causal and not shifted)
    dt = DTYPES[dtype]
    q, k, v = _qkv(b, hkv * group, hkv, sq, sk, d, dt, seed)
    if bshd:  # a projection's (B, S, H, D) output seen as (B, H, S, D)
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    masks = {"mask_align": align, "window": window}
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, device=q.device,
                                       **masks)
    out = torch.full((b, sq, hkv * group, d), float("nan"), device="cuda", dtype=dt)
    out = out.transpose(1, 2) if bshd else out.transpose(1, 2).contiguous()
    res, lse = attention(q, k, v, causal=causal, return_lse=True, out=out,
                         num_splits=num_splits, **masks)
    check_masked_result(res, out, lse, ref, ref_lse, q, k, v, causal, align, window, None)


@pytest.mark.parametrize("group", [1, 4, 32])
@pytest.mark.parametrize("splits", [1, 3, 64, 201, MAX_SPLITS])
def test_split_shares_may_be_empty(group, splits):
    """More shares than key blocks: the shares past the last block see no key (LSE -inf,
    weight 0); a causal decode row sees key 0 only (top-left), a share of one block."""
    for causal in (False, True):
        q, k, v = _qkv(2, 2 * group, 2, 1, 70, 128, torch.float16, seed=group * splits + causal)
        _check(q, k, v, causal, num_splits=splits)


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("splits", [129, 250, MAX_SPLITS])
def test_many_shares_each_with_keys(d, splits):
    """The combine's threads take several shares each (more shares than its 128 threads), in
    passes of four per slot that run past the last share (a head_dim of 64 has 8 slots, 128 has
    4, 256 two; at 96, five slots of 24 threads leave 8 idle): every share sees keys, so each
    weight and partial row counts."""
    config = default_config(d, "decode")
    for dtype in (torch.float16, torch.bfloat16):
        # one key block a share (the last one ragged)
        q, k, v = _qkv(1, 8, 2, 1, config.tile_n * splits - 17, d, dtype, seed=splits + d)
        _check(q, k, v, False, num_splits=splits, config=config)


def test_decode_with_strided_queries_and_a_long_cache():
    """q of one token from a (B, 1, Hq, D) projection (heads not contiguous), K/V views of a
    preallocated cache (only the first Sk of its slots used)."""
    cache_k = torch.randn(4, 8, 9000, 128, device="cuda", dtype=torch.bfloat16)
    cache_v = torch.randn_like(cache_k)
    q = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    for sk in (1, 777, 8193):
        _check(q, cache_k[:, :, :sk], cache_v[:, :, :sk], False)


def test_gqa_prefill_equals_expanded_kv():
    """GQA with many query tokens (not packed: each query head's CTA reads its group's K/V)
    gives what the same call on K/V repeated to the query heads gives."""
    q, k, v = _qkv(2, 8, 2, 333, 290, 64, torch.float16, seed=11)
    for causal in (False, True):
        a = attention(q, k, v, causal=causal)
        e = attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), causal=causal)
        assert torch.equal(a, e)


def test_the_benchmarks_read_floor_reads_every_word():
    """The decode rows' read floor (a Triton streaming read) XORs every word it reads: a grid
    that skipped or re-read part of the buffer would give another XOR. Ragged sizes too."""
    pytest.importorskip("triton")
    from flashcore.tuning.read_floor import streaming_read

    read = streaming_read()
    for words in (4, 1028, 3 * 2**20 + 12, 2**25):
        x = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device="cuda")
        got = np.bitwise_xor.reduce(read(x).cpu().numpy().view("uint32"))
        assert got == np.bitwise_xor.reduce(x.cpu().numpy().view("uint32")), words


# -- FP8 KV cache -------------------------------------------------------------------------------
FP8_KV_TOL = 2e-3  # relative L2 against exact attention over the dequantised cache


def _dequantised(x8, descale):
    return x8.double() * descale.double()[..., None]


def _rel_l2(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@settings(settings.get_profile("gpu"))
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 4, 8]),
    sq=st.one_of(st.just(1), st.integers(1, 40)),
    sk=st.one_of(st.integers(1, 300), st.integers(1, 20000)),
    d=st.sampled_from([64, 128]),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    causal=st.booleans(),
    log_mag=st.floats(-6, 12),
    log_q_mag=st.floats(-6, 12),
    outlier=st.sampled_from([0.0, 100.0, 1e4]),
    zero_lead=st.sampled_from([0, 1, 200]),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, hkv=8, group=4, sq=1, sk=8192, d=128, dtype="float16", causal=False, log_mag=0,
         log_q_mag=0, outlier=0.0, zero_lead=0, seed=1)
@example(b=1, hkv=1, group=1, sq=1, sk=5, d=64, dtype="bfloat16", causal=False, log_mag=4,
         log_q_mag=0, outlier=1e4, zero_lead=0, seed=2)
@example(b=1, hkv=3, group=4, sq=27, sk=176, d=64, dtype="float16", causal=True, log_mag=-3,
         log_q_mag=0, outlier=1e4, zero_lead=0, seed=72269)  # small v descales
@example(b=2, hkv=2, group=4, sq=1, sk=3000, d=128, dtype="bfloat16", causal=False,
         log_mag=12, log_q_mag=10, outlier=1e4, zero_lead=0, seed=3)  # past fp16's range
@example(b=1, hkv=2, group=8, sq=5, sk=700, d=64, dtype="bfloat16", causal=True,
         log_mag=-6, log_q_mag=-6, outlier=100.0, zero_lead=0, seed=4)  # under fp16's normals
@example(b=1, hkv=2, group=4, sq=1, sk=3000, d=128, dtype="bfloat16", causal=False,
         log_mag=4, log_q_mag=0, outlier=1e4, zero_lead=200, seed=5)  # zero tokens walked last
@example(b=1, hkv=1, group=4, sq=1, sk=2000, d=128, dtype="float16", causal=False,
         log_mag=0, log_q_mag=0, outlier=1e4, zero_lead=200, seed=6)
@example(b=1, hkv=1, group=1, sq=1, sk=1, d=64, dtype="float16", causal=False, log_mag=-6.0,
         log_q_mag=0.0, outlier=0.0, zero_lead=0, seed=0)  # an fp16 output in subnormals
@example(b=1, hkv=2, group=32, sq=1, sk=5000, d=128, dtype="bfloat16", causal=False,
         log_mag=0, log_q_mag=0, outlier=100.0, zero_lead=0, seed=7)  # 32 heads: a 32-row tile
@example(b=1, hkv=2, group=8, sq=8, sk=3000, d=64, dtype="float16", causal=True, log_mag=2,
         log_q_mag=0, outlier=0.0, zero_lead=1, seed=8)  # 64 packed rows: a 64-row tile
@example(b=1, hkv=2, group=8, sq=6, sk=2500, d=128, dtype="bfloat16", causal=False,
         log_mag=0, log_q_mag=0, outlier=0.0, zero_lead=0, seed=9)  # 48 rows: 64 (32 on an L4)
def test_fp8_kv_cache_never_overflows_and_matches_the_dequantised_cache(
    b, hkv, group, sq, sk, d, dtype, causal, log_mag, log_q_mag, outlier, zero_lead, seed
):
    """K/V quantised per token (any finite magnitude: 448 / amax per token; an outlier token
    in K and in V; zero tokens at the start, the blocks the walk reaches last) and Q of any
    magnitude its dtype holds; the kernels multiply in fp16 for both dtypes (a bf16 Q and each
    block's V descales scaled into fp16's range): the result matches exact attention over the
    dequantised cache."""
    dt = DTYPES[dtype]
    mag, q_mag = 10.0**log_mag, 10.0**log_q_mag
    if dt == torch.float16:  # fp16 inputs cannot exceed 65504
        mag = min(mag, 6e4 / max(outlier, 1.0) / 5)
        q_mag = min(q_mag, 1e4)
    q, k, v = _qkv(b, hkv * group, hkv, sq, sk, d, torch.float32, seed)
    q = (q * (q_mag / math.sqrt(d))).to(dt)  # O(1) logits once scaled: see `scale`
    k, v = (k * mag).to(dt), (v * mag).to(dt)
    if outlier:
        k[0, 0, sk // 2] *= outlier / 10 if dt == torch.float16 else outlier
        v[0, 0, sk // 3] *= outlier / 10 if dt == torch.float16 else outlier
    k[:, :, :zero_lead] = 0
    v[:, :, :zero_lead] = 0
    k8, kd = quantize_fp8(k, granularity="token")
    v8, vd = quantize_fp8(v, granularity="token")
    scale = 1.0 / (math.sqrt(d) * mag * q_mag)
    out = torch.full_like(q, float("nan"))
    attention(q, k8, v8, causal=causal, softmax_scale=scale, k_descale=kd, v_descale=vd,
              out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "NaN/Inf (or unwritten elements) in the output"
    exact = reference.attention(q, _dequantised(k8, kd), _dequantised(v8, vd), causal=causal,
                                softmax_scale=scale, device=q.device)
    err = _rel_l2(out, exact)
    # bf16 output rounding alone is up to 2^-9 relative per element; an fp16 output under
    # fp16's normals (V of 1e-6) loses more in its subnormal steps, whatever the kernel did:
    # what rounding the exact answer to the output's dtype costs is allowed on top
    rounding = _rel_l2(exact.to(dt), exact)
    allowed = (FP8_KV_TOL if dt == torch.float16 else 2 * FP8_KV_TOL) + rounding
    assert err <= allowed, f"rel L2 {err:.3g} (output rounding alone {rounding:.3g})"


@pytest.mark.parametrize("config", FP8_KV_CONFIGS, ids=lambda c: c.tag)
@pytest.mark.parametrize("d", [64, 128])
def test_fp8_kv_cache_in_every_kind_of_config(config, d):
    """The codes converted in registers (K's head dimension and O's columns permuted, V read
    transposed) for each ring depth, key tile, warp count and in-CTA key split: ragged keys,
    GQA, decode and a prefill tile, causal with LSE, both 16-bit dtypes."""
    cases = [(1, 3, 4, 1, 1000, False, "float16"), (2, 2, 2, 37, 333, True, "bfloat16"),
             (1, 1, 8, 2, 77, True, "float16")]
    for i, (b, hkv, group, sq, sk, causal, dtype) in enumerate(cases):
        dt = DTYPES[dtype]
        q, k, v = _qkv(b, hkv * group, hkv, sq, sk, d, torch.float32, seed=40 + i)
        q, k, v = (q / math.sqrt(d)).to(dt), k.to(dt), v.to(dt)
        k8, kd = quantize_fp8(k, granularity="token")
        v8, vd = quantize_fp8(v, granularity="token")
        out = torch.full_like(q, float("nan"))
        _, lse = attention(q, k8, v8, causal=causal, k_descale=kd, v_descale=vd, out=out,
                           config=config, return_lse=True)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"{config.tag} case {i}: NaN or unwritten elements"
        kf, vf = _dequantised(k8, kd), _dequantised(v8, vd)
        exact, exact_lse = reference.attention(q, kf, vf, causal=causal, return_lse=True,
                                               device=q.device)
        err = _rel_l2(out, exact)
        assert err <= (FP8_KV_TOL if dt == torch.float16 else 2 * FP8_KV_TOL), (
            f"{config.tag} case {i}: rel L2 {err:.3g}")
        finite = torch.isfinite(exact_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        assert max_abs(lse[finite], exact_lse[finite]) < 1e-3 * max(
            1.0, exact_lse.abs().max().item())


def test_fp8_kv_cache_errors():
    q, k, v = _qkv(1, 4, 2, 1, 64, 64, torch.float16, seed=5)
    k8, kd = quantize_fp8(k, granularity="token")
    v8, vd = quantize_fp8(v, granularity="token")
    with pytest.raises(ValueError, match="need k_descale"):
        attention(q, k8, v8)
    with pytest.raises(ValueError, match="v_descale must be float32 of shape"):
        attention(q, k8, v8, k_descale=kd, v_descale=vd[:, :1])
    with pytest.raises(ValueError, match="for float8_e4m3fn k and v"):
        attention(q, k, v, k_descale=kd, v_descale=vd)
    with pytest.raises(ValueError, match="precision='fp8' quantises"):
        attention(q, k8, v8, k_descale=kd, v_descale=vd, precision="fp8")


def _verify(out, q, k, v):
    ref = reference.attention(q, k, v, device=q.device)
    err, err_sdpa = max_abs(out, ref), max_abs(sdpa(q, k, v, False), ref)
    assert torch.isfinite(out).all() and err <= allowed_error(err_sdpa, ref, q.dtype, q, k, v)


def test_repeated_split_calls_keep_their_own_partials():
    """Eager split-KV calls of one shape (the memoised path, whose partial results reuse one
    scratch buffer a stream and thread) each give their own inputs' result: queued back to back
    with keys growing, on two streams at once, from two threads, and beside a CUDA graph
    captured on the stream whose buffer eager calls use (the graph's partials are its own)."""
    import threading

    cases = [_qkv(1, 32, 8, 1, 3000 + 65 * i, 128, torch.float16, seed=i) for i in range(6)]
    outs = [attention(q, k, v, num_splits=8) for q, k, v in cases]  # no sync between them
    for case, out in zip(cases, outs):
        _verify(out, *case)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        a = [attention(*cases[i], num_splits=8) for i in (0, 2, 4)]
    with torch.cuda.stream(s2):
        b = [attention(*cases[i], num_splits=8) for i in (1, 3, 5)]
    torch.cuda.synchronize()
    for i, out in zip((0, 2, 4, 1, 3, 5), a + b):
        _verify(out, *cases[i])
    results: dict[int, list] = {}

    def work(i):
        results[i] = [attention(*cases[i], num_splits=8) for _ in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    for i, outs in results.items():
        assert all(torch.equal(o, outs[0]) for o in outs)
        _verify(outs[0], *cases[i])
    static = [t.clone() for t in cases[0]]
    with torch.cuda.stream(s1):
        attention(*static, num_splits=8)  # s1 has its eager buffer
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s1):
        g_out = attention(*static, num_splits=8)
    other = _qkv(1, 32, 8, 1, 3000, 128, torch.float16, seed=99)
    for _ in range(5):
        with torch.cuda.stream(s2):
            graph.replay()
        with torch.cuda.stream(s1):
            e_out = attention(*other, num_splits=8)
    torch.cuda.synchronize()
    _verify(g_out, *static)
    _verify(e_out, *other)


@pytest.mark.parametrize("b,hkv,group,sq,sk,d,splits", [
    (1, 8, 4, 1, 4096, 128, None),  # one token's heads packed, the tuned split
    (2, 2, 1, 1, 3000, 64, 7),  # a row per head
    (1, 2, 8, 5, 2000, 128, 16),  # packed tokens: 40 rows, two query tiles
    (3, 1, 4, 1, 70, 96, 201),  # most shares empty; 24 chunks a row
    (1, 1, 2, 1, 9000, 256, None),
])
def test_an_eager_split_merges_its_shares_as_the_graphs_combine_does(b, hkv, group, sq, sk, d,
                                                                      splits):
    """An eager split call is one launch whose last share's CTA merges; a CUDA graph of the same
    call runs the split kernel and the combine. Both match the reference (output and LSE) and
    agree with each other to rounding; the eager calls leave every arrival counter at zero
    (a counter left raised would make a later call's tile merge early or never: poisoned
    outputs would show it)."""
    from flashcore.runtime import scratch

    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = _qkv(b, hkv * group, hkv, sq, sk, d, dtype, seed=sk + d)
        for _ in range(3):  # the memoised path too, on the same counters
            _check(q, k, v, sq > 1, num_splits=splits)
        eager_out, eager_lse = attention(q, k, v, causal=sq > 1, num_splits=splits,
                                         return_lse=True)
        static = torch.full_like(q, float("nan"))
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            attention(q, k, v, causal=sq > 1, num_splits=splits, return_lse=True)  # warm
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            g_out, g_lse = attention(q, k, v, causal=sq > 1, num_splits=splits,
                                     return_lse=True, out=static)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(g_out).all()
        assert max_abs(g_out, eager_out) <= 2 * torch.finfo(dtype).eps * max(
            1.0, eager_out.abs().max().item())
        assert max_abs(g_lse, eager_lse) < 1e-5 * max(1.0, eager_lse.abs().max().item())
    counters = [a for _, a in scratch._buffers.values() if a is not None]
    assert counters and all(int(a.abs().max()) == 0 for a in counters)
