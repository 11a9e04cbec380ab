"""GPU tests of the serving layouts against the float64 reference: packed variable-length
batches (``attention_varlen``) and a paged KV cache (``attention_paged``: decode with GQA and
split-KV, prefill and packed chunked prefill), with random length lists (0 and 1 included),
shuffled physical pages, page sizes 16 to 256 (and odd ones), windows and soft-capping.

Each sequence's error is held to the prefill tests' bound (``test_gpu_attention._allowed``)
with torch's own error on that sequence (SDPA with the same boolean mask). Outputs and LSE are
poisoned first; a NaN never passes.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from flashcore import reference
from flashcore.errors import SpecError
from flashcore.ops import attention, attention_paged, attention_varlen
from flashcore.specs import AttentionSpec, TileConfig
from tests.gpu_utils import (
    WGMMA_PAGED_CONFIGS,
    WGMMA_VARLEN_CONFIGS,
    allowed_error,
    current_arch,
    head_dims,
    max_abs,
    requires_cuda,
    torch_baseline,
    wgmma_page_sizes,
)
from tests.test_gpu_decode import FP8_KV_TOL, _rel_l2

pytestmark = [pytest.mark.gpu, requires_cuda]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
TILE = TileConfig((64, 64))  # the varlen / prefill kernels these tests build
WS_VARLEN = WGMMA_VARLEN_CONFIGS  # and on the Hopper family (sm_90)
WS_PAGED = WGMMA_PAGED_CONFIGS
LENGTH = st.one_of(st.sampled_from([0, 1]), st.integers(0, 200), st.integers(0, 1200))


def _masks(causal, window, softcap):
    if causal and window is not None and window[1] > 0:
        window = (window[0], 0)
    return {"mask_align": "bottom_right", "window": window, "softcap": softcap}


def _check_sequence(out, lse, q, k, v, causal, masks, dt, what):
    """One sequence's (1, H, S, D) output and (1, H, S) LSE against the reference."""
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, device=q.device,
                                       **masks)
    assert torch.isfinite(out).all(), f"{what}: NaN or unwritten elements"
    slopes = masks.get("alibi_slopes")
    if out.numel() == 0:
        return
    if k.shape[2] == 0:  # no key: zeros and -inf, as for any row that sees none
        assert not out.any() and torch.isneginf(lse).all(), f"{what}: rows without keys"
        return
    err = max_abs(out, ref)
    err_torch = max_abs(torch_baseline(q, k, v, causal, masks["mask_align"], masks["window"],
                                        masks["softcap"], slopes), ref)
    allowed = allowed_error(err_torch, ref, dt, q, k, v)
    assert err <= allowed, f"{what}: max err {err:.3g}, torch {err_torch:.3g}, allowed {allowed:.3g}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: -inf LSE exactly where no key"
    if finite.any():
        assert max_abs(lse[finite], ref_lse[finite]) < 1e-3 * max(1.0, ref_lse.abs().max().item())


def _cu(lens, device="cuda"):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


# a call's head dim, dtype and masks, as the serving properties draw them
MASKED_CALL = {
    "d": head_dims(),
    "dtype": st.sampled_from(["float16", "bfloat16"]),
    "causal": st.booleans(),
    "window": st.one_of(st.none(), st.tuples(st.integers(-1, 300), st.integers(-1, 300))),
    "softcap": st.one_of(st.none(), st.floats(0.5, 50)),
}


@settings(settings.get_profile("gpu"))
@given(
    lens=st.lists(st.tuples(LENGTH, LENGTH), min_size=1, max_size=5),
    self_attention=st.booleans(),
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 4]),
    **MASKED_CALL,
    config=st.sampled_from([TILE, *WS_VARLEN]),
    seed=st.integers(0, 2**31 - 1),
)
@example(lens=[(0, 5), (1, 1), (300, 1200), (0, 0), (77, 77)], self_attention=False, hkv=2,
         group=4, d=128, dtype="float16", causal=True, window=None, softcap=None, config=TILE,
         seed=1)
@example(lens=[(129, 129)], self_attention=True, hkv=1, group=1, d=64, dtype="bfloat16",
         causal=True, window=(40, 0), softcap=30.0, config=TILE, seed=2)
@example(lens=[(0, 5), (300, 900), (65, 65)], self_attention=False, hkv=2, group=4, d=256,
         dtype="bfloat16", causal=True, window=(200, 0), softcap=30.0, config=TILE, seed=3)
@example(lens=[(100, 400), (33, 33)], self_attention=False, hkv=1, group=4, d=96,
         dtype="float16", causal=False, window=None, softcap=None, config=TILE, seed=4)
@example(lens=[(0, 5), (1, 1), (300, 1200), (0, 0), (77, 77)], self_attention=False, hkv=2,
         group=4, d=128, dtype="float16", causal=True, window=None, softcap=None,
         config=WS_VARLEN[0], seed=5)  # Hopper: empty sequences, S_q < S_k, one row
