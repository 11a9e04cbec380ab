"""Masking scores: keys past the sequence end, and the keys a token may not see (causal,
top-left or bottom-right, and sliding windows: ``block_info.KeyBounds``); soft-capping them;
ALiBi's linear bias."""


import cutlass
import cutlass.cute as cute

from .block_info import KeyBounds, token_keys


@cute.jit
def mask_scores(S: cute.Tensor, coords: cute.Tensor, seqlen_k, bounds: KeyBounds, q_group):
    """Set to -inf every score S[r, c] (a (rows, keys) view) whose key may not be seen.

    ``coords[r, c]`` is the (query row, key) of each score. A row is its token, or with
    ``q_group`` > 1 (GQA packs the query heads of one K/V head into rows, token-major: row
    t * q_group + h) token row // q_group."""
    for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
        lo, limit = 0, seqlen_k
        if cutlass.const_expr(bounds.causal or bounds.shifted):
            row = coords[r, 0][0]
            token = row // q_group  # loop-invariant: hoisted out of the key loop
            if cutlass.const_expr(bounds.shifted):
                lo, limit = token_keys(bounds, token, seqlen_k, cutlass.min, cutlass.max)
            else:  # top-left causal: the fixed diagonal
                limit = cutlass.min(token + 1, seqlen_k)
        for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
            key = coords[0, c][1]
            if cute.elem_less(limit, key + 1):
                S[r, c] = -cutlass.Float32.inf
            if cutlass.const_expr(bounds.windowed):  # noqa: SIM102 (compile-time, then run-time)
                if cute.elem_less(key, lo):
                    S[r, c] = -cutlass.Float32.inf


@cute.jit
def mask_keys_in_rows(S: cute.Tensor, coords: cute.Tensor, seqlen_k, bounds: KeyBounds):
    """``common.mask.mask_scores`` for a (keys, query rows) view, the backward's Sᵀ:
    ``coords[r, c]`` is the (key, query row) of each score, a row a token."""
    for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
        lo, limit = 0, seqlen_k
        if cutlass.const_expr(bounds.causal or bounds.shifted):
            token = coords[0, c][1]
            if cutlass.const_expr(bounds.shifted):
                lo, limit = token_keys(bounds, token, seqlen_k, cutlass.min, cutlass.max)
            else:
                limit = cutlass.min(token + 1, seqlen_k)
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            key = coords[r, 0][0]
            if cute.elem_less(limit, key + 1):
                S[r, c] = -cutlass.Float32.inf
            if cutlass.const_expr(bounds.windowed):  # noqa: SIM102 (compile-time, then run-time)
                if cute.elem_less(key, lo):
                    S[r, c] = -cutlass.Float32.inf


@cute.jit
def soft_cap(S: cute.Tensor, scale_in, scale_out):
    """S = (cap / scale) * tanh(S * scale / cap), so that the softmax's scale makes the logits
    cap * tanh(scale * S / cap). Full-precision tanh: the approximate one's 2^-11 relative
    error, times a cap of 50, would move logits by 0.02."""
    for i in cutlass.range_constexpr(cute.size(S)):
        S[i] = scale_out * cute.math.tanh(S[i] * scale_in, fastmath=False)


@cute.jit
def alibi_bias(S: cute.Tensor, coords: cute.Tensor, slope, offset, q_group):
    """S[r, c] -= slope * |token + offset - key|: ALiBi, token = row // q_group and ``offset``
    the causal diagonal's (``KeyBounds.offset``). ``slope`` is in S's units (the logit slope
    over the softmax scale), so the logits get the slope itself."""
    for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
        token = coords[r, 0][0] // q_group
        for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
            dist = token + offset - coords[0, c][1]
            S[r, c] = S[r, c] - slope * cutlass.Float32(cutlass.max(dist, -dist))
