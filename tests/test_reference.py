"""flashcore.reference.attention against torch's SDPA in float64, and its edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcore.reference import attention


def _sdpa(q, k, v, causal, scale):
    if scale == 0.0 and causal:
        # torch's math SDPA gives NaN here (0 * the -inf of its mask); every visible score is 0,
        # so the answer is the mean of the visible values
        visible = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.float64).tril()
        return (visible / visible.sum(-1, keepdim=True).clamp_min(1)) @ v.double()
    return torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=causal, scale=scale
    )


def _lse(q, k, causal, scale):
    """logsumexp of the visible scores, written independently of the reference."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).tril().logical_not(), -math.inf)
    return torch.logsumexp(s, dim=-1)


def _qkv(b, h, sq, sk, d, seed, dtype=torch.float64, dv=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, h, sk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, h, sk, dv or d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(64, 64), (50, 80), (80, 50), (1, 17), (17, 1)])
def test_matches_sdpa(sq, sk, causal):
    q, k, v = _qkv(2, 3, sq, sk, 32, seed=sq * 1000 + sk)
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == torch.float64 and out.device.type == "cpu"
    assert out.shape == (2, 3, sq, 32) and lse.shape == (2, 3, sq)
    torch.testing.assert_close(out, _sdpa(q, k, v, causal, None), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, _lse(q, k, causal, 1 / math.sqrt(32)), rtol=1e-12, atol=1e-12)


def test_causal_is_top_left_aligned():
    q, k, v = _qkv(1, 1, 3, 5, 4, seed=0)
    out = attention(q, k, v, causal=True)
    # query 0 sees only key 0, whatever S_k is
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])
    # with more queries than keys, queries past the last key see every key
    q2, k2, v2 = _qkv(1, 1, 6, 2, 4, seed=1)
    full = attention(q2, k2, v2)
    torch.testing.assert_close(attention(q2, k2, v2, causal=True)[..., 2:, :], full[..., 2:, :])


def test_rows_without_keys_give_zero_and_minus_inf():
    q, k, v = _qkv(2, 2, 5, 0, 8, seed=3)
    for causal in (False, True):
        out, lse = attention(q, k, v, causal=causal, return_lse=True)
        assert out.shape == (2, 2, 5, 8)
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.equal(lse, torch.full_like(lse, -math.inf))


def test_empty_queries():
    q, k, v = _qkv(1, 2, 0, 7, 8, seed=4)
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0)


def test_scale_honoured():
    q, k, v = _qkv(1, 2, 9, 11, 16, seed=5)
    for scale in (0.05, 1.0, 3.0):
        out, lse = attention(q, k, v, softmax_scale=scale, return_lse=True)
        torch.testing.assert_close(out, _sdpa(q, k, v, False, scale), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, _lse(q, k, False, scale), rtol=1e-12, atol=1e-12)
    # scale 0: every key weighs the same, so the output is the mean of v and lse is log(S_k)
    out, lse = attention(q, k, v, softmax_scale=0.0, return_lse=True)
    torch.testing.assert_close(out, v.mean(dim=2, keepdim=True).expand_as(out))
    torch.testing.assert_close(lse, torch.full_like(lse, math.log(11)))


def test_large_scores_stay_finite():
    q, k, v = _qkv(1, 1, 8, 8, 16, seed=6)
    out, lse = attention(q * 100, k * 100, v, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, _sdpa(q * 100, k * 100, v, False, None))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_inputs_computed_in_float64(dtype):
    q, k, v = _qkv(1, 2, 10, 12, 8, seed=7, dtype=dtype)
    out = attention(q, k, v, causal=True)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, _sdpa(q, k, v, True, None), rtol=1e-12, atol=1e-12)


def test_value_dim_may_differ_and_device_argument():
    q, k, v = _qkv(1, 1, 4, 6, 8, seed=8, dv=5)
    out = attention(q, k, v, device="cpu")
    assert out.shape == (1, 1, 4, 5) and out.device.type == "cpu"
    torch.testing.assert_close(out, _sdpa(q, k, v, False, None))


def test_shape_errors():
    q, k, v = _qkv(1, 2, 4, 6, 8, seed=9)
    with pytest.raises(ValueError, match="batch, heads, seq, dim"):
        attention(q[0], k, v)
    with pytest.raises(ValueError, match="head dims differ"):
        attention(q[..., :4], k, v)
    with pytest.raises(ValueError, match="sequence lengths differ"):
        attention(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match="batch and heads differ"):
        attention(q, k[:, :1], v)  # k and v must agree
    with pytest.raises(ValueError, match="batch and heads differ"):
        attention(q[:, :1], k, v)  # more K/V heads than query heads
    with pytest.raises(ValueError, match="batch and heads differ"):
        attention(q, torch.cat([k, k]), torch.cat([v, v]))  # batch differs
    with pytest.raises(TypeError, match="float"):
        attention(q.long(), k, v)


@settings(max_examples=150, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    sq=st.integers(1, 12),
    sk=st.integers(1, 12),
    d=st.integers(1, 9),
    causal=st.booleans(),
    scale=st.one_of(st.none(), st.floats(0.0, 4.0)),
    seed=st.integers(0, 2**31 - 1),
)
def test_hypothesis_matches_sdpa(b, h, sq, sk, d, causal, scale, seed):
    q, k, v = _qkv(b, h, sq, sk, d, seed)
    out, lse = attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    torch.testing.assert_close(out, _sdpa(q, k, v, causal, scale), rtol=1e-10, atol=1e-10)
    s = 1 / math.sqrt(d) if scale is None else scale
    torch.testing.assert_close(lse, _lse(q, k, causal, s), rtol=1e-10, atol=1e-10)


@settings(max_examples=60, deadline=None)
@given(
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    sq=st.integers(1, 9),
    sk=st.integers(1, 9),
    causal=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_grouped_query_heads_read_their_group(hkv, group, sq, sk, causal, seed):
    """GQA: query head h attends with K/V head h // group, as SDPA's enable_gqa does."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hkv * group, sq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, hkv, sk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out = attention(q, k, v, causal=causal)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=causal)
    if causal and sq > sk:  # torch's SDPA is NaN for rows that see no key; ours is 0
        want = torch.nan_to_num(want, nan=0.0)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
