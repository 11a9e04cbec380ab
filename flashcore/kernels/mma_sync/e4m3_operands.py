"""An e4m3 KV cache read straight into the 16-bit MMA's register fragments.

The cache's K and V blocks sit in shared memory as they are in global memory, (keys, head_dim)
e4m3 codes. ``ldmatrix`` reads them as 16-bit elements, two codes each, with the partition of
the m16n8k16 B operand over a tile of half the width; each 32-bit register it fills holds four
codes, which ``cvt.rn.f16x2.e4m3x2`` turns into exactly one MMA's worth of B fragment:

* K (not transposed): a lane gets codes 4t..4t+3 of a 16-column chunk of key row g. They
  become the fragment of columns (2t, 2t+1, 2t+8, 2t+9) of that chunk, so S = Q·Kᵀ sums over
  the head dimension in another order: Q's A fragment is read with the same permutation
  (``query_columns``). The sum is the same sum.
* V (transposed): a lane gets codes (2t, 2t+1) of keys 2u and 2u+1 of each 16-column chunk;
  split by parity, they are the B fragments of two n8 tiles, the even and the odd columns.
  O's columns come out permuted that way (``output_columns``), and are stored through a view
  that puts each where it belongs.

Nothing is written back to shared memory and no barrier is added: a block's stage is free
once its MMAs have read it. The codes are exact in fp16; each key's descales scale its scores
(K) and probabilities (V) in fp32, in ``block.py``.

Both output dtypes multiply in fp16 (one conversion a pair of codes; bf16 took three, e4m3 ->
f16 -> f32 -> bf16, 1.6x the instructions a key block): a bf16 Q is scaled once into fp16's
range by a power of two its rows' exp2 scales undo (``query_to_fp16``), and each block's V
descales by a power of two set by their largest, the running output's unit
(``pipeline.column_scales``), so P·v_descale never overflows fp16 and keeps its precision
over 29 octaves under the block's largest, whatever the cache's magnitude.
"""


import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from ..common.dtypes import E4M3
from ..common.mma import SmemOperand
from ..common.pow2 import pow2_above

# a bf16 query is scaled so that its warp's largest |q| lands in [2^14, 2^15): fp16 holds it
# exactly (its 11-bit significand takes bf16's 8) with room below 65504
_Q_TOP = 2.0**15
_Q_LEAST_EXPONENT = 16  # biased: 1 / scale * _Q_TOP stays finite for any |q|


