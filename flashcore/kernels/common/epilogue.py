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


@cute.jit
def clear_rows_no_cta_owns(q_span, last, mO, mLSE, m_block, head, batch,
                           tile_m: cutlass.Constexpr,
                           threads: cutlass.Constexpr, tidx, out_dtype: cutlass.Constexpr,
                           head_dim: cutlass.Constexpr):
    """Zero the rows of a packed output (1, heads, total rows, head_dim) that no CTA computes:
    this sequence's rows past the grid's query tiles (a ``max_seqlen_q`` below its length),
    written by its last tile's CTA, and the rows past the last sequence, shared among the last
    sequence's CTAs. Both are empty for tables that pass the host's checks and cover the
    tensor; the test is a few integer operations. ``q_span``: this sequence's (first row,
    rows) (``Sequences.q_span``), ``last``: the last sequence's index; ``threads`` of this CTA
    do it, this one ``tidx``."""
    tiles = cute.arch.grid_dim()[0] // mO.shape[1]  # query tiles a sequence gets
    start, rows = q_span
    covered = tiles * tile_m
    if m_block == tiles - 1:  # noqa: SIM102 - two run-time tests, no short-circuit on device
        if rows > covered:
            _zero_rows(mO, mLSE, head, start + covered, rows - covered, 0, 1, threads, tidx,
                       out_dtype, head_dim)
    if batch == last:
        end = start + rows
        _zero_rows(mO, mLSE, head, end, mO.shape[2] - end, m_block, tiles, threads, tidx,
                   out_dtype, head_dim)


@cute.jit
def _zero_rows(mO, mLSE, head, first, count, share, shares, threads: cutlass.Constexpr, tidx,
               out_dtype: cutlass.Constexpr, head_dim: cutlass.Constexpr):
    """Rows ``first .. first + count`` of ``head``: 0, and their LSE -inf; this CTA takes share
    ``share`` of ``shares`` of the 16-byte chunks."""
    chunks = head_dim // 8
    zero = cute.make_rmem_tensor((8,), out_dtype)
    zero.fill(0.0)
    for i in range(share * threads + tidx, count * chunks, shares * threads):
        row = first + i // chunks
        chunk = i % chunks
        cute.autovec_copy(zero, cute.local_tile(mO[0, head, row, None], (8,), (chunk,)))
        if cutlass.const_expr(mLSE is not None):  # noqa: SIM102 - trace time, then run time
            if chunk == 0:
                mLSE[0, head, row] = -cutlass.Float32.inf
