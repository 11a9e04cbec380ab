"""The FlashAttention and transformers front ends without a GPU: flashcore's three ops are
replaced by float64 fakes (``flashcore.reference``) that record each call, so what is checked
is the mapping (arguments, layouts, views, per-row lengths), the torch-side work (rotary, KV
append) and the numbers that mapping gives."""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

import pytest
import torch

from flashcore import reference
from flashcore.integrations import flash_attn as fa
from flashcore.integrations import kv_cache
from flashcore.integrations import transformers as fc_tf

DT = torch.bfloat16
# the transformers backend's tests need the optional extra (``pip install -e '.[transformers]'``)
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")


def _store(res, out):
    """A fake op's result: into ``out`` when given (as the kernels write it), in q's dtype."""
    o, lse = res
    if out is None:
        return o, lse.float()
    out.copy_(o)
    return out, lse.float()


def _ref(q, k, v, causal, scale, mask_align="top_left", window=None, softcap=None,
         alibi_slopes=None):
    return reference.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True,
                               mask_align=mask_align, window=window, softcap=softcap,
                               alibi_slopes=alibi_slopes)


def _row(slopes, b: int):
    """Sequence b's ALiBi slopes: its row of (batch, heads), or the per-head vector."""
    return slopes if slopes is None or slopes.dim() == 1 else slopes[b]


class FakeOps:
    """``attention``, ``attention_varlen``, ``attention_paged`` in float64 on the CPU; each
    call is recorded as (op name, args, kwargs)."""

    def __init__(self):
        self.calls = []

    def attention(self, q, k, v, tile=None, causal=False, softmax_scale=None, return_lse=False,
                  *, out=None, num_splits=None, mask_align="top_left", window=None,
                  softcap=None, alibi_slopes=None, **kw):
        self.calls.append(("attention", (q, k, v), {"causal": causal, "mask_align": mask_align,
                           "window": window, "softcap": softcap, "out": out,
                           "num_splits": num_splits, "alibi_slopes": alibi_slopes}))
        o, lse = _store(_ref(q, k, v, causal, softmax_scale, mask_align, window, softcap,
                             alibi_slopes), out)
        return (o.to(q.dtype), lse) if return_lse else o.to(q.dtype)

    def attention_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal=False,
                         softmax_scale=None, return_lse=False, *, mask_align="top_left",
                         window=None, softcap=None, out=None, check_lengths=True,
                         alibi_slopes=None, **kw):
        self.calls.append(("attention_varlen", (q, k, v, cu_q, cu_k, max_q, max_k),
                           {"causal": causal, "mask_align": mask_align, "window": window,
                                "softcap": softcap, "alibi_slopes": alibi_slopes,
                                "check_lengths": check_lengths}))
        o = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float64)
        for b in range(cu_q.shape[0] - 1):
            qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            assert qs.stop - qs.start <= max_q and ks.stop - ks.start <= max_k
            ob, lb = _ref(*(t[s].transpose(0, 1)[None] for t, s in ((q, qs), (k, ks), (v, ks))),
                          causal, softmax_scale, mask_align, window, softcap,
                          _row(alibi_slopes, b))
            o[qs], lse[:, qs] = ob[0].transpose(0, 1), lb[0]
        o = o.to(q.dtype)
        return (o, lse.float()) if return_lse else o

    def attention_paged(self, q, k_cache, v_cache, block_table, seqlens_k, causal=False,
                        softmax_scale=None, return_lse=False, *, cu_seqlens_q=None,
                        max_seqlen_q=None, mask_align="top_left", window=None, softcap=None,
                        num_splits=None, out=None, check_lengths=True, alibi_slopes=None,
                        **kw):
        self.calls.append(("attention_paged", (q, k_cache, v_cache, block_table, seqlens_k),
                           {"causal": causal, "mask_align": mask_align, "window": window,
                                "softcap": softcap, "cu_seqlens_q": cu_seqlens_q, "out": out,
                                "max_seqlen_q": max_seqlen_q, "num_splits": num_splits,
                                "alibi_slopes": alibi_slopes, "check_lengths": check_lengths}))
        assert block_table.dtype == torch.int32 and seqlens_k.dtype == torch.int32
        o = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.zeros(o.shape[:-1], dtype=torch.float64)
        if cu_seqlens_q is not None:
            lse = lse.transpose(0, 1)  # (heads, total)
        for b in range(block_table.shape[0]):
            n = int(seqlens_k[b])
            k, v = (c[block_table[b].long()].flatten(0, 1)[:n].transpose(0, 1)[None]
                    for c in (k_cache, v_cache))
            if cu_seqlens_q is None:
                o[b:b + 1], lse[b:b + 1] = _ref(q[b:b + 1], k, v, causal, softmax_scale,
                                                mask_align, window, softcap,
                                                _row(alibi_slopes, b))
            else:
                qs = slice(cu_seqlens_q[b], cu_seqlens_q[b + 1])
                ob, lb = _ref(q[qs].transpose(0, 1)[None], k, v, causal, softmax_scale,
                              mask_align, window, softcap, _row(alibi_slopes, b))
                o[qs], lse[:, qs] = ob[0].transpose(0, 1), lb[0]
        o, lse = _store((o, lse), out)
        return (o.to(q.dtype), lse) if return_lse else o.to(q.dtype)


