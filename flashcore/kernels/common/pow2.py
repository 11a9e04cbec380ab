"""Exact power-of-two scales read off a float's exponent bits (no rounding to apply or undo).

An FP8 KV cache's kernels multiply in fp16 (``mma_sync/e4m3_operands.py``): a bf16 query and
each block's value descales are brought into fp16's range by such a scale, and its inverse goes
where the scale must be undone (the exp2 scale of the query's row; the running output's unit).
"""

import cutlass
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

# biased exponents kept within fp32's normal range, so that a scale and its inverse are finite,
# nonzero and exact
_LEAST, _MOST = 1, 252


@dsl_user_op
def float_bits(x, *, loc=None, ip=None) -> cutlass.Int32:
    """The bits of fp32 ``x``."""
    value = llvm.inline_asm(cutlass.Int32.mlir_type, [cutlass.Float32(x).ir_value(loc=loc, ip=ip)],
                            "mov.b32 $0, $1;", "=r,f", has_side_effects=False, loc=loc, ip=ip)
    return cutlass.Int32(value)


@dsl_user_op
def bits_float(bits, *, loc=None, ip=None) -> cutlass.Float32:
    """The fp32 of ``bits``."""
    value = llvm.inline_asm(cutlass.Float32.mlir_type,
                            [cutlass.Int32(bits).ir_value(loc=loc, ip=ip)],
                            "mov.b32 $0, $1;", "=f,r", has_side_effects=False, loc=loc, ip=ip)
    return cutlass.Float32(value)


def pow2_above(x, least: int = _LEAST):
    """(s, 1 / s) for ``x`` >= 0: s = 2^(floor(log2 x) + 1), the least power of two above x,
    so x / s lies in [0.5, 1). ``least`` bounds x's biased exponent from below (a zero or tiny x
    gets s = 2^(least - 126)); above, s stays below 2^126, so 1 / s is a normal number too.
    Needs a kernel's tracing context (DSL integers)."""
    e = cutlass.max(cutlass.min((float_bits(x) >> 23) & 0xFF, _MOST), least)
    return bits_float((e + 1) << 23), bits_float((253 - e) << 23)


def pow2_inverse(x):
    """1 / x, exactly, for a power of two ``x`` whose biased exponent is in [1, 253]."""
    return bits_float((254 - ((float_bits(x) >> 23) & 0xFF)) << 23)
