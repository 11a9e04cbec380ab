"""The torch side of ``flash_attn_with_kvcache``: rotary embeddings, appending new keys and
values into a dense or paged cache in place, and a dense cache seen as pages (so
``attention_paged`` reads it with per-row lengths, no copy)."""

from __future__ import annotations

import torch

# page sizes whose copy passes are compiled in (flashcore.ops.serving); others gather rows
_FAST_PAGE_SIZES = (256, 128, 64, 32, 16)


def as_lengths(cache_seqlens, batch: int, device: torch.device,
               name: str = "cache_seqlens") -> torch.Tensor:
    """``cache_seqlens`` (or the argument ``name``: an int or a (batch,) integer tensor) as an
    int32 (batch,) tensor."""
    if isinstance(cache_seqlens, bool):
        raise TypeError(f"{name} must be an int or a tensor, got {cache_seqlens!r}")
    if isinstance(cache_seqlens, int):
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be an int or a tensor, got "
                        f"{type(cache_seqlens).__name__}")
    if cache_seqlens.dtype.is_floating_point or cache_seqlens.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {cache_seqlens.dtype}")
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"{name} has shape {tuple(cache_seqlens.shape)}, expected ({batch},)")
    return cache_seqlens.to(device=device, dtype=torch.int32)


def positions(lengths: torch.Tensor, seqlen: int, per_token: bool = True) -> torch.Tensor:
    """(batch, seqlen) int64 positions lengths[b] + t (or lengths[b] for every t)."""
    start = lengths.to(torch.int64)[:, None]
    if not per_token:
        return start.expand(-1, seqlen)
    return start + torch.arange(seqlen, device=lengths.device)


def check_new_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> None:
    """New keys and values (batch, seqlen_new, heads_kv, head_dim) that fit q's batch and the
    caches' heads and head dim, on their device (what the append writes is checked here, not
    by the kernel)."""
    want = (q.shape[0], k.shape[1], *k_cache.shape[2:])
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4 or tuple(t.shape) != want:
            raise ValueError(f"flash_attn_with_kvcache: {name} has shape {tuple(t.shape)}, "
                             f"expected (batch, seqlen_new, heads_kv, head_dim) = {want}")
        if t.device != k_cache.device:
            raise ValueError(f"flash_attn_with_kvcache: {name} is on {t.device}, the cache on "
                             f"{k_cache.device}")
    if v_cache.shape != k_cache.shape or v_cache.device != k_cache.device:
        raise ValueError(f"flash_attn_with_kvcache: v_cache {tuple(v_cache.shape)} on "
                         f"{v_cache.device} is not like k_cache {tuple(k_cache.shape)} on "
                         f"{k_cache.device}")


def check_rotary(cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                 device: torch.device | None = None) -> None:
    """cos and sin: the same (positions, rotary_dim / 2) shape, rotary_dim within head_dim, on
    ``device`` where given."""
    if device is not None and (cos.device != device or sin.device != device):
        raise ValueError(f"rotary_cos ({cos.device}) and rotary_sin ({sin.device}) must be on "
                         f"q's device, {device}")
    if cos.dim() != 2 or sin.shape != cos.shape:
        raise ValueError(f"rotary_cos {tuple(cos.shape)} and rotary_sin {tuple(sin.shape)} must "
                         "both be (positions, rotary_dim / 2)")
    if 2 * cos.shape[-1] > head_dim:
        raise ValueError(f"rotary_cos has {cos.shape[-1]} columns: rotary dim "
                         f"{2 * cos.shape[-1]} is over head_dim {head_dim}")
    if cos.shape[0] == 0:
        raise ValueError("rotary_cos has no positions")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """Rotary embedding of x (batch, seqlen, heads, head_dim) at ``pos`` (batch, seqlen), with
    cos/sin (max_pos, rotary_dim / 2): the first rotary_dim features turn, the rest pass.
    Interleaved pairs features (0, 1), (2, 3), ... (GPT-J); otherwise (i, i + rotary_dim / 2)
    (GPT-NeoX). Computed in float32 and rounded once, as FlashAttention's kernel does."""
    check_rotary(cos, sin, x.shape[-1])
    half = cos.shape[-1]
    rd = 2 * half
    c = cos[pos].float()[:, :, None, :]  # (batch, seqlen, 1, half)
    s = sin[pos].float()[:, :, None, :]
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        turned = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        turned = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., rd:]), dim=-1)


def dense_slots(rows: torch.Tensor, lengths: torch.Tensor, seqlen: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache row, position) index pairs, each (batch, seqlen), where the new tokens go in a
    dense cache: row ``rows[b]``, positions lengths[b] .. lengths[b] + seqlen - 1."""
    pos = positions(lengths, seqlen)
    return rows.to(torch.int64)[:, None].expand_as(pos), pos


def paged_slots(block_table: torch.Tensor, lengths: torch.Tensor, seqlen: int, page_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, row in page) index pairs, each (batch, seqlen), of the new tokens' positions
    lengths[b] + t through the block table."""
    pos = positions(lengths, seqlen)
    pages = block_table.to(torch.int64).gather(1, pos // page_size)
    return pages, pos % page_size


def append_(cache: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor],
            new: torch.Tensor) -> None:
    """Write ``new`` (batch, seqlen, heads, head_dim) into ``cache`` at ``slots`` in place."""
    cache.index_put_(slots, new.to(cache.dtype))


