"""Float64 attention: the ground truth the kernels are tested against.

Straight softmax(scale * Q K^T) V with no tiling or online rescaling, so it is easy to trust.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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
    p_round: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of (B, H, S, D) inputs, computed and returned in float64.

    ``causal`` follows torch's ``is_causal``: top-left aligned, query i sees key j iff j <= i
    (also when S_q != S_k). A query that sees no key gets output 0 and lse -inf. ``lse`` is the
    natural log of the softmax denominator, shape (B, H, S_q). Work happens on ``device``
    (default: the CPU), where the results are returned. ``p_round``, if given, is applied to the
    unnormalised probabilities exp(s - rowmax) in the P·V product only (not the denominator).
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
    pv = p if p_round is None else p_round(p)  # the numerator's P may be rounded (FP8 kernels)
    out = torch.matmul(pv, v) / torch.where(denom > 0, denom, torch.ones_like(denom))
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


# -- FP8 (E4M3) -------------------------------------------------------------------------------------
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-30  # as the quantiser kernel: an all-zero head still gets a finite scale
P_SCALE = 256.0  # the FP8 kernel multiplies P by this before rounding it to e4m3


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to float8_e4m3fn (nearest-even, saturating at ±448); float64 out."""
    x = x.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX)
    return x.to(torch.float8_e4m3fn).to(torch.float64)


def quantize_e4m3(x: torch.Tensor, granularity: str = "head") -> tuple[torch.Tensor, torch.Tensor]:
    """The quantiser's arithmetic, simulated: per (batch, head), or per token, of a (B, H, S, D)
    tensor: amax in float32, scale = 448 / amax, e4m3(x * scale). Returns (codes as float64,
    float32 descale of shape (B, H) or (B, H, S)), so that x ≈ codes * descale."""
    xf = x.detach().to(device="cpu", dtype=torch.float32)
    dims = (2, 3) if granularity == "head" else (3,)
    amax = xf.abs().amax(dim=dims, keepdim=True).clamp_min(AMAX_FLOOR)
    scale = torch.tensor(E4M3_MAX, dtype=torch.float32) / amax
    codes = e4m3_round(xf * scale)
    descale = amax / E4M3_MAX
    return codes, descale.reshape(descale.shape[: 4 - len(dims)])


def dequantize_e4m3(codes: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    d = descale.to(torch.float64)
    return codes.to(torch.float64) * d.reshape(*d.shape, *([1] * (4 - d.dim())))


def attention_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    round_p: bool = True,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Float64 attention of the FP8 kernel's quantised computation: q and k quantised per token
    and v per head as the quantiser does (same scales, e4m3 rounding), and, with ``round_p``, P
    rounded to e4m3 after scaling by P_SCALE (relative to the final row max; the kernel uses the
    running max, so the two round P differently by at most one e4m3 step)."""
    deq = [dequantize_e4m3(*quantize_e4m3(t, g)) for t, g in ((q, "token"), (k, "token"), (v, "head"))]

    def rp(p: torch.Tensor) -> torch.Tensor:
        return e4m3_round(p * P_SCALE).to(p.device) / P_SCALE

    return attention(*deq, causal=causal, softmax_scale=softmax_scale, device=device,
                     p_round=rp if round_p else None)
