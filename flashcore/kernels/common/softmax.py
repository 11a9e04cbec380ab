"""Online softmax over key blocks (FlashAttention's running max and sum), one state per
accumulator row a thread holds.

exp2 with the softmax scale pre-multiplied by log2(e). Each row keeps its own scale
(``row_scale``): the FP8 kernel folds its query's descale into it. A row that has seen no key yet
keeps max = -inf and exponentiates against 0, so it gets p = 0 instead of NaN; a row that never
sees a key ends with sum 0, which the epilogue turns into output 0 and lse -inf.
"""


import copy
import math

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .fragments import quad_max, quad_sum

LN_2 = math.log(2.0)
LOG2_E = math.log2(math.e)
FORMS = ("offset", "exact", "rounded")  # how p's exp2 argument is formed (``OnlineSoftmax``)
# "rounded" keeps p's scale within a factor 2**-(2**-6) of the exact form's while every
# |max * scale| of its rows stays below this (two roundings up of an offset below 2**16)
ROUNDED_OFFSET_LIMIT = 2.0**16


@dsl_user_op
def offset_up(m, scale, p_log2: float, *, loc=None, ip=None) -> cutlass.Float32:
    """m * scale - p_log2, each step rounded up (``mul.rp``, ``add.rp``), so that
    exp2(s * scale - offset) <= 2**p_log2 for every s <= m."""
    args = [cutlass.Float32(x).ir_value(loc=loc, ip=ip) for x in (m, scale, -p_log2)]
    value = llvm.inline_asm(cutlass.Float32.mlir_type, args,
                            "{ .reg .f32 t; mul.rp.f32 t, $1, $2; add.rp.f32 $0, t, $3; }",
                            "=f,f,f,f", has_side_effects=False, loc=loc, ip=ip)
    return cutlass.Float32(value)


