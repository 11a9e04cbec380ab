"""Float64 attention: the ground truth the kernels are tested against.

Straight softmax(scale * Q K^T) V with no tiling or online rescaling, so it is easy to trust.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .kernels.common.block_info import UNBOUNDED, KeyBounds, key_range


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
    mask_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of (B, H, S, D) inputs, computed and returned in float64.

    k and v may have fewer heads than q (grouped-query attention: query head h reads K/V head
    h // (Hq / Hkv)). ``causal`` follows torch's ``is_causal``: top-left aligned, query i sees key j iff j <= i
    (also when S_q != S_k). A query that sees no key gets output 0 and lse -inf. ``lse`` is the
    natural log of the softmax denominator, shape (B, H, S_q). Work happens on ``device``
    (default: the CPU), where the results are returned. ``p_round``, if given, is applied to the
    unnormalised probabilities exp(s - rowmax) in the P·V product only (not the denominator).
    Inputs that require grad keep their graph: autograd of this function is the float64
    reference of the backward.

    ``mask_align="bottom_right"`` shifts the diagonal by S_k - S_q (query i sees j <= i + S_k -
    S_q); ``window=(left, right)`` keeps keys i + shift - left <= j <= i + shift + right (-1: no
    limit; right is 0 when causal); ``softcap`` turns the scaled scores s into
    softcap * tanh(s / softcap) before the mask. ``alibi_slopes`` ((H,) or (B, H)) then adds
    -slope * |i + shift - j| to each score (ALiBi; the shift as the diagonal's).
    """
    _check_shapes(q, k, v)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    q, k, v = (t.to(device=dev, dtype=torch.float64) for t in (q, k, v))
    k, v = (_expand_heads(t, q.shape[1]) for t in (k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)

    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        sq, sk = scores.shape[-2:]
        shift = sk - sq if mask_align == "bottom_right" else 0
        i = torch.arange(sq, device=dev).unsqueeze(1) + shift
        j = torch.arange(sk, device=dev).unsqueeze(0)
        slopes = alibi_slopes.to(device=dev, dtype=torch.float64)
        slopes = slopes.expand(q.shape[0], q.shape[1])[:, :, None, None]
        scores = scores - slopes * (i - j).abs().to(torch.float64)
    if causal or window is not None:
        sq, sk = scores.shape[-2:]
        shift = sk - sq if mask_align == "bottom_right" else 0
        i = torch.arange(sq, device=dev).unsqueeze(1) + shift
        j = torch.arange(sk, device=dev).unsqueeze(0)
        hidden = torch.zeros((sq, sk), dtype=torch.bool, device=dev)
        if causal:
            hidden |= j > i
        if window is not None:
            left, right = window
            if right >= 0:
                hidden |= j > i + right
            if left >= 0:
                hidden |= j < i - left
        scores = scores.masked_fill(hidden, -math.inf)

    # Subtract the row max for range; a row with no visible key has max -inf, use 0 there so
    # exp gives 0 rather than exp(-inf - -inf) = NaN.
    if scores.shape[-1]:
        row_max = scores.amax(dim=-1, keepdim=True)
    else:
        row_max = scores.new_full((*scores.shape[:-1], 1), -math.inf)
    # the max only shifts the exponent (it cancels): no gradient flows through it
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    pv = p if p_round is None else p_round(p)  # the numerator's P may be rounded (FP8 kernels)
    out = torch.matmul(pv, v) / torch.where(denom > 0, denom, torch.ones_like(denom))
    if not return_lse:
        return out
    lse = (row_max + torch.log(denom)).squeeze(-1)  # log(0) = -inf for empty rows
    return out, lse


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
    """``attention`` of a packed batch (``flashcore.ops.attention_varlen``'s convention): q
    (total_q, H, D), k and v (total_k, Hkv, D), sequence b in rows cu[b] .. cu[b + 1]; ALiBi
    slopes of shape (batch, H) give sequence b row b. Returns
    float64 out (total_q, H, D) and, with ``return_lse``, lse (H, total_q)."""
    return_lse = kw.get("return_lse", False)
    cq, ck = (c.tolist() for c in (cu_seqlens_q, cu_seqlens_k))
    outs, lses = [], []
    def seq(t, cu, b):
        return t[cu[b]:cu[b + 1]].transpose(0, 1).unsqueeze(0)  # (1, H, S, D)

    for b in range(len(cq) - 1):
        r = attention(seq(q, cq, b), seq(k, ck, b), seq(v, ck, b), **_sequence_kw(kw, b))
        o, lse = r if return_lse else (r, None)
        outs.append(o[0].transpose(0, 1))
        lses.append(None if lse is None else lse[0])
    dev = outs[0].device if outs else torch.device(kw.get("device") or "cpu")
    out = (torch.cat(outs) if outs else torch.zeros(q.shape, dtype=torch.float64, device=dev))
    if not return_lse:
        return out
    lse = torch.cat(lses, dim=1) if lses else torch.zeros((q.shape[1], 0), dtype=torch.float64)
    return out, lse


def _sequence_kw(kw: dict, b: int) -> dict:
    """``attention``'s keywords for sequence ``b`` of a batch: its row of (batch, heads)
    ALiBi slopes."""
    slopes = kw.get("alibi_slopes")
    if slopes is None or slopes.dim() == 1:
        return kw
    return {**kw, "alibi_slopes": slopes[b]}


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, seqlen: int, b: int):
    """Sequence ``b``'s first ``seqlen`` keys of a paged cache (pages, page_size, Hkv, D), as
    (1, Hkv, seqlen, D)."""
    page_size = cache.shape[1]
    keys = torch.arange(seqlen)
    pages = block_table[b].cpu().long()[keys // page_size]
    return cache[pages.to(cache.device), (keys % page_size).to(cache.device)].transpose(0, 1)[None]


def attention_paged(q, k_cache, v_cache, block_table, seqlens_k, **kw):
    """``attention`` against a paged KV cache (``flashcore.ops.attention_paged``'s convention)
    for a dense q (B, H, S_q, D): sequence b attends to its ``seqlens_k[b]`` keys."""
    return_lse = kw.get("return_lse", False)
    outs, lses = [], []
    for b, n in enumerate(seqlens_k.tolist()):
        k = gather_pages(k_cache, block_table, n, b)
        v = gather_pages(v_cache, block_table, n, b)
        r = attention(q[b:b + 1], k, v, **_sequence_kw(kw, b))
        o, lse = r if return_lse else (r, None)
        outs.append(o)
        lses.append(lse)
    out = torch.cat(outs)
    return (out, torch.cat(lses)) if return_lse else out


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, heads, seq, dim), got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
    if (q.shape[0] != k.shape[0] or k.shape[:2] != v.shape[:2] or k.shape[1] == 0
            or q.shape[1] % k.shape[1]):
        raise ValueError(
            f"batch and heads differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "(k and v may have fewer heads than q, a divisor of its count)"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v sequence lengths differ: {k.shape[2]} vs {v.shape[2]}")


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V with each head repeated for the query heads that share it."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


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
    tile: tuple[int, int] | None = None,
    kv_splits: int = 1,
    num_splits: int = 1,
    k_scale: str = "token",
    sum_rounded_p: bool = False,
    mask_align: str = "top_left",
    window: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Float64 attention of the FP8 kernel's quantised computation: q and k quantised per token
    (k per (batch, head) with ``k_scale="head"``) and v per head as the quantiser does (same
    scales, e4m3 rounding), and, with ``round_p``, P rounded to e4m3 after scaling by P_SCALE.

    With ``tile=None`` P is rounded relative to the final row max (the kernel uses the running
    max, so the two differ by up to a few percent) and the result is not rounded further. With
    ``tile=(tile_m, tile_n)`` (and the kernel's ``kv_splits``) the kernel's block loop is replayed
    (``attention_fp8_online``) and the result is rounded to q's dtype, as the kernel's output is;
    either way float64 is returned. ``sum_rounded_p`` (with ``tile``): the row sums add P as
    rounded for the P·V MMA, as a kernel whose tensor cores sum the rows does. ``mask_align``
    and ``window`` as in ``attention``.
    """
    if sum_rounded_p and tile is None:
        raise ValueError("attention_fp8: sum_rounded_p replays a kernel's block loop; pass its "
                         "tile too")
    codes = [quantize_e4m3(t, g) for t, g in ((q, "token"), (k, k_scale), (v, "head"))]
    if tile is not None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        (qc, qd), (kc, kd), (vc, vd) = ((c.to(dev), d.to(dev)) for c, d in codes)
        if kd.dim() == 2:  # one descale per head: every key's (the kernel folds it per row)
            kd = kd.unsqueeze(-1).expand(*kd.shape, kc.shape[2])
        out = attention_fp8_online(qc, qd, kc, kd, vc, vd, causal=causal,
                                   softmax_scale=softmax_scale, tile=tile, kv_splits=kv_splits,
                                   num_splits=num_splits, round_p=round_p,
                                   sum_rounded_p=sum_rounded_p,
                                   bounds=key_bounds(q.shape[2], k.shape[2], causal, mask_align,
                                                     window))
        return out.to(q.dtype).to(torch.float64)
    deq = [dequantize_e4m3(*c) for c in codes]

    def rp(p: torch.Tensor) -> torch.Tensor:
        return e4m3_round(p * P_SCALE).to(p.device) / P_SCALE

    return attention(*deq, causal=causal, softmax_scale=softmax_scale, device=device,
                     p_round=rp if round_p else None, mask_align=mask_align, window=window)


def key_bounds(seqlen_q: int, seqlen_k: int, causal: bool, mask_align: str = "top_left",
               window: tuple[int, int] | None = None) -> KeyBounds:
    """The kernels' ``KeyBounds`` of ``attention``'s mask arguments (a window side of -1, or
    past ``UNBOUNDED``, limits nothing)."""
    if mask_align != "bottom_right" and window is None:
        return KeyBounds(causal)
    offset = seqlen_k - seqlen_q if mask_align == "bottom_right" else 0
    left = right = UNBOUNDED
    if window is not None:
        left, right = (UNBOUNDED if w < 0 or w >= UNBOUNDED else w for w in window)
    return KeyBounds(causal, True, window is not None, offset, left, right)


def kernel_key_blocks(
    seqlen_q: int, seqlen_k: int, tile: tuple[int, int], causal: bool, kv_splits: int = 1,
    num_splits: int = 1, bounds: KeyBounds | None = None,
) -> list[list[tuple[int, int]]]:
    """[share][m_block] -> (lo, hi): the key blocks [lo, hi) of tile_n keys that each share of
    each query tile of tile_m rows walks (hi - 1 down to lo) in the attention kernel, a share
    being one warp group (of ``kv_splits``) of one CTA (of ``num_splits`` split-KV CTAs): the
    kernel's own ``key_range`` (``flashcore.kernels.common.block_info``); ``bounds``: the masks'
    (default: ``causal``'s)."""
    tile_m, tile_n = tile
    bounds = KeyBounds(causal) if bounds is None else bounds
    return [[key_range(mb, tile_m, tile_n, seqlen_k, bounds, 1, s, num_splits, g, kv_splits)[:2]
             for mb in range(-(-seqlen_q // tile_m))]
            for s in range(num_splits) for g in range(kv_splits)]


def attention_fp8_online(
    qc: torch.Tensor,
    qd: torch.Tensor,
    kc: torch.Tensor,
    kd: torch.Tensor,
    vc: torch.Tensor,
    vd: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float | None,
    tile: tuple[int, int],
    kv_splits: int = 1,
    num_splits: int = 1,
    round_p: bool = True,
    sum_rounded_p: bool = False,
    bounds: KeyBounds | None = None,
) -> torch.Tensor:
    """The FP8 kernel's online softmax replayed in float64 on e4m3 codes (as ``quantize_e4m3``
    returns them: qd (B, H, Sq), kd (B, H, Sk), vd (B, H)). Returns the float64 output, before
    the kernel's final rounding to the output dtype, on the codes' device.

    Per row, key blocks of ``tile_n`` go from the last to the first with a running max m, sum l
    and accumulator acc; P is rounded to e4m3 (``round_p``) against the running max, as the
    kernel's P·V MMA sees it, while l sums the unrounded P (or, with ``sum_rounded_p``, P as
    the MMA sees it: a kernel whose tensor cores sum the rows). Each query tile of ``tile_m`` rows
    walks only the blocks the kernel does (``kernel_key_blocks``: causal tiles skip those above
    their diagonal; ``kv_splits`` > 1 gives each split its own range and state, merged at the
    end; ``bounds``: the masks' keys, default ``causal``'s). Not replayed: the kernel's float32 arithmetic (scale, logits, exp2, sums), ~1e-7
    relative. Like the kernel, P is exp2((s - max) * scale), so the row max gets exactly 1 at any
    logit magnitude; with logits of 1e7 and more, the float32 rounding of the scores themselves
    can still decide between two keys that (nearly) tie.
    """
    tile_m, tile_n = tile
    if tile_m <= 0 or tile_n <= 0 or kv_splits <= 0 or num_splits <= 0:
        raise ValueError(f"tile, kv_splits and num_splits must be positive, got {tile}, "
                         f"{kv_splits}, {num_splits}")
    sq, sk = qc.shape[2], kc.shape[2]
    scale = 1.0 / math.sqrt(qc.shape[-1]) if softmax_scale is None else float(softmax_scale)
    # the q descale is folded into each row's exp2 scale; the k descale into the scores
    rs = (scale * math.log2(math.e)) * qd.to(torch.float64).unsqueeze(-1)
    kd64 = kd.to(torch.float64)
    qc, kc, vc = (t.to(torch.float64) for t in (qc, kc, vc))
    rows = torch.arange(sq, device=qc.device).unsqueeze(1)
    splits = []
    bounds = KeyBounds(causal) if bounds is None else bounds
    masked = bounds.bounded_above or bounds.windowed
    for ranges in kernel_key_blocks(sq, sk, tile, causal, kv_splits, num_splits, bounds):
        m = qc.new_full((*qc.shape[:3], 1), -math.inf)
        l = qc.new_zeros((*qc.shape[:3], 1))
        acc = qc.new_zeros((*qc.shape[:3], vc.shape[-1]))
        for n in range(max((hi for _, hi in ranges), default=0) - 1, -1, -1):
            # the query tiles walking block n are consecutive: lo and hi grow with the tile
            tiles = [mb for mb, (lo, hi) in enumerate(ranges) if lo <= n < hi]
            if not tiles:
                continue
            r = slice(tiles[0] * tile_m, min((tiles[-1] + 1) * tile_m, sq))
            k = slice(n * tile_n, min((n + 1) * tile_n, sk))  # keys past sk: P = 0, no effect
            s = (qc[:, :, r] @ kc[:, :, k].transpose(-1, -2)) * kd64[:, :, None, k]
            if masked:
                hidden = _hidden(torch.arange(k.start, k.stop, device=qc.device), rows[r],
                                 bounds)
                s = s.masked_fill(hidden, -math.inf)
            cur = torch.maximum(m[:, :, r], s.amax(dim=-1, keepdim=True))
            # a row with nothing visible yet keeps max -inf and exponentiates against 0
            safe = torch.where(cur == -math.inf, 0.0, cur)
            p = torch.exp2((s - safe) * rs[:, :, r])
            if masked:  # P = 0 for hidden keys explicitly, not via exp2(-inf * scale)
                p = p.masked_fill(hidden, 0.0)
            corr = _rescale(m[:, :, r], safe, rs[:, :, r])
            pv = e4m3_round(p * P_SCALE).to(p.device) if round_p else p * P_SCALE
            summed = pv / P_SCALE if sum_rounded_p else p
            l[:, :, r] = l[:, :, r] * corr + summed.sum(dim=-1, keepdim=True)
            acc[:, :, r] = acc[:, :, r] * corr + pv @ vc[:, :, k]
            m[:, :, r] = cur
        splits.append((m, l, acc))
    # merge the splits' states at their common max (a factor of exactly 1 for a single split)
    m_all = torch.stack([m for m, _, _ in splits]).amax(dim=0)
    safe = torch.where(m_all == -math.inf, 0.0, m_all)
    l = torch.stack([l * _rescale(m, safe, rs) for m, l, _ in splits]).sum(dim=0)
    acc = torch.stack([acc * _rescale(m, safe, rs) for m, _, acc in splits]).sum(dim=0)
    o_scale = vd.to(torch.float64)[:, :, None, None] / P_SCALE
    return torch.where(l > 0, acc / torch.where(l > 0, l, 1.0), 0.0) * o_scale


def _hidden(keys: torch.Tensor, tokens: torch.Tensor, bounds: KeyBounds) -> torch.Tensor:
    """(tokens, keys): whether each token may not see each key (``block_info.token_keys``)."""
    hidden = torch.zeros(tokens.shape[0], keys.shape[0], dtype=torch.bool, device=keys.device)
    if bounds.bounded_above:
        hidden |= keys > tokens + bounds.offset + bounds.right_edge
    if bounds.windowed:
        hidden |= keys < tokens + bounds.offset - bounds.left
    return hidden


def _rescale(m: torch.Tensor, safe: torch.Tensor, rs: torch.Tensor) -> torch.Tensor:
    """exp2((m - safe) * rs) as the kernel computes it, 0 where m is still -inf."""
    return torch.where(m == -math.inf, 0.0, torch.exp2((m - safe) * rs))
