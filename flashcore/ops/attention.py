"""``flashcore.ops.attention``: validate, plan, launch the kernels on torch's current stream.

``attention_varlen`` and ``attention_paged`` are the serving layouts (``flashcore.ops.serving``).
Eager calls run the kernels directly (the cheapest path; host time matters at small shapes).
Under ``torch.compile`` / ``torch.export``, or on tensor subclasses (fake tensors while
tracing), the call goes through the registered op ``torch.ops.flashcore.attention``
(``flashcore.ops.library``), which traces like any torch op and runs this same eager path.
"""

from __future__ import annotations

import torch

from ..specs import TileConfig
from .backward import needs_grad, why_no_backward
from .eager import run
from .library import attention_op, attention_paged_op, attention_varlen_op
from .serving import run_paged, run_varlen
from .validate import check_grad


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tile: tuple[int, int] | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    config: TileConfig | None = None,
    warps: int | None = None,
    stages: int | None = None,
    kv_splits: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    precision: str = "fp16",
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    mask_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    allow_no_grad: bool = False,
    deterministic: bool = False,
):
    """softmax(scale · q kᵀ [+ causal mask]) v, like torch's SDPA, for (batch, heads, seq, head_dim).

    ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query / multi-query attention: query
    head h reads K/V head h // (Hq / Hkv)); nothing is copied. ``causal`` follows torch's
    ``is_causal`` (top-left: query i sees keys j <= i). A query row that sees no key gets 0.
    With ``return_lse`` also returns the float32 log-sum-exp (batch, heads, seq_q) of the scaled
    scores (natural log; -inf for a row with no visible key). ``softmax_scale`` defaults to
    1/sqrt(head_dim) and may be any finite number; a negative one runs as -q with its magnitude
    (the same logits, one negated copy of q).

    Kernel choice: ``tile=None`` (the default) takes the autotuner's config for this GPU, head
    dim, masking and query length (``flashcore.tuning``); ``tile=(m, n)`` with ``warps``,
    ``stages`` and ``kv_splits``, or ``config=TileConfig(...)``, picks one. Decode (at most 16
    query tokens) splits the keys over ``num_splits`` CTAs (default: enough to fill the GPU) and
    combines their partial results; with GQA and one query token the query heads of a K/V head
    share one tile.

    ``out``, if given, receives the result: shape and dtype of q, on q's device, last dim
    contiguous, 16-byte aligned, sharing no memory with q, k or v.

    ``precision="fp8"`` (sm_89, sm_90) quantises q, k, v to float8_e4m3fn with scales from the
    data (no finite input overflows) and runs the e4m3 MMA kernel. An FP8 KV cache: ``k`` and
    ``v`` in float8_e4m3fn with ``k_descale``/``v_descale`` (float32 (B, Hkv, Sk), from
    ``flashcore.ops.fp8.quantize_fp8(x, granularity="token")``); q and the arithmetic stay
    16-bit, K/V bytes halve.

    Masks (each compiled into its own kernel; their sizes are run-time values):
    ``mask_align="bottom_right"`` puts the causal diagonal (and a window's) on the last key, so
    query i sees keys j <= i + S_k - S_q (FlashAttention >= 2.1, torch's
    ``causal_lower_right``: chunked prefill against a longer cache); ``window=(left, right)``
    lets query i see keys i - left .. i + right (-1: no limit on that side; key blocks outside
    the window are skipped); ``softcap=c`` turns the scaled logits s into c · tanh(s / c).
    ``alibi_slopes`` (float32 (heads,) or (batch, heads)): ALiBi adds -slope · |i + offset - j|
    to the logits (after any soft-cap), offset S_k - S_q with ``mask_align="bottom_right"``
    (FlashAttention's) else 0; 16-bit only, no backward yet (an input that requires grad is
    refused, as for FP8).

    Backward: 16-bit calls are differentiable, masks included (inputs that require grad run
    through the registered op, whose backward is ``flashcore.ops.backward``); FP8 ones and
    the FP8 KV cache raise an error when an input requires grad (under
    ``torch.no_grad()`` they do not) unless ``allow_no_grad=True``, which returns a result that
    carries no gradient. ``deterministic=True`` (or ``torch.use_deterministic_algorithms(True)``
    when the forward runs) makes the backward add dQ in a fixed order: the same gradients, bit
    for bit, every run (dK and dV always are).
    """
    if not _tracing(q):  # eager: the kernels directly, unless autograd needs the op
        if allow_no_grad or not needs_grad(q, k, v):
            return run(q, k, v, tile, causal, softmax_scale, return_lse, config, warps, stages,
                       kv_splits, num_splits, out, precision, k_descale, v_descale, mask_align,
                       window, softcap, alibi_slopes)
        why = "ALiBi" if alibi_slopes is not None else why_no_backward(
            q, k, causal=causal, precision=precision, k_descale=k_descale,
            mask_align=mask_align, window=window, softcap=softcap)
        if why is not None:
            check_grad(q, k, v, why)
    # tracing (torch.compile, export, fake tensors) or autograd: the registered op
    return attention_op(q, k, v, tile=tile, causal=causal, softmax_scale=softmax_scale,
                        return_lse=return_lse, config=config, warps=warps, stages=stages,
                        kv_splits=kv_splits, num_splits=num_splits, out=out,
                        precision=precision, k_descale=k_descale, v_descale=v_descale,
                        mask_align=mask_align, window=window, softcap=softcap,
                        alibi_slopes=alibi_slopes, deterministic=deterministic)


