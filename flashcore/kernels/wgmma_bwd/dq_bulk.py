"""dQ's fp32 adds as bulk reductions: a query block's dQ goes to shared memory (as the
accumulator in global memory lies, ``mma_sync_bwd/dq_layout.py``) and one thread adds the whole
block into global memory with ``cp.reduce.async.bulk`` (one L2 reduction of whole lines,
instead of a ``red.global`` per pair of values a thread). Two shared buffers: a block's
reduction reads its buffer while the next block computes."""

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def bulk_add_f32(gaddr, saddr, size: int, *, loc=None, ip=None) -> None:
    """``cp.reduce.async.bulk .add.f32``: add ``size`` bytes of fp32 at shared address
    ``saddr`` into global address ``gaddr`` (both 16-byte aligned), in this thread's bulk
    group."""
    llvm.inline_asm(None, [cutlass.Int64(gaddr).ir_value(loc=loc, ip=ip),
                           cutlass.Int32(saddr).ir_value(loc=loc, ip=ip)],
                    "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 "
                    f"[$0], [$1], {size};", "l,r", has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_shared_v2_f32(a, b, saddr, *, loc=None, ip=None) -> None:
    """``st.shared.v2.f32``: ``a`` and ``b`` at the 8-byte aligned shared address ``saddr``."""
    llvm.inline_asm(None, [cutlass.Int32(saddr).ir_value(loc=loc, ip=ip),
                           cutlass.Float32(a).ir_value(loc=loc, ip=ip),
                           cutlass.Float32(b).ir_value(loc=loc, ip=ip)],
                    "st.shared.v2.f32 [$0], {$1, $2};", "r,f,f", has_side_effects=True,
                    loc=loc, ip=ip)


@cute.jit
def stage_dq(acc_dQ: cute.Tensor, tdQsdQ: cute.Tensor, slot, turn):
    """This thread's dQ into buffer ``slot`` as the accumulator in global memory lays it out
    (each address XORed with ``turn``: ``mma_sync_bwd/dq_layout.py``, which spreads a warp's
    eight rows over the banks); the caller fences them for the bulk copy's (async) proxy once
    no MMA is in flight, and a barrier then makes the block whole. Values 2j and 2j + 1 of the
    accumulator are adjacent columns."""
    dst = tdQsdQ[None, None, None, slot]
    for j in cutlass.range_constexpr(cute.size(acc_dQ) // 2):
        ptr = dst.iterator + cute.crd2idx(2 * j, dst.layout)
        st_shared_v2_f32(acc_dQ[2 * j], acc_dQ[2 * j + 1], ptr.toint() ^ turn)


@cute.jit
def issue_dq(sdQ: cute.Tensor, gdQ: cute.Tensor, slot, tidx):
    """Thread 0: add buffer ``slot`` (a whole staged block, after a barrier) into ``gdQ`` (the
    block's rows of the fp32 accumulator, contiguous)."""
    if tidx == 0:
        rows, cols = cute.size(gdQ, mode=[0]), cute.size(gdQ, mode=[1])
        src = sdQ.iterator + slot * rows * cols
        bulk_add_f32(gdQ.iterator.toint(), src.toint(), rows * cols * 4)
        cute.arch.cp_async_bulk_commit_group()


@cute.jit
def wait_dq_read(tidx):
    """Thread 0: the reductions issued so far have read their buffers (before a barrier that
    hands a buffer back to every thread)."""
    if tidx == 0:
        cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def wait_dq_done(tidx):
    """Thread 0: every reduction has been performed (before the CTA exits)."""
    if tidx == 0:
        cute.arch.cp_async_bulk_wait_group(0, read=False)
