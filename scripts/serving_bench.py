"""Serving layouts against their peers, in one run (kernel time in a CUDA graph,
``flashcore.tuning.timing``):

* varlen prefill: 16 sequences of 128..8192 tokens (seeded), causal, GQA 32/8, D 128, fp16:
  ``attention_varlen`` against SDPA's flash backend run once per sequence (the work of
  ``flash_attn_varlen_func``, in torch), SDPA over the padded batch with a mask (the fallback),
  and FlashAttention-4's varlen where it is installed;
* paged decode: one query token per sequence against a paged cache (pages of 16 and 128,
  shuffled) against the same decode on a contiguous cache (ours and SDPA flash), and the same
  with an e4m3 cache (per-key scales), paged and contiguous;
* paged chunked prefill: 2048 new tokens a sequence against 8192 cached keys, bottom-right
  causal, pages of 16 to 256 against the contiguous cache and FlashAttention-4's paged varlen
  (pages of 16 and 128).

    python scripts/serving_bench.py [varlen] [paged] [prefill]
"""

from __future__ import annotations

import random
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashcore.ops import attention, attention_paged, attention_varlen
from flashcore.ops.fp8 import quantize_fp8, quantize_paged_cache
from flashcore.tuning.timing import report


def _fa4_varlen():
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except Exception:  # noqa: BLE001
        return None
    return flash_attn_varlen_func


def varlen_prefill(fa4) -> None:
    rng = random.Random(0)
    lens = [rng.randint(128, 8192) for _ in range(16)]
    hq, hkv, d = 32, 8, 128
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    total, top = sum(lens), max(lens)
    sets = []
    for _ in range(2):
        q = torch.randn(total, hq, d, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(total, hkv, d, device="cuda", dtype=torch.float16) for _ in range(2))
        sets.append((q, k, v))
    flops = sum(4 * hq * d * n * (n + 1) // 2 for n in lens)
    starts = cu.tolist()

    def ours(q, k, v):
        return attention_varlen(q, k, v, cu, cu, top, top, causal=True,
                                mask_align="bottom_right")

    def sdpa_per_sequence(q, k, v):
        out = torch.empty_like(q)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for b in range(len(lens)):
                rows = slice(starts[b], starts[b + 1])
                o = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
                    v[rows].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
                out[rows] = o[0].transpose(0, 1)
        return out

    pad_idx = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).cuda()
    keep = (torch.arange(top, device="cuda")[None, :] < torch.tensor(lens, device="cuda")[:, None])
    mask = (keep[:, None, :, None] & keep[:, None, None, :]
            & torch.ones(top, top, dtype=torch.bool, device="cuda").tril())
    mask |= ~keep[:, None, :, None]  # padded query rows see every key (no NaN), dropped after

    def sdpa_padded(q, k, v):
        def pad(t):
            out = t.new_zeros(len(lens) * top, t.shape[1], d)
            rows = (torch.arange(len(lens), device="cuda")[:, None] * top
                    + torch.arange(top, device="cuda")[None, :])[keep]
            out[rows] = t[pad_idx]
            return out.view(len(lens), top, t.shape[1], d).transpose(1, 2)

        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask,
                                               enable_gqa=True)
        return o.transpose(1, 2)[keep]

    impls = {"flashcore attention_varlen": ours,
             "SDPA flash, once per sequence": sdpa_per_sequence,
             "SDPA over the padded batch + mask": sdpa_padded,
             "FA4 varlen": None if fa4 is None else
             (lambda q, k, v: fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True))}
    report(f"varlen prefill, 16 sequences 128..8192 (total {total}), causal, 32/8, d128", impls,
           sets, flops)