@pytest.fixture
def fake(monkeypatch):
    f = FakeOps()
    ns = SimpleNamespace(attention=f.attention, attention_varlen=f.attention_varlen,
                         attention_paged=f.attention_paged)
    monkeypatch.setattr(fa, "ops", ns)
    monkeypatch.setattr(fc_tf, "ops", ns)
    return f


def _randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DT)


def _naive(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None, alibi=None):
    """FlashAttention's semantics written out in float64 on its (batch, seq, heads, dim)
    layout, independent of flashcore's reference: bottom-right diagonal, GQA by head index,
    ALiBi's -slope * |i + S_k - S_q - j| after the soft-cap."""
    q, k, v = (t.double() for t in (q, k, v))
    sq, sk, h, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    k, v = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale or 1 / math.sqrt(d))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    if alibi is not None:
        s = s - alibi.double().expand(q.shape[0], h)[:, :, None, None] * (i - j).abs()
    left, right = window
    right = 0 if causal else right
    hide = torch.zeros(sq, sk, dtype=torch.bool)
    if left >= 0:
        hide |= j < i - left
    if right >= 0:
        hide |= j > i + right
    p = torch.softmax(s.masked_fill(hide, -math.inf), -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _close(a, b, tol=2e-2):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a.double() - b.double()).abs().max().item()
    assert err <= tol, f"max err {err}"


# -- mapping ---------------------------------------------------------------------------------


@pytest.mark.parametrize("causal, window, softcap, sq, sk, want", [
    (False, (-1, -1), 0.0, 5, 9, fa.Masks(False, "top_left", None, None)),
    (True, (-1, -1), 0.0, 5, 9, fa.Masks(True, "bottom_right", None, None)),
    (True, (-1, -1), 0.0, 9, 9, fa.Masks(True, "top_left", None, None)),
    (True, (4, 7), 30.0, 5, 9, fa.Masks(True, "bottom_right", (4, 0), 30.0)),
    (True, (-1, 3), 0.0, 5, 9, fa.Masks(True, "bottom_right", None, None)),
    (False, (4, 2), 0.0, 5, 9, fa.Masks(False, "bottom_right", (4, 2), None)),
    (False, (-1, 0), 0.0, 5, 9, fa.Masks(False, "bottom_right", (-1, 0), None)),
    (True, (3, 0), 0.0, None, None, fa.Masks(True, "bottom_right", (3, 0), None)),
])
def test_fa_masks_map_flash_attention_conventions(causal, window, softcap, sq, sk, want):
    assert fa.fa_masks(causal, window, softcap, sq, sk) == want


def test_bad_window_size_names_it():
    with pytest.raises(ValueError, match="window_size"):
        fa.fa_masks(False, 5, 0.0)


# -- flash_attn_func and its packed forms -------------------------------------------------------


@pytest.mark.parametrize("causal, window, softcap", [
    (False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (True, (3, 0), 0.0), (False, (2, 1), 5.0)])
@pytest.mark.parametrize("sq, sk", [(7, 7), (3, 11), (1, 6)])
def test_flash_attn_func_matches_flash_attention_semantics(fake, causal, window, softcap, sq, sk):
    q = _randn(2, sq, 4, 64, seed=1)
    k, v = _randn(2, sk, 2, 64, seed=2), _randn(2, sk, 2, 64, seed=3)
    out = fa.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)
    assert out.shape == q.shape and out.is_contiguous() and out.dtype == DT
    _close(out, _naive(q, k, v, causal, window, softcap))
    name, (cq, ck, cv), kw = fake.calls[-1]
    # transposed views of the caller's tensors: same memory, no copy
    assert name == "attention"
    assert cq.data_ptr() == q.data_ptr() and cq.shape == (2, 4, sq, 64)
    assert ck.data_ptr() == k.data_ptr() and cv.data_ptr() == v.data_ptr()
    assert kw["out"].data_ptr() == out.data_ptr()  # the kernel writes the result in place


def test_flash_attn_func_returns_lse_and_refuses_what_flashcore_lacks(fake):
    q, k, v = _randn(1, 5, 2, 64), _randn(1, 5, 2, 64, seed=1), _randn(1, 5, 2, 64, seed=2)
    _out, lse, probs = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert lse.shape == (1, 2, 5) and lse.dtype == torch.float32 and probs is None
    with pytest.raises(NotImplementedError, match="dropout_p"):
        fa.flash_attn_func(q, k, v, dropout_p=0.1)


@pytest.mark.parametrize("causal, sq, sk", [(True, 3, 11), (False, 3, 11), (True, 7, 7),
                                            (False, 9, 4)])
def test_flash_attn_func_alibi_is_flash_attentions(fake, causal, sq, sk):
    """ALiBi, per head or per (batch, head), measured from FlashAttention's bottom-right
    diagonal: flashcore is asked for it with that alignment whenever S_q != S_k."""
    q = _randn(2, sq, 4, 64, seed=1)
    k, v = _randn(2, sk, 2, 64, seed=2), _randn(2, sk, 2, 64, seed=3)
    for slopes in (torch.tensor([0.5, 0.25, 0.125, 0.0625]), torch.rand(2, 4) * 0.3):
        out = fa.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes, softcap=4.0)
        _close(out, _naive(q, k, v, causal, (-1, -1), 4.0, alibi=slopes))
        kw = fake.calls[-1][2]
        assert kw["alibi_slopes"] is slopes
        assert kw["mask_align"] == ("top_left" if sq == sk else "bottom_right")