class OnlineSoftmax:
    """``form``: how p = exp2(...) is formed from a row's scores s.

    * ``"offset"``: FA2's one FMA, exp2(s * scale - max * scale). The rounding of max * scale
      shifts p once logits pass ~1e5; 16-bit P and its sums carry the same shift.
    * ``"exact"``: exp2((s - max) * scale), exact at the max however large the logits (an FP8
      kernel's e4m3 inputs may be of any magnitude, and a shifted max can put a whole row of P
      under e4m3's range). One FADD a score more.
    * ``"rounded"``: exp2(s * scale - offset) with the offset max * scale - p_log2 rounded up
      (``offset_up``: p <= 2**p_log2 still), one FMA a score. Safe only while
      |max * scale| < ``ROUNDED_OFFSET_LIMIT``: a kernel that can bound it before its key
      loop walks its keys in this form (``in_form``) where it holds, else exactly, and sets
      ``rounded`` (run time) to say which.

    ``p_log2``: p comes out multiplied by 2**p_log2, the sums with it; ``lse`` takes it out
    again. An FP8 kernel scales P so for its e4m3 conversion at no cost.

    ``sums``: ``"rows"``, each thread sums its p as it forms them; ``"mma"``, the kernel's
    MMAs sum P (rescaled with O by the same corrections) and ``finish`` takes their totals.
    """

    def __init__(self, rows: int, scale_log2, form: str = "offset", p_log2: float = 0.0,
                 sums: str = "rows"):
        assert form in FORMS, form
        assert sums in ("rows", "mma"), sums
        self.form = form
        self.p_log2 = p_log2
        self.sums = sums
        self.rounded = None  # run time: the key loop took the rounded form (``lse``)
        self.row_max = cute.make_rmem_tensor(rows, cutlass.Float32)
        self.row_sum = cute.make_rmem_tensor(rows, cutlass.Float32)
        self.row_scale = cute.make_rmem_tensor(rows, cutlass.Float32)
        self.row_max.fill(-cutlass.Float32.inf)
        self.row_sum.fill(0.0)
        self.row_scale.fill(scale_log2)

    def in_form(self, form: str) -> "OnlineSoftmax":
        """This softmax (the same state) forming p another way: one of a kernel's two key
        loops, chosen at run time."""
        assert form in FORMS, form
        other = copy.copy(self)
        other.form = form
        return other

    @cute.jit
    def update(self, S: cute.Tensor, O: cute.Tensor, factor=None):
        """One key block: S (rows, keys) of scores becomes P in place; the running max and sum
        move on, and O (rows, head_dim) is rescaled to the new max (and by ``factor``, common
        to every row, when given)."""
        correction = self.step(S)
        if cutlass.const_expr(factor is not None):
            correction.store(correction.load() * factor)
        self.rescale(O, correction)

    @cute.jit
    def step(self, S: cute.Tensor) -> cute.Tensor:
        """``update`` without touching O: S becomes P in place, the running max and sum move on;
        returns each row's correction (the factor O must be rescaled by, ``rescale``). Lets a
        kernel form P while the MMA that accumulates the previous block into O is in flight."""
        correction = cute.make_rmem_tensor(cute.size(S, mode=[0]), cutlass.Float32)
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            scale_log2 = self.row_scale[r]
            row = S[r, None].load()
            prev_max = self.row_max[r]
            cur_max = quad_max(row.reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0))
            cur_max = cute.arch.fmax(prev_max, cur_max)
            safe_max = 0.0 if cur_max == -cutlass.Float32.inf else cur_max
            if cutlass.const_expr(self.form == "rounded"):
                offset = offset_up(safe_max, scale_log2, self.p_log2)
                p = cute.math.exp2(
                    cute.math.fma(row, cute.full_like(row, scale_log2),
                                  cute.full_like(row, -offset)),
                    fastmath=True,
                )
                correction[r] = cute.math.exp2(
                    offset_up(prev_max, scale_log2, self.p_log2) - offset, fastmath=True)
            elif cutlass.const_expr(self.form == "exact"):
                if cutlass.const_expr(self.p_log2 != 0.0):  # one FMA with the P scale
                    logit = cute.math.fma(row - safe_max, cute.full_like(row, scale_log2),
                                          cute.full_like(row, self.p_log2))
                else:
                    logit = (row - safe_max) * scale_log2
                p = cute.math.exp2(logit, fastmath=True)
                correction[r] = cute.math.exp2((prev_max - safe_max) * scale_log2,
                                               fastmath=True)
            else:
                offset = safe_max * scale_log2
                p = cute.math.exp2(
                    cute.math.fma(row, cute.full_like(row, scale_log2),
                                  cute.full_like(row, -offset)),
                    fastmath=True,
                )
                correction[r] = cute.math.exp2(cute.math.fma(prev_max, scale_log2, -offset),
                                               fastmath=True)
            if cutlass.const_expr(self.sums == "rows"):
                # each thread sums its own columns; the quad's partial sums meet in finish()
                self.row_sum[r] = (self.row_sum[r] * correction[r]
                                   + p.reduce(cute.ReductionOp.ADD, 0.0, 0))
            self.row_max[r] = cur_max
            S[r, None] = p
        return correction

    @cute.jit
    def rescale(self, O: cute.Tensor, correction: cute.Tensor):
        """O (rows, head_dim) times each row's correction from ``step``."""
        for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
            O[r, None] = O[r, None].load() * correction[r]

    @cute.jit
    def finish(self, totals: cute.Tensor | None = None):
        """Sum each row's partial sums over the four lanes of its quad; with ``sums="mma"``
        take each row's total from ``totals`` (one per row, the MMA's sums)."""
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            if cutlass.const_expr(self.sums == "mma"):
                self.row_sum[r] = totals[r]
            else:
                self.row_sum[r] = quad_sum(self.row_sum[r])

    @cute.jit
    def inverse_sum(self, r: cutlass.Constexpr):
        """1 / row sum, and 0 for a row that saw no key (its sum is 0: output 0, not NaN)."""
        total = self.row_sum[r]
        inv = cute.arch.rcp_approx(total)
        return 0.0 if total == 0.0 else inv

    @cute.jit
    def lse(self, r: cutlass.Constexpr):
        """Natural-log log-sum-exp of row r's scaled scores; -inf for a row that saw no key."""
        total = self.row_sum[r]
        value = (self.row_max[r] * self.row_scale[r]
                 + cute.math.log2(total, fastmath=False)) * LN_2
        if cutlass.const_expr(self.p_log2 != 0.0):
            value = value - self.p_log2 * LN_2
        if cutlass.const_expr(self.rounded is not None):  # noqa: SIM102 - trace, then run time
            if self.rounded:  # the sums are relative to the rounded offset
                value = (offset_up(self.row_max[r], self.row_scale[r], self.p_log2)
                         + cute.math.log2(total, fastmath=False)) * LN_2
        return -cutlass.Float32.inf if total == 0.0 else value
