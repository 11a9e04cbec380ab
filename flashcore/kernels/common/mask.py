"""Masking scores: keys past the sequence end, and (causal, top-left) keys past a row's token."""


import cutlass
import cutlass.cute as cute


@cute.jit
def mask_scores(S: cute.Tensor, coords: cute.Tensor, seqlen_k, causal: cutlass.Constexpr,
                q_group):
    """Set to -inf every score S[r, c] (a (rows, keys) view) whose key may not be seen.

    ``coords[r, c]`` is the (query row, key) of each score. A row is its token, or with
    ``q_group`` > 1 (GQA packs the query heads of one K/V head into the rows of a single query
    token) every row is token 0; causal rows see keys up to their token."""
    for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
        limit = seqlen_k
        if cutlass.const_expr(causal):
            row = coords[r, 0][0]
            token = row if q_group == 1 else 0  # a select: no division in the loop
            limit = cutlass.min(token + 1, seqlen_k)
        for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
            if cute.elem_less(limit, coords[0, c][1] + 1):
                S[r, c] = -cutlass.Float32.inf
