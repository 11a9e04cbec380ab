"""The eager implementations of the serving layouts (``flashcore.ops.attention_varlen``: a packed
batch of sequences of different lengths, the convention of ``flash_attn_varlen_func``;
``flashcore.ops.attention_paged``: K/V in a paged cache read through a block table, the
convention of vLLM and FlashInfer): check, plan, launch.

What is checked, and what is trusted:

* Always, on the host (no GPU work): shapes, dtypes, devices, int32 tables, head counts, and
  the sizes of the tables against each other.
* With ``check_lengths=True`` (the default), one small reduction on the GPU and one read of its
  result (a synchronisation): offsets that start at 0 and never decrease, that end inside the
  packed tensors, sequences no longer than ``max_seqlen_q`` / ``max_seqlen_k`` (rows past
  ``max_seqlen_q`` would never be computed), key lengths within the block table, and block-table
  entries that the lengths reach inside ``[0, pages)``. Inside a CUDA graph capture this check
  cannot run (it reads device values) and is skipped: the tables are trusted, as they are with
  ``check_lengths=False``, and a wrong one reads the wrong memory.
"""

from __future__ import annotations

import math

import torch

from ..runtime.device import arch_of
from ..spec import HEAD_DIMS
from .eager import resolve_config
from .inputs import DTYPE_NAMES, E4M3, prepared
from .launcher import Serving, launch_attention
from .masks import call_masking
from .validate import check_kv_descales, check_num_splits, signed_query, softmax_scale_of

_INT32_MAX = 2**31 - 1


def _fail(op: str, what: str) -> ValueError:
    return ValueError(f"{op}: {what}")


