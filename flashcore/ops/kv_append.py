"""Appending new keys and values to a KV cache in place, with rotary on them and on the
queries, in one kernel (``flashcore.specs.KvAppendSpec``): what ``flash_attn_with_kvcache``
does before its attention. Tensors in FlashAttention's (batch, seqlen, heads, head_dim)
layout; the cache as pages (a dense cache is its rows' pages: ``integrations.kv_cache``)."""

from __future__ import annotations

import torch

from ..compiler.abi import MAX_GRID_Z
from ..runtime.device import arch_of
from ..runtime.launch import kernel_for, launch
from ..specs import HEAD_DIMS, KvAppendSpec
from .inputs import DTYPE_NAMES, prepared, readable

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
    args = (k_arg, v_arg, kc_arg, vc_arg,
            (table.data_ptr(), table.shape[0], table.shape[1], table.stride(0)),
            (seqlens.data_ptr(), seqlens.shape[0]))
    batch, new, heads_kv, _ = k.shape
    if not rotary_dim:
        if new * heads_kv * batch:
            launch(kern, (new, heads_kv, batch), args, dev)
        return None
    out = q.new_empty(q.shape)
    _q, q_arg = prepared(q.transpose(1, 2))
    out_arg = prepared(out.transpose(1, 2))[1]
    args += (q_arg, out_arg, *((t.data_ptr(), t.shape[0], t.shape[1], t.stride(0))
                               for t in (cos, sin)), (int(q_per_token),))
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


__all__ = ["append_kv", "fits"]