@example(lens=[(1000, 1000), (129, 129), (0, 0)], self_attention=True, hkv=2, group=2, d=64,
         dtype="bfloat16", causal=True, window=(100, 0), softcap=20.0, config=WS_VARLEN[2],
         seed=6)  # three consumers, every mask, a tile past the last sequence's end
def test_varlen_matches_the_reference(lens, self_attention, hkv, group, d, dtype, causal, window,
                                      softcap, config, seed):
    """Packed batches on the mma_sync family everywhere and on the Hopper family on sm_90
    (each sequence's rows read through TMA coordinates offset to its start)."""
    lq = [a for a, _ in lens]
    lk = lq if self_attention else [b for _, b in lens]
    dt = DTYPES[dtype]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lq), hkv * group, d, device="cuda", generator=gen).to(dt)
    k, v = (torch.randn(sum(lk), hkv, d, device="cuda", generator=gen).to(dt) for _ in range(2))
    masks = _masks(causal, window, softcap)
    if config is not TILE:  # the Hopper family: sm_90, and a config this call builds
        assume(current_arch() == "sm_90")
        try:
            AttentionSpec(arch="sm_90", dtype=dtype, head_dim=d, causal=causal, varlen=True,
                          return_lse=True, mask_align="bottom_right",
                          window=masks["window"] is not None, softcap=softcap is not None,
                          config=config)
        except SpecError:
            assume(False)
    out = torch.full_like(q, float("nan"))
    res, lse = attention_varlen(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal,
                                return_lse=True, out=out, config=config, **masks)
    torch.cuda.synchronize()
    assert res is out and lse.shape == (hkv * group, sum(lq))
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    def seq(t, cu, b):
        return t[cu[b]:cu[b + 1]].transpose(0, 1)[None]

    for b in range(len(lens)):
        _check_sequence(seq(out, cq, b), lse[None, :, cq[b]:cq[b + 1]], seq(q, cq, b),
                        seq(k, ck, b), seq(v, ck, b), causal, masks, dt, f"sequence {b} of {lens}")


def _paged_cache(lens, page_size, hkv, d, dt, gen):
    """K/V caches whose pages are shuffled and shared by no two sequences, the block table
    (padded with -1 past each sequence's pages) and the dense K/V of each sequence."""
    need = [max(1, -(-n // page_size)) for n in lens]
    max_pages = max(need)
    pages = sum(need) + 3
    order = torch.randperm(pages, device="cuda", generator=gen)
    table = torch.full((len(lens), max_pages), -1, dtype=torch.int32, device="cuda")
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = order[at:at + n].to(torch.int32)
        at += n
    k_cache, v_cache = (torch.randn(pages, page_size, hkv, d, device="cuda", generator=gen).to(dt)
                        for _ in range(2))
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    dense = [(reference.gather_pages(k_cache, table, n, b), reference.gather_pages(v_cache, table, n, b))
             for b, n in enumerate(lens)]
    return k_cache, v_cache, table, seqlens, dense


# Pages copied whole (16: four to a 64-key block; 128: a block inside a page) and gathered a
# row at a time (24 and 1 fit no copy pass); test_every_page_size_kind covers the others.
PAGE_SIZES = st.sampled_from([16, 128, 24, 1])
# key lengths of the sequences in a paged cache: empty, one key, short, several thousand
CACHE_LENS = st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(0, 600),
                                st.integers(0, 5000)), min_size=1, max_size=4)


@settings(settings.get_profile("gpu"))
@given(
    lens=CACHE_LENS,
    sq=st.one_of(st.just(1), st.integers(1, 200)),
    page_size=PAGE_SIZES,
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 4]),
    d=head_dims(),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    causal=st.booleans(),
    num_splits=st.sampled_from([None, 1, 3]),
    seed=st.integers(0, 2**31 - 1),
)
@example(lens=[4999, 0, 1, 700], sq=1, page_size=16, hkv=2, group=4, d=128, dtype="float16",
         causal=False, num_splits=None, seed=1)  # decode, GQA packed, split, empty sequence
@example(lens=[1000, 300], sq=128, page_size=256, hkv=1, group=1, d=64, dtype="bfloat16",
         causal=True, num_splits=None, seed=2)  # chunked prefill against the cache
@example(lens=[333], sq=1, page_size=24, hkv=1, group=1, d=64, dtype="float16", causal=True,
         num_splits=3, seed=3)  # a page size that divides no tile
@example(lens=[2999, 17], sq=1, page_size=16, hkv=2, group=4, d=256, dtype="bfloat16",
         causal=True, num_splits=None, seed=4)  # wide decode: pages copied whole, split
@example(lens=[700, 1], sq=40, page_size=24, hkv=1, group=4, d=96, dtype="float16",
         causal=True, num_splits=None, seed=5)  # chunked prefill, three 64-byte lines a row
