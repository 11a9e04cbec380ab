"""A benchmark case: the shape of one attention call (``python -m flashcore.bench``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    """(batch, heads, seq, head_dim): ``seq`` keys; ``seq_q`` queries (default ``seq``);
    ``kv_heads`` K/V heads (default ``heads``: grouped-query attention when fewer)."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool = False
    dtype: str = "float16"
    kv_heads: int | None = None
    seq_q: int | None = None

    @property
    def sq(self) -> int:
        return self.seq if self.seq_q is None else self.seq_q

    @property
    def hkv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def decode(self) -> bool:
        return self.sq < self.seq

    @property
    def label(self) -> str:
        heads = f"{self.heads}" if self.hkv == self.heads else f"{self.heads}/{self.hkv}"
        seq = f"{self.seq}" if self.sq == self.seq else f"{self.sq}x{self.seq}"
        c = " causal" if self.causal else ""
        dt = "" if self.dtype == "float16" else f" {self.dtype}"
        return f"{self.batch},{heads},{seq},{self.head_dim}{c}{dt}"

    def flops(self) -> float:
        f = 4.0 * self.batch * self.heads * self.sq * self.seq * self.head_dim
        return f / 2 if self.causal and self.sq == self.seq else f

    def min_bytes(self, kv_bytes: int = 2) -> float:
        """Each input read once and the output written once."""
        qo = 2 * 2 * self.batch * self.heads * self.sq * self.head_dim
        return qo + 2 * kv_bytes * self.batch * self.hkv * self.seq * self.head_dim

    def inputs(self) -> tuple[torch.Tensor, ...]:
        dt = getattr(torch, self.dtype)

        def mk(h: int, s: int) -> torch.Tensor:
            return torch.randn(self.batch, h, s, self.head_dim, device="cuda", dtype=dt)

        return mk(self.heads, self.sq), mk(self.hkv, self.seq), mk(self.hkv, self.seq)