def test_packed_functions_are_views(fake):
    qkv = _randn(2, 6, 3, 4, 64)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True)
    _close(out, _naive(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], True))
    args = fake.calls[-1][1]
    assert all(t.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr() for t in args)
    q, kv = _randn(2, 3, 4, 64, seed=5), _randn(2, 8, 2, 2, 64, seed=6)
    out = fa.flash_attn_kvpacked_func(q, kv, causal=True)
    _close(out, _naive(q, kv[:, :, 0], kv[:, :, 1], True))


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_per_sequence_attention(fake, causal):
    lq, lk = [3, 0, 5], [6, 2, 5]
    q, k, v = _randn(8, 4, 64, seed=1), _randn(13, 2, 64, seed=2), _randn(13, 2, 64, seed=3)
    cq, ck = _cu(lq), _cu(lk)
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, causal=causal,
                                            return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (4, 8)
    for b in range(3):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if lq[b]:
            _close(out[qs], _naive(q[None, qs], k[None, ks], v[None, ks], causal)[0])
    assert fake.calls[-1][2]["mask_align"] == ("bottom_right" if causal else "top_left")
    qkv = _randn(8, 3, 4, 64, seed=4)
    fa.flash_attn_varlen_qkvpacked_func(qkv, cq, 5, causal=True)
    kv = _randn(13, 2, 2, 64, seed=4)
    fa.flash_attn_varlen_kvpacked_func(q, kv, cq, ck, 5, 6)
    assert fake.calls[-1][1][1].data_ptr() == kv.data_ptr()


def test_varlen_with_block_table_runs_the_paged_op(fake):
    pages, ps = 6, 4
    kc, vc = _randn(pages, ps, 2, 64, seed=1), _randn(pages, ps, 2, 64, seed=2)
    table = torch.tensor([[5, 0, 3], [1, 2, 4]], dtype=torch.int32)
    lq, lk = [2, 3], [9, 3]
    q = _randn(5, 4, 64, seed=3)
    cq, ck = _cu(lq), _cu(lk)
    out = fa.flash_attn_varlen_func(q, kc, vc, cq, ck, 3, 9, causal=True, block_table=table)
    name, args, kw = fake.calls[-1]
    assert name == "attention_paged" and args[4].tolist() == lk
    assert kw["cu_seqlens_q"] is cq and kw["max_seqlen_q"] == 3
    for b in range(2):
        keys = [kc, vc]
        k, v = (c[table[b].long()].flatten(0, 1)[:lk[b]][None] for c in keys)
        qs = slice(cq[b], cq[b + 1])
        _close(out[qs], _naive(q[None, qs], k, v, True)[0])


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_alibi_measures_from_each_sequences_bottom_right(fake, causal):
    """ALiBi in the packed forms: each sequence's own bottom-right diagonal (flashcore is asked
    for that alignment: the host does not know the lengths), a (batch, heads) row a sequence;
    through a block table too."""
    lq, lk = [3, 0, 5], [6, 2, 5]
    q, k, v = _randn(8, 4, 64, seed=1), _randn(13, 2, 64, seed=2), _randn(13, 2, 64, seed=3)
    cq, ck = _cu(lq), _cu(lk)
    for slopes in (torch.tensor([0.5, 0.25, 0.125, 0.0625]), torch.rand(3, 4) * 0.4):
        out = fa.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, causal=causal, alibi_slopes=slopes)
        kw = fake.calls[-1][2]
        assert kw["mask_align"] == "bottom_right" and kw["alibi_slopes"] is slopes
        for b in range(3):
            qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            if lq[b]:
                _close(out[qs], _naive(q[None, qs], k[None, ks], v[None, ks], causal,
                                       alibi=_row(slopes, b))[0])
    kc, vc = _randn(6, 4, 2, 64, seed=4), _randn(6, 4, 2, 64, seed=5)
    table = torch.tensor([[5, 0, 3], [1, 2, 4]], dtype=torch.int32)
    lq, lk = [2, 3], [9, 3]
    slopes = torch.rand(2, 4) * 0.4
    q2, cq, ck = q[:5], _cu(lq), _cu(lk)
    out = fa.flash_attn_varlen_func(q2, kc, vc, cq, ck, 3, 9, causal=causal, block_table=table,
                                    alibi_slopes=slopes)
    assert fake.calls[-1][0] == "attention_paged"
    for b in range(2):
        kb, vb = (c[table[b].long()].flatten(0, 1)[:lk[b]][None] for c in (kc, vc))
        qs = slice(cq[b], cq[b + 1])
        _close(out[qs], _naive(q2[None, qs], kb, vb, causal, alibi=slopes[b])[0])


# -- rotary and the KV cache -------------------------------------------------------------------


def _rotary_tables(n, half, base=10000.0):
    inv = base ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv
    return ang.cos().float(), ang.sin().float()


def _rotary64(x, cos, sin, pos, interleaved):
    """Rotary as complex multiplication in float64: each feature pair (a, b) -> (a + ib) e^{iθ}."""
    half = cos.shape[-1]
    x = x.double()
    xr = x[..., :2 * half]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
    else:
        a, b = xr[..., :half], xr[..., half:]
    z = torch.complex(a, b) * torch.polar(torch.ones(()).double(),
                                          torch.atan2(sin.double(), cos.double())[pos][:, :, None])
    turned = (torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved
              else torch.cat((z.real, z.imag), -1))
    return torch.cat((turned, x[..., 2 * half:]), -1)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_matches_the_float64_formula(interleaved, rotary_dim):
    x = torch.randn(2, 3, 4, 64)
    cos, sin = _rotary_tables(20, rotary_dim // 2)
    pos = torch.tensor([[0, 1, 2], [7, 8, 9]])
    got = kv_cache.apply_rotary(x, cos, sin, pos, interleaved)
    want = _rotary64(x, cos, sin, pos, interleaved)
    assert (got.double() - want).abs().max() < 1e-5
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])


