"""Special registers read so the compiler cannot merge two reads.

``cute.arch.block_idx()`` is a pure intrinsic: LLVM merges every read of it, so coordinates
computed from it at a kernel's start and again in its epilogue become one value kept live (or
spilled) through the whole key loop. A read with side effects is done again where it is
written, and whatever was derived from the first read dies early.
"""

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


def _fresh(register: str, loc, ip) -> Int32:
    value = llvm.inline_asm(Int32.mlir_type, [], f"mov.u32 $0, {register};", "=r",
                            has_side_effects=True, loc=loc, ip=ip)
    return Int32(value)


@dsl_user_op
def fresh_ctaid(axis: str = "x", *, loc=None, ip=None) -> Int32:
    """%ctaid.<axis>, read again here (never merged with another read)."""
    return _fresh(f"%ctaid.{axis}", loc, ip)


@dsl_user_op
def fresh_nctaid(axis: str = "x", *, loc=None, ip=None) -> Int32:
    """%nctaid.<axis> (the grid's size), read again here."""
    return _fresh(f"%nctaid.{axis}", loc, ip)


@dsl_user_op
def opaque(x: Int32, *, loc=None, ip=None) -> Int32:
    """``x``, through a move the compiler cannot merge with another: what is computed from it
    here is computed again, not kept live from an earlier computation of the same value."""
    value = llvm.inline_asm(Int32.mlir_type, [Int32(x).ir_value(loc=loc, ip=ip)],
                            "mov.b32 $0, $1;", "=r,r", has_side_effects=True, loc=loc, ip=ip)
    return Int32(value)


@dsl_user_op
def sm_count(*, loc=None, ip=None) -> Int32:
    """``%nsmid``: an upper bound of this GPU's SM ids (its SM count, or a little more), read
    again here."""
    return _fresh("%nsmid", loc, ip)