def test_paged_matches_the_reference(lens, sq, page_size, hkv, group, d, dtype, causal,
                                     num_splits, seed):
    _check_paged_call(lens, sq, page_size, hkv, group, d, dtype, causal, num_splits, seed)


def _check_paged_call(lens, sq, page_size, hkv, group, d, dtype, causal, num_splits, seed):
    """One attention_paged call (bottom-right masks, poisoned output and LSE), each sequence
    against the reference."""
    dt = DTYPES[dtype]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k_cache, v_cache, table, seqlens, dense = _paged_cache(lens, page_size, hkv, d, dt, gen)
    q = torch.randn(len(lens), hkv * group, sq, d, device="cuda", generator=gen).to(dt)
    masks = _masks(causal, None, None)
    out = torch.full_like(q, float("nan"))
    config = TILE if sq > 16 else None  # decode: the tuned kernels (split-KV, packed GQA)
    res, lse = attention_paged(q, k_cache, v_cache, table, seqlens, causal=causal,
                               return_lse=True, out=out, config=config, num_splits=num_splits,
                               mask_align="bottom_right")
    torch.cuda.synchronize()
    assert res is out
    for b, (k, v) in enumerate(dense):
        _check_sequence(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k, v, causal, masks, dt,
                        f"sequence {b} of {lens}, page {page_size}")


@settings(settings.get_profile("gpu"))
@given(
    lens=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 1500)), min_size=1, max_size=4),
    page_size=PAGE_SIZES,
    d=head_dims(),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_packed_chunks_against_a_paged_cache(lens, page_size, d, dtype, seed):
    """Chunked prefill as vLLM runs it: each sequence's new chunk packed in q, attending
    (causal, bottom-right) to its whole history in the paged cache."""
    lens = [(min(a, b), b) for a, b in lens]  # a chunk is part of the keys
    dt = DTYPES[dtype]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lk = [b for _, b in lens]
    lq = [a for a, _ in lens]
    k_cache, v_cache, table, seqlens, dense = _paged_cache(lk, page_size, 2, d, dt, gen)
    q = torch.randn(sum(lq), 4, d, device="cuda", generator=gen).to(dt)
    out = torch.full_like(q, float("nan"))
    res, lse = attention_paged(q, k_cache, v_cache, table, seqlens, causal=True,
                               return_lse=True, out=out, config=TILE, cu_seqlens_q=_cu(lq),
                               max_seqlen_q=max(lq), mask_align="bottom_right")
    torch.cuda.synchronize()
    assert res is out
    cq = _cu(lq).tolist()
    for b, (k, v) in enumerate(dense):
        rows = slice(cq[b], cq[b + 1])
        _check_sequence(out[rows].transpose(0, 1)[None], lse[None, :, rows],
                        q[rows].transpose(0, 1)[None], k, v, True, _masks(True, None, None), dt,
                        f"sequence {b} of {lens}")


def _poison_past_keys(cache: torch.Tensor, table: torch.Tensor, lens) -> None:
    """NaN in every cache row a sequence's pages hold past its keys: a kernel that reads them
    must not let them reach its output (P is 0 there; 0 * NaN is not)."""
    page_size = cache.shape[1]
    for b, n in enumerate(lens):
        pages = max(1, -(-n // page_size))
        last = int(table[b, pages - 1])
        cache[last, n - (pages - 1) * page_size:] = float("nan")


@settings(settings.get_profile("gpu"))
@given(
    lens=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 3000)), min_size=1, max_size=4),
    packed=st.booleans(),
    pages=st.sampled_from(["a block", "two blocks", "two a block", "16 rows"]),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 4]),
    **MASKED_CALL,
    config=st.sampled_from(WS_PAGED),
    seed=st.integers(0, 2**31 - 1),
)
@example(lens=[(70, 1000), (0, 0), (1, 129), (300, 300)], packed=True, pages="a block",
         hkv=2, group=4, d=128, dtype="float16", causal=True, window=None, softcap=None,
         config=WS_PAGED[0], seed=1)  # chunked prefill: an empty sequence, one query
@example(lens=[(200, 2500), (200, 77)], packed=False, pages="two blocks", hkv=1, group=1,
         d=64, dtype="bfloat16", causal=True, window=(500, 0), softcap=30.0,
         config=WS_PAGED[2], seed=2)  # queries that see no key, a window, three consumers
@example(lens=[(70, 1000), (0, 0), (1, 1), (300, 333)], packed=True, pages="16 rows",
         hkv=2, group=4, d=128, dtype="float16", causal=True, window=None, softcap=None,
         config=WS_PAGED[0], seed=3)  # a block of eight pages, its last ones past the table
@example(lens=[(129, 129), (129, 3000)], packed=False, pages="two a block", hkv=1, group=4,
         d=64, dtype="bfloat16", causal=True, window=(700, 0), softcap=None,
         config=WS_PAGED[2], seed=4)  # two pages a block, a window, three consumers
