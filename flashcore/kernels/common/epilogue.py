"""Epilogue pieces both kernel families share."""


import cutlass
import cutlass.cute as cute

from .softmax import OnlineSoftmax


@cute.jit
def store_lse(tile, softmax: OnlineSoftmax, lse_rows, m_block, scattered: cutlass.Constexpr = False):
    """Each row's natural-log log-sum-exp (-inf for a row that saw no key) into ``lse_rows``
    (the rows of this batch and head; ``scattered``: a function of the row giving its (1,)
    view), by one lane of the four that share the row. ``tile``: the CTA's view (``config``,
    ``row_coords()``, ``seqlen_q``)."""
    tm = tile.config.tile_m
    gLSE = None
    if cutlass.const_expr(not scattered):
        gLSE = cute.local_tile(lse_rows, (tm,), (m_block,))
    rows = tile.row_coords()
    lane = cute.arch.lane_idx()
    for r in cutlass.range_constexpr(len(rows)):
        value = softmax.lse(r)
        row = m_block * tm + rows[r]
        if cutlass.const_expr(scattered):
            dst = lse_rows(row)  # the row's (1,) view: an address, nothing read
            if lane % 4 == 0 and row < tile.seqlen_q:
                dst[0] = value
        elif lane % 4 == 0 and row < tile.seqlen_q:
            gLSE[rows[r]] = value
