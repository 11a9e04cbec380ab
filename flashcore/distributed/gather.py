"""All-gather attention's forward (gather every rank's K/V, then local calls per query chunk)
and the choice between it and the ring."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .common import AttentionFn, Shards
from .layout import unshard_zigzag
from .merge import accumulation_dtype, merge_partials


def _gather_sequence(x: torch.Tensor, lengths: list[int], group: dist.ProcessGroup | None,
                     layout: str) -> torch.Tensor:
    """The whole sequence of ``x`` (batch, heads, seq_shard, dim) in global order."""
    longest = max(lengths)
    pad = longest - x.shape[2]
    if pad:  # all_gather needs equal sizes: pad the shorter shards, cut after
        x = torch.cat([x, x.new_zeros((*x.shape[:2], pad, x.shape[3]))], dim=2)
    parts = [torch.empty_like(x) for _ in lengths]
    dist.all_gather(parts, x.contiguous(), group=group)
    parts = [p[:, :, :n] for p, n in zip(parts, lengths)]
    if layout == "zigzag":
        return unshard_zigzag(parts, len(parts))
    return torch.cat(parts, dim=2)


def _query_chunks(layout: str, shards: Shards, rank: int) -> list[tuple[slice, int]]:
    """(local query rows, number of global keys up to and including the chunk's last query)."""
    sq = shards.q[rank]
    if layout == "zigzag":
        c, world = sq // 2, len(shards.q)
        return [(slice(0, c), (rank + 1) * c), (slice(c, sq), (2 * world - rank) * c)]
    return [(slice(0, sq), shards.q_offset(rank) + sq)]


def _causal_chunk(fn: AttentionFn, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                  end: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a query chunk at global positions end - len .. end - 1 under a causal
    mask: its diagonal block and, merged in the accumulation dtype, the keys before it."""
    start_ = end - q.shape[2]
    out, lse = fn(q, k_all[:, :, start_:end], v_all[:, :, start_:end], causal=True,
                  softmax_scale=scale, return_lse=True, mask_align="top_left")
    if start_ == 0:
        return out, lse
    before, lse_before = fn(q, k_all[:, :, :start_], v_all[:, :, :start_], causal=False,
                            softmax_scale=scale, return_lse=True, mask_align="top_left")
    acc = accumulation_dtype(q.dtype)
    return merge_partials(out.to(acc), lse.to(acc), before.to(acc), lse_before.to(acc))


def all_gather_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, fn: AttentionFn,
                       scale: float, shards: Shards, causal: bool,
                       group: dist.ProcessGroup | None, layout: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ring_forward``'s result by all-gathering K and V, then attending locally. Causal: each
    contiguous query chunk (one for "contiguous", two for "zigzag") attends to the keys at its
    own positions with a top-left diagonal (S_q = S_k) and to every key before them in full,
    the two merged by their LSE: the masks the fastest kernels build, where one bottom-right
    call over the prefix would not run on them everywhere."""
    rank = dist.get_rank(group)
    k_all, v_all = (_gather_sequence(t, shards.k, group, layout) for t in (k, v))

    if not causal:
        out, lse = fn(q, k_all, v_all, causal=False, softmax_scale=scale, return_lse=True,
                      mask_align="top_left")
    else:
        outs, lses = [], []
        for rows, end in _query_chunks(layout, shards, rank):
            o, s = _causal_chunk(fn, q[:, :, rows], k_all, v_all, end, scale)
            outs.append(o)
            lses.append(s)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
    return out.to(q.dtype), lse.to(accumulation_dtype(q.dtype))


def prefers_all_gather(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The ``method="auto"`` rule: all-gather when one token's K and V bytes are no more than its
    Q bytes (GQA with at least two query heads per K/V head, at equal head dims).

    Both move the same (N-1) shards of K/V per rank; the ring hides it behind compute but merges
    a Q-sized float32 accumulator every step, which outweighs an exposed gather of K/V no larger
    than Q. Per-token bytes are the same on every rank, so all ranks choose alike.
    """
    kv = k.shape[1] * k.shape[3] * k.element_size() + v.shape[1] * v.shape[3] * v.element_size()
    return kv <= q.shape[1] * q.shape[3] * q.element_size()