def test_dense_cache_as_pages_reads_the_same_memory():
    cache = torch.randn(3, 256, 2, 64)
    rows = torch.tensor([2, 0], dtype=torch.int32)
    pages, table = kv_cache.dense_as_pages(cache, rows)
    assert pages.data_ptr() == cache.data_ptr() and pages.shape[1] == 256
    odd = torch.randn(3, 40, 2, 64)
    pages_odd, table_odd = kv_cache.dense_as_pages(odd, rows)
    assert pages_odd is odd and table_odd.tolist() == [[2], [0]]
    cache = torch.randn(3, 96, 2, 64)
    pages, table = kv_cache.dense_as_pages(cache, rows)
    assert pages.shape == (9, 32, 2, 64) and table.dtype == torch.int32
    for b, r in enumerate(rows.tolist()):
        assert torch.equal(pages[table[b].long()].flatten(0, 1), cache[r])


def test_dense_caches_share_one_table_and_page_size():
    """K and V read through one table: where either cache's rows are not contiguous with one
    another both become a page a row; the identity table (no cache_batch_idx) is made once."""
    k = torch.randn(3, 96, 2, 64)
    v = torch.randn(3, 2, 96, 64).transpose(1, 2)  # rows apart: no (pages, 32, ...) view
    kp, vp, table = kv_cache.dense_pages(k, v, None, 2)
    assert kp is k and vp is v and table.tolist() == [[0], [1]]
    kp, vp, table = kv_cache.dense_pages(k, k.clone(), None, 2)
    assert kp.shape == vp.shape == (9, 32, 2, 64) and table.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert kv_cache.dense_pages(k, k, None, 2)[2] is table  # remembered
    rows = torch.tensor([2, 0], dtype=torch.int32)
    _, _, picked = kv_cache.dense_pages(k, k, rows, 2)
    assert picked.tolist() == [[6, 7, 8], [0, 1, 2]]


def _dense_cache_call(fake, cache_seqlens, batch_idx=None, causal=True, rotary=False,
                      interleaved=True, window=(-1, -1), check_lengths=True, leftpad=None,
                      alibi=None):
    b, sq, snew, cap = 2, 2, 2, 96
    kc, vc = _randn(3, cap, 2, 64, seed=1), _randn(3, cap, 2, 64, seed=2)
    kc0, _vc0 = kc.clone(), vc.clone()
    q = _randn(b, sq, 4, 64, seed=3)
    k, v = _randn(b, snew, 2, 64, seed=4), _randn(b, snew, 2, 64, seed=5)
    cos, sin = _rotary_tables(cap, 16) if rotary else (None, None)
    out, lse = fa.flash_attn_with_kvcache(
        q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=cache_seqlens,
        cache_batch_idx=batch_idx, cache_leftpad=leftpad, causal=causal, window_size=window,
        rotary_interleaved=interleaved, return_softmax_lse=True, check_lengths=check_lengths,
        alibi_slopes=alibi)
    pads = [0] * b if leftpad is None else kv_cache.as_lengths(leftpad, b, q.device).tolist()
    lens = kv_cache.as_lengths(cache_seqlens, b, q.device).tolist()
    rows = list(range(b)) if batch_idx is None else batch_idx.tolist()
    assert lse.shape == (b, 4, sq)
    for i, (r, n, pad) in enumerate(zip(rows, lens, pads)):
        kn, qi = k[i:i + 1], q[i:i + 1]
        if rotary:
            per_token = causal or window != (-1, -1)
            qpos = torch.arange(sq)[None] + n if per_token else torch.full((1, sq), n)
            qi = _rotary64(qi, cos, sin, qpos, interleaved).to(DT)
            kn = _rotary64(kn, cos, sin, torch.arange(snew)[None] + n, interleaved).to(DT)
        # appended in place at cache_seqlens; every other position untouched
        assert torch.equal(kc[r, n:n + snew], kn[0]) and torch.equal(vc[r, n:n + snew], v[i])
        assert torch.equal(kc[r, :n], kc0[r, :n])
        assert torch.equal(kc[r, n + snew:], kc0[r, n + snew:])
        # the row's keys from cache_leftpad on; rotary positions stay the row's own
        want = _naive(qi, kc[r:r + 1, pad:n + snew], vc[r:r + 1, pad:n + snew], causal, window,
                      alibi=_row(alibi, i))
        _close(out[i:i + 1], want)
    untouched = sorted(set(range(3)) - set(rows))
    assert all(torch.equal(kc[r], kc0[r]) for r in untouched)
    return fake.calls[-1]


def test_kvcache_equal_lengths_slice_the_cache_for_attention(fake):
    name, (_q, k, _v), kw = _dense_cache_call(fake, 5)
    assert name == "attention" and k.shape == (2, 2, 7, 64) and kw["mask_align"] == "bottom_right"


