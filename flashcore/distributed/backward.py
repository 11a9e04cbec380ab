"""The backward of context-parallel attention: K/V shards travel the ring again, each with the
float32 gradients gathered for it so far, and every rank adds what its queries contribute.

A block's gradients need only the forward's merged output and LSE: with them the block's
probabilities are the global ones (P = exp(S - lse)), so the sum of the blocks' (dQ, dK, dV) is
the whole attention's gradient, whichever method (ring or all-gather) ran the forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .common import Shards, peer
from .layout import plan_blocks
from .merge import accumulation_dtype
from .ring import post_exchange

# (dout, q, k, v, out, lse, *, causal=, softmax_scale=, dlse=) -> (dq, dk, dv), top-left masks
BackwardFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def resolve_backward_fn(backward_fn: BackwardFn | None) -> BackwardFn:
    if backward_fn is not None:
        return backward_fn
    from ..ops.backward import attention_backward  # imported on use, as the forward's

    def flashcore_backward(dout, q, k, v, out, lse, *, causal, softmax_scale, dlse=None):
        return attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, dlse=dlse)

    return flashcore_backward


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None, *,
                  causal: bool, scale: float, group: dist.ProcessGroup | None, layout: str,
                  shards: Shards, backward_fn: BackwardFn
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this rank's shards. At step s the rank holds rank (r - s)'s K/V and the
    gradients of it that ranks r - s .. r - 1 added; it adds its own and passes both on. After
    the last step each K/V's gradients, complete, are one hop from home."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    send_to, recv_from = peer(group, (rank + 1) % world), peer(group, (rank - 1) % world)
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    grads = None  # the incoming (dk, dv) of the K/V in hand, and its transfer
    for step in range(world):
        src = (rank - step) % world
        pending = None
        if step + 1 < world:
            pending = post_exchange(k_cur, v_cur, shards.k[(src - 1) % world], send_to,
                                    recv_from, group)
        dk = torch.zeros(k_cur.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v_cur.shape, dtype=acc, device=q.device)
        for blk in plan_blocks(layout, causal, rank, src, q.shape[2], k_cur.shape[2]):
            # views: the backward copies only what its kernels cannot read as it is
            g_out, q_blk, out_blk, lse_blk = (t[:, :, blk.q] for t in (dout, q, out, lse))
            dlse_blk = None if dlse is None else dlse[:, :, blk.q]
            bq, bk, bv = backward_fn(g_out, q_blk, k_cur[:, :, blk.k], v_cur[:, :, blk.k],
                                     out_blk, lse_blk, causal=blk.causal, softmax_scale=scale,
                                     dlse=dlse_blk)
            dq[:, :, blk.q] += bq
            dk[:, :, blk.k] += bk
            dv[:, :, blk.k] += bv
        if grads is not None:  # what the ranks before added to this K/V
            got_k, got_v = grads.wait()
            dk += got_k
            dv += got_v
        if world > 1:  # on to the next rank, with the next K/V's from the one before
            grads = post_exchange(dk, dv, shards.k[(src - 1) % world], send_to, recv_from,
                                  group)
        if pending is not None:
            k_cur, v_cur = pending.wait()
    if world > 1:
        dk, dv = grads.wait()  # this rank's own K/V, back from its last visit
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
