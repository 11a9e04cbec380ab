"""The warp-specialised Hopper backward (``BackwardSpec.warp_specialized``: dense batches, dQ
added in bulk): the Hopper kernel's walk and products (``attention_bwd.py``) with a producer
warpgroup in front of its two MMA warpgroups, so the MMA warps neither copy nor meet the
whole CTA.

* Warp 0 copies: K and V once, then each query block's Q and dO tiles (TMA) and its LSE and D
  rows (1-D bulk copies) into the block's stage, all on the stage's full barrier; a stage is
  refilled once every MMA warp has arrived on its empty barrier.
* Warp 1 adds dQ: each block's dQ, staged by the MMA warpgroups in one of two buffers, goes to
  the fp32 accumulator as one bulk reduction; the buffers change hands on named barriers (full:
  the MMA warps arrive, the writer waits; empty: the other way round).
* The MMA warpgroups meet each other once a block (dSᵀ written, a named barrier; dSᵀ has two
  stages, so no barrier guards its store), and at the epilogue.

The producer warpgroup keeps ``PRODUCER_REGS`` registers, the MMA warpgroups the rest: evenly,
or, where the first computes dQ alone (d96), more to it (its dQ accumulator) and fewer to the
second, each running its own copy of the block loop.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from ..common.sync import named_barrier
from ..hopper.fragments import acc_as_operand_a
from ..hopper.mma import wgmmas
from ..mma_sync_bwd.epilogue import store_key_grads
from .attention_bwd import (
    HopperBackward,
    HopperCta,
    dq_block,
    dq_turn_bytes,
    issue_dv,
    next_block,
    p_and_ds,
)
from .dq_bulk import bulk_add_f32, stage_dq
from .loads import bulk_copy_g2s

PRODUCER_REGS = 24  # the producer warps only issue copies and walk the blocks
MMA_REGS = 240  # 2 x 128 x 240 + 128 x 24 registers fit the register file
DQ_WG_REGS, OTHER_WG_REGS = 256, 224  # dQ in the first warpgroup alone: the same total
DS_BARRIER = 2  # named barriers (1: the epilogue's, ``mma_sync_bwd.epilogue``)
DQ_FULL = 3  # and 4: a dQ buffer staged
DQ_EMPTY = 5  # and 6: a dQ buffer's reduction has read it
WRITER = 32  # threads of the dQ writer warp, beside the MMA warps at the dQ barriers


@cute.jit
def produce(cta: HopperCta, first, lo, per_head, steps):
    """Warp 0: K and V, then every step's Q, dO, LSE and D rows into its stage."""
    stages = cta.config.stages
    HopperCta.copy_keys(cta, steps)  # (none where no step runs)
    head, m_block = cutlass.Int32(first), cutlass.Int32(lo)
    for step in range(steps):
        slot = step % stages
        if step >= stages:  # every MMA warp is done with the stage's last block
            cute.arch.mbarrier_wait(cta.mbar + stages + 1 + slot, (step // stages + 1) % 2)
        copy_block(cta, head, m_block, slot)
        head, m_block = next_block(head, m_block, lo, per_head)


@cute.jit
def copy_block(cta: HopperCta, head, m_block, slot):
    """Warp 0: query block ``m_block`` of ``head``'s Q and dO tiles and its LSE and D rows
    into stage ``slot``, on the stage's full barrier."""
    tm = cta.config.tile_m
    rows_bytes = tm * 4
    full = cta.mbar + slot
    HopperCta.copy_tiles(cta, head, m_block, slot, 2 * rows_bytes)
    with cute.arch.elect_one():
        for source, dst in ((cta.src_lse, cta.sLSE), (cta.src_d, cta.sD)):
            block = cute.local_tile(cta.at_head(source, head), (tm,), (m_block,))
            bulk_copy_g2s(dst[None, slot].iterator.toint(), block.iterator.toint(),
                          rows_bytes, full.toint())


@cute.jit
def write_dq(cta: HopperCta, mdQacc, first, lo, per_head, steps, lane):
    """Warp 1: each step's staged dQ block into the fp32 accumulator, one bulk reduction from
    lane 0; a buffer is handed back once its reduction has read it."""
    mma_threads = cta.config.threads
    for buf in cutlass.range_constexpr(2):  # both buffers start free
        cute.arch.barrier_arrive(barrier_id=DQ_EMPTY + buf,
                                 number_of_threads=mma_threads + WRITER)
    head, m_block = cutlass.Int32(first), cutlass.Int32(lo)
    rows, d = cta.config.tile_m, cta.spec.head_dim
    for step in range(steps):
        buf = step % 2
        cute.arch.barrier(barrier_id=DQ_FULL + buf, number_of_threads=mma_threads + WRITER)
        if lane == 0:
            gdQ = dq_block(cta, mdQacc, head, m_block)
            src = cta.sdQ.iterator + buf * rows * d
            bulk_add_f32(gdQ.iterator.toint(), src.toint(), rows * d * 4)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier_arrive(barrier_id=DQ_EMPTY + buf,
                                 number_of_threads=mma_threads + WRITER)
        head, m_block = next_block(head, m_block, lo, per_head)
    if lane == 0:  # every reduction performed before the CTA exits
        cute.arch.cp_async_bulk_wait_group(0, read=False)


@cute.jit
def mma_block(cta: HopperCta, mdQacc, head, m_block, scale_log2, step,
              mine: cutlass.Constexpr[bool]):
    """One query block on the MMA warpgroups, its tiles landed in stage ``step % stages``: the
    Hopper kernel's products (``attention_bwd.query_block``), dSᵀ into its own stage, dQ
    handed to the writer warp, the stage handed back to the producer. ``mine``: this
    warpgroup computes (its share of) dQ."""
    c, d, lay = cta.config, cta.spec.head_dim, cta.lay
    tm, tn = c.tile_m, c.tile_n
    slot = step % c.stages
    acc_S = cute.make_rmem_tensor(cta.thr_sdp.partition_shape_C((tn, tm)), cutlass.Float32)
    acc_dP = cute.make_rmem_tensor(cta.thr_sdp.partition_shape_C((tn, tm)), cutlass.Float32)
    wgmmas([(lay.mma_sdp, acc_S, cta.tSrK, cta.tSrQ[None, None, None, slot])], True, None)
    wgmmas([(lay.mma_sdp, acc_dP, cta.tSrV, cta.tSrdO[None, None, None, slot])], True, 1)
    p_and_ds(cta, acc_S, acc_dP, m_block, scale_log2, slot)
    rdS = issue_dv(cta, acc_S, acc_dP, slot)
    # dSᵀ into this block's stage: the other warpgroup's dQ product of two blocks ago, the
    # last reader of that stage, was waited for before the last block's barrier
    cute.copy(cta.r2s_ds, cta.r2s_ds.retile(rdS), cta.tdSsdS[None, None, None, slot])
    cute.arch.fence_proxy("async.shared", space="cta")
    # (d96: each MMA warpgroup meets here from its own copy of the loop)
    named_barrier(DS_BARRIER, c.threads, aligned=not lay.dq_single)
    rdS_a = cute.make_tensor(rdS.iterator, acc_as_operand_a(rdS.layout))
    acc_dQ = cute.make_rmem_tensor(cta.thr_dq.partition_shape_C((tm, d)), cutlass.Float32)
    if cutlass.const_expr(mine):
        wgmmas([(lay.mma_dq, acc_dQ, cta.tQrdS[None, None, None, slot], cta.tQrKt)], True,
               None)
    wgmmas([(lay.mma_dkv, cta.acc_dK, rdS_a, cta.tKrQt[None, None, None, slot])], False, 1)
    # dQ into the writer's buffer once its last reduction has read it, under dK's MMAs
    named_barrier(DQ_EMPTY + slot, c.threads + WRITER, aligned=not lay.dq_single)
    if cutlass.const_expr(mine):
        stage_dq(acc_dQ, cta.tdQsdQ, slot, dq_turn_bytes(cta, mdQacc, head, m_block))
    warpgroup.wait_group(0)
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier_arrive(barrier_id=DQ_FULL + slot, number_of_threads=c.threads + WRITER,
                             aligned=not cta.lay.dq_single)
    if cta.tidx % 32 == 0:  # this warp is done with the stage (its MMAs waited)
        cute.arch.mbarrier_arrive(cta.mbar + c.stages + 1 + slot)


class WarpSpecializedBackward(HopperBackward):
    @cute.kernel
    def kernel(self, args):
        mdQacc = args.workspaces.dq_accum
        cta, first, lo, per_head, steps = self.begin(args)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                produce(cta, first, lo, per_head, steps)
            if warp == 1:
                write_dq(cta, mdQacc, first, lo, per_head, steps, cute.arch.lane_idx())
        else:
            if cutlass.const_expr(not cta.lay.dq_single):
                cute.arch.setmaxregister_increase(MMA_REGS)
                consume(cta, mdQacc, first, lo, per_head, steps, args, True)
            else:  # (compile time, then run time)
                if warp < 8:  # the first MMA warpgroup, dQ's
                    cute.arch.setmaxregister_increase(DQ_WG_REGS)
                    consume(cta, mdQacc, first, lo, per_head, steps, args, True)
                else:
                    cute.arch.setmaxregister_increase(OTHER_WG_REGS)
                    consume(cta, mdQacc, first, lo, per_head, steps, args, False)


@cute.jit
def consume(cta: HopperCta, mdQacc, first, lo, per_head, steps, args,
            mine: cutlass.Constexpr[bool]):
    """An MMA warpgroup: every step's block (``mma_block``), then dK and dV out."""
    head, m_block = cutlass.Int32(first), cutlass.Int32(lo)
    for step in range(steps):
        HopperCta.wait_tiles(cta, step)  # (through the class: see attention_bwd.py)
        mma_block(cta, mdQacc, head, m_block, args.scales.scale_log2, step, mine)
        head, m_block = next_block(head, m_block, lo, per_head)
    store_key_grads(cta, args.grads.dk, args.grads.dv, args.scales.scale)
