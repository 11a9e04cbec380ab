"""Appending new keys and values to a KV cache in place, with rotary on them and on the
queries, in one kernel (``flashcore.specs.KvAppendSpec``): ``append_paged_kv`` for
``attention_paged``'s caches, and the step ``flash_attn_with_kvcache`` takes before its
attention (``append_kv``: FlashAttention's (batch, seqlen, heads, head_dim) layout; a dense
cache as its rows' pages, ``integrations.kv_cache``)."""

from __future__ import annotations

import torch

from ..compiler.abi import MAX_GRID_Z
from ..runtime.device import arch_of
from ..runtime.launch import kernel_for, launch
from ..specs import HEAD_DIMS, KvAppendSpec
from .inputs import DTYPE_NAMES, matrix_arg, prepared, readable, vector_arg
from .table_checks import checking, raise_faults, table_faults
from .validate import check_heads, check_tensor, int32_vector, op_error

_kernels: dict[tuple, object] = {}  # call-site key -> loaded kernel (no spec work per call)


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
         v_cache: torch.Tensor) -> bool:
    """Whether the kernel takes this append (shapes and devices checked by the caller): 16-bit
    CUDA tensors of one dtype and a head dim it builds, and caches whose (pages, heads,
    page_size, head_dim) views it can write in place."""
    return (k.is_cuda and k.dtype in DTYPE_NAMES
            and all(t.dtype == k.dtype for t in (q, v, k_cache, v_cache))
            and k.shape[-1] in HEAD_DIMS
            and k.shape[0] <= MAX_GRID_Z
            and k_cache.shape[-1] == k.shape[-1]
            and all(readable(c.permute(0, 2, 1, 3)) for c in (k_cache, v_cache)))


def append_kv(k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
              block_table: torch.Tensor, seqlens: torch.Tensor, *, q: torch.Tensor | None = None,
              cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
              interleaved: bool = False, q_per_token: bool = True) -> torch.Tensor | None:
    """Write k and v (batch, new, heads_kv, head_dim) at positions seqlens[b] + t of each
    sequence's pages (k_pages, v_pages (pages, page_size, heads_kv, head_dim), ``fits``;
    block_table (batch, max_pages) int32; seqlens (batch,) int32). With cos and sin
    (positions, rotary_dim / 2) the keys are turned by rotary at their positions, and the
    turned copy of q (batch, seq_q, heads, head_dim) at seqlens[b] + t (``q_per_token``) or
    seqlens[b] is returned. Lengths and tables are not checked here (the caller's checks);
    whatever they hold, nothing is written outside the caches."""
    rotary_dim = 0 if cos is None else 2 * cos.shape[-1]
    tables = "float32"
    if rotary_dim:
        tables = DTYPE_NAMES.get(cos.dtype, "float32")
        cos, sin = (t.float() if tables == "float32" and t.dtype != torch.float32 else t
                    for t in (cos, sin))
        if cos.stride(-1) != 1 or sin.stride(-1) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
    dev = k.get_device()
    kern = _kernel(dev, k.dtype, k.shape[-1], rotary_dim, interleaved, tables)
    _k, k_arg = prepared(k.transpose(1, 2))
    _v, v_arg = prepared(v.transpose(1, 2))
    kc_arg = prepared(k_pages.permute(0, 2, 1, 3))[1]  # readable (``fits``): no copy
    vc_arg = prepared(v_pages.permute(0, 2, 1, 3))[1]
    table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    if seqlens.stride(0) != 1:  # the kernel reads (batch,) with a unit stride
        seqlens = seqlens.contiguous()
    args = (k_arg, v_arg, kc_arg, vc_arg, matrix_arg(table), vector_arg(seqlens))
    batch, new, heads_kv, _ = k.shape
    if not rotary_dim:
        if new * heads_kv * batch:
            launch(kern, (new, heads_kv, batch), args, dev)
        return None
    out = q.new_empty(q.shape)
    _q, q_arg = prepared(q.transpose(1, 2))
    out_arg = prepared(out.transpose(1, 2))[1]
    args += (q_arg, out_arg, matrix_arg(cos), matrix_arg(sin), (int(q_per_token),))
    grid = (new + q.shape[1], max(q.shape[2], heads_kv), batch)
    if grid[0] * grid[1] * grid[2]:
        launch(kern, grid, args, dev)
    return out


def _kernel(device: int, dtype: torch.dtype, head_dim: int, rotary_dim: int, interleaved: bool,
            tables: str):
    key = (device, dtype, head_dim, rotary_dim, interleaved, tables)
    kern = _kernels.get(key)
    if kern is None:
        spec = KvAppendSpec(arch=arch_of(device), dtype=DTYPE_NAMES[dtype], head_dim=head_dim,
                            rotary_dim=rotary_dim, interleaved=interleaved and rotary_dim > 0,
                            table_dtype=tables)
        kern = _kernels[key] = kernel_for(spec, device)
    return kern