@pytest.mark.parametrize("rotary, interleaved", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("causal", [True, False])
def test_kvcache_per_row_lengths_read_the_dense_cache_as_pages(fake, rotary, interleaved, causal):
    lens = torch.tensor([3, 17], dtype=torch.int32)
    name, args, _kw = _dense_cache_call(fake, lens, causal=causal, rotary=rotary,
                                       interleaved=interleaved)
    assert name == "attention_paged" and args[4].tolist() == [5, 19]
    assert args[1].shape == (9, 32, 2, 64)  # 96-key rows as three pages of 32, no copy


@pytest.mark.parametrize("rotary", [False, True])
def test_kvcache_leftpad_reads_each_row_from_its_first_key(fake, rotary):
    """FlashAttention's cache_leftpad: row b's keys are cache_leftpad[b] .. cache_seqlens[b] +
    new - 1 (appended at cache_seqlens, rotary at the row's own positions), read as pages of
    one key; equal lengths too (no plain slice of the cache then)."""
    for lens, pad, idx in ((torch.tensor([9, 17], dtype=torch.int32), torch.tensor([4, 0]), None),
                           (6, torch.tensor([6, 1], dtype=torch.int32),
                            torch.tensor([2, 0], dtype=torch.int32))):
        name, args, _kw = _dense_cache_call(fake, lens, batch_idx=idx, rotary=rotary,
                                            leftpad=pad)
        assert name == "attention_paged" and args[1].shape == (3 * 96, 1, 2, 64)
        starts = pad.tolist()
        assert args[4].tolist() == [n + 2 - p for n, p in
                                    zip(kv_cache.as_lengths(lens, 2, "cpu").tolist(), starts)]


@pytest.mark.parametrize("per_batch", [False, True])
def test_kvcache_alibi_on_every_path(fake, per_batch):
    """ALiBi against a cache: a slice of it (equal lengths), per-row lengths (pages), rows read
    from cache_leftpad on (its distances are the row's own positions' differences)."""
    slopes = torch.rand(2, 4) * 0.4 if per_batch else torch.tensor([0.5, 0.3, 0.2, 0.1])
    for lens, pad, causal in ((5, None, True), (5, None, False),
                              (torch.tensor([3, 17], dtype=torch.int32), None, False),
                              (torch.tensor([9, 17], dtype=torch.int32), torch.tensor([4, 0]),
                               True)):
        _name, _args, kw = _dense_cache_call(fake, lens, causal=causal, leftpad=pad,
                                             alibi=slopes)
        assert kw["alibi_slopes"] is slopes


def test_kvcache_batch_idx_and_window(fake):
    _dense_cache_call(fake, torch.tensor([4, 9]), batch_idx=torch.tensor([2, 0], dtype=torch.int32),
                      window=(3, 0))


def test_kvcache_without_new_keys_and_whole_cache(fake):
    kc, vc = _randn(2, 16, 2, 64, seed=1), _randn(2, 16, 2, 64, seed=2)
    q = _randn(2, 1, 4, 64, seed=3)
    out = fa.flash_attn_with_kvcache(q, kc, vc, causal=True)
    _close(out, _naive(q, kc, vc, True))
    assert fake.calls[-1][0] == "attention" and fake.calls[-1][1][1].shape[2] == 16


def test_kvcache_rotary_comes_with_new_keys_only(fake):
    """FlashAttention turns q and the new keys by rotary only when k and v are given: without
    them the tables change nothing."""
    kc, vc = _randn(2, 16, 2, 64, seed=1), _randn(2, 16, 2, 64, seed=2)
    q = _randn(2, 1, 4, 64, seed=3)
    cos, sin = _rotary_tables(16, 16)
    out = fa.flash_attn_with_kvcache(q, kc, vc, rotary_cos=cos, rotary_sin=sin,
                                     cache_seqlens=9, causal=True)
    _close(out, _naive(q, kc[:, :9], vc[:, :9], True))
    assert torch.equal(fake.calls[-1][1][0], q.transpose(1, 2))


def test_kvcache_paged_append_goes_through_the_block_table(fake):
    pages, ps = 8, 4
    kc, vc = _randn(pages, ps, 1, 64, seed=1), _randn(pages, ps, 1, 64, seed=2)
    table = torch.tensor([[6, 2, 7], [0, 3, 5]], dtype=torch.int32)
    q, k, v = _randn(2, 3, 2, 64, seed=3), _randn(2, 3, 1, 64, seed=4), _randn(2, 3, 1, 64, seed=5)
    lens = torch.tensor([2, 7], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table,
                                     causal=True, num_splits=4)
    name, args, kw = fake.calls[-1]
    assert name == "attention_paged" and args[3] is table and kw["num_splits"] == 4
    for b in range(2):
        keys = kc[table[b].long()].flatten(0, 1)
        vals = vc[table[b].long()].flatten(0, 1)
        n = int(lens[b])
        assert torch.equal(keys[n:n + 3], k[b]) and torch.equal(vals[n:n + 3], v[b])
        _close(out[b:b + 1], _naive(q[b:b + 1], keys[None, :n + 3], vals[None, :n + 3], True))


def test_kvcache_errors_name_the_argument(fake):
    kc, vc = _randn(2, 8, 2, 64), _randn(2, 8, 2, 64)
    q, k = _randn(2, 1, 2, 64), _randn(2, 1, 2, 64)
    lens = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_leftpad is for a dense cache"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=lens,
                                   block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_leftpad must be in 0..cache_seqlens"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                   cache_leftpad=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_leftpad has shape"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=lens[:1])
    with pytest.raises(TypeError, match="cache_leftpad must hold integers"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=lens.float())
    with pytest.raises(ValueError, match="k and v"):
        fa.flash_attn_with_kvcache(q, kc, vc, k=k, cache_seqlens=lens)
    with pytest.raises(ValueError, match="cache_seqlens"):
        fa.flash_attn_with_kvcache(q, kc, vc, k=k, v=k)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_batch_idx=lens,
                                   block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens .* over the cache"):
        fa.flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=torch.tensor([1, 8]))
    with pytest.raises(ValueError, match="block_table entry"):
        fa.flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=lens,
                                   block_table=torch.tensor([[0], [9]], dtype=torch.int32))
    with pytest.raises(ValueError, match="rotary_sin"):
        fa.flash_attn_with_kvcache(q, kc, vc, rotary_cos=torch.ones(8, 4))
    with pytest.raises(ValueError, match="cache_seqlens has shape"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"k has shape \(2, 1, 1, 64\), expected"):
        fa.flash_attn_with_kvcache(q, kc, vc, k[:, :, :1], k[:, :, :1], cache_seqlens=lens)
    with pytest.raises(ValueError, match="v has shape"):
        fa.flash_attn_with_kvcache(q, kc, vc, k, k[:1], cache_seqlens=lens)
    with pytest.raises(ValueError, match="block_table has 1 rows for a batch of 2"):
        fa.flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=lens,
                                   block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_batch_idx must be in 0\.\.1"):
        fa.flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=lens,
                                   cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))
    assert not fake.calls  # every error comes before any attention


