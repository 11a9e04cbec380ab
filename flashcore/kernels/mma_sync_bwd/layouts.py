"""The backward kernel's trace-time data: shared-memory layouts and struct, copy atoms and the
three tiled MMAs of one spec (Python data at trace time, no instructions).

* S = Q·Kᵀ and dP = dO·Vᵀ: (tile_m, tile_n) over head_dim.
* dV += Pᵀ·dO and dK += dSᵀ·Q: (tile_n, head_dim) over tile_m.
* dQ = dS·K: (tile_m, head_dim) over tile_n.

Each MMA spreads all warps over its tile: ``spec.warps_m`` of them along its rows, or 16 rows a
warp first (``spec.backward.warp_grid``).

With two stages (``spec.prefetch_rows``) each query block's LSE and D rows have shared tiles
too, copied in with its Q and dO.
"""


import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from ...specs import BackwardSpec
from ...specs.backward import warp_grid
from ..common.copies import g2s_copy, swizzled_row_atom
from ..common.dtypes import DTYPES
from ..mma_sync.layouts import line_elems

LINE = 64  # 16-bit elements of the widest (128-byte) swizzle line


def tiled_mma(dtype, rows: int, cols: int, warps: int, along_rows: int = 0):
    wm, wn = warp_grid(rows, cols, warps, along_rows)
    return cute.make_tiled_mma(warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16)),
                               (wm, wn, 1), permutation_mnk=(wm * 16, wn * 16, 16))


class BackwardLayouts:
    """Shared tiles: Q and dO (tile_m, head_dim, stage), K and V (tile_n, head_dim), P and dS
    (tile_m, tile_n), all row-major under a 128-byte (or row-wide) swizzle."""

    def __init__(self, spec: BackwardSpec):
        c = spec.config
        d, tm, tn = spec.head_dim, c.tile_m, c.tile_n
        self.spec = spec
        self.dtype = DTYPES[spec.dtype]
        # rows of head_dim in lines of up to 128 bytes that tile them (96 wide: three of 64),
        # as the forward's
        line = line_elems(d, self.dtype.width)
        per_line = line // 8  # threads of a line's 16-byte copies
        atom = swizzled_row_atom(16, line)
        self.sQ = cute.tile_to_shape(atom, (tm, d, c.stages), (0, 1, 2))
        self.sK = cute.tile_to_shape(atom, (tn, d), (0, 1))
        self.sPdS = cute.tile_to_shape(swizzled_row_atom(16, min(tn, LINE)), (tm, tn), (0, 1))
        self.g2s = g2s_copy(self.dtype, line, c.threads)
        # registers -> global: 16-byte stores, a line's threads over a line of a row
        self.r2g = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128),
            cute.make_layout((c.threads // per_line, per_line), stride=(per_line, 1)),
            cute.make_layout((1, 8)),
        )
        wms = spec.warps_m or (0, 0, 0)
        self.mma_sdp = tiled_mma(self.dtype, tm, tn, c.warps, wms[0])
        self.mma_dkv = tiled_mma(self.dtype, tn, d, c.warps, wms[1])
        self.mma_dq = tiled_mma(self.dtype, tm, d, c.warps, wms[2])
        # the LSE and D rows of each stage: (tile_m, stage), one 4-byte cp.async a row
        self.sRows = cute.make_layout((tm, c.stages))
        self.rows_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), cutlass.Float32,
            num_bits_per_copy=32)
        self.storage = self._shared_storage()

    def _shared_storage(self):
        dt = self.dtype
        n_q, n_k, n_p = (cute.cosize(x) for x in (self.sQ, self.sK, self.sPdS))
        Align, Mem = cute.struct.Align, cute.struct.MemRange
        fields = {"sQ": Align[Mem[dt, n_q], 1024], "sdO": Align[Mem[dt, n_q], 1024],
                  "sK": Align[Mem[dt, n_k], 1024], "sV": Align[Mem[dt, n_k], 1024],
                  "sP": Align[Mem[dt, n_p], 1024], "sdS": Align[Mem[dt, n_p], 1024]}
        if self.spec.prefetch_rows:  # each stage's LSE and D rows
            n_r = cute.cosize(self.sRows)
            fields["sLSE"] = fields["sD"] = Align[Mem[cutlass.Float32, n_r], 128]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


def transposed(tile: cute.Tensor, rows: int, cols: int) -> cute.Tensor:
    """A (rows, cols[, stages]) tile read as (cols, rows[, stages]): the operand view of a
    row-major tile that an MMA takes with its contiguous mode as M or N (ldmatrix.trans)."""
    if cute.rank(tile) == 3:
        stages = cute.size(tile, mode=[2])
        return cute.composition(tile, cute.make_layout((cols, rows, stages),
                                                       stride=(rows, 1, rows * cols)))
    return cute.composition(tile, cute.make_layout((cols, rows), stride=(rows, 1)))
