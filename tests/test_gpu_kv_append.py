"""The KV-cache append kernel on the GPU (``flashcore.ops.kv_append``): new keys and values
land at each sequence's length in a dense or paged cache, turned by rotary as the float32
torch formula turns them (within one rounding of the dtype), the queries too; nothing else in
the cache moves, and lengths or tables past the cache write inside it, never outside."""

from __future__ import annotations

import pytest
import torch

from flashcore.integrations import flash_attn as fa
from flashcore.integrations import kv_cache
from flashcore.ops import kv_append
from tests.gpu_utils import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


def _close_to_one_rounding(got, want):
    """Equal but for the last bit of a 16-bit rounding (the kernel may fuse a multiply-add)."""
    ulp = 2.0 ** (-7 if want.dtype == torch.bfloat16 else -10)
    err = (got.float() - want.float()).abs()
    assert bool((err <= want.float().abs() * ulp + 1e-6).all()), err.max().item()


def _tables(n, half, dtype, gen):
    ang = torch.rand(n, 1, device="cuda", generator=gen) * 100 * (
        10000.0 ** (-torch.arange(half, device="cuda") / half))
    return ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("rotary_dim, interleaved, table_dtype", [
    (0, False, None), (128, False, torch.float32), (64, True, torch.float32),
    (32, False, "q")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_append_matches_the_torch_formula(paged, rotary_dim, interleaved, table_dtype, dtype):
    gen = torch.Generator(device="cuda").manual_seed(rotary_dim + paged)
    b, sq, new, h, hkv, d, cap, ps = 3, 2, 5, 8, 2, 128, 256, 16
    lens = torch.tensor([0, 17, 250], dtype=torch.int32, device="cuda")
    q = torch.randn(b, sq, h, d, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(b, new, hkv, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    if paged:
        pages = b * cap // ps + 2
        kc, vc = (torch.randn(pages, ps, hkv, d, device="cuda", generator=gen).to(dtype)
                  for _ in range(2))
        table = torch.randperm(pages, device="cuda", generator=gen)[:b * cap // ps].view(b, -1)
        table = table.to(torch.int32)
        k_pages, v_pages = kc, vc
    else:
        kc, vc = (torch.randn(b + 1, cap, hkv, d, device="cuda", generator=gen).to(dtype)
                  for _ in range(2))
        rows = torch.tensor([2, 0, 3], dtype=torch.int32, device="cuda")  # cache_batch_idx
        k_pages, table = kv_cache.dense_as_pages(kc, rows)
        v_pages, _ = kv_cache.dense_as_pages(vc, rows)
    k0, v0 = kc.clone(), vc.clone()
    cos = sin = None
    if rotary_dim:
        tdt = dtype if table_dtype == "q" else table_dtype
        cos, sin = _tables(cap + 8, rotary_dim // 2, tdt, gen)
    turned = kv_append.append_kv(k, v, k_pages, v_pages, table, lens, q=q, cos=cos, sin=sin,
                                 interleaved=interleaved, q_per_token=True)
    torch.cuda.synchronize()
    want_k = k
    if rotary_dim:
        at = kv_cache.positions(lens, new)
        want_k = kv_cache.apply_rotary(k, cos, sin, at, interleaved)
        _close_to_one_rounding(turned, kv_cache.apply_rotary(q, cos, sin,
                                                             kv_cache.positions(lens, sq),
                                                             interleaved))
    else:
        assert turned is None
    if paged:
        slots = kv_cache.paged_slots(table, lens, new, ps)
    else:
        slots = kv_cache.dense_slots(rows, lens, new)
    _close_to_one_rounding(kc[slots], want_k)
    assert torch.equal(vc[slots], v)
    moved = torch.zeros(kc.shape[:2], dtype=torch.bool, device="cuda")
    moved[slots] = True
    assert torch.equal(kc[~moved], k0[~moved]) and torch.equal(vc[~moved], v0[~moved])


def test_lengths_past_the_cache_write_inside_it():
    """Unchecked lengths and table entries out of range: the writes are clamped into the
    cache (the guard memory around it stays as it was)."""
    d, hkv, ps, pages = 64, 1, 16, 4
    buf = torch.randn(2 * pages * ps * hkv * d + 2 * 4096, device="cuda").half()
    guard = buf.clone()
    kc = buf[4096:4096 + pages * ps * hkv * d].view(pages, ps, hkv, d)
    vc = buf[-4096 - pages * ps * hkv * d:-4096].view(pages, ps, hkv, d)
    table = torch.tensor([[0, 9], [-3, 1]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([1000, -50], dtype=torch.int32, device="cuda")
    k, v = (torch.randn(2, 3, hkv, d, device="cuda").half() for _ in range(2))
    q = torch.randn(2, 1, 2, d, device="cuda").half()
    cos, sin = _tables(8, 16, torch.float32, torch.Generator(device="cuda").manual_seed(0))
    kv_append.append_kv(k, v, kc, vc, table, lens, q=q, cos=cos, sin=sin)
    torch.cuda.synchronize()
    assert torch.equal(buf[:4096], guard[:4096]) and torch.equal(buf[-4096:], guard[-4096:])
    inside = buf[4096 + pages * ps * hkv * d:-4096 - pages * ps * hkv * d]
    assert torch.equal(inside, guard[4096 + pages * ps * hkv * d:-4096 - pages * ps * hkv * d])


def test_flash_attn_with_kvcache_appends_through_the_kernel():
    """flash_attn_with_kvcache takes the kernel for a CUDA 16-bit cache (one launch for the
    append and rotary), and its result is the torch path's."""
    from unittest import mock

    gen = torch.Generator(device="cuda").manual_seed(3)
    b, h, hkv, d, cap = 2, 8, 2, 128, 128
    lens = torch.tensor([3, 90], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, d, device="cuda", generator=gen).half()
    k, v = (torch.randn(b, 1, hkv, d, device="cuda", generator=gen).half() for _ in range(2))
    kc, vc = (torch.randn(b, cap, hkv, d, device="cuda", generator=gen).half() for _ in range(2))
    cos, sin = _tables(cap, 32, torch.float32, gen)
    caches = (kc.clone(), vc.clone())
    with mock.patch.object(kv_append, "append_kv", wraps=kv_append.append_kv) as fused:
        out = fa.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin,
                                         cache_seqlens=lens, causal=True)
    assert fused.call_count == 1
    with mock.patch.object(kv_append, "fits", return_value=False):
        want = fa.flash_attn_with_kvcache(q, *caches, k, v, rotary_cos=cos, rotary_sin=sin,
                                          cache_seqlens=lens, causal=True)
    _close_to_one_rounding(kc, caches[0])
    assert torch.equal(vc, caches[1])
    torch.testing.assert_close(out, want, atol=2e-3, rtol=0)


def test_append_paged_kv_then_attention_paged():
    """The public op in flashcore's layout: append with rotary, then attention over the
    appended cache equals attention over the torch formula's keys."""
    from flashcore.ops import append_paged_kv, attention, attention_paged

    gen = torch.Generator(device="cuda").manual_seed(7)
    b, h, hkv, sq, d, ps, pages = 2, 8, 2, 3, 128, 16, 20
    lens = torch.tensor([5, 40], dtype=torch.int32, device="cuda")
    q = torch.randn(b, h, sq, d, device="cuda", generator=gen).half()
    k, v = (torch.randn(b, hkv, sq, d, device="cuda", generator=gen).half() for _ in range(2))
    kc, vc = (torch.randn(pages, ps, hkv, d, device="cuda", generator=gen).half()
              for _ in range(2))
    table = torch.randperm(pages, device="cuda", generator=gen)[:8].view(b, 4).to(torch.int32)
    cos, sin = _tables(128, 32, torch.float32, gen)
    turned = append_paged_kv(k, v, kc, vc, table, lens, q=q, rotary_cos=cos, rotary_sin=sin)
    out = attention_paged(turned, kc, vc, table, lens + sq, causal=True,
                          mask_align="bottom_right")
    want_q = kv_cache.apply_rotary(q.transpose(1, 2), cos, sin, kv_cache.positions(lens, sq),
                                   False).transpose(1, 2)
    _close_to_one_rounding(turned, want_q)
    for i in range(b):
        n = int(lens[i])
        keys = kc[table[i].long()].flatten(0, 1)[:n + sq].transpose(0, 1)[None]
        vals = vc[table[i].long()].flatten(0, 1)[:n + sq].transpose(0, 1)[None]
        want_k = kv_cache.apply_rotary(k[i:i + 1].transpose(1, 2), cos, sin,
                                       kv_cache.positions(lens[i:i + 1], sq), False)
        _close_to_one_rounding(keys[0, :, n:].transpose(0, 1), want_k[0])
        torch.testing.assert_close(out[i:i + 1], attention(turned[i:i + 1], keys, vals,
                                                           causal=True,
                                                           mask_align="bottom_right"),
                                   atol=2e-3, rtol=0)