# -- transformers ------------------------------------------------------------------------------


def _tiny_llama(name, **extra):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128, **extra)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(DT).eval()
    model.set_attn_implementation(name)
    return model


def test_register_refuses_names_transformers_reads_otherwise():
    for bad in ("flashcore_attn", "sdpa", "org/kernel", ""):
        with pytest.raises(ValueError, match="name"):
            fc_tf._check_name(bad)
    fc_tf._check_name(fc_tf.DEFAULT_NAME)


def test_a_flash_name_is_what_transformers_cannot_load():
    """Why the default name avoids "flash": transformers then looks for FlashAttention."""
    transformers = pytest.importorskip("transformers")
    transformers.AttentionInterface.register("flashcore_attn", fc_tf.attention_forward)
    model = _tiny_llama("sdpa")
    with pytest.raises((ValueError, ImportError)):
        model.set_attn_implementation("flashcore_attn")


def _logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()


@pytest.fixture
def llama_pair(fake):
    name = fc_tf.register()
    ours, theirs = _tiny_llama(name), _tiny_llama("sdpa")
    theirs.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == name
    fc_tf.reset_fallbacks()
    return ours, theirs


@needs_transformers
def test_transformers_plain_forward_runs_dense_causal_attention(fake, llama_pair):
    ours, theirs = llama_pair
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    _close(_logits(ours, ids), _logits(theirs, ids), tol=0.1)
    calls = [c for c in fake.calls if c[0] == "attention"]
    assert len(calls) == 2 and fc_tf.fallback_count() == 0
    q, k, _ = calls[0][1]
    assert q.shape == (2, 4, 12, 64) and k.shape == (2, 2, 12, 64)  # GQA: no repeat_kv
    assert calls[0][2]["causal"] and calls[0][2]["mask_align"] == "top_left"


@needs_transformers
def test_transformers_padding_unpads_to_varlen(fake, llama_pair):
    ours, theirs = llama_pair
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    a, b = _logits(ours, ids, mask), _logits(theirs, ids, mask)
    _close(a[:, -6:], b[:, -6:], tol=0.1)
    _close(a[1], b[1], tol=0.1)
    assert {c[0] for c in fake.calls} == {"attention_varlen"} and fc_tf.fallback_count() == 0
    cu_q = fake.calls[0][1][3]
    assert cu_q.tolist() == [0, 6, 16]
    # offsets made here from the mask: no device check (a synchronisation per layer)
    assert not any(c[2]["check_lengths"] for c in fake.calls)


@needs_transformers
def test_transformers_greedy_generation_agrees(fake, llama_pair):
    ours, theirs = llama_pair
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(3))
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        a, b = ours.generate(ids, **kw), theirs.generate(ids, **kw)
    assert torch.equal(a, b)
    decode = [c for c in fake.calls if c[1][0].shape[2] == 1]
    assert decode and all(c[0] == "attention" for c in decode)


