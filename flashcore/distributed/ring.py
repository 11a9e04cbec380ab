"""Ring attention's forward: K/V shards travel around the ring while each rank attends its own
queries to the shard in hand, merging the partial results by their LSE."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .common import AttentionFn, Shards, peer
from .layout import plan_blocks
from .merge import Partial, accumulation_dtype


@dataclass
class _Exchange:
    """One step's K/V transfer in flight: the works to wait on and the buffers they fill."""

    works: list[dist.Work]
    k: torch.Tensor
    v: torch.Tensor

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        for w in self.works:
            w.wait()
        return self.k, self.v


def post_exchange(k: torch.Tensor, v: torch.Tensor, incoming: int, send_to: int, recv_from: int,
                   group: dist.ProcessGroup | None) -> _Exchange:
    """Send this K/V to the next rank and receive the previous rank's (``incoming`` keys)."""
    rk = k.new_empty((*k.shape[:2], incoming, k.shape[3]))
    rv = v.new_empty((*v.shape[:2], incoming, v.shape[3]))
    ops = [dist.P2POp(dist.isend, k, send_to, group), dist.P2POp(dist.isend, v, send_to, group),
           dist.P2POp(dist.irecv, rk, recv_from, group),
           dist.P2POp(dist.irecv, rv, recv_from, group)]
    return _Exchange(dist.batch_isend_irecv(ops), rk, rv)


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, fn: AttentionFn,
                 scale: float, shards: Shards, causal: bool, group: dist.ProcessGroup | None,
                 layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, merged LSE in the accumulation dtype) of this rank's queries: in N
    steps each rank attends to every rank's K/V, passed on to the next rank with
    ``batch_isend_irecv`` (the next transfer is posted before computing on the shard in hand),
    merging the partial results by their LSE."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    send_to, recv_from = peer(group, (rank + 1) % world), peer(group, (rank - 1) % world)

    acc = Partial.empty(q, v.shape[-1], accumulation_dtype(q.dtype))
    k_cur, v_cur = k.contiguous(), v.contiguous()
    for step in range(world):
        src = (rank - step) % world  # the rank whose K/V is in hand
        pending = None
        if step + 1 < world:
            incoming = shards.k[(src - 1) % world]
            pending = post_exchange(k_cur, v_cur, incoming, send_to, recv_from, group)
        for blk in plan_blocks(layout, causal, rank, src, q.shape[2], k_cur.shape[2]):
            out, lse = fn(q[:, :, blk.q], k_cur[:, :, blk.k], v_cur[:, :, blk.k],
                          causal=blk.causal, softmax_scale=scale, return_lse=True,
                          mask_align="top_left")
            acc.add(blk.q, out, lse)
        if pending is not None:
            k_cur, v_cur = pending.wait()
    return acc.out.to(q.dtype), acc.lse
