"""Merging partial attention results by their log-sum-exp."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax-normalised partial outputs (..., S, D) over disjoint key sets, with
    their natural-log LSEs (..., S), into the output and LSE over the union.

    Rescaling is against m = max(lse_a, lse_b), so one weight is exactly 1 and nothing overflows;
    a row that is -inf on both sides (no key seen yet) keeps out 0 and lse -inf, without NaN.
    Computed in the inputs' dtype (callers pass float32 or float64).
    """
    m = torch.maximum(lse_a, lse_b)
    safe = torch.where(m == -math.inf, torch.zeros_like(m), m)  # exp(-inf - 0) = 0, not NaN
    w_a, w_b = torch.exp(lse_a - safe), torch.exp(lse_b - safe)
    total = w_a + w_b
    lse = safe + torch.log(total)  # log(0) = -inf on rows that saw no key
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out = (out_a * (w_a / denom).unsqueeze(-1)) + (out_b * (w_b / denom).unsqueeze(-1))
    return out, lse


@dataclass
class Partial:
    """The running result of one rank's queries: output and LSE in the accumulation dtype."""

    out: torch.Tensor  # (B, H, S_q, D_v)
    lse: torch.Tensor  # (B, H, S_q)

    @classmethod
    def empty(cls, q: torch.Tensor, head_dim_v: int, dtype: torch.dtype) -> Partial:
        b, h, s, _ = q.shape
        return cls(q.new_zeros((b, h, s, head_dim_v), dtype=dtype),
                   q.new_full((b, h, s), -math.inf, dtype=dtype))

    def add(self, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge a block's (out, lse) for query rows ``rows`` into the running result."""
        o, s = merge_partials(self.out[:, :, rows], self.lse[:, :, rows],
                              out.to(self.out.dtype), lse.to(self.lse.dtype))
        self.out[:, :, rows] = o
        self.lse[:, :, rows] = s


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs, float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)
