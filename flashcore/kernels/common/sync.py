"""A named barrier that also reduces a predicate over its threads (the DSL has the barrier
alone), a named barrier that warps may also reach at different instructions, and a 32-bit
shared store to an address the caller computed (a swizzle applied by
hand)."""

import cutlass.cute as cute
from cutlass import Boolean, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def barrier_all(pred: Int32, barrier_id: Int32, threads: int, *, loc=None, ip=None) -> Boolean:
    """Wait at named barrier ``barrier_id`` (a run-time value) with ``threads`` threads;
    whether ``pred`` (non-zero) held in every one of them (``bar.red.and.pred``): the same
    answer in all of them."""
    args = [Int32(x).ir_value(loc=loc, ip=ip) for x in (pred, barrier_id)]
    value = llvm.inline_asm(
        Int32.mlir_type, args,
        "{ .reg .pred p, q; setp.ne.u32 p, $1, 0; "
        f"bar.red.and.pred q, $2, {threads}, p; selp.u32 $0, 1, 0, q; }}",
        "=r,r,r", has_side_effects=True, loc=loc, ip=ip)
    return Int32(value) != 0


@dsl_user_op
def st_shared_b32(addr: Int32, value: Int32, *, loc=None, ip=None) -> None:
    """One 32-bit store of ``value`` to shared-memory address ``addr``."""
    llvm.inline_asm(None, [Int32(addr).ir_value(loc=loc, ip=ip),
                           Int32(value).ir_value(loc=loc, ip=ip)],
                    "st.shared.b32 [$0], $1;", "r,r", has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def named_barrier(barrier_id: Int32, threads: int, *, aligned: bool = True, loc=None,
                  ip=None) -> None:
    """Wait at named barrier ``barrier_id`` (a run-time value) with ``threads`` threads.
    ``aligned=False``: ``barrier.sync`` without ``.aligned``, for warps that reach it at
    different instructions (two copies of one loop)."""
    if aligned:
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads, loc=loc, ip=ip)
        return
    llvm.inline_asm(None, [Int32(barrier_id).ir_value(loc=loc, ip=ip)],
                    f"barrier.sync $0, {threads};", "r", has_side_effects=True, loc=loc, ip=ip)