def test_paged_prefill_on_the_hopper_family(lens, packed, pages, hkv, group, d, dtype, causal,
                                            window, softcap, config, seed):
    """Prefill and chunked prefill (bottom-right) against a paged cache on the Hopper family
    (sm_90): each key block one page's rows by TMA, or a box from each of its pages, the
    pages shuffled, the rows past each sequence's keys NaN; q dense (every sequence the same
    query length) or packed."""
    assume(current_arch() == "sm_90")
    masks = _masks(causal, window, softcap)
    page_size = wgmma_page_sizes(config)[pages]
    try:
        AttentionSpec(arch="sm_90", dtype=dtype, head_dim=d, causal=causal, paged_kv=True,
                      page_size=page_size, varlen=packed, return_lse=True,
                      mask_align="bottom_right", window=masks["window"] is not None,
                      softcap=softcap is not None, config=config)
    except SpecError:
        assume(False)
    lk = [b for _, b in lens]
    lq = [min(a, b) if packed else lens[0][0] for a, b in lens]
    dt = DTYPES[dtype]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k_cache, v_cache, table, seqlens, dense = _paged_cache(lk, page_size, hkv, d, dt, gen)
    for cache in (k_cache, v_cache):
        _poison_past_keys(cache, table, lk)
    extra = {}
    if packed:
        q = torch.randn(sum(lq), hkv * group, d, device="cuda", generator=gen).to(dt)
        extra = {"cu_seqlens_q": _cu(lq), "max_seqlen_q": max(lq)}
    else:
        q = torch.randn(len(lk), hkv * group, lq[0], d, device="cuda", generator=gen).to(dt)
    out = torch.full_like(q, float("nan"))
    res, lse = attention_paged(q, k_cache, v_cache, table, seqlens, causal=causal,
                               return_lse=True, out=out, config=config, **masks, **extra)
    torch.cuda.synchronize()
    assert res is out
    cq = _cu(lq).tolist()
    for b, (k, v) in enumerate(dense):
        if packed:
            rows = slice(cq[b], cq[b + 1])
            o, lb, qb = (out[rows].transpose(0, 1)[None], lse[None, :, rows],
                         q[rows].transpose(0, 1)[None])
        else:
            o, lb, qb = out[b:b + 1], lse[b:b + 1], q[b:b + 1]
        _check_sequence(o, lb, qb, k, v, causal, masks, dt, f"sequence {b} of {lens}")


@pytest.mark.parametrize("lens,sq,page_size,hkv,group,d,dtype,causal,num_splits", [
    ([4999, 0, 1, 700], 3, 16, 2, 4, 128, "float16", True, None),  # whole pages, an empty one
    ([333, 1000], 5, 24, 1, 8, 64, "bfloat16", False, None),  # a gathered page size
    ([2000], 2, 16, 2, 2, 128, "float16", True, 3),
])
def test_paged_multi_token_gqa_packs_tokens(lens, sq, page_size, hkv, group, d, dtype, causal,
                                            num_splits):
    """A few query tokens against a paged cache, each K/V head's (token, head) pairs packed
    into rows (``plan.packs_tokens``: the kernel gathers and scatters them): each sequence
    against the reference with bottom-right masks, output and LSE poisoned first."""
    from flashcore.ops import plan

    assert plan.packs_tokens(sq, hkv * group, hkv, 16, 64, False)
    _check_paged_call(lens, sq, page_size, hkv, group, d, dtype, causal, num_splits, sq)


@pytest.mark.parametrize("page_size", [1, 4, 8, 24, 32, 64, 256, 192])
@pytest.mark.parametrize("sq", [1, 100])
def test_every_page_size_kind(page_size, sq):
    """Page sizes that the decode (one warp) and prefill (four warps) kernels copy whole or
    gather, pages smaller and larger than a key block: ragged lengths against the reference."""
    gen = torch.Generator(device="cuda").manual_seed(page_size * 1000 + sq)
    lens = [1, 700, 0, 385]
    k_cache, v_cache, table, seqlens, dense = _paged_cache(lens, page_size, 2, 128,
                                                           torch.float16, gen)
    q = torch.randn(len(lens), 8, sq, 128, device="cuda", generator=gen, dtype=torch.float16)
    out = torch.full_like(q, float("nan"))
    _, lse = attention_paged(q, k_cache, v_cache, table, seqlens, return_lse=True, out=out,
                             config=TILE if sq > 16 else None)
    torch.cuda.synchronize()
    for b, (k, v) in enumerate(dense):
        _check_sequence(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k, v, False,
                        _masks(False, None, None), torch.float16, f"page {page_size} seq {b}")