def _paged(k, v, page_size, gen):
    """A contiguous (B, H, S, D) K/V laid into shuffled pages of a cache."""
    b, h, s, d = k.shape
    per = -(-s // page_size)
    order = torch.randperm(b * per, generator=gen).cuda()
    table = order.view(b, per).to(torch.int32)
    caches = []
    for t in (k, v):
        pad = torch.zeros(b, h, per * page_size, d, device="cuda", dtype=t.dtype)
        pad[:, :, :s] = t
        pages = pad.view(b, h, per, page_size, d).permute(0, 2, 3, 1, 4).reshape(
            b * per, page_size, h, d)
        cache = torch.empty_like(pages)
        cache[order] = pages
        caches.append(cache)
    return (*caches, table)


def paged_decode(fa4) -> None:
    gen = torch.Generator().manual_seed(0)
    for shape in ((16, 32, 8, 8192, 128), (1, 32, 8, 32768, 128), (64, 32, 8, 2048, 128)):
        paged_decode_case(fa4, gen, *shape)


def paged_decode_case(fa4, gen, b, hq, hkv, s, d) -> None:
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.float16) for _ in range(2))
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    cu_q = torch.arange(b + 1, dtype=torch.int32, device="cuda")

    def ours_paged(cache):
        kc, vc, table = cache
        return lambda q, k, v: attention_paged(q, kc, vc, table, lens)

    def fa4_paged(cache):
        kc, vc, table = cache
        return lambda q, k, v: fa4(q.transpose(1, 2).reshape(b, hq, d), kc, vc,
                                   cu_seqlens_q=cu_q, seqused_k=lens, page_table=table)

    def ours_fp8_paged(cache):
        (kc, kd), (vc, vd) = (quantize_paged_cache(c) for c in cache[:2])
        return lambda q, k, v: attention_paged(q, kc, vc, cache[2], lens, k_descale=kd,
                                               v_descale=vd)

    def ours_fp8_contiguous():
        (k8, kd), (v8, vd) = (quantize_fp8(t, granularity="token") for t in (k, v))
        return lambda q, k, v: attention(q, k8, v8, k_descale=kd, v_descale=vd)

    caches = {page: _paged(k, v, page, gen) for page in (16, 128)}
    impls = {"flashcore contiguous": attention,
             "flashcore paged, page 16": ours_paged(caches[16]),
             "flashcore paged, page 128": ours_paged(caches[128]),
             "SDPA flash contiguous": _sdpa_flash,
             "FA4 paged, page 128": None if fa4 is None else fa4_paged(caches[128]),
             "flashcore FP8 contiguous": ours_fp8_contiguous(),
             "flashcore FP8 paged, page 16": ours_fp8_paged(caches[16]),
             "flashcore FP8 paged, page 128": ours_fp8_paged(caches[128])}
    moved = 2 * b * hkv * s * d * 2
    report(f"paged decode {b},{hq}/{hkv},1x{s},{d} (column: TB/s of the fp16 bytes)", impls,
           [(q, k, v)], moved, unit="TB/s")


PREFILL_PAGES = (128, 256, 64, 32, 16)  # tests/gpu_specs.py builds their kernels


def paged_prefill(fa4) -> None:
    """Chunked prefill: each sequence's next 2048 tokens against its 8192 cached keys
    (bottom-right causal), the cache paged (pages of 16 to 256, on the Hopper family on sm_90)
    or contiguous (the dense call that does the same work)."""
    gen = torch.Generator().manual_seed(1)
    b, hq, hkv, sq, s, d = 4, 32, 8, 2048, 8192, 128
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.float16) for _ in range(2))
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    q_packed = q.transpose(1, 2).reshape(b * sq, hq, d).contiguous()
    cu_q = torch.arange(0, b * sq + 1, sq, dtype=torch.int32, device="cuda")
    mask = {"causal": True, "mask_align": "bottom_right"}

    def ours_paged(cache):
        kc, vc, table = cache
        return lambda q, k, v: attention_paged(q, kc, vc, table, lens, **mask)

    def fa4_paged(cache):
        kc, vc, table = cache
        return lambda q, k, v: fa4(q_packed, kc, vc, cu_seqlens_q=cu_q, seqused_k=lens,
                                   page_table=table, causal=True)

    caches = {page: _paged(k, v, page, gen) for page in PREFILL_PAGES}
    impls = {"flashcore contiguous": lambda q, k, v: attention(q, k, v, **mask)}
    impls.update({f"flashcore paged, page {page}": ours_paged(caches[page])
                  for page in PREFILL_PAGES})
    impls.update({f"FA4 paged, page {page}": None if fa4 is None else fa4_paged(caches[page])
                  for page in (16, 128)})
    seen = sq * (s - sq) + sq * (sq + 1) // 2
    report(f"paged chunked prefill {b},{hq}/{hkv},{sq}x{s},{d}, bottom-right causal", impls,
           [(q, k, v)], 4 * b * hq * d * seen)


def _sdpa_flash(q, k, v):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def main() -> None:
    parts = sys.argv[1:] or ["varlen", "paged", "prefill"]
    print(torch.cuda.get_device_name(), "| ratio = time / first row's time (< 1: faster)\n")
    fa4 = _fa4_varlen()
    if "varlen" in parts:
        varlen_prefill(fa4)
    if "paged" in parts:
        paged_decode(fa4)
    if "prefill" in parts:
        paged_prefill(fa4)


if __name__ == "__main__":
    main()
