"""Which global positions each rank holds, and which (query, key) blocks a step computes.

``contiguous``: rank r holds one run of positions, ranks in order (lengths may differ).
``zigzag``: the sequence is cut into 2N equal chunks and rank r holds chunks r and 2N-1-r
(Llama 3's causal load balancing: every rank gets the same amount of unmasked work).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Block:
    """One attention call of a ring step: local query rows x local key rows, causal or full."""

    q: slice
    k: slice
    causal: bool


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def plan_blocks(layout: str, causal: bool, rank: int, src: int, sq: int, sk: int) -> list[Block]:
    """The calls that attend rank ``rank``'s sq queries to rank ``src``'s sk keys.

    Causal (queries and keys at the same positions on each rank): a key chunk wholly before the
    query chunk is full, the same chunk is causal (equal lengths: top-left is bottom-right),
    wholly after is skipped. In zigzag, src < rank: both query chunks see src's first chunk in
    full and not its second; src > rank: only the second query chunk sees src, all of it; src ==
    rank: top-left causal over the two chunks is exactly the mask (the first query chunk does not
    see the second key chunk, the second sees all of the first).
    """
    every = slice(0, sq)
    if sq == 0 or sk == 0:
        return []
    if not causal:
        return [Block(every, slice(0, sk), False)]
    if src == rank:
        return [Block(every, slice(0, sk), True)]
    if layout == "contiguous":
        return [Block(every, slice(0, sk), False)] if src < rank else []
    if src < rank:
        return [Block(every, slice(0, sk // 2), False)]
    return [Block(slice(sq // 2, sq), slice(0, sk), False)]


def shard_zigzag(x: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of ``x`` along ``dim``: chunks rank and 2*world-1-rank of
    2*world equal chunks, concatenated (the length must divide by 2*world)."""
    n = x.shape[dim]
    if world <= 0 or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world), got rank={rank}, world={world}")
    if n % (2 * world):
        raise ValueError(f"x: length {n} along dim {dim} does not split into 2*world = "
                         f"{2 * world} equal chunks")
    c = n // (2 * world)
    chunks = [x.narrow(dim, i * c, c) for i in range(2 * world)]
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def unshard_zigzag(parts: list[torch.Tensor], world: int, dim: int = 2) -> torch.Tensor:
    """The full tensor from every rank's zigzag shard (``parts[r]`` from rank r)."""
    if len(parts) != world:
        raise ValueError(f"parts: expected {world} shards (one per rank), got {len(parts)}")
    chunks: list[torch.Tensor | None] = [None] * (2 * world)
    for r, part in enumerate(parts):
        if part.shape[dim] % 2:
            raise ValueError(f"parts[{r}]: odd length {part.shape[dim]} along dim {dim}")
        half = part.shape[dim] // 2
        chunks[r] = part.narrow(dim, 0, half)
        chunks[2 * world - 1 - r] = part.narrow(dim, half, half)
    return torch.cat(chunks, dim=dim)


def shard_contiguous(x: torch.Tensor, lengths: list[int], rank: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s contiguous shard of ``x`` along ``dim``, shards of ``lengths`` in order."""
    if sum(lengths) != x.shape[dim]:
        raise ValueError(f"lengths sum to {sum(lengths)}, x has {x.shape[dim]} along dim {dim}")
    return x.split(lengths, dim=dim)[rank]
