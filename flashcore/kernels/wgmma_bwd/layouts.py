"""The Hopper backward's trace-time data: shared tiles (the canonical swizzled K-major wgmma
layouts of ``hopper/layouts.py``), the three tiled warpgroup MMAs and the copies.

* Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: (tile_n, tile_m) over head_dim, both operands K-major as stored,
  64 keys a warpgroup.
* dV += Pᵀ·dO and dK += dSᵀ·Q: (tile_n, head_dim) over tile_m, A from the registers Sᵀ and dPᵀ
  became, B the Q and dO tiles read through a transposed (head_dim, rows) view (MN-major).
* dQ = dS·K: (tile_m, head_dim) over tile_n, A the dSᵀ tile read transposed (MN-major), B K
  read transposed; the warpgroups split its rows where there are 64 each, else head_dim, or
  (a half of head_dim no whole number of swizzle atoms: d96) the first computes it alone.

The transposed views are ``mma_sync_bwd.layouts.transposed``'s: the transposed K-major swizzle
atom is the MN-major one.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import OperandMajorMode, cpasync

from ...specs import BackwardSpec
from ..common.copies import g2s_copy
from ..common.dtypes import DTYPES
from ..hopper.layouts import ROWS_PER_WARPGROUP, WARPGROUP, k_major, swizzle_bytes

_ALIGN = 1024
K, MN = OperandMajorMode.K, OperandMajorMode.MN


class HopperBackwardLayouts:
    def __init__(self, spec: BackwardSpec):
        c = spec.config
        d, tm, tn = spec.head_dim, c.tile_m, c.tile_n
        self.spec = spec
        self.dtype = dt = DTYPES[spec.dtype]
        self.warpgroups = wgs = c.warps // 4
        self.sQ = k_major(dt, (tm, d, c.stages))  # and dO
        self.sK = k_major(dt, (tn, d))  # and V
        # dSᵀ as the Sᵀ accumulator holds it (warp-specialised: two stages)
        self.sdS = k_major(dt, (tn, tm, 2) if spec.warp_specialized else (tn, tm))
        self.sRows = cute.make_layout((tm, c.stages))  # each stage's LSE and D rows
        # two fp32 dQ blocks, row-major as the accumulator lies (``dq_bulk.py``)
        self.sdQ = cute.make_layout((tm, d, 2), stride=(d, 1, tm * d)) if spec.bulk_dq else None
        f32 = cutlass.Float32
        self.mma_sdp = sm90.make_trivial_tiled_mma(dt, dt, K, K, f32, (wgs, 1, 1),
                                                   (ROWS_PER_WARPGROUP, tm))
        self.mma_dkv = sm90.make_trivial_tiled_mma(dt, dt, K, MN, f32, (wgs, 1, 1),
                                                   (ROWS_PER_WARPGROUP, d),
                                                   sm90.OperandSource.RMEM)
        # copies go by swizzle lines (d96: three of 32), a pass of the threads whole rows
        line = swizzle_bytes(dt, d) * 8 // dt.width
        assert min(tm, tn) % (c.threads * 8 // line) == 0, (tm, tn, line)
        along_m = tm // ROWS_PER_WARPGROUP  # warpgroups along dQ's rows; the rest split d
        split = wgs // along_m
        # a share of d that neither fills whole swizzle atoms of Kᵀ nor divides one (d96: 48
        # of 32-wide atoms; d64's 32 of 64 and d128's 64 of 64 partition): the first
        # warpgroup computes dQ alone
        atom, share = line, d // split
        self.dq_single = split > 1 and share % atom != 0 and atom % share != 0
        if self.dq_single:
            along_m, split = 1, 1
        self.mma_dq = sm90.make_trivial_tiled_mma(dt, dt, MN, MN, f32, (along_m, split, 1),
                                                  (ROWS_PER_WARPGROUP, d // split))
        self.g2s = g2s_copy(dt, line, c.threads)
        self.rows_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), f32,
            num_bits_per_copy=32)
        # dSᵀ registers -> shared by stmatrix (the accumulator's rows are the tile's rows)
        self.r2s_ds = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), dt), self.mma_sdp)
        # the epilogue's shared -> global: 16-byte stores, a line's threads over a line
        self.r2g = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt, num_bits_per_copy=128),
            cute.make_layout((c.threads // (line // 8), line // 8), stride=(line // 8, 1)),
            cute.make_layout((1, 8)))
        self.storage = self._shared_storage()
        assert c.threads == wgs * WARPGROUP

    def _shared_storage(self):
        dt = self.dtype
        n_q, n_k, n_ds = (cute.cosize(x) for x in (self.sQ, self.sK, self.sdS))
        n_r = cute.cosize(self.sRows)
        bulk, n_dq = self.spec.bulk_dq, cute.cosize(self.sdQ) if self.spec.bulk_dq else 0
        tma = self.spec.loads_by_tma
        stages = self.spec.config.stages
        barriers = stages + 1 + (stages if self.spec.warp_specialized else 0)
        Align, Mem = cute.struct.Align, cute.struct.MemRange

        @cute.struct
        class SharedStorage:
            sQ: Align[Mem[dt, n_q], _ALIGN]
            sdO: Align[Mem[dt, n_q], _ALIGN]
            sK: Align[Mem[dt, n_k], _ALIGN]
            sV: Align[Mem[dt, n_k], _ALIGN]
            sdS: Align[Mem[dt, n_ds], _ALIGN]
            sLSE: Align[Mem[cutlass.Float32, n_r], _ALIGN]
            sD: Align[Mem[cutlass.Float32, n_r], _ALIGN]
            if bulk:
                sdQ: Align[Mem[cutlass.Float32, n_dq], _ALIGN]
            if tma:  # a barrier a stage, and the key block's (``loads.py``); warp-specialised:
                # and an empty barrier a stage
                mbar: Align[Mem[cutlass.Int64, barriers], 8]

        return SharedStorage
