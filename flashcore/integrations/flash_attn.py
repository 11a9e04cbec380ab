"""FlashAttention's Python API on flashcore's kernels: switching is an import.

    from flashcore.integrations.flash_attn import flash_attn_func, flash_attn_varlen_func

Layouts are FlashAttention's: q, k, v (batch, seqlen, heads, head_dim) for the dense functions,
packed (total, heads, head_dim) with int32 ``cu_seqlens`` for varlen. The dense tensors reach
the kernels as transposed views (no copies), and the output is a fresh (batch, seqlen, heads,
head_dim) tensor written in place by the kernel. Masks follow FlashAttention >= 2.1: ``causal``
puts the diagonal on the last key (bottom-right), ``window_size=(left, right)`` keeps keys
i + S_k - S_q - left .. i + S_k - S_q + right (-1: no limit on that side; right is 0 with
causal), ``softcap=0.0`` means none.

What differs:

* ``dropout_p > 0`` raises ``NotImplementedError``. Head dims flashcore does not build
  (``flashcore.specs.HEAD_DIMS``: 32, 64, 80, 96, 128, 256) raise flashcore's ``ValueError``.
* ``alibi_slopes`` (float32 (heads,) or (batch, heads)) works in every function, measured from
  FlashAttention's bottom-right diagonal; with a 16-bit cache only, and without a backward.
* ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: the LSE as FlashAttention
  lays it out ((batch, heads, seqlen_q) dense, (heads, total_q) varlen); FlashAttention's third
  value carries probabilities only with dropout, which flashcore does not do.
* ``cache_leftpad`` (a dense cache's rows starting at those keys) reads the cache as pages of
  one key, gathered a key at a time: slower than a call without it.
* A bad ``block_table`` raises flashcore's ``ValueError`` naming it (FlashAttention raises a
  ``RuntimeError``); ``check_lengths`` (keyword, default True) is flashcore's device-side check
  of tables and lengths (one synchronisation; False trusts them, as FlashAttention does).
* Backward: the dense and varlen functions (and their packed forms) are differentiable with
  every mask; ALiBi, a paged ``block_table`` and ``flash_attn_with_kvcache`` raise an error
  naming what is missing when an input requires grad. ``deterministic=True`` gives the same
  gradients bit for bit every run (dQ's adds in a fixed order), as FlashAttention's does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..ops import kv_append as append_kv
from ..ops.table_checks import raise_faults
from . import kv_cache

_OP = "flash_attn"


@dataclass(frozen=True)
class Masks:
    """flashcore's mask arguments for one FlashAttention call."""

    causal: bool = False
    mask_align: str = "top_left"
    window: tuple[int, int] | None = None
    softcap: float | None = None

    def kwargs(self) -> dict:
        return {"mask_align": self.mask_align, "window": self.window, "softcap": self.softcap}


def fa_masks(causal: bool, window_size, softcap, seqlen_q: int | None = None,
             seqlen_k: int | None = None) -> Masks:
    """FlashAttention's (causal, window_size, softcap) as flashcore's. Its diagonal is
    bottom-right; with equal known lengths top-left is the same mask, and that form keeps
    flashcore's backward."""
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"{_OP}: window_size must be (left, right), got {window_size!r}") from None
    if causal:
        right = 0  # FlashAttention's rule: causal ends the window on the diagonal
    window = None if left < 0 and right < 0 else (max(left, -1), max(right, -1))
    if causal and window is not None and window[0] < 0:
        window = None  # causal with no left limit is plain causal
    cap = None if softcap is None or float(softcap) == 0.0 else float(softcap)
    same = seqlen_q is not None and seqlen_q == seqlen_k
    align = "top_left" if same or not (causal or window is not None) else "bottom_right"
    return Masks(bool(causal), align, window, cap)


def _unsupported(dropout_p: float = 0.0) -> None:
    if dropout_p:
        raise NotImplementedError(f"{_OP}: dropout_p={dropout_p}: flashcore has no attention "
                                  "dropout; pass dropout_p=0.0")


def _alibi_kwargs(masks: Masks, alibi_slopes) -> dict:
    """The mask keywords of a call whose sequences' lengths the host does not know: ALiBi's
    distances from FlashAttention's bottom-right diagonal."""
    kw = masks.kwargs()
    if alibi_slopes is not None:
        kw.update(mask_align="bottom_right", alibi_slopes=alibi_slopes)
    return kw


def _with_lse(res, want: bool, triple: bool):
    """FlashAttention's return value: out, or (out, lse[, None])."""
    if not want:
        return res
    out, lse = res
    return (out, lse, None) if triple else (out, lse)


