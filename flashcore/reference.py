"""Float64 attention: the ground truth the kernels are tested against.

Straight softmax(scale * Q K^T) V with no tiling or online rescaling, so it is easy to trust.
"""

from __future__ import annotations

import math

import torch


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    device: torch.device | str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of (B, H, S, D) inputs, computed and returned in float64.

    ``causal`` follows torch's ``is_causal``: top-left aligned, query i sees key j iff j <= i
    (also when S_q != S_k). A query that sees no key gets output 0 and lse -inf. ``lse`` is the
    natural log of the softmax denominator, shape (B, H, S_q). Work happens on ``device``
    (default: the CPU), where the results are returned.
    """
    _check_shapes(q, k, v)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    q, k, v = (t.detach().to(device=dev, dtype=torch.float64) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)

    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        i = torch.arange(sq, device=dev).unsqueeze(1)
        j = torch.arange(sk, device=dev).unsqueeze(0)
        scores = scores.masked_fill(j > i, -math.inf)

    # Subtract the row max for range; a row with no visible key has max -inf, use 0 there so
    # exp gives 0 rather than exp(-inf - -inf) = NaN.
    if scores.shape[-1]:
        row_max = scores.amax(dim=-1, keepdim=True)
    else:
        row_max = scores.new_full((*scores.shape[:-1], 1), -math.inf)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p, v) / torch.where(denom > 0, denom, torch.ones_like(denom))
    if not return_lse:
        return out
    lse = (row_max + torch.log(denom)).squeeze(-1)  # log(0) = -inf for empty rows
    return out, lse


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, heads, seq, dim), got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"batch and heads differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v sequence lengths differ: {k.shape[2]} vs {v.shape[2]}")
