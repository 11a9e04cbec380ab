"""Attention in plain torch for the calls the kernels do not take (a 4-D mask, dropout, float32
inputs, a backward flashcore lacks): torch's SDPA, or the logits written out where a soft-cap
is asked for. The masks are the ones ``flashcore.integrations.transformers`` receives."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def keep_mask(mask, seqlen_q: int, seqlen_k: int, causal: bool,
              window: tuple[int, int] | None, device: torch.device) -> torch.Tensor | None:
    """The boolean (batch or 1, 1, seqlen_q, seqlen_k) mask of which keys each query sees.

    ``mask`` is None (every key valid), a (batch,) count of valid leading keys, a (batch, L)
    padding mask (L <= seqlen_k; keys past L are invalid) or a 4-D mask (returned as is, with
    ``causal`` and ``window`` already in it). Queries are the last seqlen_q positions of each
    row's valid length (the causal diagonal and the window sit bottom-right)."""
    if mask is not None and mask.dim() == 4:
        return mask
    j = torch.arange(seqlen_k, device=device)
    if mask is None:
        valid = torch.full((1,), seqlen_k, device=device)
        keep = torch.ones((1, seqlen_k), dtype=torch.bool, device=device)
    elif mask.dim() == 1:
        valid = mask.to(device=device, dtype=torch.int64)
        keep = j[None, :] < valid[:, None]
    else:
        pad = mask.to(device=device, dtype=torch.bool)
        valid = torch.full((pad.shape[0],), pad.shape[1], device=device)
        keep = F.pad(pad, (0, seqlen_k - pad.shape[1]), value=False)
    if not causal and window is None:
        return keep[:, None, None, :]
    qpos = (valid[:, None] - seqlen_q + torch.arange(seqlen_q, device=device))[:, :, None]
    rows = keep[:, None, :].expand(-1, seqlen_q, -1)
    if causal:
        rows = rows & (j <= qpos)
    if window is not None:
        left, right = window
        if left >= 0:
            rows = rows & (j >= qpos - left)
        if right >= 0:
            rows = rows & (j <= qpos + right)
    return rows[:, None]


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              keep: torch.Tensor | None, scale: float | None, softcap: float | None,
              dropout: float, training: bool) -> torch.Tensor:
    """(batch, heads, seqlen_q, head_dim) attention with ``keep`` (boolean, or an additive
    float mask), GQA by repeating K/V heads. A query row that sees no key gives 0 (as the
    kernels do), never NaN."""
    heads = query.shape[1]
    if key.shape[1] != heads:
        key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    empty = None
    if keep is not None and keep.dtype == torch.bool:
        empty = ~keep.any(-1, keepdim=True)
        keep = keep | empty  # a row with no key would be NaN: computed over all, then zeroed
    p = dropout if training else 0.0
    if softcap is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=keep, dropout_p=p,
                                             scale=scale)
    else:
        s = (query @ key.transpose(-1, -2)).float() * scale
        s = softcap * torch.tanh(s / softcap)
        if keep is not None:
            s = s.masked_fill(~keep, -math.inf) if keep.dtype == torch.bool else s + keep
        w = F.dropout(torch.softmax(s, dim=-1), p).to(value.dtype)
        out = w @ value
    return out if empty is None else out.masked_fill(empty, 0.0)


__all__ = ["attention", "keep_mask"]