def test_compiled_serving_calls_equal_eager_bit_for_bit():
    """torch.compile(fullgraph=True) traces both layouts through their registered ops
    (torch.ops.flashcore.attention_varlen / attention_paged) and launches the same kernels."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    lens = [5, 0, 130]
    cu = _cu(lens)
    q, k, v = (torch.randn(sum(lens), h, 64, device="cuda", generator=gen, dtype=torch.float16)
               for h in (4, 2, 2))

    def varlen(q, k, v, cu):
        return attention_varlen(q, k, v, cu, cu, 130, 130, causal=True, return_lse=True,
                                mask_align="bottom_right", tile=(64, 64))

    compiled = torch.compile(varlen, fullgraph=True)(q, k, v, cu)
    for got, want in zip(compiled, varlen(q, k, v, cu)):
        assert torch.equal(got, want)
    k_cache, v_cache, table, seqlens, _ = _paged_cache([300, 1, 17], 16, 2, 128, torch.float16,
                                                       gen)
    qd = torch.randn(3, 8, 1, 128, device="cuda", generator=gen, dtype=torch.float16)

    def paged(q, kc, vc, table, seqlens):
        return attention_paged(q, kc, vc, table, seqlens, return_lse=True)

    compiled = torch.compile(paged, fullgraph=True)(qd, k_cache, v_cache, table, seqlens)
    for got, want in zip(compiled, paged(qd, k_cache, v_cache, table, seqlens)):
        assert torch.equal(got, want)


def test_paged_decode_equals_contiguous_decode():
    """The same keys, paged (page 16, shuffled) or contiguous: equal outputs to rounding."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = [3000, 17, 4096]
    k_cache, v_cache, table, seqlens, dense = _paged_cache(lens, 16, 2, 128, torch.float16, gen)
    q = torch.randn(3, 8, 1, 128, device="cuda", generator=gen, dtype=torch.float16)
    paged = attention_paged(q, k_cache, v_cache, table, seqlens)
    for b, (k, v) in enumerate(dense):
        torch.testing.assert_close(paged[b:b + 1], attention(q[b:b + 1], k, v), atol=2e-3, rtol=0)