def _dense(q, k, v, softmax_scale, masks: Masks, return_lse: bool, num_splits=None,
           alibi_slopes=None, deterministic=False):
    """flashcore's ``attention`` on (batch, seqlen, heads, head_dim) tensors: transposed views
    in, the kernel writing a fresh tensor of q's layout through its transposed view. ALiBi's
    bias is measured from FlashAttention's bottom-right diagonal."""
    out = q.new_empty(q.shape)
    kw = masks.kwargs()
    if alibi_slopes is not None and q.shape[1] != k.shape[1]:
        kw["mask_align"] = "bottom_right"
    res = ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        causal=masks.causal, softmax_scale=softmax_scale, return_lse=return_lse,
                        num_splits=num_splits, out=out.transpose(1, 2),
                        alibi_slopes=alibi_slopes, deterministic=deterministic, **kw)
    return (out, res[1]) if return_lse else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """``flash_attn.flash_attn_func``: q (batch, seqlen_q, heads, head_dim), k and v
    (batch, seqlen_k, heads_kv, head_dim), heads a multiple of heads_kv (GQA, no copies).
    Returns out like q; with ``return_attn_probs`` (out, softmax_lse, None)."""
    _unsupported(dropout_p)
    masks = fa_masks(causal, window_size, softcap, q.shape[1], k.shape[1])
    res = _dense(q, k, v, softmax_scale, masks, return_attn_probs, alibi_slopes=alibi_slopes,
                 deterministic=deterministic)
    return _with_lse(res, return_attn_probs, triple=True)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """``flash_attn_func`` on qkv (batch, seqlen, 3, heads, head_dim), read as three views."""
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """``flash_attn_func`` with kv (batch, seqlen_k, 2, heads_kv, head_dim), read as views."""
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None,
                           *, check_lengths=True):
    """``flash_attn.flash_attn_varlen_func``: packed q (total_q, heads, head_dim), k and v
    (total_k, heads_kv, head_dim), int32 offsets (batch + 1). With ``block_table`` (batch,
    max_pages) k and v are paged caches (pages, page_size, heads_kv, head_dim) and sequence b
    has cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys from its first page on (flashcore's
    ``attention_paged`` with a packed q). LSE: (heads, total_q)."""
    _unsupported(dropout_p)
    masks = fa_masks(causal, window_size, softcap)
    kw = _alibi_kwargs(masks, alibi_slopes)
    if block_table is None:
        res = ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, masks.causal, softmax_scale, return_attn_probs,
                                   check_lengths=check_lengths, deterministic=deterministic,
                                   **kw)
    else:
        seqlens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        res = ops.attention_paged(q, k, v, block_table, seqlens_k, masks.causal, softmax_scale,
                                  return_attn_probs, cu_seqlens_q=cu_seqlens_q,
                                  max_seqlen_q=max_seqlen_q, check_lengths=check_lengths, **kw)
    return _with_lse(res, return_attn_probs, triple=True)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """``flash_attn_varlen_func`` on qkv (total, 3, heads, head_dim), one set of offsets."""
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """``flash_attn_varlen_func`` with kv (total_k, 2, heads_kv, head_dim), read as views."""
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs)


