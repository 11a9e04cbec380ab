"""The warp-specialised kernel's epilogue: each consumer warpgroup's rows of O (divided by
their sums; FP8: times V's descale) through its share of the output tile in shared memory
(Q's buffer, or FP8's own) to 16-byte stores of the rows below seqlen_q, and the LSE."""

import cutlass
import cutlass.cute as cute

from ..common.epilogue import clear_rows_no_cta_owns, store_lse
from ..common.softmax import OnlineSoftmax
from ..hopper.fragments import acc_mn_view
from ..hopper.layouts import ROWS_PER_WARPGROUP, WARPGROUP
from .consumer import Consumer
from .layouts import EPILOGUE_BARRIER


@cute.jit
def store_output(cons: Consumer, softmax: OnlineSoftmax, mO: cute.Tensor,
                 mLSE: cute.Tensor | None, head, batch, o_scale, packed=None):
    """O / row sum (times ``o_scale`` for FP8), LSE, and the rows below seqlen_q out.
    ``packed``: a packed batch's (seq, head_dim) and (seq,) rows of this sequence and head, in
    place of (batch, head)'s, its (first row, rows) and the last sequence's index: then the
    rows no CTA owns are zeroed too (``clear_rows_no_cta_owns``)."""
    d, out_dtype = cons.spec.head_dim, cons.lay.out_dtype
    O = acc_mn_view(cons.acc_O)
    for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
        inv = softmax.inverse_sum(r)
        if cutlass.const_expr(o_scale is not None):
            inv = inv * o_scale
        O[r, None] = O[r, None].load() * inv
    if cutlass.const_expr(mLSE is not None):
        store_lse(cons, softmax, mLSE[batch, head, None] if packed is None else packed[1],
                  cons.m_block)
    rO = cute.make_rmem_tensor(cons.acc_O.layout, out_dtype)
    rO.store(cons.acc_O.load().to(out_dtype))
    # through shared memory: this warpgroup's rows of the output tile (Q's, which only its
    # own Q·Kᵀ read, every one completed), then 16-byte stores of the rows below seqlen_q
    r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                     out_dtype), cons.lay.pv_mma)
    r2s_thr = r2s.get_slice(cons.ctid)
    cute.copy(r2s, r2s_thr.retile(rO), r2s_thr.partition_D(cons.sO))
    cute.arch.barrier(barrier_id=EPILOGUE_BARRIER + cons.wg, number_of_threads=WARPGROUP)
    rows = ROWS_PER_WARPGROUP
    sO = cute.local_tile(cons.sO, (rows, d), (cons.wg, 0))
    gO = cute.local_tile(mO[batch, head, None, None] if packed is None else packed[0],
                         (rows, d),
                         (cons.m_block * cons.lay.consumers + cons.wg, 0))
    cO = cute.local_tile(cute.make_identity_tensor((cons.seqlen_q, d)), (rows, d),
                         (cons.m_block * cons.lay.consumers + cons.wg, 0))
    r2g = cons.lay.r2g_o.get_slice(cons.ctid % WARPGROUP)
    tOsO, tOgO, tOcO = r2g.partition_S(sO), r2g.partition_D(gO), r2g.partition_D(cO)
    tOrO = cute.make_rmem_tensor_like(tOgO, out_dtype)
    cute.autovec_copy(tOsO, tOrO)
    for m in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
        if cute.elem_less(tOcO[0, m, 0][0], cons.seqlen_q):
            cute.copy(cons.lay.r2g_o, tOrO[None, m, None], tOgO[None, m, None])
    if cutlass.const_expr(packed is not None):
        clear_rows_no_cta_owns(packed[2], packed[3], mO, mLSE, cons.m_block, head, batch,
                               cons.config.tile_m, cons.lay.consumers * WARPGROUP, cons.ctid,
                               out_dtype, d)
