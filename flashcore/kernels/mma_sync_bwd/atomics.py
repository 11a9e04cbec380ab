"""fp32 reductions into global memory: the dQ accumulator every key block adds into."""

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def red_add_f32(value, address, *, loc=None, ip=None) -> None:
    """``red.global.add.f32``: add ``value`` at global ``address`` (an Int64), no result (the
    fire-and-forget form: the thread does not wait for the sum)."""
    llvm.inline_asm(None, [cutlass.Int64(address).ir_value(loc=loc, ip=ip),
                           cutlass.Float32(value).ir_value(loc=loc, ip=ip)],
                    "red.global.add.f32 [$0], $1;", "l,f", has_side_effects=True,
                    loc=loc, ip=ip)


@dsl_user_op
def red_add_v2_f32(a, b, address, *, loc=None, ip=None) -> None:
    """``red.global.add.v2.f32`` (sm_90): add ``a`` and ``b`` at the 8-byte aligned ``address``
    and the next float, one instruction for both."""
    llvm.inline_asm(None, [cutlass.Int64(address).ir_value(loc=loc, ip=ip),
                           cutlass.Float32(a).ir_value(loc=loc, ip=ip),
                           cutlass.Float32(b).ir_value(loc=loc, ip=ip)],
                    "red.global.add.v2.f32 [$0], {$1, $2};", "l,f,f", has_side_effects=True,
                    loc=loc, ip=ip)


@cute.jit
def add_into(acc: cute.Tensor, dst: cute.Tensor, pairs: cutlass.Constexpr = False, turn=0):
    """Add every element of register fragment ``acc`` into ``dst`` (its partition of a global
    fp32 tensor, shaped like ``acc``), each address XORed with ``turn`` (``dq_layout``).
    ``pairs``: ``acc`` is an MMA accumulator (each atom's values 2j and 2j + 1 are adjacent
    columns of one row) over an even-strided, 8-byte aligned ``dst``: one ``red.v2`` per pair
    (sm_90), half the atomics."""
    if cutlass.const_expr(pairs):
        for j in cutlass.range_constexpr(cute.size(acc) // 2):
            ptr = dst.iterator + cute.crd2idx(2 * j, dst.layout)
            red_add_v2_f32(acc[2 * j], acc[2 * j + 1], ptr.toint() ^ turn)
    else:
        for i in cutlass.range_constexpr(cute.size(acc)):
            ptr = dst.iterator + cute.crd2idx(i, dst.layout)
            red_add_f32(acc[i], ptr.toint() ^ turn)