@needs_transformers
def test_transformers_padded_generation_decodes_over_kept_keys(fake, llama_pair,
                                                                 monkeypatch):
    """A left-padded batch (and a hole inside a row): prefill unpads to varlen, each decode
    step reads the kept keys in place (attention_paged over pages of one key, no copy, no
    device check), and the tokens are those of the unpadded (varlen) decode; the logits of the
    result are SDPA's on every kept token."""
    from flashcore.integrations import padding

    ours, theirs = llama_pair
    ids = torch.randint(1, 97, (3, 9), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :5] = 0
    mask[2, 3] = 0  # a hole inside a row
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "attention_mask": mask}
    with torch.no_grad():
        got = ours.generate(ids, **kw)
    assert fc_tf.fallback_count() == 0
    decode = [c for c in fake.calls if c[1][0].shape[-2] == 1 and c[1][0].dim() == 4]
    assert decode and all(c[0] == "attention_paged" for c in decode)
    _q, k_pages, _, _table, lengths = decode[-1][1]
    assert k_pages.shape[1] == 1 and not decode[-1][2]["check_lengths"]
    assert lengths.tolist() == [4 + 3, 9 + 3, 8 + 3]  # kept prompt keys + the new tokens
    assert {c[0] for c in fake.calls} == {"attention_varlen", "attention_paged"}
    fake.calls.clear()
    monkeypatch.setattr(padding, "key_row_step", lambda t: None)  # no page view: varlen
    with torch.no_grad():
        want = ours.generate(ids, **kw)
    assert {c[0] for c in fake.calls} == {"attention_varlen"}
    assert torch.equal(got, want)
    # keys whose rows are not contiguous are unpadded (varlen) instead: read in place, a page
    # view of them would be copied whole
    module = SimpleNamespace(is_causal=True, training=False)
    q1, k1 = _randn(2, 4, 1, 64, seed=8), _randn(2, 2, 64, 7, seed=9).transpose(2, 3)
    fake.calls.clear()
    fc_tf.attention_forward(module, q1, k1, k1, torch.ones(2, 7, dtype=torch.bool), scaling=0.1)
    assert [c[0] for c in fake.calls] == ["attention_varlen"]
    full = torch.cat([mask, torch.ones(3, 4, dtype=torch.long)], 1)
    keep = full.bool()
    _close(_logits(ours, got, full)[keep], _logits(theirs, got, full)[keep], tol=0.1)


def test_kept_keys_list_each_rows_kept_keys_in_order():
    from flashcore.integrations import padding

    key = _randn(3, 2, 7, 8, seed=7)[:, :, :6]  # rows 2*7 keys apart, 6 keys used
    keep = torch.tensor([[0, 1, 1, 0, 1, 1], [1] * 6, [0] * 6], dtype=torch.bool)
    step = padding.key_row_step(key)
    assert step == 14
    pages = padding.key_pages(key)
    kept = padding.kept_keys(keep, step)
    assert kept.lengths.tolist() == [4, 6, 0] and kept.table.dtype == torch.int32
    for b in range(3):
        n = int(kept.lengths[b])
        got = pages[kept.table[b, :n].long(), 0]  # (n, heads, dim)
        assert torch.equal(got, key[b][:, keep[b]].transpose(0, 1))
    assert int(kept.table.max()) < pages.shape[0]
    # made once per mask: the same mask again is the same table; a changed mask is not
    assert padding.kept_keys(keep, step) is kept
    keep[1, 0] = False
    again = padding.kept_keys(keep, step)
    assert again is not kept and again.lengths.tolist() == [4, 5, 0]
    odd = torch.zeros(2, 3, 5, 8)[:, :, :, :6]  # keys 8 apart, rows 120: a whole number
    assert padding.key_row_step(odd) == 15
    skew = torch.zeros(400).as_strided((2, 3, 5, 8), (121, 40, 8, 1))  # rows 121 apart
    assert padding.key_row_step(skew) is None


@needs_transformers
def test_transformers_padded_decode_compiles_fullgraph(monkeypatch):
    """A decode step under a padding mask traces whole through the registered attention_paged
    op (its table made in the graph: no host read, no fallback) and gives the eager result."""
    import importlib

    from flashcore.ops import library

    eager_entry = importlib.import_module("flashcore.ops.attention")

    ref = FakeOps()  # the eager code behind the public op and the registered one
    monkeypatch.setattr(library, "run_paged", ref.attention_paged)
    monkeypatch.setattr(eager_entry, "run_paged", ref.attention_paged)
    fc_tf.register()
    fc_tf.reset_fallbacks()
    module = SimpleNamespace(is_causal=True, training=False)
    q, k, v = _randn(3, 4, 1, 64, seed=1), _randn(3, 2, 20, 64, seed=2), _randn(3, 2, 20, 64, seed=3)
    keep = torch.ones(3, 17, dtype=torch.bool)  # a static cache: 17 of its 20 keys written
    keep[0, :6] = False
    keep[2, 4] = False

    def step(q, k, v, keep):
        return fc_tf.attention_forward(module, q, k, v, keep, scaling=0.125)[0]

    traced = torch.compile(step, fullgraph=True)  # inductor: the views and out= survive it
    got, want = traced(q, k, v, keep), step(q, k, v, keep)
    assert fc_tf.fallback_count() == 0
    _close(got, want, tol=0)
    assert all(c[0] == "attention_paged" for c in ref.calls) and len(ref.calls) == 2
    for b in range(3):
        kk, vv = (t[b:b + 1, :, :17][:, :, keep[b]].transpose(1, 2) for t in (k, v))
        _close(got[b:b + 1], _naive(q[b:b + 1].transpose(1, 2), kk, vv, scale=0.125))


def test_unpadding_offsets_are_made_once_per_mask():
    from flashcore.integrations import padding

    keep = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    un = padding.unpadding(keep, 2)
    assert un.cu_keys.tolist() == [0, 2, 6] and un.max_keys == 4
    assert un.cu_queries.tolist() == [0, 2, 4] and un.max_queries == 2
    assert un.keys.tolist() == [2, 3, 4, 5, 6, 7] and un.queries.tolist() == [0, 1, 2, 3]
    assert padding.unpadding(keep, 2) is un
    assert padding.unpadding(keep, 1) is not un  # another query length
    assert padding.unpadding(keep.clone(), 2) is not un  # another mask