def _check_tensor(op: str, name: str, t, dims: int, dtypes, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise _fail(op, f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected one of {tuple(dtypes)}")
    if not t.is_cuda:
        raise _fail(op, f"{name} is on {t.device}; flashcore runs on CUDA tensors")
    if device is not None and t.device != device:
        raise _fail(op, f"{name} is on {t.device}, q on {device}")


def _check_heads(op: str, q_heads: int, kv_heads: int, head_dim: int, kv_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise _fail(op, f"head_dim {head_dim} is not supported; supported are {HEAD_DIMS}")
    if kv_dim != head_dim:
        raise _fail(op, f"q has head_dim {head_dim}, k/v {kv_dim}")
    if kv_heads == 0 or q_heads % kv_heads:
        raise _fail(op, f"q has {q_heads} heads and k/v {kv_heads}: the query heads must be a "
                        "whole multiple of the key/value heads (grouped-query attention)")


def _check_max(op: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _INT32_MAX:
        raise _fail(op, f"{name} must be an int in 0..2**31-1, got {value!r}")
    return value


def _int32_vector(op: str, name: str, t, device, length: int | None = None) -> torch.Tensor:
    _check_tensor(op, name, t, 1, (torch.int32,), device)
    if length is not None and t.shape[0] != length:
        raise _fail(op, f"{name} has {t.shape[0]} entries, expected {length}")
    return t.contiguous()


def _pack_view(t: torch.Tensor) -> torch.Tensor:
    """(total, heads, d) -> the kernel's (1, heads, total, d) view of the same memory."""
    total, heads, d = t.shape
    st = t.stride()
    return t.as_strided((1, heads, total, d), (max(t.numel(), 1), st[1], st[0], st[2]))


def _cu_seqlens_faults(name: str, cu: torch.Tensor, total: int, max_len: int) -> list:
    """Device-side tests of one offsets vector: (message, bad?) pairs (read back together)."""
    lens = cu[1:] - cu[:-1]
    return [(f"{name}[0] must be 0", cu[0] != 0),
            (f"{name} must not decrease", (lens < 0).any()),
            (f"{name}[-1] is past the packed tensor's {total} rows", cu[-1] > total),
            (f"a sequence in {name} is longer than its max_seqlen ({max_len})",
             (lens > max_len).any())]


def _table_faults(lens: torch.Tensor, table: torch.Tensor, pages: int, page_size: int) -> list:
    """Device-side tests of a paged cache's key lengths and block table, as
    ``_cu_seqlens_faults``: only the entries a sequence's length reaches are read."""
    max_pages = table.shape[1]
    reach = (lens.clamp(min=0) + page_size - 1) // page_size  # pages each sequence uses
    used = torch.arange(max_pages, device=table.device)[None, :] < reach[:, None]
    return [("seqlens_k must be >= 0", (lens < 0).any()),
            (f"seqlens_k is over the block table's {max_pages} pages x {page_size}",
             (lens > max_pages * page_size).any()),
            (f"a block_table entry a sequence uses is outside 0..{pages - 1}",
             (used & ((table < 0) | (table >= pages))).any())]


def _checking(check_lengths: bool) -> bool:
    """Whether to run the device-side checks: asked for, and not inside a graph capture (which
    cannot read device values back; its small kernels would also join the graph)."""
    return bool(check_lengths) and not torch.cuda.is_current_stream_capturing()


def _raise_faults(op: str, faults: list) -> None:
    flags = torch.stack([torch.as_tensor(bad).reshape(()) for _, bad in faults]).tolist()
    for (message, _), bad in zip(faults, flags):
        if bad:
            raise _fail(op, message + " (check_lengths=False skips these checks)")


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
):
    """``flashcore.ops.attention_varlen``, eager: check, plan, launch."""
    op = "attention_varlen"
    _check_tensor(op, "q", q, 3, tuple(DTYPE_NAMES))
    for name, t in (("k", k), ("v", v)):
        _check_tensor(op, name, t, 3, (q.dtype,), q.device)
    if k.shape != v.shape:
        raise _fail(op, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    _check_heads(op, q.shape[1], k.shape[1], q.shape[2], k.shape[2])
    cu_q = _int32_vector(op, "cu_seqlens_q", cu_seqlens_q, q.device)
    cu_k = _int32_vector(op, "cu_seqlens_k", cu_seqlens_k, q.device, cu_q.shape[0])
    if cu_q.shape[0] < 1:
        raise _fail(op, "cu_seqlens_q needs batch + 1 >= 1 entries")
    max_q = _check_max(op, "max_seqlen_q", max_seqlen_q)
    max_k = _check_max(op, "max_seqlen_k", max_seqlen_k)
    if max(q.shape[0], k.shape[0]) > _INT32_MAX:
        raise _fail(op, "a packed tensor has over 2**31 - 1 rows")
    mask = call_masking(causal, mask_align, window, softcap)
    scale = softmax_scale_of(softmax_scale, q.shape[2])
    total_q, heads, d = q.shape
    if out is None:
        out = q.new_empty(q.shape)
    elif (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype
          or out.device != q.device):
        raise _fail(op, f"out must be a {q.dtype} tensor of shape {tuple(q.shape)} on {q.device}")
    lse = q.new_empty((heads, total_q), dtype=torch.float32) if return_lse else None
    batch = cu_q.shape[0] - 1
    if _checking(check_lengths):
        _raise_faults(op, _cu_seqlens_faults("cu_seqlens_q", cu_q, total_q, max_q)
                      + _cu_seqlens_faults("cu_seqlens_k", cu_k, k.shape[0], max_k))
    if batch == 0 or total_q == 0 or max_q == 0:
        return _empty(out, lse)
    cfg = resolve_config(config, tile, None, None, None, arch=arch_of(q.get_device()),
                         head_dim=d, causal=causal, seqlen_q=max_q, precision="fp16",
                         features=(("varlen", True), *mask.features))
    q, scale = signed_query(q, scale)
    # prepared() may copy: the copies stay referenced until the launch has been issued
    q4, q_arg = prepared(_pack_view(q))
    k4, k_arg = prepared(_pack_view(k))
    v4, v_arg = prepared(_pack_view(v))
    target = out if _aligned(out) else q.new_empty(q.shape)
    lse3 = None if lse is None else lse.view(1, heads, total_q)
    serving = Serving(True, 0, (_vector_arg(cu_q), _vector_arg(cu_k)), batch, max_q, max_k)
    launch_attention(q4, k4, _pack_view(target), lse3, (q_arg, k_arg, v_arg), (), cfg, causal,
                     scale, None, mask=mask, serving=serving)
    del q4, k4, v4  # (any copies) live until the launch is issued
    if target is not out:
        out.copy_(target)
    return (out, lse) if return_lse else out


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
):
    """``flashcore.ops.attention_paged``, eager: check, plan, launch."""
    op = "attention_paged"
    packed = cu_seqlens_q is not None
    _check_tensor(op, "q", q, 3 if packed else 4, tuple(DTYPE_NAMES))
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(op, name, t, 4, (q.dtype, E4M3), q.device)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise _fail(op, f"k_cache {k_cache.dtype} {tuple(k_cache.shape)} and v_cache "
                        f"{v_cache.dtype} {tuple(v_cache.shape)} differ")
    kd, vd = check_kv_descales(k_cache, k_descale, v_descale, op, paged=True)
    pages, page_size, kv_heads, d = k_cache.shape
    heads = q.shape[-2] if packed else q.shape[1]
    _check_heads(op, heads, kv_heads, q.shape[-1], d)
    if page_size == 0 or pages == 0:
        raise _fail(op, f"the cache has no room: shape {tuple(k_cache.shape)}")
    _check_tensor(op, "block_table", block_table, 2, (torch.int32,), q.device)
    batch, max_pages = block_table.shape
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    lens = _int32_vector(op, "seqlens_k", seqlens_k, q.device, batch)
    if packed:
        cu_q = _int32_vector(op, "cu_seqlens_q", cu_seqlens_q, q.device, batch + 1)
        max_q = _check_max(op, "max_seqlen_q", max_seqlen_q)
    else:
        if max_seqlen_q is not None:
            raise _fail(op, "max_seqlen_q goes with cu_seqlens_q (a packed q)")
        if q.shape[0] != batch:
            raise _fail(op, f"q has batch {q.shape[0]}, block_table {batch}")
        max_q = q.shape[2]
    check_num_splits(op, num_splits)
    mask = call_masking(causal, mask_align, window, softcap)
    scale = softmax_scale_of(softmax_scale, d)
    max_k = max_pages * page_size
    if _checking(check_lengths):
        faults = _table_faults(lens, block_table, pages, page_size)
        if packed:
            faults += _cu_seqlens_faults("cu_seqlens_q", cu_q, q.shape[0], max_q)
        _raise_faults(op, faults)
    if out is None:
        out = q.new_empty(q.shape)
    elif (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype
          or out.device != q.device):
        raise _fail(op, f"out must be a {q.dtype} tensor of shape {tuple(q.shape)} on {q.device}")
    lse_shape = (heads, q.shape[0]) if packed else tuple(q.shape[:3])
    lse = q.new_empty(lse_shape, dtype=torch.float32) if return_lse else None
    if batch == 0 or q.numel() == 0 or max_q == 0:
        return _empty(out, lse)
    cfg = resolve_config(config, tile, None, None, None, arch=arch_of(q.get_device()),
                         head_dim=d, causal=causal, seqlen_q=max_q,
                         precision="fp16" if kd is None else "fp8kv",
                         features=(("paged_kv", True), ("varlen", packed), *mask.features),
                         group=1 if packed else heads // kv_heads)
    # the cache's pages as (pages, heads_kv, page_size, head_dim): what the kernel indexes
    k4, k_arg = prepared(k_cache.permute(0, 2, 1, 3))
    v4, v_arg = prepared(v_cache.permute(0, 2, 1, 3))
    descales = () if kd is None else (kd.permute(0, 2, 1), vd.permute(0, 2, 1))
    tables = (_table_arg(block_table), _vector_arg(lens))
    target = out if _aligned(out) else q.new_empty(q.shape)
    q, scale = signed_query(q, scale)
    if packed:
        q4, q_arg = prepared(_pack_view(q))
        o4, lse_v = _pack_view(target), None if lse is None else lse.view(1, heads, q.shape[0])
        tables = (_vector_arg(cu_q), *tables)
        if num_splits not in (None, 1):
            raise _fail(op, "a packed q runs unsplit (num_splits None or 1)")
    else:
        q4, q_arg = prepared(q)
        o4, lse_v = target, lse
    serving = Serving(packed, page_size, tables, batch, max_q, max_k)
    launch_attention(q4, k4, o4, lse_v, (q_arg, k_arg, v_arg), descales, cfg, causal, scale,
                     num_splits, kv_fp8=kd is not None, mask=mask, serving=serving)
    del q4, k4, v4  # (any copies) live until the launch is issued
    if target is not out:
        out.copy_(target)
    return (out, lse) if return_lse else out


def _aligned(t: torch.Tensor) -> bool:
    """Whether the kernel can store into ``t`` directly (16-byte rows and base)."""
    align = 16 // t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s % align == 0 for s in t.stride()[:-1]))


def _vector_arg(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.shape[0])


def _table_arg(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.shape[0], t.shape[1], t.stride(0))


def _empty(out: torch.Tensor, lse: torch.Tensor | None):
    out.zero_()
    if lse is None:
        return out
    lse.fill_(-math.inf)
    return out, lse


__all__ = ["run_paged", "run_varlen"]
