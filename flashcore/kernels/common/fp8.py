"""FP8 (e4m3) operands' scales, shared by the kernel families that multiply e4m3 Q, K and Vᵀ.

The quantisers give Q and K a descale per token and V one per (batch, head) (K one per (batch,
head) too with ``k_scale="head"``). A query's descale folds into its row's exp2 scale, and so
does a per-head K descale; a per-token one multiplies its column of scores; P comes out of its
exp2 times ``P_SCALE`` (``OnlineSoftmax``'s ``p_log2``) for its e4m3 conversion, and the row sums
with it, so O / sum needs only V's descale (``flashcore.reference.attention_fp8_online`` replays
this in float64).
"""

import cutlass
import cutlass.cute as cute

from .softmax import ROUNDED_OFFSET_LIMIT, OnlineSoftmax
from .sync import barrier_all

# P is multiplied by this before its e4m3 conversion, so small probabilities keep normal-range
# precision; a power of two, exact to apply and to undo (in the epilogue)
P_SCALE = 256.0
E4M3_MAX = 448.0  # the largest finite e4m3 magnitude: |q8 · k8| <= E4M3_MAX**2 * head_dim


@cute.jit
def fold_query_descales(tile, softmax: OnlineSoftmax, q_descales: cute.Tensor, scale_log2,
                        k_descale=None):
    """Each row's exp2 scale times its query's descale (``q_descales``: the rows of this batch
    and head) and, for K descaled per head (``k_descale``, a scalar), K's: a positive factor
    common to a row's scores scales its max with them, so the softmax takes it in its exp2.
    ``tile``: the CTA's view (``config``, ``m_block``, ``row_coords()``, ``seqlen_q``)."""
    rows, row_scale = tile.row_coords(), softmax.row_scale
    scale = scale_log2
    if cutlass.const_expr(k_descale is not None):
        scale = scale_log2 * k_descale
    for r in cutlass.range_constexpr(len(rows)):
        row = tile.m_block * tile.config.tile_m + rows[r]
        if row < tile.seqlen_q:
            row_scale[r] = scale * q_descales[row]


@cute.jit
def offsets_bounded(tile, softmax: OnlineSoftmax, head_dim: int, barrier_id, threads: int):
    """Whether every query row of the ``threads`` threads meeting at named barrier
    ``barrier_id`` keeps |max * scale| (log2 units) below ``ROUNDED_OFFSET_LIMIT`` for any
    scores: e4m3 operands bound |q8 · k8| by E4M3_MAX**2 * head_dim, and with K descaled per
    head every scale of a row's scores is in its exp2 scale. One answer for all of them (a
    warpgroup, whose warps issue its wgmma together); rows past seqlen_q, never stored, have no
    say. ``tile``: as for ``fold_query_descales``."""
    largest = cutlass.Float32(0.0)
    rows = tile.row_coords()
    for r in cutlass.range_constexpr(len(rows)):
        if tile.m_block * tile.config.tile_m + rows[r] < tile.seqlen_q:
            largest = cute.arch.fmax(largest, softmax.row_scale[r])
    bounded = largest * (E4M3_MAX**2 * head_dim) < ROUNDED_OFFSET_LIMIT
    return barrier_all(cutlass.Int32(1) if bounded else cutlass.Int32(0), barrier_id, threads)


@cute.jit
def key_descales(cols: cute.Tensor, k_descales: cute.Tensor, seqlen_k,
                 inside: cutlass.Constexpr = False):
    """The descales of the keys whose scores this thread holds, for a (rows, keys) view of the
    score coordinates (1 past the last key; ``inside``: the block is known to lie below
    seqlen_k, no check). Issue before the MMAs: their latency hides."""
    kd = cute.make_rmem_tensor(cute.size(cols, mode=[1]), cutlass.Float32)
    load_key_descales(kd, cols, k_descales, seqlen_k, inside)
    return kd


@cute.jit
def load_key_descales(kd: cute.Tensor, cols: cute.Tensor, k_descales: cute.Tensor, seqlen_k,
                      inside: cutlass.Constexpr = False):
    """``key_descales`` into the registers ``kd`` (a kernel that loads a block ahead)."""
    for c in cutlass.range_constexpr(cute.size(cols, mode=[1])):
        col = cols[0, c][1]
        if cutlass.const_expr(inside):
            kd[c] = k_descales[col]
        else:
            kd[c] = cutlass.Float32(1.0)
            if col < seqlen_k:
                kd[c] = k_descales[col]


@cute.jit
def scale_columns(S: cute.Tensor, scales: cute.Tensor):
    """S[r, c] *= scales[c] over a (rows, keys) view."""
    for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            S[r, c] = S[r, c] * scales[c]