def append_paged_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor, *,
                    q: torch.Tensor | None = None, rotary_cos: torch.Tensor | None = None,
                    rotary_sin: torch.Tensor | None = None, rotary_interleaved: bool = False,
                    q_per_token: bool = True, check_lengths: bool = True
                    ) -> torch.Tensor | None:
    """Write new keys and values into ``attention_paged``'s caches in place, one launch.

    k and v: (batch, heads_kv, new, head_dim), new token t of sequence b going to position
    seqlens[b] + t (int32 (batch,): each sequence's keys before the append) through
    ``block_table`` (int32 (batch, max_pages)) into k_cache and v_cache (pages, page_size,
    heads_kv, head_dim), all of one 16-bit dtype. With ``rotary_cos``/``rotary_sin``
    ((positions, rotary_dim / 2), float32 or the dtype) the keys are turned by rotary at their
    positions (features (i, i + rotary_dim / 2), or (2i, 2i + 1) with ``rotary_interleaved``),
    and so is ``q`` (batch, heads, seq_q, head_dim), at seqlens[b] + t (``q_per_token``) or
    seqlens[b]: its turned copy is returned (else None). Then
    ``attention_paged(q, k_cache, v_cache, block_table, seqlens + new)``.

    ``check_lengths`` (default): one device-side check, as ``attention_paged``'s, that the new
    positions fit the table and reach only pages of the cache; whatever the tables hold, the
    kernel writes inside the caches."""
    op = "append_paged_kv"
    if torch.compiler.is_compiling():
        raise op_error(op, "runs eagerly (its kernel writes the caches in place); call it "
                       "outside torch.compile")
    check_tensor(op, "k", k, 4, tuple(DTYPE_NAMES))
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(op, name, t, 4, (k.dtype,), k.device)
    batch, heads_kv, new, d = k.shape
    if v.shape != k.shape:
        raise op_error(op, f"v {tuple(v.shape)} and k {tuple(k.shape)} differ in shape")
    if k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (heads_kv, d):
        raise op_error(op, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                       f"must be (pages, page_size, {heads_kv}, {d})")
    if d not in HEAD_DIMS:
        raise op_error(op, f"head_dim {d} is not one flashcore builds ({HEAD_DIMS})")
    if batch > MAX_GRID_Z:
        raise op_error(op, f"a batch of {batch} is over the {MAX_GRID_Z} a launch holds")
    if not all(readable(c.permute(0, 2, 1, 3)) for c in (k_cache, v_cache)):
        raise op_error(op, "the caches must have a contiguous head_dim, a 16-byte aligned base "
                       "and 16-byte multiples as strides (they are written in place)")
    check_tensor(op, "block_table", block_table, 2, (torch.int32,), k.device)
    if block_table.shape[0] != batch:
        raise op_error(op, f"block_table has {block_table.shape[0]} rows for a batch of {batch}")
    lens = int32_vector(op, "seqlens", seqlens, k.device, batch)
    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary:
        if rotary_cos is None or rotary_sin is None or q is None:
            raise op_error(op, "rotary takes rotary_cos, rotary_sin and q together")
        check_tensor(op, "q", q, 4, (k.dtype,), k.device)
        check_heads(op, q.shape[1], heads_kv, q.shape[3], d)
        if q.shape[0] != batch:
            raise op_error(op, f"q has batch {q.shape[0]}, k {batch}")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor) or t.device != k.device or t.dim() != 2:
                raise op_error(op, f"{name} must be a 2-d tensor on {k.device}")
        if rotary_sin.shape != rotary_cos.shape or not 0 < 2 * rotary_cos.shape[1] <= d \
                or rotary_cos.shape[0] == 0:
            raise op_error(op, f"rotary_cos {tuple(rotary_cos.shape)} and rotary_sin "
                           f"{tuple(rotary_sin.shape)} must both be (positions, rotary_dim / 2), "
                           f"rotary_dim in 2..{d}")
    if checking(op, check_lengths):
        raise_faults(op, table_faults(lens.to(torch.int64) + new, block_table,
                                        k_cache.shape[0], k_cache.shape[1],
                                        f"seqlens + the {new} new tokens"))
    turned = append_kv(k.transpose(1, 2), v.transpose(1, 2), k_cache, v_cache, block_table, lens,
                       q=None if q is None else q.transpose(1, 2), cos=rotary_cos,
                       sin=rotary_sin, interleaved=rotary_interleaved, q_per_token=q_per_token)
    return None if turned is None else turned.transpose(1, 2)


__all__ = ["append_kv", "append_paged_kv", "fits"]
