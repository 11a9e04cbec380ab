"""Shared-memory layouts and global->shared copies shared by the kernels.

* Layouts: row-major atoms of 128-byte lines under a swizzle that XORs the line index into the
  16-byte chunk index, so ldmatrix reads are conflict-free.
* Copies: 128-bit ``cp.async`` tiled over a warp group; ``pred``-less rows past a sequence end
  are zero-filled in shared memory instead.
"""


import math

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync


def swizzled_row_atom(elem_bits: int, row_elems: int):
    """Row-major (8, row_elems) atom whose 16-byte chunks are XOR-swizzled by the line index."""
    elem_bytes = elem_bits // 8
    chunk_bits = int(math.log2(16 // elem_bytes))  # elements per 16-byte chunk
    row_chunks = row_elems * elem_bytes // 16
    b = min(3, int(math.log2(row_chunks)))
    return cute.make_composed_layout(
        cute.make_swizzle(b, chunk_bits, 3), 0,
        cute.make_layout((8, row_elems), stride=(row_elems, 1)),
    )


def g2s_copy(dtype, row_elems: int, threads: int, bits: int = 128):
    """``threads`` threads copying rows of ``row_elems`` elements global->shared with cp.async,
    in 16-byte chunks, the rows of one atom spread over the threads."""
    per_copy = bits // dtype.width
    tpr = min(row_elems, 128 * 8 // dtype.width) // per_copy  # threads per atom row
    # a row wider than 128 bytes goes in 128-byte passes, which must tile it (d96's 192-byte
    # rows: pass a swizzle line's width instead)
    assert row_elems % (tpr * per_copy) == 0, (row_elems, tpr * per_copy)
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=bits)
    return cute.make_tiled_copy_tv(
        atom,
        cute.make_layout((threads // tpr, tpr), stride=(tpr, 1)),
        cute.make_layout((1, per_copy)),
    )


@cute.jit
def load_rows(tiled_copy, src, dst, coords, seqlen):
    """cp.async a partitioned tile ((atom, rows, cols) modes), zero-filling rows whose
    coordinate is at or past ``seqlen``."""
    for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
        if cute.elem_less(coords[0, m, 0][0], seqlen):
            cute.copy(tiled_copy, src[None, m, None], dst[None, m, None])
        else:
            dst[None, m, None].fill(0)


@cute.jit
def load_vector(atom, element_of, dst, tidx, threads: cutlass.Constexpr, n: cutlass.Constexpr,
                first, limit):
    """cp.async elements [0, n) into 1-d ``dst``, one element per copy: element i (global index
    ``first`` + i) from the (1,) tensor ``element_of(i)``; those at or past ``limit`` are
    zero-filled (and never looked up)."""
    for i in cutlass.range_constexpr((n + threads - 1) // threads):
        e = tidx + i * threads
        if e < n:
            if first + e < limit:
                cute.copy(atom, element_of(e), cute.local_tile(dst, (1,), (e,)))
            else:
                dst[e] = 0.0


@cute.jit
def load_block(tiled_copy, src, dst, coords, n_block, slot, seqlen, ragged: cutlass.Constexpr):
    """cp.async key block ``n_block`` of a partitioned (atom, rows, cols, blocks) source into
    stage ``slot`` of the destination; if ``ragged``, rows past ``seqlen`` are zero-filled."""
    if cutlass.const_expr(ragged):
        load_rows(tiled_copy, src[None, None, None, n_block], dst[None, None, None, slot],
                  coords[None, None, None, n_block], seqlen)
    else:
        cute.copy(tiled_copy, src[None, None, None, n_block], dst[None, None, None, slot])


@cute.jit
def load_paged(tiled_copy, thr_copy, page_of, dst, coords, n_block, slot, seqlen,
               tile: cutlass.Constexpr, page_size: cutlass.Constexpr, ragged: cutlass.Constexpr):
    """``load_block`` for a paged source whose page size is known at compile time and whose
    pages hold whole copy passes (``spec.families.MmaSync.copies_whole_pages``): the ``tile``
    (rows, cols) block is ``rows // piece`` pieces of ``piece = min(page_size, rows)`` rows, each
    inside one page, ``page_of(i)`` being the sequence's i-th page as a (page_size, cols) tensor.
    A piece is partitioned like a tile of its rows, so thread rows keep their places and 16-byte
    copies; one block-table read per piece. Pages wholly past ``seqlen`` are not looked up (the
    table may end before them): their rows are zero-filled."""
    rows, cols = tile
    piece = min(page_size, rows)
    pass_rows = cute.size(tiled_copy.tiler_mn[0])
    assert piece % pass_rows == 0, f"a piece of {piece} rows is not whole copy passes"
    per_piece = piece // pass_rows  # copy passes (thread rows) per piece
    for j in cutlass.range_constexpr(rows // piece):
        first = n_block * rows + j * piece
        index = first // page_size
        if cutlass.const_expr(ragged):  # the last page with keys, for pieces past the end
            index = cutlass.min(index, (seqlen - 1) // page_size)
        src = thr_copy.partition_S(
            cute.local_tile(page_of(index), (piece, cols), ((first % page_size) // piece, 0)))
        for i in cutlass.range_constexpr(per_piece):
            m = j * per_piece + i
            if cutlass.const_expr(ragged):
                if cute.elem_less(coords[0, m, 0, n_block][0], seqlen):
                    cute.copy(tiled_copy, src[None, i, None], dst[None, m, None, slot])
                else:
                    dst[None, m, None, slot].fill(0)
            else:
                cute.copy(tiled_copy, src[None, i, None], dst[None, m, None, slot])


@cute.jit
def load_gathered(tiled_copy, thr_copy, row_of, dst, coords, n_block, slot, seqlen,
                  tile: cutlass.Constexpr, ragged: cutlass.Constexpr):
    """``load_block`` for a ``tile`` (rows, cols) whose rows are scattered (a paged cache):
    ``row_of(m, key)`` is key ``key``'s (cols,) row in global memory (``m``: the thread's row
    pass, so a caller may keep what it looked up for the next tile of the same keys). Each thread's row ``m`` is
    copied from a view whose rows all sit at that row's address (row stride 0), partitioned like
    the whole tile, so its chunks keep the tile's columns and 16-byte copies."""
    for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
        key = coords[0, m, 0, n_block][0]
        if cutlass.const_expr(ragged):
            if key < seqlen:
                copy_row(tiled_copy, thr_copy.partition_S, row_of(m, key),
                         dst[None, m, None, slot], m, tile)
            else:
                dst[None, m, None, slot].fill(0)
        else:
            copy_row(tiled_copy, thr_copy.partition_S, row_of(m, key),
                     dst[None, m, None, slot], m, tile)


@cute.jit
def load_scattered_rows(tiled_copy, thr_copy, row_of, dst, coords, seqlen,
                        tile: cutlass.Constexpr):
    """``load_rows`` for a (rows, cols) ``tile`` whose rows are scattered (packed tokens'
    queries, ``grid.packed_row``): row ``r``'s (cols,) row is ``row_of(r)``."""
    for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
        row = coords[0, m, 0][0]
        if row < seqlen:
            copy_row(tiled_copy, thr_copy.partition_S, row_of(row), dst[None, m, None], m, tile)
        else:
            dst[None, m, None].fill(0)


@cute.jit
def copy_row(tiled_copy, partition, row, other, m, tile: cutlass.Constexpr, store=False):
    """Copy a thread's pass ``m`` of a ``tile`` between ``other`` (its partitioned pass) and
    global ``row``: a view whose rows all sit at the row's address (row stride 0),
    partitioned like the whole tile (``partition``: the thread's partition_S or partition_D),
    so its chunks keep the tile's columns and 16-byte copies. ``store``: into the row."""
    view = partition(cute.make_tensor(row.iterator, cute.make_layout(tile, stride=(0, 1))))
    if cutlass.const_expr(store):
        cute.copy(tiled_copy, other, view[None, m, None])
    else:
        cute.copy(tiled_copy, view[None, m, None], other)