@needs_transformers
def test_transformers_static_cache_passes_row_lengths(fake, llama_pair):
    ours, theirs = llama_pair
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(4))
    kw = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0,
          "cache_implementation": "static"}
    with torch.no_grad():
        a, b = ours.generate(ids, **kw), theirs.generate(ids, **kw)
    assert torch.equal(a, b)
    paged = [c for c in fake.calls if c[0] == "attention_paged"]
    assert paged and paged[-1][1][4].tolist() == [7]  # 5 prompt + 2 generated keys valid
    # its own table and lengths: no device check (none can run inside a CUDA graph anyway)
    assert not any(c[2]["check_lengths"] for c in paged)


@needs_transformers
def test_transformers_four_d_mask_falls_back_counted(fake, llama_pair):
    ours, theirs = llama_pair
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(5))
    keep = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    _close(_logits(ours, ids, keep), _logits(theirs, ids, keep), tol=0.1)
    assert fc_tf.fallback_reasons() == {"4-D mask": 2} and not fake.calls


@needs_transformers
def test_transformers_sliding_window_and_softcap_reach_the_op(fake):
    fc_tf.register()
    module = SimpleNamespace(is_causal=True, training=False)
    q, k, v = _randn(1, 4, 9, 64, seed=1), _randn(1, 2, 9, 64, seed=2), _randn(1, 2, 9, 64, seed=3)
    out, _ = fc_tf.attention_forward(module, q, k, v, None, scaling=0.1, sliding_window=4,
                                     softcap=20.0)
    assert out.shape == (1, 9, 4, 64)
    kw = fake.calls[-1][2]
    assert kw["window"] == (3, 0) and kw["softcap"] == 20.0
    want = _naive(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True, (3, 0), 20.0,
                  scale=0.1)
    _close(out, want)
    # the same call through the torch fallback (as a 4-D mask would take it) gives the same
    keep = fc_tf.sdpa_fallback.keep_mask(None, 9, 9, True, (3, 0), q.device)
    alt = fc_tf.sdpa_fallback.attention(q, k, v, keep, 0.1, 20.0, 0.0, False)
    _close(alt.transpose(1, 2), want)


@needs_transformers
def test_transformers_training_with_padding_stays_on_flashcore(fake, llama_pair):
    """A fine-tuning step on a left-padded batch: the padded attention runs as
    ``attention_varlen`` (which has a backward) and the parameters' gradients are SDPA's."""
    ours, theirs = llama_pair
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    for model in (ours, theirs):
        model.train()
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
    assert fc_tf.fallback_count() == 0
    assert {c[0] for c in fake.calls} == {"attention_varlen"}
    named = dict(theirs.named_parameters())
    checked = 0
    for name, p in ours.named_parameters():
        if "self_attn" in name and p.grad is not None:
            want = named[name].grad.double()
            assert want.abs().max() > 0, name
            err = (p.grad.double() - want).abs().max() / want.abs().max()
            assert err < 0.05, (name, err.item())
            checked += 1
    assert checked >= 4


@needs_transformers
def test_transformers_training_at_a_wide_head_dim_stays_on_flashcore(fake):
    """Phi's 96-wide and Gemma's 256-wide heads train through flashcore's backward too: no
    fallback, and the attention weights' gradients are SDPA's."""
    name = fc_tf.register()
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(6))
    for d in (96, 256):
        ours, theirs = _tiny_llama(name, head_dim=d), _tiny_llama("sdpa", head_dim=d)
        theirs.load_state_dict(ours.state_dict())
        fc_tf.reset_fallbacks()
        fake.calls.clear()
        for model in (ours, theirs):
            model.train()
            model(input_ids=ids, labels=ids).loss.backward()
        assert fc_tf.fallback_count() == 0
        calls = [c for c in fake.calls if c[0] == "attention"]
        assert calls and calls[0][1][0].shape[-1] == d
        named = dict(theirs.named_parameters())
        for pname, p in ours.named_parameters():
            if "self_attn.q_proj" in pname:
                want = named[pname].grad.double()
                err = (p.grad.double() - want).abs().max() / want.abs().max()
                assert err < 0.05, (d, pname, err.item())


def test_kvcache_checks_the_lengths_once_a_step(fake):
    """An append's room check covers what the attention's own check would read back (lengths
    + new inside the cache, the table's used pages): one read-back a decode step, not two.
    Without new keys the attention still checks the caller's lengths; check_lengths=False
    checks nothing."""
    lens = torch.tensor([3, 17], dtype=torch.int32)
    _name, _args, kw = _dense_cache_call(fake, lens)
    assert kw["check_lengths"] is False
    _name, _args, kw = _dense_cache_call(fake, lens, check_lengths=False)
    assert kw["check_lengths"] is False
    kc, vc = _randn(2, 16, 2, 64, seed=1), _randn(2, 16, 2, 64, seed=2)
    q = _randn(2, 1, 4, 64, seed=3)
    fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([5, 16],
                                                                      dtype=torch.int32))
    assert fake.calls[-1][0] == "attention_paged" and fake.calls[-1][2]["check_lengths"]
    with pytest.raises(ValueError, match="over the cache"):
        _dense_cache_call(fake, torch.tensor([3, 95], dtype=torch.int32))