def room_faults(lengths: torch.Tensor, seqlen: int, capacity: int,
                block_table: torch.Tensor | None, pages: int) -> list[tuple[str, torch.Tensor]]:
    """Device-side tests (read back together) that appending ``seqlen`` tokens after
    ``lengths`` stays inside the cache: an index_put_ out of range is a device fault."""
    end = lengths.to(torch.int64) + seqlen
    over = f"cache_seqlens + the {seqlen} new tokens is over the cache's {capacity} positions"
    faults = [("cache_seqlens must be >= 0", (lengths < 0).any()), (over, (end > capacity).any())]
    if block_table is not None:
        page_size = capacity // max(block_table.shape[1], 1)
        reach = (end.clamp(0, capacity) + page_size - 1) // page_size
        page_ids = torch.arange(block_table.shape[1], device=block_table.device)
        used = page_ids[None, :] < reach[:, None]
        faults.append((f"a block_table entry the new tokens use is outside 0..{pages - 1}",
                       (used & ((block_table < 0) | (block_table >= pages))).any()))
    return faults


def row_faults(rows: torch.Tensor, n_rows: int) -> list[tuple[str, torch.Tensor]]:
    """Device-side test that cache_batch_idx names rows of the cache."""
    return [(f"cache_batch_idx must be in 0..{n_rows - 1}",
             ((rows < 0) | (rows >= n_rows)).any())]


def leftpad_faults(start: torch.Tensor, lengths: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Device-side tests that each row's keys start inside it: 0 <= cache_leftpad <=
    cache_seqlens."""
    return [("cache_leftpad must be in 0..cache_seqlens",
             ((start < 0) | (start > lengths)).any())]


def dense_as_pages(cache: torch.Tensor, rows: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense cache (batch_cache, seqlen_cache, heads, head_dim) as ``attention_paged``'s
    (pages, page_size, heads, head_dim) view of the same memory and the (batch, pages per row)
    int32 block table that maps batch entry b onto cache row ``rows[b]`` (``dense_pages`` for
    one cache)."""
    pages, _, table = dense_pages(cache, cache, rows, rows.shape[0])
    return pages, table


_identity_tables: dict[tuple, torch.Tensor] = {}


def dense_pages(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor | None,
                batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense K and V caches (batch_cache, seqlen_cache, heads, head_dim) as ``attention_paged``'s
    (pages, page_size, heads, head_dim) views of their memory, and the (batch, pages per row)
    int32 block table, one for both, that maps batch entry b onto cache row ``rows[b]`` (None:
    row b). The largest page size of the compiled-in copy passes that divides a row is used where
    both views exist; else a row is one page (read a key at a time). The table of ``rows=None``
    is made once per device and shape (outside graph captures, whose tensors hold their values
    only once replayed)."""
    n_rows, seqlen = k_cache.shape[:2]
    page = next((p for p in _FAST_PAGE_SIZES if seqlen % p == 0), None)
    if page is None or any(c.stride(0) != seqlen * c.stride(1) for c in (k_cache, v_cache)):
        page = seqlen  # the caches themselves: a page a row
    per_row = seqlen // page
    k_pages, v_pages = (c.view(n_rows * per_row, page, *c.shape[2:]) if per_row > 1 else c
                        for c in (k_cache, v_cache))
    device = k_cache.device
    if rows is not None:
        first = rows.to(torch.int32)[:, None] * per_row
        return k_pages, v_pages, first + torch.arange(per_row, dtype=torch.int32, device=device)
    key = (device, batch, per_row)
    table = _identity_tables.get(key)
    if table is None:
        table = torch.arange(batch * per_row, dtype=torch.int32, device=device).view(batch,
                                                                                     per_row)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            if len(_identity_tables) >= 64:
                _identity_tables.clear()
            _identity_tables[key] = table
    return k_pages, v_pages, table


def dense_as_key_pages(cache: torch.Tensor, rows: torch.Tensor, start: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense cache (batch_cache, seqlen_cache, heads, head_dim) as pages of one key each, and
    the (batch, seqlen_cache) int32 block table whose row b lists cache row ``rows[b]``'s keys
    from position ``start[b]`` on: ``attention_paged`` then reads each row's keys from its own
    first one (FlashAttention's ``cache_leftpad``), a key at a time. The view shares the cache's
    memory where its rows are contiguous with one another; else the pages are a copy. Entries
    past a row's end point at the cache's last key (no call reads them)."""
    n_rows, seqlen = cache.shape[:2]
    shape = (n_rows * seqlen, 1, *cache.shape[2:])
    pages = (cache.view(shape) if cache.stride(0) == seqlen * cache.stride(1)
             else cache.reshape(shape))
    first = rows.to(torch.int64) * seqlen + start.to(torch.int64)
    keys = torch.arange(seqlen, device=cache.device)
    table = (first[:, None] + keys).clamp_(0, n_rows * seqlen - 1).to(torch.int32)
    return pages, table


__all__ = ["append_", "apply_rotary", "as_lengths", "check_new_keys", "check_rotary",
           "dense_as_key_pages", "dense_as_pages", "dense_pages", "dense_slots", "leftpad_faults",
           "paged_slots", "positions", "room_faults", "row_faults"]
