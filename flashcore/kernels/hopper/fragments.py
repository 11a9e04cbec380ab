"""Register-fragment views of warpgroup MMA (wgmma) accumulators, and the coordinates of what a
thread holds: pure layout algebra.

A wgmma accumulator of a 64 x N atom, as a thread holds it, is ((2, 2, N / 8), M, N_tiles):
the m16n8 C fragment of mma.sync (columns 2t, 2t + 1 of rows g and g + 8 of its warp's 16 rows)
repeated over the N / 8 column groups of the atom. Mode 0 is (column pair, row half, column
group), with compact strides (1, 2, 4) in a register tensor.
"""

import cutlass.cute as cute

from ..common.fragments import acc_as_fp8_operand_a as mma_sync_fp8_operand_a


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """Re-view a ((2, 2, J), M, N) wgmma accumulator (or a partition of an identity tensor) as
    (rows, cols): rows = (row half, M), cols = (column pair, J, N).

    The order of the columns in the view is not the order of the keys (a thread holds keys
    8j + 2t + c): reductions and masks do not care, and masks read the keys through the same
    view of an identity tensor.
    """
    shape = acc.layout.shape
    compact = cute.make_layout(shape)
    (s_c, s_r, s_j), s_m, s_n = compact.stride
    mn = cute.make_layout(
        ((shape[0][1], shape[1]), (shape[0][0], shape[0][2], shape[2])),
        stride=((s_r, s_m), (s_c, s_j, s_n)),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def acc_as_operand_a(layout: cute.Layout) -> cute.Layout:
    """((2, 2, J), M, 1) accumulator of a 64 x (8J) wgmma -> ((2, 2, 2), M, J / 2): the A
    operand of a register-sourced (RS) wgmma whose K is the accumulator's N.

    The RS A fragment of one k16 step holds, per thread, the same rows and columns as two
    neighbouring n8 column groups of the accumulator (columns 2t, 2t + 1, then 8 + 2t, 9 + 2t,
    of rows g and g + 8), in the order (column pair, row half, which group): so k step kk is
    column groups 2kk and 2kk + 1, read in place with no data movement.
    """
    (s_c, s_r, s_j), s_m, _ = layout.stride
    (_, _, groups), m, n = layout.shape
    assert n == 1 and groups % 2 == 0, f"accumulator {layout} is not one atom of even N / 8"
    return cute.make_layout(((2, 2, 2), m, groups // 2),
                            stride=((s_c, s_r, s_j), s_m, 2 * s_j))


def acc_as_fp8_operand_a(layout: cute.Layout) -> cute.Layout:
    """((2, 2, J), M, 1) accumulator of a 64 x (8J) wgmma -> (((2, 2), 2, 2), M, J / 4): the
    16 values per k32 step of an e4m3 RS wgmma's A operand, in its register order. Each
    warp's part of the accumulator is the mma.sync m16n8 C fragment repeated over J column
    groups and the e4m3 A operand the m16n8k32 one, so this is the mma_sync view
    (``common.fragments.acc_as_fp8_operand_a``: the same key permutation of FP8 Vᵀ) of the
    column groups as n8 tiles."""
    (s_c, s_r, s_j), s_m, _ = layout.stride
    (_, _, groups), m, n = layout.shape
    assert n == 1 and groups % 4 == 0, f"accumulator {layout} is not one atom of N % 32 == 0"
    return mma_sync_fp8_operand_a(cute.make_layout(((2, 2), m, groups),
                                                   stride=((s_c, s_r), s_m, s_j)))


class ThreadCoords:
    """Coordinates of what one thread holds, for a CTA view with ``thr_qk`` and ``thr_pv`` (its
    slices of the two tiled MMAs), ``config``, ``spec``, ``m_block``, ``seqlen_q``, ``seqlen_k``
    (the warp-specialised consumers derive from it)."""

    def score_coords(self, n_block):
        """(query row, key) of each score this thread holds in key block ``n_block``, as an
        (rows, keys) view like ``acc_mn_view`` of its scores."""
        c = self.config
        cS = cute.local_tile(cute.make_identity_tensor((self.seqlen_q, self.seqlen_k)),
                             (c.tile_m, c.tile_n), (self.m_block, n_block))
        return acc_mn_view(self.thr_qk.partition_C(cS))

    def row_coords(self) -> list:
        """The row, within the query tile, of each accumulator row this thread holds (static)."""
        rows = acc_mn_view(self.thr_pv.partition_C(
            cute.make_identity_tensor((self.config.tile_m, self.spec.head_dim))))
        return [rows[r, 0][0] for r in range(cute.size(rows, mode=[0]))]