def _columns(tile_m: int, head_dim: int, strides: tuple) -> cute.Layout:
    """(row, logical column) -> index of (row, head_dim column) in a column-major (tile_m,
    head_dim) tile, for logical column j + 2t + 8h + 16c (shape (2, 4, 2, head_dim / 16))
    going to head-dim column ``strides`` · (j, t, h) + 16c."""
    sj, st, sh = strides
    return cute.make_layout(
        (tile_m, ((2, 4, 2), head_dim // 16)),
        stride=(1, ((sj * tile_m, st * tile_m, sh * tile_m), 16 * tile_m)))


def query_columns(tile_m: int, head_dim: int) -> cute.Layout:
    """Q's columns in the order the converted K fragments hold the head dimension: logical
    column 2t + j (+8h) is head-dim column 4t + j (+2h) of each 16."""
    return _columns(tile_m, head_dim, (1, 4, 2))


def output_columns(tile_m: int, head_dim: int) -> cute.Layout:
    """O's columns as the converted V fragments produce them: n8 tile 2c + h, column 2t + j is
    head-dim column 16c + 4t + 2j + h."""
    return _columns(tile_m, head_dim, (2, 4, 1))


def permuted(tensor: cute.Tensor, columns: cute.Layout) -> cute.Tensor:
    """``tensor`` (tile_m, head_dim) seen with its columns in the order ``columns`` gives."""
    return cute.composition(tensor, columns)


class E4m3Operand:
    """K (``transposed=False``) or Vᵀ of an e4m3 ring, as the B operand of ``tiled_mma``.

    ``codes``: the ring as 16-bit elements, (rows, head_dim / 2, stages) for K, or
    (head_dim / 2, keys, stages) for Vᵀ; ``shape``: the 16-bit operand tile the MMAs multiply,
    (keys, head_dim) or (head_dim, keys)."""

    def __init__(self, tiled_mma, codes: cute.Tensor, transposed: bool, op_dtype, shape,
                 tidx):
        thr = tiled_mma.get_slice(tidx)
        ld = warp.LdMatrix8x8x16bOp(transpose=transposed, num_matrices=4)
        self.raw = SmemOperand(tiled_mma, cute.make_tiled_copy_B, ld, op_dtype, codes,
                               thr.make_fragment_B(thr.partition_B(codes[None, None, 0])),
                               tidx)
        self.frag = cute.make_rmem_tensor(
            thr.make_fragment_B(thr.partition_shape_B(shape)).layout, op_dtype)
        self.transposed = transposed
        self.op_dtype = op_dtype

    def stage(self, slot):
        return self.raw.stage(slot)

    @cute.jit
    def load(self, src, k: cutlass.Constexpr):
        """ldmatrix step ``k`` of the codes (16-bit step: 32 head-dim columns of K, 16 keys of
        Vᵀ)."""
        self.raw.load(src, k)

    @cute.jit
    def convert(self, k: cutlass.Constexpr):
        """The 16-bit fragments of ldmatrix step ``k``: K steps 2k and 2k + 1, or Vᵀ step k."""
        raw = self.raw.frag
        for n in cutlass.range_constexpr(cute.size(raw, mode=[1])):
            codes = cute.recast_tensor(raw[None, n, k], E4M3)  # 8 codes, 2 registers
            values = cute.make_rmem_tensor((8,), self.op_dtype)
            if cutlass.const_expr(self.op_dtype == cutlass.Float16):
                values.store(codes.load().to(self.op_dtype))  # cvt.rn.f16x2.e4m3x2
            else:
                values.store(codes.load().to(cutlass.Float32).to(self.op_dtype))
            if cutlass.const_expr(self.transposed):
                # value 2i + h: register i // 2, key 2u + i % 2 of column 2t + h
                for h in cutlass.range_constexpr(2):
                    for i in cutlass.range_constexpr(4):
                        self.frag[i, 2 * n + h, k] = values[2 * i + h]
            else:
                for half in cutlass.range_constexpr(2):
                    for i in cutlass.range_constexpr(4):
                        self.frag[i, n, 2 * k + half] = values[4 * half + i]


@cute.jit
def gemm_codes(tiled_mma, acc, a_frag, b: E4m3Operand, src):
    """acc += A · B with A's fragment in registers (Q, permuted; or P) and B's e4m3 codes in
    shared memory (K; or Vᵀ), each ldmatrix step converted while the next one loads. A step of
    K's codes feeds two of the MMA's k-steps (32 head-dim columns), a step of Vᵀ's one (16
    keys)."""
    steps = cute.size(b.raw.frag, mode=[2])
    per_step = 1 if cutlass.const_expr(b.transposed) else 2
    b.load(src, 0)
    for s in cutlass.range_constexpr(steps):
        if cutlass.const_expr(s + 1 < steps):
            b.load(src, s + 1)
        b.convert(s)
        for h in cutlass.range_constexpr(per_step):
            k = per_step * s + h
            cute.gemm(tiled_mma, acc, a_frag[None, None, k], b.frag[None, None, k], acc)


@cute.jit
def query_to_fp16(q_in: cute.Tensor, q_frag: cute.Tensor):
    """``q_frag`` = a bf16 query fragment ``q_in`` times the power of two that puts the warp's
    largest |q| in [2^14, 2^15); returns its inverse, the factor the rows' exp2 scales take
    (their scores come out scaled by it). Every warp holding the same rows (the warp groups of
    one CTA) finds the same factor."""
    x = q_in.load().to(cutlass.Float32)
    largest = cute.arch.fmax(x.reduce(cute.ReductionOp.MAX, 0.0, 0),
                             -x.reduce(cute.ReductionOp.MIN, 0.0, 0))
    largest = cute.arch.warp_reduction(largest, cute.arch.fmax)
    unit, inverse = pow2_above(largest, _Q_LEAST_EXPONENT)
    q_frag.store((x * (inverse * _Q_TOP)).to(cutlass.Float16))
    return unit * (1.0 / _Q_TOP)
