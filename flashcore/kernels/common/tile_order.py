"""The order in which a causal grid hands out its query tiles.

A causal query tile's work grows with its index (tile ``m`` walks ``m + 1`` key blocks), and the
GPU starts CTAs in grid order as SMs free up. Longest tiles first keeps the end of the grid from
waiting on one long tile (list scheduling). Taken over the whole grid that would put every head's
longest tile in the first wave, each re-reading its own head's K/V from HBM; taken per head, the
last head's longest tile starts too late (a ~6% tail in a model of 4,16,4096 at 128x128 on 132
SMs). So the (batch, head) pairs are taken in sections of ``SECTION``: within a section the query
tiles run longest first, the section's heads side by side (their K/V, a few MB, stay in L2).
Pairs beyond the last full section (``pairs % SECTION`` of them, none for the usual head counts)
run last, head by head, each head's tiles longest first. A grid of no more CTAs than SMs
starts every tile at once; it takes no pairs in sections (``pairs=0``), the plain per-head
order (``grid.py``).

Only the tile count ``m_blocks`` divides at run time, as in a grid without this order. The
kernels compute the order again in their epilogue; they read the grid's sizes through an opaque
move there (``sreg.opaque``), or the compiler keeps the sizes derived at the start live through
the key loop (an mma_sync 64x64 kernel at 128 registers spilled them, one inside the loop).
Plain integer arithmetic: it runs on Python ints (the tests check it is a permutation) and on
the DSL's run-time integers inside a kernel (``grid.py`` passes a ``select`` built on
``cutlass.select_``). Imports no DSL.
"""

SECTION = 8  # (batch, head) pairs whose query tiles are interleaved, longest first


def _where(cond, a, b):
    return a if cond else b


def causal_tile(lin, m_blocks, pairs, select=_where):
    """(query tile, (batch, head) index) of the ``lin``-th CTA of a causal grid of ``pairs``
    (batch, head) pairs with ``m_blocks`` query tiles each. ``pairs=0``: every pair head by
    head, longest first (the order of a tail, for any grid)."""
    full = pairs // SECTION * SECTION  # pairs in full sections
    sectioned = lin < full * m_blocks
    tail = lin - full * m_blocks  # the index among the pairs after the full sections
    x = select(sectioned, lin // SECTION, tail)
    d = x // m_blocks
    m_rev = x - d * m_blocks
    bh = select(sectioned, d * SECTION + lin % SECTION, full + d)
    return m_blocks - 1 - m_rev, bh
