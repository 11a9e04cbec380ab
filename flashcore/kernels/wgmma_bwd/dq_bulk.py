"""dQ's fp32 adds as bulk reductions: a query block's dQ goes to shared memory (row-major, as
the accumulator in global memory lies) and one thread adds the whole block into global memory
with ``cp.reduce.async.bulk`` (one L2 reduction of whole lines, instead of a ``red.global`` per
pair of values a thread). Two shared buffers: a block's reduction reads its buffer while the
next block computes."""

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


@cute.jit
def stage_dq(acc_dQ: cute.Tensor, tdQsdQ: cute.Tensor, slot):
    """This thread's dQ into buffer ``slot``, fenced for the bulk copy's (async) proxy; the
    caller's barrier then makes the block whole."""
    tdQsdQ[None, None, None, slot].store(acc_dQ.load())
    cute.arch.fence_proxy("async.shared", space="cta")


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
