"""What a (batch, L) boolean padding mask means to the kernels, worked out once per mask.

A model builds one padding mask a forward and every layer receives it, so what the mask implies
(the offsets that unpad a batch; the table of each row's kept keys) is made at the first layer
and taken by the others. The memo holds the mask itself: a mask is found again by identity
(and its version counter, so an in-place change is a new mask), never by an address that could
be reused.

* ``unpadding``: the kept tokens' indices and int32 ``cu_seqlens`` of the keys and of the last
  ``seqlen_q`` columns (the queries), with their longest lengths: what ``attention_varlen``
  takes. The two lengths are read on the host (synchronisations), once per mask.
* ``kept_keys``: a view of a (batch, heads, L, head_dim) K or V tensor as pages of one key and
  the (batch, L) int32 block table listing each row's kept keys first, in order, with their
  count: ``attention_paged`` then reads only the kept keys, from the tensor's own memory, with
  no copy and no synchronisation.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch


class Unpadding(NamedTuple):
    keys: torch.Tensor  # (kept keys,) indices into the (batch * L) tokens
    cu_keys: torch.Tensor  # (batch + 1,) int32
    max_keys: int
    queries: torch.Tensor  # (kept queries,) indices into the (batch * seqlen_q) tokens
    cu_queries: torch.Tensor
    max_queries: int


class KeptKeys(NamedTuple):
    table: torch.Tensor  # (batch, L) int32: row b's kept keys as pages of ``key_pages``
    lengths: torch.Tensor  # (batch,) int32: how many keys row b keeps


_memo = threading.local()  # one entry per kind: (what it was made from, what was made)


def _remembered(kind: str, mask: torch.Tensor, extra: tuple, make):
    if torch.compiler.is_compiling():  # a traced graph computes it (and may share it itself)
        return make()
    held = getattr(_memo, kind, None)
    if held is not None and held[0] is mask and held[1] == (mask._version, *extra):
        return held[2]
    made = make()
    setattr(_memo, kind, (mask, (mask._version, *extra), made))
    return made


def _offsets(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    lens = keep.sum(-1, dtype=torch.int32)
    cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    return keep.flatten().nonzero().flatten(), cu, int(lens.max()) if lens.numel() else 0


def unpadding(mask: torch.Tensor, seqlen_q: int) -> Unpadding:
    """The varlen offsets of ``mask`` (batch, L) bool, queries its last ``seqlen_q`` columns."""
    def make() -> Unpadding:
        return Unpadding(*_offsets(mask), *_offsets(mask[:, mask.shape[1] - seqlen_q:]))
    return _remembered("unpadding", mask, (seqlen_q,), make)


def key_row_step(t: torch.Tensor) -> int | None:
    """Pages of one key between row b and row b + 1 of a (batch, heads, L, head_dim) tensor
    (None: its rows are not a whole number of key strides apart, so no one-key page view)."""
    step, key = t.stride(0), t.stride(2)
    if t.shape[0] < 2:
        return 0
    return step // key if key > 0 and step % key == 0 else None


def key_pages(t: torch.Tensor) -> torch.Tensor:
    """``t`` (batch, heads, L, head_dim) as ``attention_paged``'s (pages, 1, heads, head_dim):
    page ``b * key_row_step(t) + j`` is key j of row b (pages in between, other heads' keys
    or unused memory, are never in a table). A view of t's own memory."""
    batch, heads, length, dim = t.shape
    step = key_row_step(t)
    pages = (batch - 1) * step + length
    return t.as_strided((pages, 1, heads, dim), (t.stride(2), t.stride(2), t.stride(1),
                                                 t.stride(3)))


def kept_keys(mask: torch.Tensor, row_step: int) -> KeptKeys:
    """The table of ``key_pages`` (rows ``row_step`` pages apart) that lists each row's kept
    keys of ``mask`` (batch, L) bool, in order, and their counts. No synchronisation."""
    def make() -> KeptKeys:
        # a stable sort of "dropped" puts each row's kept keys first, in their order
        order = torch.sort(mask.logical_not().to(torch.uint8), dim=1, stable=True).indices
        first = torch.arange(mask.shape[0], device=mask.device)[:, None] * row_step
        return KeptKeys((order + first).to(torch.int32), mask.sum(-1, dtype=torch.int32))
    return _remembered("kept_keys", mask, (row_step,), make)


__all__ = ["KeptKeys", "Unpadding", "kept_keys", "key_pages", "key_row_step", "unpadding"]
