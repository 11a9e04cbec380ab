"""The benchmark's implementations: flashcore's variants and every peer on this machine, each
an ``Impl`` (q, k, v, causal) -> out: torch SDPA forced to each backend (``enable_gqa`` where K/V
have fewer heads), FlashAttention-4 when importable, NVIDIA's CuTe DSL FA2 example when
``FLASHCORE_NV_FA2`` names a copy (this module then imports the DSL to run it)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Impl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def _sdpa(backend) -> Impl:
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])

    # the backend is forced around a whole measurement, not per call: entering sdpa_kernel costs
    # more host time than the mission shape's kernel
    run.context = lambda: sdpa_kernel(backend)
    return run


def _fa4() -> Impl | None:
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception:
        return None

    def run(q, k, v, causal, **kw):
        # FA4 takes (batch, seq, heads, dim), and K/V heads may be fewer (GQA); ``kw`` are its
        # other options (window_size, softcap, ...)
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              causal=causal, **kw)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)

    return run


def _flex() -> Impl | None:
    """FlexAttention compiled (``torch.nn.attention.flex_attention``): causal as a block mask
    made once per (lengths, device), top-left as torch's ``is_causal``."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception:
        return None
    compiled = torch.compile(flex_attention, dynamic=False)
    masks: dict = {}

    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def run(q, k, v, causal):
        block_mask = None
        if causal:
            key = (q.shape[2], k.shape[2], q.device)
            block_mask = masks.get(key)
            if block_mask is None:
                block_mask = masks[key] = create_block_mask(
                    causal_mask, None, None, q.shape[2], k.shape[2], device=q.device)
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])

    return run


def _flashcore(**kw) -> Impl:
    """Our op with its defaults (the tuned config) or the knobs given."""
    from ..ops import attention

    def run(q, k, v, causal):
        return attention(q, k, v, causal=causal, **kw)

    return run


def _flashcore_plain(**kw) -> Impl:
    """Our op launched without programmatic dependent launch (the A/B of PDL on Hopper)."""
    from ..runtime.loader import plain_launches

    ours = _flashcore(**kw)

    def run(q, k, v, causal):
        with plain_launches():
            return ours(q, k, v, causal)

    return run


def _prepared_once(prepare: Callable) -> Callable:
    """Memoise ``prepare(q, k, v)`` per input set (kept alive here: a pointer alone can come
    back for another tensor once the first is freed, with a stale result)."""
    memo: dict = {}

    def get(q, k, v):
        hit = memo.get((id(q), id(k), id(v)))
        if hit is None or hit[0] is not q or hit[1] is not k or hit[2] is not v:
            hit = memo[(id(q), id(k), id(v))] = (q, k, v, prepare(q, k, v))
        return hit[3]

    return get


def _flashcore_kv_expanded() -> Impl:
    """Our op on K/V whose heads were repeated to the query heads beforehand (the GQA prefill
    target's baseline: GQA must not be slower than this)."""
    from ..ops import attention

    def expand(q, k, v):
        g = q.shape[1] // k.shape[1]
        return k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)

    get = _prepared_once(expand)

    def run(q, k, v, causal):
        if k.shape[1] == q.shape[1]:
            raise ValueError("not a GQA shape")
        ke, ve = get(q, k, v)
        return attention(q, ke, ve, causal=causal)

    return run


def fp8_kernel_only(config=None, k_scale: str = "token") -> Impl:
    """The FP8 attention kernel alone, on inputs quantised once (K per token, or per head with
    ``k_scale="head"``). ``config=None``: tuned."""
    from ..ops.fp8 import attention_fp8, quantize_fp8

    get = _prepared_once(lambda q, k, v: (*quantize_fp8(q, granularity="token"),
                                           *quantize_fp8(k, granularity=k_scale),
                                           *quantize_fp8(v, transpose=True)))

    def run(q, k, v, causal):
        q8, qd, k8, kd, vt8, vd = get(q, k, v)
        return attention_fp8(q8, k8, vt8, qd, kd, vd, causal=causal, out_dtype=q.dtype,
                             config=config)

    return run


