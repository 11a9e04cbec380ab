"""The warp-specialised Hopper kernel's trace-time data: shared-memory layouts and struct (the
128-byte-swizzled tiles of ``hopper/layouts.py``, plus the pipelines' mbarriers), the two tiled
warpgroup MMAs over the consumer warpgroups, and the TMA pipelines
(``flashcore.specs.families.WgmmaWs`` validates and budgets the spec)."""

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import OperandMajorMode

from ...specs.families import WgmmaWs
from ..common.dtypes import DTYPES, E4M3
from ..hopper.layouts import WARPGROUP, k_major, smem_tiles, tiled_mmas
from . import row_sums

EPILOGUE_BARRIER = 1  # named barriers 1.. (one per consumer warpgroup); 0 is the CTA's
CONSUMERS_BARRIER = 7  # every consumer thread (4..6 are ``turns``')
PRODUCER_REGS = 24  # the producer warpgroup only issues TMA
# ... or walks a block table too, each warp its share of a block's pages (``producer.py``),
# where that costs the consumers nothing (``producer_regs``)
PAGING_PRODUCER_REGS = 32
REGISTERS_PER_SM = 65536


def register_pool(consumers: int) -> int:
    """The registers of a CTA of a producer and ``consumers`` consumer warpgroups, all that
    ``setmaxnreg`` moves between them (one CTA an SM: each thread's even share of the SM's, a
    multiple of 8): a consumer asking for more than there is waits forever (384 threads: 168
    each, 64512; producers of 32 beside two consumers of 240 hang)."""
    threads = WARPGROUP * (1 + consumers)
    return min(256, REGISTERS_PER_SM // threads // 8 * 8) * threads


def consumer_regs(consumers: int, producer_regs: int = PRODUCER_REGS) -> int:
    """What each consumer thread may take after the producer's ``setmaxnreg`` gave its share
    back: the rest of the CTA's pool, a multiple of 8, at most 240 (two consumers:
    128 x 24 + 256 x 240 = 64512; three: 128 x 24 + 384 x 160 = 64512 of 65536)."""
    rest = (register_pool(consumers) - WARPGROUP * producer_regs) // (WARPGROUP * consumers)
    return min(240, rest // 8 * 8)


def producer_regs(consumers: int, paging: bool) -> int:
    """The producers' registers: more where they walk a block table and the consumers keep
    theirs (three consumers: 32 and 160; two: 24, as 32 would leave them 232)."""
    if paging and consumer_regs(consumers, PAGING_PRODUCER_REGS) == consumer_regs(consumers):
        return PAGING_PRODUCER_REGS
    return PRODUCER_REGS


_ALIGN = 1024


class WsLayouts:
    def __init__(self, spec):
        c = spec.config
        d, tm, tn = spec.head_dim, c.tile_m, c.tile_n
        self.spec = spec
        self.fp8 = spec.precision == "fp8"
        self.out_dtype = DTYPES[spec.dtype]
        self.dtype = E4M3 if self.fp8 else self.out_dtype  # what TMA loads and the MMAs read
        self.consumers = c.warps // 4
        # pages smaller than a key block: a K/V TMA box is one page's rows of a stage, and
        # the producer warps walk the block table
        self.key_box_rows = WgmmaWs.key_box_rows(spec)
        self.sPage = k_major(self.dtype, (self.key_box_rows, d))
        self.producer_regs = producer_regs(self.consumers, self.key_box_rows < tn)
        self.consumer_regs = consumer_regs(self.consumers, self.producer_regs)
        self.sQ, self.sKV = smem_tiles(self.dtype, tm, tn, d, c.stages)
        # V: 16-bit V tiles read through a transposed view (MN-major), or FP8 Vᵀ tiles
        # (head_dim rows of tile_n keys, K-major) with O staged in its own 16-bit tile (the
        # e4m3 Q buffer is half its size)
        self.sV = k_major(self.dtype, (d, tn, c.stages)) if self.fp8 else self.sKV
        self.sO = smem_tiles(self.out_dtype, tm, tn, d, 1)[0] if self.fp8 else None
        # P through shared memory (``WgmmaWs.p_in_shared``): its own tile, the SS P·V
        self.p_in_shared = WgmmaWs.p_in_shared(spec)
        self.sP = k_major(self.dtype, (tm, tn)) if self.p_in_shared else None
        self.qk_mma, self.pv_mma = tiled_mmas(
            self.dtype, self.consumers, tn, d,
            OperandMajorMode.K if self.fp8 else OperandMajorMode.MN, not self.p_in_shared)
        # the row sums by the tensor cores (``WgmmaWs.sums_by_mma``): P times a tile of ones
        self.sums_by_mma = WgmmaWs.sums_by_mma(spec)
        self.sOnes = row_sums.ones_layout(self.dtype, tn) if self.sums_by_mma else None
        self.sum_mma = (row_sums.sum_mma(self.dtype, self.consumers, not self.p_in_shared)
                        if self.sums_by_mma else None)
        # the epilogue: each consumer warpgroup's 64 rows of O, shared -> global in 16-byte
        # vectors by its own 128 threads, up to 8 a row (as many as divide a row's vectors)
        vec = 128 // self.out_dtype.width
        per_row = math.gcd(8, d // vec)
        self.r2g_o = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype,
                                num_bits_per_copy=128),
            cute.make_layout((WARPGROUP // per_row, per_row), stride=(per_row, 1)),
            cute.make_layout((1, vec)))
        self.q_bytes = tm * d * self.dtype.width // 8
        self.kv_bytes = tn * d * self.dtype.width // 8  # one stage of K (or V): TMA's tx count
        self.storage = self._shared_storage()

    def _shared_storage(self):
        dtype, stages, fp8 = self.dtype, self.spec.config.stages, self.fp8
        n_q, n_kv = cute.cosize(self.sQ), cute.cosize(self.sKV)
        out_dtype, n_o = self.out_dtype, cute.cosize(self.sO) if fp8 else 0
        p_in_shared, n_p = self.p_in_shared, cute.cosize(self.sP) if self.p_in_shared else 0
        ones, n_ones = self.sums_by_mma, cute.cosize(self.sOnes) if self.sums_by_mma else 0
        Align, Mem = cute.struct.Align, cute.struct.MemRange

        @cute.struct
        class SharedStorage:
            mbar_q: Mem[cutlass.Int64, 2]  # full, empty
            mbar_k: Mem[cutlass.Int64, 2 * stages]
            mbar_v: Mem[cutlass.Int64, 2 * stages]
            sQ: Align[Mem[dtype, n_q], _ALIGN]
            sK: Align[Mem[dtype, n_kv], _ALIGN]
            sV: Align[Mem[dtype, n_kv], _ALIGN]
            if fp8:  # the output tile of its own
                sO: Align[Mem[out_dtype, n_o], _ALIGN]
            if p_in_shared:
                sP: Align[Mem[dtype, n_p], _ALIGN]
            if ones:
                sOnes: Align[Mem[dtype, n_ones], _ALIGN]

        return SharedStorage

    def pipelines(self, storage):
        """(Q, K, V) pipelines: one producer thread (its TMA's bytes complete the full barrier),
        one empty-barrier arrival per consumer warp. Initialised here; the caller fences and
        synchronises the CTA before any wait."""
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.consumers)

        def make(barriers, stages, tx):
            return pipeline.PipelineTmaAsync.create(
                num_stages=stages, producer_group=producer, consumer_group=consumer_warps,
                tx_count=tx, barrier_storage=barriers.data_ptr(), defer_sync=True)

        stages = self.spec.config.stages
        return (make(storage.mbar_q, 1, self.q_bytes), make(storage.mbar_k, stages, self.kv_bytes),
                make(storage.mbar_v, stages, self.kv_bytes))
