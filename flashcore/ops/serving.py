"""The eager implementations of the serving layouts (``flashcore.ops.attention_varlen``: a packed
batch of sequences of different lengths, the convention of ``flash_attn_varlen_func``;
``flashcore.ops.attention_paged``: K/V in a paged cache read through a block table, the
convention of vLLM and FlashInfer): check, plan, launch.

What is checked, and what is trusted:

* Always, on the host (no GPU work): shapes, dtypes, devices, int32 tables, head counts, and
  the sizes of the tables against each other.
* With ``check_lengths=True`` (the default), one small reduction on the GPU and one read of its
  result (a synchronisation), in 64-bit arithmetic: offsets that start at 0 and never decrease,
  that end inside the packed tensors, sequences no longer than ``max_seqlen_q`` /
  ``max_seqlen_k`` (rows past ``max_seqlen_q`` would never be computed), key lengths within the
  block table, and block-table entries that the lengths reach inside ``[0, pages)``.
* Whatever the tables say, the kernels never read outside q, k, v, the cache and the tables, nor
  write outside out and the LSE: each offset is clamped into its tensor, each length into the
  room its table gives, each page index into the cache. A wrong table that is not checked
  (``check_lengths=False``, or inside a CUDA graph capture, which cannot read device values and
  warns once that it trusts the tables) gives wrong numbers, never a fault.
* Rows of a packed q that no sequence owns (past the last offset) or that no CTA computes (a
  sequence longer than ``max_seqlen_q``, unchecked) are written as 0 (LSE -inf) by the kernel:
  the output never shows what its memory held before.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import NamedTuple

import torch

from ..compiler.abi import MAX_GRID_Z
from ..runtime.device import arch_of
from ..tuned import table as tuned_table
from . import plan
from .eager import resolve_config
from .inputs import DTYPE_NAMES, E4M3, matrix_arg, prepared, readable, vector_arg
from .launcher import Serving, launch_attention, launch_plan, planned
from .masks import call_masking, folded
from .table_checks import checking, cu_seqlens_faults, raise_faults, table_faults
from .validate import (
    INT32_MAX,
    alibi_arg,
    check_heads,
    check_int32,
    check_kv_descales,
    check_num_splits,
    check_out,
    check_tensor,
    exact_ints,
    int32_vector,
    op_error,
    out_apart,
    signed_query,
    softmax_scale_of,
)


def pack_view(t: torch.Tensor) -> torch.Tensor:
    """(total, heads, d) -> the kernel's (1, heads, total, d) view of the same memory."""
    total, heads, d = t.shape
    st = t.stride()
    return t.as_strided((1, heads, total, d), (max(t.numel(), 1), st[1], st[0], st[2]))


def _check_serving_out(op: str, out, q: torch.Tensor, inputs: dict) -> torch.Tensor:
    """``out=`` of a serving op (as ``validate.check_out``; an out the kernel cannot store into
    directly is written through a scratch tensor), or a new one."""
    if out is None:
        return q.new_empty(q.shape)
    check_out(out, tuple(q.shape), q.dtype, q.device, inputs, op, aligned=False)
    return out


def _launch_batches(serving: Serving, tables, launch_one, bias: tuple = ()) -> None:
    """``launch_one(serving, bias)`` for the whole batch, or, where a packed batch has more
    sequences than the grid's z dimension holds, for slices of it: ``tables(b0, b1)`` gives the
    table arguments of sequences b0..b1 (views of the same memory; offsets stay absolute), and
    (batch, heads) ALiBi slopes start at row b0."""
    if not serving.varlen or serving.batch <= MAX_GRID_Z:
        launch_one(serving, bias)
        return
    for b0 in range(0, serving.batch, MAX_GRID_Z):
        b1 = min(b0 + MAX_GRID_Z, serving.batch)
        part = tuple((ptr + 4 * b0 * stride, b1 - b0, heads, stride)
                     for ptr, _, heads, stride in bias)
        launch_one(replace(serving, tables=tables(b0, b1), batch=b1 - b0), part)