def _tracing(q) -> bool:
    return type(q) is not torch.Tensor or torch.compiler.is_compiling()


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    mask_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    tile: tuple[int, int] | None = None,
    config: TileConfig | None = None,
    out: torch.Tensor | None = None,
    check_lengths: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    allow_no_grad: bool = False,
    deterministic: bool = False,
):
    """Attention over a packed batch: sequence ``b`` is rows ``cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1]`` of q (total_q, heads, head_dim) and rows ``cu_seqlens_k[b] ..
    cu_seqlens_k[b + 1]`` of k and v (total_k, heads_kv, head_dim); int32 offsets, batch + 1 of
    each. Zero-length sequences are legal (their rows are 0, LSE -inf). Masks and GQA as in
    ``attention``; FlashAttention's varlen causal mask is ``mask_align="bottom_right"``.
    ``alibi_slopes`` as in ``attention``, (batch, heads) giving sequence b its row. Returns
    out (total_q, heads, head_dim) and, with ``return_lse``, the float32 LSE (heads, total_q).
    Differentiable (16-bit, every head dim, every mask; not with ALiBi) through the
    registered op, whose backward is ``flashcore.ops.backward_varlen``; ``deterministic`` as
    in ``attention``.
    ``check_lengths``: see ``flashcore.ops.serving`` (what is checked, what is trusted)."""
    grad = not allow_no_grad and needs_grad(q, k, v)
    if grad:
        why = "ALiBi" if alibi_slopes is not None else why_no_backward(q, k)
        if why is not None:
            check_grad(q, k, v, why)
    if _tracing(q) or grad:  # tracing or autograd: the registered op
        return attention_varlen_op(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
            softmax_scale=softmax_scale, return_lse=return_lse, mask_align=mask_align,
            window=window, softcap=softcap, tile=tile, config=config, out=out,
            check_lengths=check_lengths, alibi_slopes=alibi_slopes, deterministic=deterministic)
    return run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                      softmax_scale, return_lse, mask_align=mask_align, window=window,
                      softcap=softcap, tile=tile, config=config, out=out,
                      check_lengths=check_lengths, alibi_slopes=alibi_slopes)


def attention_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    mask_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    tile: tuple[int, int] | None = None,
    config: TileConfig | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    check_lengths: bool = True,
    allow_no_grad: bool = False,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
):
    """Attention against a paged KV cache: k_cache and v_cache are (pages, page_size, heads_kv,
    head_dim); key ``j`` of sequence ``b`` is row ``j % page_size`` of page
    ``block_table[b, j // page_size]``; sequence ``b`` has ``seqlens_k[b]`` keys (int32 tables,
    block_table (batch, max_pages)). Any page size. q is (batch, heads, seq_q, head_dim) (decode:
    seq_q = 1; chunked prefill: the chunk), or packed (total_q, heads, head_dim) with
    ``cu_seqlens_q`` and ``max_seqlen_q`` as in ``attention_varlen``. Decode splits the keys
    over CTAs like ``attention``. Returns out shaped like q, and with ``return_lse`` the LSE
    ((batch, heads, seq_q), or (heads, total_q) packed).

    An FP8 cache: k_cache and v_cache in float8_e4m3fn with float32 per-key descales
    ``k_descale``/``v_descale`` of shape (pages, page_size, heads_kv), any strides (a stride-0
    broadcast of one scale per tensor or per head is fine); key j of head h is
    ``k_cache[p, j, h].float() * k_descale[p, j, h]``. ``flashcore.ops.fp8.quantize_paged_cache``
    makes both from a 16-bit cache. The arithmetic stays in q's dtype (sm_89 and sm_90).
    ``alibi_slopes`` (a 16-bit cache) as in ``attention``: (heads,) or (batch, heads)."""
    if _tracing(q):
        return attention_paged_op(
            q, k_cache, v_cache, block_table, seqlens_k, causal=causal,
            softmax_scale=softmax_scale, return_lse=return_lse, cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q, mask_align=mask_align, window=window, softcap=softcap,
            tile=tile, config=config, num_splits=num_splits, out=out,
            check_lengths=check_lengths, k_descale=k_descale, v_descale=v_descale,
            alibi_slopes=alibi_slopes)
    if not allow_no_grad:
        check_grad(q, k_cache, v_cache)
    return run_paged(q, k_cache, v_cache, block_table, seqlens_k, causal, softmax_scale,
                     return_lse, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                     mask_align=mask_align, window=window, softcap=softcap, tile=tile,
                     config=config, num_splits=num_splits, out=out, check_lengths=check_lengths,
                     k_descale=k_descale, v_descale=v_descale, alibi_slopes=alibi_slopes)
