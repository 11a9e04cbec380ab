"""The context-parallel ops: ring or all-gather forward, one ring backward (autograd).

Every rank calls an op with its shard of q, k, v (batch, heads, seq_shard, head_dim) and gets
the output rows of its own queries. ``layout``: "contiguous" (rank r holds positions after rank
r-1's; lengths may differ between ranks) or "zigzag" (``shard_zigzag``: equal causal work on
every rank). Causal needs q and k sharded alike. K/V may have fewer heads (GQA). Partial results
merge by their LSE in float32 (float64 for float64 inputs); ``return_lse`` also returns the
merged natural-log LSE (batch, heads, seq_shard) in that dtype. ``attention_fn`` and
``backward_fn`` default to ``flashcore.ops.attention`` and ``attention_backward``; every block
they see is full or top-left causal.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .backward import BackwardFn, resolve_backward_fn, ring_backward
from .common import AttentionFn, Shards, start
from .gather import all_gather_forward, prefers_all_gather
from .ring import ring_forward

METHODS = ("auto", "ring", "all_gather")
Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class _ContextParallel(torch.autograd.Function):
    """The forward by ``forward_impl``; the backward always by the ring (``ring_backward``)."""

    @staticmethod
    def forward(ctx, q, k, v, forward_impl: Forward, fn: AttentionFn, backward_fn: BackwardFn,
                scale: float, shards: Shards, causal: bool, group, layout: str):
        out, lse = forward_impl(q, k, v, fn=fn, scale=scale, shards=shards, causal=causal,
                                group=group, layout=layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)  # an unused LSE's gradient stays None: no dlse term
        ctx.args = (backward_fn, scale, shards, causal, group, layout)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        backward_fn, scale, shards, causal, group, layout = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        dlse = None if dlse is None else dlse.to(lse.dtype)
        # the block backward takes the forward's LSE in float32 (float64 for float64 inputs)
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, dlse, causal=causal,
                                   scale=scale, group=group, layout=layout, shards=shards,
                                   backward_fn=backward_fn)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def _run(forward_impl: Forward, q, k, v, *, causal, softmax_scale, group, layout, return_lse,
         attention_fn, backward_fn):
    fn, scale, shards = start(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group,
                              layout=layout, attention_fn=attention_fn)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = _ContextParallel.apply(q, k, v, forward_impl, fn,
                                          resolve_backward_fn(backward_fn), scale, shards,
                                          causal, group, layout)
    else:
        out, lse = forward_impl(q, k, v, fn=fn, scale=scale, shards=shards, causal=causal,
                                group=group, layout=layout)
    return (out, lse) if return_lse else out


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    return_lse: bool = False,
    attention_fn: AttentionFn | None = None,
    backward_fn: BackwardFn | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of sequence-sharded q, k, v over ``group`` (the module's conventions): K/V
    shards travel around the ring while each rank attends its own queries to the shard in hand
    (the next transfer is posted before computing on it). Differentiable: the backward passes
    K/V around again with their gradients."""
    return _run(ring_forward, q, k, v, causal=causal, softmax_scale=softmax_scale, group=group,
                layout=layout, return_lse=return_lse, attention_fn=attention_fn,
                backward_fn=backward_fn)


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    return_lse: bool = False,
    attention_fn: AttentionFn | None = None,
    backward_fn: BackwardFn | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``ring_attention``'s result by all-gathering K and V, then attending locally: cheap when
    K/V are small (GQA with few K/V heads), at the memory of the whole sequence's K/V per rank.
    The backward is the ring's."""
    return _run(all_gather_forward, q, k, v, causal=causal, softmax_scale=softmax_scale,
                group=group, layout=layout, return_lse=return_lse, attention_fn=attention_fn,
                backward_fn=backward_fn)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    method: str = "auto",
    **kwargs,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``ring_attention`` or ``all_gather_attention`` (same keyword arguments): ``method="auto"``
    picks by ``prefers_all_gather``; "ring" and "all_gather" force one."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "all_gather" or (method == "auto" and prefers_all_gather(q, k, v)):
        return all_gather_attention(q, k, v, **kwargs)
    return ring_attention(q, k, v, **kwargs)