def _alibi(op: str, slopes, batch: int, heads: int, q: torch.Tensor, scale: float) -> tuple:
    """(the slopes tensor the kernels read, the launch's ``bias`` arguments) of a serving
    call's ``alibi_slopes`` (None: none)."""
    if slopes is None:
        return None, ()
    if scale == 0:
        raise op_error(op, "alibi_slopes needs a softmax_scale other than 0")
    slopes, arg = alibi_arg(slopes, batch, heads, q, op)
    return slopes, (arg,)


def run_varlen(
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
    config=None,
    out: torch.Tensor | None = None,
    check_lengths: bool = True,
    alibi_slopes: torch.Tensor | None = None,
):
    """``flashcore.ops.attention_varlen``, eager: check, plan, launch."""
    op = "attention_varlen"
    check_tensor(op, "q", q, 3, tuple(DTYPE_NAMES))
    for name, t in (("k", k), ("v", v)):
        check_tensor(op, name, t, 3, (q.dtype,), q.device)
    if k.shape != v.shape:
        raise op_error(op, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    check_heads(op, q.shape[1], k.shape[1], q.shape[2], k.shape[2])
    cu_q = int32_vector(op, "cu_seqlens_q", cu_seqlens_q, q.device)
    cu_k = int32_vector(op, "cu_seqlens_k", cu_seqlens_k, q.device, cu_q.shape[0])
    if cu_q.shape[0] < 1:
        raise op_error(op, "cu_seqlens_q needs batch + 1 >= 1 entries")
    max_q = check_int32(op, "max_seqlen_q", max_seqlen_q)
    max_k = check_int32(op, "max_seqlen_k", max_seqlen_k)
    if max(q.shape[0], k.shape[0]) > INT32_MAX:
        raise op_error(op, "a packed tensor has over 2**31 - 1 rows")
    mask = call_masking(causal, mask_align, window, softcap, alibi_slopes is not None)
    causal, mask = folded(causal, mask, max_q, max_k, exact=False)
    scale = softmax_scale_of(softmax_scale, q.shape[2])
    total_q, heads, d = q.shape
    _slopes, bias = _alibi(op, alibi_slopes, cu_q.shape[0] - 1, heads, q, scale)
    given = out
    out = _check_serving_out(op, out, q, {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q,
                                          "cu_seqlens_k": cu_k})
    lse = q.new_empty((heads, total_q), dtype=torch.float32) if return_lse else None
    batch = cu_q.shape[0] - 1
    if checking(op, check_lengths):
        raise_faults(op, cu_seqlens_faults("cu_seqlens_q", cu_q, total_q, max_q)
                      + cu_seqlens_faults("cu_seqlens_k", cu_k, k.shape[0], max_k))
    if batch == 0 or total_q == 0 or max_q == 0:
        return _done(_empty(out, lse), given)
    cfg = resolve_config(config, tile, None, None, None, arch=arch_of(q.get_device()),
                         head_dim=d, causal=causal, seqlen_q=max_q, precision="fp16",
                         features=(("varlen", True), *mask.features), pairs=batch * heads,
                         slots=plan.sm_count(q.get_device()))
    q, scale = signed_query(q, scale)
    # prepared() may copy: the copies stay referenced until the launch has been issued
    q4, q_arg = prepared(pack_view(q))
    k4, k_arg = prepared(pack_view(k))
    _v_alive, v_arg = prepared(pack_view(v))
    target = out if readable(out) else q.new_empty(q.shape)
    lse3 = None if lse is None else lse.view(1, heads, total_q)
    serving = Serving(True, 0, (vector_arg(cu_q), vector_arg(cu_k)), batch, max_q, max_k)
    _launch_batches(
        serving, lambda b0, b1: (vector_arg(cu_q[b0:b1 + 1]), vector_arg(cu_k[b0:b1 + 1])),
        lambda part, bias_part: launch_attention(
            q4, k4, pack_view(target), lse3, (q_arg, k_arg, v_arg), (), cfg, causal, scale,
            None, mask=mask, serving=part, bias=bias_part), bias)
    if target is not out:
        out.copy_(target)
    return _done((out, lse) if return_lse else out, given)


class PagedCall(NamedTuple):
    """What a checked decode-layout paged call (q (B, H, S, D), a 16-bit cache, tables used as
    given) decides apart from its tensors' addresses and the tables' contents: its plan's
    arguments and the kernel arguments' strides. Memoised per distinct call (``run_paged``):
    a serving loop calls every layer with the same layouts, and then pays for the checks on
    shapes and the config once; ``check_lengths`` still checks each call's tables."""

    serial: int  # names the call's plan in the launcher's memo (never reused)
    negate: bool  # a negative softmax_scale runs as -q
    lse_shape: tuple | None
    q_strides: tuple  # modes 0-2 of q, and of the caches' (pages, heads, page_size, d) views
    kv_strides: tuple
    table_stride: int
    serving: tuple  # Serving's page_size, batch, max_seqlen_q, max_seqlen_k
    plan_args: tuple  # ``launcher.plan_launch``'s arguments


_paged_calls: dict[tuple, PagedCall] = {}
_PAGED_MEMO_SIZE = 256
_serials = itertools.count()


def _paged_key(q, k_cache, v_cache, block_table, seqlens_k, causal, softmax_scale, return_lse,
               mask_align, window, softcap, tile, config, num_splits, out, check_lengths):
    """The memo key of a paged call: every argument but the tensors' addresses and contents."""
    layout = tuple((t.shape, t.stride(), t.dtype, t.get_device())
                   for t in (q, k_cache, v_cache, block_table, seqlens_k))
    out_layout = None if out is None else (out.shape, out.stride(), out.dtype, out.get_device())
    return (layout, causal, softmax_scale, return_lse, mask_align, window, softcap, tile, config,
            num_splits, check_lengths, out_layout, tuned_table.generation)


def run_paged(
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
    config=None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    check_lengths: bool = True,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
):
    """``flashcore.ops.attention_paged``, eager: check, plan, launch. A call in q's
    (B, H, S, D) layout whose arguments a checked call had before takes its memoised
    ``PagedCall`` (``_launch_paged``)."""
    op = "attention_paged"
    key = None
    if (cu_seqlens_q is None and max_seqlen_q is None and k_descale is None
            and v_descale is None and alibi_slopes is None and exact_ints(tile, num_splits)):
        try:
            key = _paged_key(q, k_cache, v_cache, block_table, seqlens_k, causal, softmax_scale,
                             return_lse, mask_align, window, softcap, tile, config, num_splits,
                             out, check_lengths)
            call = _paged_calls.get(key)
        except (AttributeError, TypeError):
            call, key = None, None  # not memoisable, or bad: the checks below name it
        if call is not None and (out is None or out_apart(out, (q, k_cache, v_cache,
                                                                block_table, seqlens_k))):
            return _launch_paged(call, q, k_cache, v_cache, block_table, seqlens_k, out,
                                 check_lengths)
    packed = cu_seqlens_q is not None
    check_tensor(op, "q", q, 3 if packed else 4, tuple(DTYPE_NAMES))
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(op, name, t, 4, (q.dtype, E4M3), q.device)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise op_error(op, f"k_cache {k_cache.dtype} {tuple(k_cache.shape)} and v_cache "
                        f"{v_cache.dtype} {tuple(v_cache.shape)} differ")
    kd, vd = check_kv_descales(k_cache, k_descale, v_descale, op, paged=True)
    pages, page_size, kv_heads, d = k_cache.shape
    heads = q.shape[-2] if packed else q.shape[1]
    check_heads(op, heads, kv_heads, q.shape[-1], d)
    if page_size == 0 or pages == 0:
        raise op_error(op, f"the cache has no room: shape {tuple(k_cache.shape)}")
    check_tensor(op, "block_table", block_table, 2, (torch.int32,), q.device)
    batch, max_pages = block_table.shape
    table = block_table  # the caller's (a copy below would not be)
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    lens = int32_vector(op, "seqlens_k", seqlens_k, q.device, batch)
    cu_q = None
    if packed:
        cu_q = int32_vector(op, "cu_seqlens_q", cu_seqlens_q, q.device, batch + 1)
        max_q = check_int32(op, "max_seqlen_q", max_seqlen_q)
    else:
        if max_seqlen_q is not None:
            raise op_error(op, "max_seqlen_q goes with cu_seqlens_q (a packed q)")
        if q.shape[0] != batch:
            raise op_error(op, f"q has batch {q.shape[0]}, block_table {batch}")
        max_q = q.shape[2]
    check_num_splits(op, num_splits)
    mask = call_masking(causal, mask_align, window, softcap, alibi_slopes is not None)
    scale = softmax_scale_of(softmax_scale, d)
    if alibi_slopes is not None and kd is not None:
        raise op_error(op, "alibi_slopes is built for a 16-bit cache, not an FP8 one")
    _slopes, bias = _alibi(op, alibi_slopes, batch, heads, q, scale)
    max_k = max_pages * page_size
    if max_k > INT32_MAX:  # the kernels bound a sequence's keys by this, in 32 bits
        raise op_error(op, f"block_table's {max_pages} pages x {page_size} keys is over 2**31 - 1 "
                        "keys a sequence")
    causal, mask = folded(causal, mask, max_q, max_k, exact=False)  # e.g. decode: no diagonal
    given = out
    out = _check_serving_out(op, out, q, {
        "q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table,
        "seqlens_k": lens, "cu_seqlens_q": cu_q, "k_descale": kd,
        "v_descale": vd})
    if checking(op, check_lengths):
        faults = table_faults(lens, block_table, pages, page_size)
        if packed:
            faults += cu_seqlens_faults("cu_seqlens_q", cu_q, q.shape[0], max_q)
        raise_faults(op, faults)
    lse_shape = (heads, q.shape[0]) if packed else tuple(q.shape[:3])
    lse = q.new_empty(lse_shape, dtype=torch.float32) if return_lse else None
    if batch == 0 or q.numel() == 0 or max_q == 0:
        return _done(_empty(out, lse), given)
    if packed and num_splits not in (None, 1):
        raise op_error(op, "a packed q runs unsplit (num_splits None or 1)")
    cfg = resolve_config(config, tile, None, None, None, arch=arch_of(q.get_device()),
                         head_dim=d, causal=causal, seqlen_q=max_q,
                         precision="fp16" if kd is None else "fp8kv",
                         features=(("paged_kv", True), ("page_size", page_size),
                                   ("varlen", packed), *mask.features),
                         group=1 if packed else heads // kv_heads, pairs=batch * heads,
                         slots=plan.sm_count(q.get_device()))
    # the cache's pages as (pages, heads_kv, page_size, head_dim): what the kernel indexes; any
    # copies prepared() makes stay referenced until the launches have been issued
    k4, k_arg = prepared(k_cache.permute(0, 2, 1, 3))
    _v_alive, v_arg = prepared(v_cache.permute(0, 2, 1, 3))
    descales = () if kd is None else (kd.permute(0, 2, 1), vd.permute(0, 2, 1))
    target = out if readable(out) else q.new_empty(q.shape)
    if (key is not None and target is out and lens is seqlens_k and table is block_table
            and k_arg[0] == k_cache.data_ptr() and v_arg[0] == v_cache.data_ptr()
            and readable(q)):
        # the tables and caches as given, nothing copied: remember the call
        call = PagedCall(
            next(_serials), scale < 0, (tuple(lse.shape) if lse is not None else None),
            q.stride()[:3], (k_arg[4:], v_arg[4:]), block_table.stride(0),
            (page_size, batch, max_q, max_k),
            (q.get_device(), *q.shape, kv_heads, -(-max_k // cfg.tile_n), q.dtype, cfg,
             causal, lse is not None, "fp16", False, False, mask, False, page_size, batch,
             max_q, num_splits, abs(scale)))
        if len(_paged_calls) >= _PAGED_MEMO_SIZE:
            _paged_calls.clear()
        _paged_calls[key] = call
        return _launch_paged(call, q, k_cache, v_cache, block_table, lens, out, False,
                             lse=lse)
    q, scale = signed_query(q, scale)
    if packed:
        q4, q_arg = prepared(pack_view(q))
        o4, lse_v = pack_view(target), None if lse is None else lse.view(1, heads, q.shape[0])
    else:
        q4, q_arg = prepared(q)
        o4, lse_v = target, lse

    def tables(b0: int, b1: int) -> tuple:  # sequences b0..b1's (past the grid's z limit)
        return (*((vector_arg(cu_q[b0:b1 + 1]),) if packed else ()),
                matrix_arg(block_table[b0:b1]), vector_arg(lens[b0:b1]))

    # the whole batch's arguments without slicing: a view costs an eager decode call host time
    whole = (*((vector_arg(cu_q),) if packed else ()), matrix_arg(block_table),
             vector_arg(lens))
    serving = Serving(packed, page_size, whole, batch, max_q, max_k)
    _launch_batches(serving, tables, lambda part, bias_part: launch_attention(
        q4, k4, o4, lse_v, (q_arg, k_arg, v_arg), descales, cfg, causal, scale, num_splits,
        kv_fp8=kd is not None, mask=mask, serving=part, bias=bias_part), bias)
    if target is not out:
        out.copy_(target)
    return _done((out, lse) if return_lse else out, given)


def _launch_paged(call: PagedCall, q, k_cache, v_cache, block_table, lens, out,
                  check_lengths: bool, lse: torch.Tensor | None = None):
    """Bind a memoised paged call's tensors and launch it (``lse``: one the checked call made)."""
    op = "attention_paged"
    page_size, batch, max_q, max_k = call.serving
    if checking(op, check_lengths):
        raise_faults(op, table_faults(lens, block_table, k_cache.shape[0], page_size))
    given = out
    result = q.new_empty(q.shape) if out is None else out
    if lse is None and call.lse_shape is not None:
        lse = q.new_empty(call.lse_shape, dtype=torch.float32)
    if call.negate:
        q = torch.neg(q)
    qp, kp, vp = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
    b, h, sq, _ = q.shape
    pages, _, heads_kv, _ = k_cache.shape
    if call.negate or (qp | kp | vp) % 16:  # a fresh -q, or a base the kernels cannot read
        q, q_arg = prepared(q)
        k_cache, k_arg = prepared(k_cache.permute(0, 2, 1, 3))
        v_cache, v_arg = prepared(v_cache.permute(0, 2, 1, 3))
    else:
        ks, vs = call.kv_strides
        q_arg = (qp, b, h, sq, *call.q_strides)
        k_arg = (kp, pages, heads_kv, page_size, *ks)
        v_arg = (vp, pages, heads_kv, page_size, *vs)
    tables = ((block_table.data_ptr(), batch, block_table.shape[1], call.table_stride),
              (lens.data_ptr(), batch))
    eager = not plan.capturing()  # as ``launcher.launch_attention`` plans it
    launch_plan(planned((call.serial, eager), (*call.plan_args, eager)), result, lse,
                (q_arg, k_arg, v_arg), (), Serving(False, page_size, tables, batch, max_q, max_k))
    return _done((result, lse) if call.lse_shape is not None else result, given)


def _done(result, given: torch.Tensor | None):
    """The op's result, after telling autograd that a caller's ``out=`` was written."""
    if given is not None:
        torch.autograd.graph.increment_version(given)
    return result


def _empty(out: torch.Tensor, lse: torch.Tensor | None):
    out.zero_()
    if lse is None:
        return out
    lse.fill_(-math.inf)
    return out, lse


__all__ = ["run_paged", "run_varlen"]
