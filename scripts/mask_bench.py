"""Masks as data against the peers that have them, in one run (kernel time in a CUDA graph,
``flashcore.tuning.timing``): a sliding window over a long sequence against full causal
attention, chunked prefill with bottom-right causal masking against SDPA's
``causal_lower_right`` (cuDNN's among them), and soft-capped logits against FlashAttention-4's
``softcap``. Each prefill also runs the tuned entry's ``mma_sync`` fallback (what such calls
ran before the warp-specialised family built masks).

    python scripts/mask_bench.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from flashcore.ops import attention
from flashcore.runtime.device import arch_of
from flashcore.tuned import table
from flashcore.tuning.peers import _fa4
from flashcore.tuning.timing import n_sets, report


def inputs(b, hq, hkv, sq, sk, d):
    per = 2 * b * d * (hq * sq + 2 * hkv * sk)
    n = n_sets(per, torch.cuda.get_device_properties(0).L2_cache_size)
    return [(torch.randn(b, hq, sq, d, device="cuda", dtype=torch.float16),
             torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.float16),
             torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.float16)) for _ in range(n)]


def fallback(d: int, causal: bool, sq: int, **masks):
    """A prefill timed on the tuned entry's fallback config (None where it has none)."""
    arch = table.table_arch(arch_of(torch.cuda.current_device()))
    tuned = table.entries(arch).get(table.key(d, causal, table.bucket_of(sq)))
    if tuned is None or tuned.fallback is None:
        return None
    return lambda q, k, v: attention(q, k, v, causal=causal, config=tuned.fallback, **masks)


def main() -> None:
    f4 = _fa4()
    print(torch.cuda.get_device_name(), "| ratio = time / first row's time (< 1: faster)\n")
    # sliding window 4096 over 32768 tokens (Mistral-style), causal, GQA 32/8, D 128
    s, w = 32768, 4096
    sets = inputs(1, 32, 8, s, s, 128)
    win_flops = 4 * 32 * 128 * sum(min(i + 1, w) for i in range(0, s, 64)) * 64
    report(f"window {w} over 1,32/8,{s},128 causal", {
        "flashcore window": lambda q, k, v: attention(q, k, v, causal=True, window=(w - 1, 0)),
        "flashcore window, mma_sync": fallback(128, True, s, window=(w - 1, 0)),
        "flashcore full causal": lambda q, k, v: attention(q, k, v, causal=True),
        "flashcore full (no mask)": lambda q, k, v: attention(q, k, v),
        "FA4 window": None if f4 is None else
        (lambda q, k, v: f4(q, k, v, True, window_size=(w - 1, 0))),
        "SDPA flash full causal": _forced(SDPBackend.FLASH_ATTENTION, causal=True),
    }, sets, win_flops)
    del sets
    # chunked prefill: 2048 new tokens at the end of 16384, bottom-right causal
    sq, sk = 2048, 16384
    sets = inputs(2, 32, 32, sq, sk, 128)
    flops = 4 * 2 * 32 * 128 * sum(sk - sq + i + 1 for i in range(sq))
    report(f"chunked prefill 2,32,{sq}x{sk},128 bottom-right", {
        "flashcore": lambda q, k, v: attention(q, k, v, causal=True, mask_align="bottom_right"),
        "flashcore mma_sync": fallback(128, True, sq, mask_align="bottom_right"),
        "SDPA causal_lower_right": _lower_right(),
        "SDPA cuDNN causal_lower_right": _lower_right([SDPBackend.CUDNN_ATTENTION]),
        "FA4 causal": None if f4 is None else (lambda q, k, v: f4(q, k, v, True)),
    }, sets, flops)
    del sets
    # soft-capped logits (Gemma 2: cap 50), causal prefill 4,16,4096,128
    sets = inputs(4, 16, 16, 4096, 4096, 128)
    flops = 4 * 4 * 16 * 128 * 4096 * 4097 // 2
    report("softcap 50, 4,16,4096,128 causal", {
        "flashcore softcap": lambda q, k, v: attention(q, k, v, causal=True, softcap=50.0),
        "flashcore softcap, mma_sync": fallback(128, True, 4096, softcap=50.0),
        "flashcore no cap": lambda q, k, v: attention(q, k, v, causal=True),
        "FA4 softcap": None if f4 is None else
        (lambda q, k, v: f4(q, k, v, True, softcap=50.0)),
    }, sets, flops)
    # decode with a window (1 token, 32/8 heads, 32768 cached keys, window 4096)
    sets = inputs(8, 32, 8, 1, 32768, 128)
    bytes_moved = 8 * 8 * 2 * min(w, 32768) * 128 * 2
    report(f"decode 8,32/8,1x32768,128 window {w} (TF/s column: TB/s x1e-3)", {
        "flashcore window": lambda q, k, v: attention(q, k, v, causal=True,
                                                      mask_align="bottom_right",
                                                      window=(w - 1, 0)),
        "flashcore full": lambda q, k, v: attention(q, k, v),
        "SDPA flash full": _forced(SDPBackend.FLASH_ATTENTION, causal=False),
    }, sets, bytes_moved / 1e3)


def _forced(backend, causal):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                  enable_gqa=q.shape[1] != k.shape[1])
    return run


def _lower_right(backends=(SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                            SDPBackend.CUDNN_ATTENTION)):
    def run(q, k, v):
        bias = causal_lower_right(q.shape[2], k.shape[2])
        with sdpa_kernel(list(backends)):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    return run


if __name__ == "__main__":
    main()