def _checkable() -> bool:
    """Whether device values may be read back: not while tracing or capturing a CUDA graph."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _as_pages(k_cache, v_cache, block_table, rows, batch: int) -> tuple:
    """(k pages, v pages, block table) of a paged cache, or of a dense one's rows."""
    if block_table is not None:
        return k_cache, v_cache, block_table
    return kv_cache.dense_pages(k_cache, v_cache, rows, batch)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, check_lengths=True):
    """``flash_attn.flash_attn_with_kvcache``: q (batch, seqlen_q, heads, head_dim) against a
    cache, dense (batch_cache, seqlen_cache, heads_kv, head_dim) or paged (pages, page_size,
    heads_kv, head_dim) through ``block_table`` (batch, max_pages).

    In order: rotary on q and on the new k (cos/sin (seqlen_ro, rotary_dim / 2); q's positions
    are cache_seqlens + t when causal or windowed, else cache_seqlens; as in FlashAttention, only
    when k and v are given), k/v (batch, seqlen_new,
    heads_kv, head_dim) written into the cache in place at cache_seqlens (its rows
    ``cache_batch_idx[b]`` for a dense cache), then attention over the first cache_seqlens +
    seqlen_new keys of each row, or, with ``cache_leftpad`` (int32 (batch,), a dense cache), over
    its keys cache_leftpad .. cache_seqlens + seqlen_new - 1 (positions stay those of the row,
    as FlashAttention's rotary takes them). ``cache_seqlens`` None means the whole cache, with
    nothing appended. Returns out like q, with ``return_softmax_lse`` (out, lse (batch, heads,
    seqlen_q)). On CUDA with a 16-bit cache the append and the rotary are one kernel launch
    (``flashcore.ops.kv_append``); torch ops otherwise (and while torch.compile traces)."""
    if cache_leftpad is not None and block_table is not None:
        raise ValueError(f"{_OP}: cache_leftpad is for a dense cache; a paged cache's keys "
                         "start where its block_table says")
    if (k is None) != (v is None):
        raise ValueError(f"{_OP}: give both k and v, or neither (k is {type(k).__name__}, "
                         f"v is {type(v).__name__})")
    if block_table is not None and cache_batch_idx is not None:
        raise ValueError(f"{_OP}: cache_batch_idx picks rows of a dense cache; a paged cache "
                         "takes block_table instead")
    if k is not None and cache_seqlens is None:
        raise ValueError(f"{_OP}: appending k and v needs cache_seqlens (where they go)")
    batch, seqlen_q = q.shape[:2]
    new = 0 if k is None else k.shape[1]
    if k is not None:
        kv_cache.check_new_keys(q, k, v, k_cache, v_cache)
    if block_table is not None and block_table.shape[0] != batch:
        raise ValueError(f"{_OP}: block_table has {block_table.shape[0]} rows for a batch of "
                         f"{batch}")
    masks = fa_masks(causal, window_size, softcap)
    if block_table is None:
        capacity, pages = k_cache.shape[1], k_cache.shape[0]
    else:
        capacity, pages = block_table.shape[1] * k_cache.shape[1], k_cache.shape[0]
    known = None if isinstance(cache_seqlens, torch.Tensor) else (
        capacity if cache_seqlens is None else cache_seqlens)
    lengths = kv_cache.as_lengths(capacity if cache_seqlens is None else cache_seqlens, batch,
                                  q.device)
    rows = cache_batch_idx  # None: batch entry b is cache row b

    def row_ids() -> torch.Tensor:
        return (torch.arange(batch, dtype=torch.int32, device=q.device) if rows is None
                else rows)

    start = (None if cache_leftpad is None else
             kv_cache.as_lengths(cache_leftpad, batch, q.device, "cache_leftpad"))
    # the attention's own check of its lengths and table (a second read-back) is left out when
    # the room check has covered them: lengths + new inside the cache, the table's used pages
    recheck = check_lengths
    if (check_lengths and (start is not None or k is not None or rows is not None)
            and _checkable()):
        faults = [] if start is None else kv_cache.leftpad_faults(start, lengths)
        if rows is not None and block_table is None:
            faults += kv_cache.row_faults(rows, k_cache.shape[0])
        if k is not None:
            faults += kv_cache.room_faults(lengths, new, capacity, block_table, pages)
            recheck = False
        raise_faults("flash_attn_with_kvcache", faults)

    per_token = masks.causal or masks.window is not None
    if rotary_cos is not None:
        if rotary_sin is None:
            raise ValueError(f"{_OP}: rotary_cos needs rotary_sin")
        kv_cache.check_rotary(rotary_cos, rotary_sin, q.shape[-1], q.device)
    pages = None  # the caches as pages and their table, made once for both uses
    if (k is not None and not torch.compiler.is_compiling()
            and append_kv.fits(q, k, v, k_cache, v_cache)):
        # one kernel: the new keys (turned) and values into the cache, q turned
        pages = _as_pages(k_cache, v_cache, block_table, rows, batch)
        turned = append_kv.append_kv(k, v, *pages, lengths, q=q,
                                     cos=rotary_cos, sin=rotary_sin,
                                     interleaved=rotary_interleaved, q_per_token=per_token)
        q = q if turned is None else turned
    else:
        if rotary_cos is not None and k is not None:  # FlashAttention's: rotary comes with k
            q = kv_cache.apply_rotary(q, rotary_cos, rotary_sin,
                                      kv_cache.positions(lengths, seqlen_q, per_token),
                                      rotary_interleaved)
            k = kv_cache.apply_rotary(k, rotary_cos, rotary_sin,
                                      kv_cache.positions(lengths, new), rotary_interleaved)
        if k is not None:
            if block_table is None:
                slots = kv_cache.dense_slots(row_ids(), lengths, new)
            else:
                slots = kv_cache.paged_slots(block_table, lengths, new, k_cache.shape[1])
            kv_cache.append_(k_cache, slots, k)
            kv_cache.append_(v_cache, slots, v)

    splits = None if num_splits in (0, None) else num_splits
    if block_table is None and known is not None and cache_batch_idx is None and start is None:
        # one length for every row, known here: plain attention over a slice of the cache
        keys = known + new
        masks = fa_masks(causal, window_size, softcap, seqlen_q, keys)
        res = _dense(q, k_cache[:batch, :keys], v_cache[:batch, :keys], softmax_scale, masks,
                     return_softmax_lse, splits, alibi_slopes)
        return _with_lse(res, return_softmax_lse, triple=False)
    # Per-row lengths on the device: the paged kernels read them there (no synchronisation)
    # and read a dense cache in place as pages; varlen would need the keys packed (a copy).
    seqlens = lengths + new if new else lengths
    if start is not None:  # each row's keys from its own first one: pages of one key
        k_pages, table = kv_cache.dense_as_key_pages(k_cache, row_ids(), start)
        v_pages, _ = kv_cache.dense_as_key_pages(v_cache, row_ids(), start)
        seqlens = seqlens - start
    else:
        k_pages, v_pages, table = pages or _as_pages(k_cache, v_cache, block_table, rows, batch)
    out = q.new_empty(q.shape)
    res = ops.attention_paged(q.transpose(1, 2), k_pages, v_pages, table, seqlens,
                              masks.causal, softmax_scale, return_softmax_lse,
                              num_splits=splits, out=out.transpose(1, 2),
                              check_lengths=recheck, **_alibi_kwargs(masks, alibi_slopes))
    return (out, res[1]) if return_softmax_lse else out


__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