def fp8_kv_cache() -> Impl:
    """Our op reading K/V from an e4m3 KV cache (quantised once per token, as a serving engine
    appends them); Q and the arithmetic stay 16-bit."""
    from ..ops import attention
    from ..ops.fp8 import quantize_fp8

    get = _prepared_once(lambda q, k, v: (*quantize_fp8(k, granularity="token"),
                                           *quantize_fp8(v, granularity="token")))

    def run(q, k, v, causal):
        k8, kd, v8, vd = get(q, k, v)
        return attention(q, k8, v8, causal=causal, k_descale=kd, v_descale=vd)

    return run


def read_floor(fraction: float = 1.0) -> Impl:
    """Not attention: one launch that reads ``fraction`` of K's and V's bytes once (0.5: the
    bytes of an e4m3 cache), from one buffer that size made beforehand: what streaming the
    cache costs on this GPU, launch and ramp included, beside the bytes-over-bandwidth floor.
    A tuned Triton read (``read_floor.streaming_read``) where Triton is installed, else torch's
    sum (slower than a tuned read: a floor our decode can beat)."""
    from . import read_floor as rf

    stream = rf.streaming_read() if rf.available() else None

    def make(q, k, v):
        n = int(fraction * (k.numel() * k.element_size() + v.numel() * v.element_size())) // 4
        return torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device=k.device)

    get = _prepared_once(make)

    def run(q, k, v, causal):
        x = get(q, k, v)
        return stream(x) if stream is not None else x.view(torch.float16).sum(dtype=torch.float32)

    return run


def _nvidia_fa2_example() -> Impl | None:
    """NVIDIA's CuTe DSL FA2 example (``FlashAttentionForwardAmpere`` in NVIDIA/cutlass
    examples/python/CuTeDSL/.../flash_attention_v2.py), from a copy the user fetched and named in
    ``FLASHCORE_NV_FA2`` (it is not part of flashcore), in its documented configuration: m128 n64,
    128 threads. Needs the DSL on this host. Equal heads and lengths only."""
    import importlib.util
    import os

    path = os.environ.get("FLASHCORE_NV_FA2")
    if not path:
        return None
    try:
        spec = importlib.util.spec_from_file_location("nv_fa2_example", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        import cuda.bindings.driver as cu
        import cutlass.cute as cute
        from cutlass.cute.runtime import from_dlpack
    except Exception:  # no DSL or no file: the peer is absent
        return None
    compiled: dict = {}

    def cute_view(t, bshd=False):  # (b, h, s, d) -> the example's (b, s, h, d), no copy
        t = t if bshd else t.transpose(1, 2)
        # as the example marks its tensors: dynamic, and strides divisible by 16 bytes
        return (from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=3)
                .mark_compact_shape_dynamic(mode=3, stride_order=t.dim_order(),
                                            divisibility=128 // (8 * t.element_size())))

    def run(q, k, v, causal):
        if q.shape[1] != k.shape[1] or q.shape[2] != k.shape[2]:
            raise ValueError("the example takes equal head counts and lengths only")
        b, h, s, d = q.shape
        out = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device)
        stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
        args = [cute_view(q), cute_view(k), cute_view(v), cute_view(out, bshd=True)]
        key = (q.dtype, d, causal)
        if key not in compiled:
            fa2 = mod.FlashAttentionForwardAmpere(d, 128, 64, 128, causal)
            compiled[key] = cute.compile(fa2, *args, 1.0 / math.sqrt(d), stream)
        compiled[key](*args, 1.0 / math.sqrt(d), stream)
        return out.transpose(1, 2)

    return run


def implementations(ours: dict[str, Impl] | None = None) -> dict[str, Impl]:
    from torch.nn.attention import SDPBackend

    impls: dict[str, Impl] = dict(ours or {"flashcore": _flashcore()})
    impls["sdpa-flash"] = _sdpa(SDPBackend.FLASH_ATTENTION)
    impls["sdpa-efficient"] = _sdpa(SDPBackend.EFFICIENT_ATTENTION)
    impls["sdpa-cudnn"] = _sdpa(SDPBackend.CUDNN_ATTENTION)
    fa4 = _fa4()
    if fa4 is not None:
        impls["fa4"] = fa4
    nv = _nvidia_fa2_example()
    if nv is not None:
        impls["nv-fa2-example"] = nv
    return impls