@pytest.mark.parametrize("b,hq,hkv,sq,lens,d,page,dtype,fp8", [
    (3, 32, 8, 1, [5, 3000, 777], 128, 16, torch.float16, False),
    (2, 16, 4, 1, [4097, 2500], 128, 24, torch.bfloat16, False),  # pages gathered
    (2, 8, 2, 3, [1500, 4000], 64, 128, torch.float16, False),  # packed tokens
    (1, 28, 4, 1, [6000], 128, 16, torch.bfloat16, False),
    (2, 32, 8, 1, [3001, 9], 128, 16, torch.float16, True),  # an e4m3 cache
])
def test_an_eager_paged_split_decode_is_one_launch(b, hq, hkv, sq, lens, d, page, dtype, fp8):
    """An eager split decode against a paged cache merges its shares in the split kernel (one
    launch, its last share's CTA writing the output and LSE), bottom-right causal, the memoised
    call too: against the float64 reference of the gathered pages."""
    from unittest import mock

    from flashcore.ops import launcher

    gen = torch.Generator().manual_seed(len(lens) + d)
    pages_per = -(-max(lens) // page)
    n_pages = b * pages_per + 3
    q = torch.randn(b, hq, sq, d, generator=gen).to("cuda", dtype)
    kc, vc = (torch.randn(n_pages, page, hkv, d, generator=gen).to("cuda", dtype)
              for _ in range(2))
    table = torch.randperm(n_pages, generator=gen)[:b * pages_per].view(b, pages_per)
    table, seqlens = table.to("cuda", torch.int32), torch.tensor(lens, device="cuda",
                                                                 dtype=torch.int32)
    extra, kq, vq = {}, kc.double(), vc.double()
    if fp8:
        kd, vd = (torch.rand(n_pages, page, hkv, device="cuda", generator=None) + 0.5
                  for _ in range(2))
        kc = (kc.float() / kd[..., None]).to(torch.float8_e4m3fn)
        vc = (vc.float() / vd[..., None]).to(torch.float8_e4m3fn)
        kq, vq = kc.double() * kd.double()[..., None], vc.double() * vd.double()[..., None]
        extra = {"k_descale": kd, "v_descale": vd}
    ref, ref_lse = reference.attention_paged(q.double(), kq, vq, table, seqlens, causal=True,
                                             return_lse=True, mask_align="bottom_right")
    ref, ref_lse = ref.to("cuda"), ref_lse.to("cuda")
    with mock.patch.object(launcher, "launch", wraps=launcher.launch) as launches:
        for _ in range(3):
            launches.reset_mock()
            out = torch.full_like(q, float("nan"))
            res, lse = attention_paged(q, kc, vc, table, seqlens, causal=True, return_lse=True,
                                       mask_align="bottom_right", out=out, **extra)
            torch.cuda.synchronize()
            grids = [c.args[1] for c in launches.call_args_list]
            assert res is out and torch.isfinite(out).all()
            assert len(grids) == 1 and grids[0][1] > 1, grids  # split, one launch
            assert max_abs(out, ref) < 2e-2
            # every row sees a key: both LSEs finite (no NaN passes), then close
            assert torch.isfinite(ref_lse).all() and torch.isfinite(lse).all()
            assert max_abs(lse, ref_lse) < 1e-3


def _slopes(batch, heads, per_batch, gen):
    """ALiBi slopes: the paper's geometric ones, per head or scaled per sequence."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)
    if per_batch:
        slopes = slopes * torch.rand(batch, 1, device="cuda", generator=gen) * 2
    return slopes.float()


@settings(settings.get_profile("gpu"))
@given(
    lens=st.lists(st.tuples(LENGTH, LENGTH), min_size=1, max_size=4),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 4]),
    causal=st.booleans(),
    per_batch=st.booleans(),
    softcap=st.one_of(st.none(), st.floats(2.0, 50)),
    seed=st.integers(0, 2**31 - 1),
)
@example(lens=[(0, 5), (300, 1100), (1, 1), (64, 0)], hkv=2, group=4, causal=True,
         per_batch=True, softcap=None, seed=1)
def test_varlen_alibi_matches_the_reference(lens, hkv, group, causal, per_batch, softcap, seed):
    """ALiBi over a packed batch: each sequence measured from its own bottom-right diagonal,
    (batch, heads) slopes a row a sequence."""
    lq, lk = [a for a, _ in lens], [b for _, b in lens]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h, d, dt = hkv * group, 128, torch.float16
    q = torch.randn(sum(lq), h, d, device="cuda", generator=gen).to(dt)
    k, v = (torch.randn(sum(lk), hkv, d, device="cuda", generator=gen).to(dt) for _ in range(2))
    slopes = _slopes(len(lens), h, per_batch, gen)
    out = torch.full_like(q, float("nan"))
    res, lse = attention_varlen(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal,
                                return_lse=True, out=out, config=TILE, mask_align="bottom_right",
                                softcap=softcap, alibi_slopes=slopes)
    torch.cuda.synchronize()
    assert res is out
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for b in range(len(lens)):
        rows = slice(cq[b], cq[b + 1])
        masks = {**_masks(causal, None, softcap),
                 "alibi_slopes": slopes[b] if per_batch else slopes}
        _check_sequence(out[rows].transpose(0, 1)[None], lse[None, :, rows],
                        q[rows].transpose(0, 1)[None], k[ck[b]:ck[b + 1]].transpose(0, 1)[None],
                        v[ck[b]:ck[b + 1]].transpose(0, 1)[None], causal, masks, dt,
                        f"sequence {b} of {lens}")


@pytest.mark.parametrize("sq, page_size, num_splits", [(1, 16, None), (1, 1, 3), (77, 16, None)])
@pytest.mark.parametrize("per_batch", [False, True])
def test_paged_alibi_matches_the_reference(sq, page_size, num_splits, per_batch):
    """ALiBi against a paged cache: split decode (GQA unpacked: a slope a head) and chunked
    prefill, each sequence's distances from its own last key."""
    gen = torch.Generator(device="cuda").manual_seed(sq + page_size)
    lens, hkv, group, d, dt = [2999, 0, 1, 700], 2, 4, 128, torch.bfloat16
    k_cache, v_cache, table, seqlens, dense = _paged_cache(lens, page_size, hkv, d, dt, gen)
    q = torch.randn(len(lens), hkv * group, sq, d, device="cuda", generator=gen).to(dt)
    slopes = _slopes(len(lens), hkv * group, per_batch, gen)
    out = torch.full_like(q, float("nan"))
    res, lse = attention_paged(q, k_cache, v_cache, table, seqlens, causal=True, return_lse=True,
                               out=out, num_splits=num_splits, mask_align="bottom_right",
                               alibi_slopes=slopes)
    torch.cuda.synchronize()
    assert res is out
    for b, (k, v) in enumerate(dense):
        masks = {**_masks(True, None, None), "alibi_slopes": slopes[b] if per_batch else slopes}
        _check_sequence(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k, v, True, masks, dt,
                        f"sequence {b} of {lens}, page {page_size}")


def test_repeated_paged_calls_read_their_own_lengths_and_tables():
    """Paged decode calls of one shape (the memoised path) queued back to back, the lengths
    growing by one and the table reshuffled between calls: each equals the contiguous call on
    its own keys, split or not."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    k_cache, v_cache, table, seqlens, _ = _paged_cache([700, 33, 1990], 16, 2, 128,
                                                        torch.float16, gen)
    relabel = torch.randperm(k_cache.shape[0], device="cuda", generator=gen).to(torch.int32)
    q = torch.randn(3, 8, 1, 128, device="cuda", generator=gen, dtype=torch.float16)
    for splits in (1, 4):
        calls = []
        for step in range(4):
            lens = seqlens + step
            tab = torch.where(table >= 0, relabel[table.clamp(min=0).long()], table)
            tab = tab if step % 2 else table.clone()
            calls.append((lens, tab, attention_paged(q, k_cache, v_cache, tab, lens,
                                                     num_splits=splits)))
        for lens, tab, out in calls:
            for b, n in enumerate(lens.tolist()):
                k = reference.gather_pages(k_cache, tab, n, b)
                v = reference.gather_pages(v_cache, tab, n, b)
                torch.testing.assert_close(out[b:b + 1], attention(q[b:b + 1], k, v),
                                           atol=2e-3, rtol=0)


def test_bad_tables_are_refused_on_the_host():
    q = torch.randn(5, 2, 64, device="cuda", dtype=torch.float16)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="must not decrease"):
        attention_varlen(q, q, q, torch.tensor([0, 4, 3], dtype=torch.int32, device="cuda"), cu,
                         4, 4)
    with pytest.raises(ValueError, match="longer than its max_seqlen"):
        attention_varlen(q, q, q, cu, cu, 2, 3)
    with pytest.raises(ValueError, match="past the packed tensor"):
        attention_varlen(q, q, q, cu, torch.tensor([0, 3, 6], dtype=torch.int32,
                                                   device="cuda"), 3, 3)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        attention_varlen(q, q, q, cu.long(), cu, 3, 3)
    k_cache = torch.randn(4, 16, 2, 64, device="cuda", dtype=torch.float16)
    qd = torch.randn(2, 2, 1, 64, device="cuda", dtype=torch.float16)
    table = torch.tensor([[0, 1], [2, 7]], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="outside 0..3"):
        attention_paged(qd, k_cache, k_cache, table, torch.tensor([20, 20], dtype=torch.int32,
                                                                   device="cuda"))
    # the entry past what the lengths reach is never read: not an error
    out = attention_paged(qd, k_cache, k_cache, table, torch.tensor([20, 16], dtype=torch.int32,
                                                                     device="cuda"))
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="over the block table"):
        attention_paged(qd, k_cache, k_cache, table, torch.tensor([33, 1], dtype=torch.int32,
                                                                   device="cuda"))
    with pytest.raises(ValueError, match="num_splits"):
        attention_paged(qd, k_cache, k_cache, table, torch.tensor([1, 1], dtype=torch.int32,
                                                                   device="cuda"), num_splits=0)
    with pytest.raises(ValueError, match="batch"):
        attention_paged(qd[:1], k_cache, k_cache, table, torch.tensor([1, 1], dtype=torch.int32,
                                                                       device="cuda"))


def test_empty_batches_and_keyless_sequences():
    q = torch.randn(3, 2, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(0, 2, 64, device="cuda", dtype=torch.float16)
    cu_q = torch.tensor([0, 3], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 0], dtype=torch.int32, device="cuda")
    out, lse = attention_varlen(q, k, k, cu_q, cu_k, 3, 0, return_lse=True, config=TILE)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    none = torch.tensor([0], dtype=torch.int32, device="cuda")
    assert attention_varlen(q[:0], k, k, none, none, 0, 0).shape == (0, 2, 64)
    # a sequence of queries with no keys next to one with keys: 0 and -inf only where none
    k = torch.randn(4, 2, 64, device="cuda", dtype=torch.float16)
    cu_q = torch.tensor([0, 1, 3], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 0, 4], dtype=torch.int32, device="cuda")
    out, lse = attention_varlen(q, k, k, cu_q, cu_k, 2, 4, return_lse=True, config=TILE)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[:, 0]).all()
    assert torch.isfinite(lse[:, 1:]).all() and out[1:].abs().sum() > 0
    assert not math.isnan(out.sum().item())


@settings(settings.get_profile("gpu"))
@given(
    lens=CACHE_LENS,
    sq=st.one_of(st.just(1), st.integers(1, 40)),
    packed=st.booleans(),
    page_size=PAGE_SIZES,
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 4]),
    d=st.sampled_from([64, 128]),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    causal=st.booleans(),
    num_splits=st.sampled_from([None, 1, 3]),
    log_mag=st.floats(-3, 4),
    outlier=st.sampled_from([0.0, 100.0, 1e4]),
    seed=st.integers(0, 2**31 - 1),
)
@example(lens=[4999, 0, 1, 700], sq=1, packed=False, page_size=16, hkv=2, group=4, d=128,
         dtype="float16", causal=False, num_splits=None, log_mag=0.0, outlier=1e4,
         seed=1)  # decode: GQA packed into rows, split over CTAs, an empty sequence
@example(lens=[333, 40], sq=7, packed=True, page_size=24, hkv=1, group=1, d=64,
         dtype="bfloat16", causal=True, num_splits=None, log_mag=4.0, outlier=0.0,
         seed=2)  # packed chunks against gathered pages, huge magnitudes
def test_fp8_paged_cache_matches_the_dequantised_cache(lens, sq, packed, page_size, hkv, group,
                                                       d, dtype, causal, num_splits, log_mag,
                                                       outlier, seed):
    """An e4m3 paged cache (``quantize_paged_cache``: per-key scales, no overflow for any finite
    magnitude), shuffled pages of every kind, decode and (packed) chunks against it: the
    result matches exact attention over the dequantised cache, as the dense FP8 KV cache does
    (test_gpu_decode)."""
    from flashcore.ops.fp8 import quantize_paged_cache

    dt = DTYPES[dtype]
    mag = 10.0**log_mag
    if dt == torch.float16:  # fp16 inputs cannot exceed 65504
        mag = min(mag, 6e4 / max(outlier, 1.0) / 5)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k16, v16, table, seqlens, _ = _paged_cache(lens, page_size, hkv, d, torch.float32, gen)
    k16, v16 = (k16 * mag).to(dt), (v16 * mag).to(dt)
    if outlier and lens[0]:  # one key of the first sequence, far above the rest
        k16[table[0, 0], 0, 0] *= outlier / 10 if dt == torch.float16 else outlier
    k8, kd = quantize_paged_cache(k16)
    v8, vd = quantize_paged_cache(v16)
    heads = hkv * group
    scale = 1.0 / (math.sqrt(d) * mag)  # O(1) logits: the property under test is K/V's range
    lq = [min(sq, n) if packed else sq for n in lens]
    q = torch.randn(sum(lq) if packed else len(lens) * sq, heads, d, device="cuda",
                    generator=gen).to(dt)
    if not packed:
        q = q.view(len(lens), sq, heads, d).transpose(1, 2)
    out = torch.full_like(q, float("nan"))
    kw = {"cu_seqlens_q": _cu(lq), "max_seqlen_q": max(lq)} if packed else {}
    attention_paged(q, k8, v8, table, seqlens, causal=causal, softmax_scale=scale, out=out,
                    num_splits=None if packed else num_splits, mask_align="bottom_right",
                    k_descale=kd, v_descale=vd, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "NaN/Inf (or unwritten elements) in the output"
    k_exact = k8.double() * kd.double()[..., None]
    v_exact = v8.double() * vd.double()[..., None]
    cq = _cu(lq).tolist()
    got, want = [], []
    for b, n in enumerate(lens):
        qb = (q[cq[b]:cq[b + 1]].transpose(0, 1)[None] if packed else q[b:b + 1])
        ob = (out[cq[b]:cq[b + 1]].transpose(0, 1)[None] if packed else out[b:b + 1])
        if n == 0:  # no key: zeros
            assert not ob.any(), f"sequence {b} has no keys: its rows must be 0"
            continue
        got.append(ob.flatten())
        want.append(reference.attention(
            qb, reference.gather_pages(k_exact, table, n, b),
            reference.gather_pages(v_exact, table, n, b), causal=causal, softmax_scale=scale,
            mask_align="bottom_right", device=q.device).flatten())
    if got:
        err = _rel_l2(torch.cat(got), torch.cat(want))
        # bf16 output rounding alone is up to 2^-9 relative per element
        assert err <= (FP8_KV_TOL if dt == torch.float16 else 2 * FP8_KV_TOL), f"rel L2 {err:.3g}"


def test_fp8_paged_cache_errors():
    from flashcore.ops.fp8 import quantize_paged_cache

    k16 = torch.randn(4, 16, 2, 64, device="cuda", dtype=torch.float16)
    k8, kd = quantize_paged_cache(k16)
    q = torch.randn(2, 4, 1, 64, device="cuda", dtype=torch.float16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([20, 5], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="need k_descale"):
        attention_paged(q, k8, k8, table, lens)
    with pytest.raises(ValueError, match=r"v_descale must be float32 of shape \(4, 16, 2\)"):
        attention_paged(q, k8, k8, table, lens, k_descale=kd, v_descale=kd[:, :, :1])
    with pytest.raises(ValueError, match="differ"):
        attention_paged(q, k8, k16, table, lens, k_descale=kd, v_descale=kd)
    with pytest.raises(ValueError, match="for float8_e4m3fn k and v"):
        attention_paged(q, k16, k16, table, lens, k_descale=kd, v_descale=kd)
    # one scale per tensor, broadcast with stride 0: the kernel reads the strides it is given
    one = kd.amax().expand(kd.shape)
    k_one = (k16.float() / one[..., None]).to(torch.float8_e4m3fn)
    out = attention_paged(q, k_one, k_one, table, lens, k_descale=one, v_descale=one)
    exact = k_one.double() * one.double()[..., None]
    for b, n in enumerate(lens.tolist()):
        ref = reference.attention(q[b:b + 1], reference.gather_pages(exact, table, n, b),
                                  reference.gather_pages(exact, table, n, b), device=q.device)
        assert _rel_l2(out[b:b + 1], ref) <= FP8_KV_TOL
