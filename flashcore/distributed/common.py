"""What the context-parallel ops share: argument checks, every rank's shard lengths, the
attention call of one block."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .layout import check_layout

# (q, k, v, causal=, softmax_scale=, return_lse=True, mask_align=) -> (out, lse)
AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def resolve_attention_fn(attention_fn: AttentionFn | None) -> AttentionFn:
    if attention_fn is not None:
        return attention_fn
    from ..ops import attention  # imported on use: the CPU path with an injected fn needs no DSL

    return attention


def resolve_scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


@dataclass(frozen=True)
class Shards:
    """Every rank's local query and key/value lengths (index: rank in the group)."""

    q: list[int]
    k: list[int]

    def q_offset(self, rank: int) -> int:
        return sum(self.q[:rank])


def gather_lengths(q: torch.Tensor, k: torch.Tensor, group: dist.ProcessGroup | None) -> Shards:
    """Every rank's (S_q, S_k): one small all-gather, so that receive buffers can be sized and
    every rank validates the same facts (raising on all ranks, never leaving peers hanging)."""
    mine = torch.tensor([q.shape[2], k.shape[2]], dtype=torch.int64, device=q.device)
    got = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, mine, group=group)
    pairs = torch.stack(got).tolist()
    return Shards([p[0] for p in pairs], [p[1] for p in pairs])


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, heads, seq_shard, head_dim), got shape "
                             f"{tuple(t.shape)}")
    if (q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or k.shape[1] == 0
            or q.shape[1] % k.shape[1]):
        raise ValueError(f"k and v must match each other and q's batch, with a divisor of q's "
                         f"heads: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")


def check_shards(shards: Shards, layout: str, causal: bool) -> None:
    """Causal needs each rank's queries and keys at the same positions (self-attention);
    zigzag needs equal, even shards (two equal chunks per rank)."""
    check_layout(layout)
    if causal and shards.q != shards.k:
        raise ValueError(f"causal: q and k must be sharded alike (queries and keys at the same "
                         f"positions), got q lengths {shards.q} and k lengths {shards.k}")
    if layout == "zigzag" and (len(set(shards.q)) != 1 or len(set(shards.k)) != 1
                               or shards.q[0] % 2 or shards.k[0] % 2):
        raise ValueError(f"layout='zigzag': every rank needs the same even shard length, got q "
                         f"lengths {shards.q} and k lengths {shards.k}")


def peer(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank P2P ops address, of a rank in ``group``."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def start(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
          softmax_scale: float | None, group: dist.ProcessGroup | None, layout: str,
          attention_fn: AttentionFn | None) -> tuple[AttentionFn, float, Shards]:
    """What both context-parallel ops begin with: the checks, the attention call, the scale and
    every rank's shard lengths (a collective: every rank of ``group`` calls it)."""
    check_layout(layout)
    check_inputs(q, k, v)
    fn = resolve_attention_fn(attention_fn)
    scale = resolve_scale(q, softmax_scale)
    shards = gather_lengths(q, k, group)
    check_shards(shards, layout, causal)
    return fn, scale, shards
