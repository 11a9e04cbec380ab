"""Warp-level MMA over shared-memory operands: ldmatrix into register fragments, software-
pipelined over the K mode (fragment k + 1 loads while fragment k multiplies)."""


import cutlass
import cutlass.cute as cute


class SmemOperand:
    """An MMA operand read from shared memory by ldmatrix.

    ``smem``: this thread's partition of the operand's shared tile for the copy (modes (atom,
    M or N, K, ...stages)); ``frag``: the MMA register fragment; ``view``: the fragment as the
    copy sees it."""

    def __init__(self, tiled_mma, make_copy, ld_op, dtype, smem_tile, frag, tidx):
        self.copy = make_copy(cute.make_copy_atom(ld_op, dtype), tiled_mma)
        thr = self.copy.get_slice(tidx)
        self.smem = thr.partition_S(smem_tile)
        self.frag = frag
        self.view = thr.retile(frag)

    def stage(self, slot):
        """The partition of one stage (the last mode) of a staged tile."""
        return self.smem[None, None, None, slot]

    @cute.jit
    def load(self, src, k: cutlass.Constexpr):
        cute.copy(self.copy, src[None, None, k], self.view[None, None, k])


@cute.jit
def gemm_ss(tiled_mma, acc, a: SmemOperand, a_src, b: SmemOperand, b_src):
    """acc += A · B with both operands from shared memory (``a_src``/``b_src``: the stage)."""
    steps = cute.size(a_src, mode=[2])
    a.load(a_src, 0)
    b.load(b_src, 0)
    for k in cutlass.range_constexpr(steps):
        if cutlass.const_expr(k + 1 < steps):
            a.load(a_src, k + 1)
            b.load(b_src, k + 1)
        cute.gemm(tiled_mma, acc, a.frag[None, None, k], b.frag[None, None, k], acc)


@cute.jit
def gemm_rs(tiled_mma, acc, a_frag, b: SmemOperand, b_src):
    """acc += A · B with A already in registers (P) and B from shared memory."""
    steps = cute.size(a_frag, mode=[2])
    b.load(b_src, 0)
    for k in cutlass.range_constexpr(steps):
        if cutlass.const_expr(k + 1 < steps):
            b.load(b_src, k + 1)
        cute.gemm(tiled_mma, acc, a_frag[None, None, k], b.frag[None, None, k], acc)
