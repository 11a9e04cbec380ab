"""One consumer thread of the warp-specialised Hopper kernel, seen at trace time: its
warpgroup's MMA fragments over the shared tiles, its accumulators, P in the P·V MMA's A-operand
registers (or in its shared tile), and the coordinates of its scores (``attention_fwd.py`` walks
the keys with it)."""

import cutlass
import cutlass.cute as cute

from ..common.block_info import KeyBounds
from ..common.dtypes import E4M3
from ..common.sync import st_shared_b32
from ..hopper.fragments import ThreadCoords, acc_as_fp8_operand_a, acc_as_operand_a, acc_mn_view
from ..hopper.layouts import WARPGROUP
from . import row_sums
from .layouts import CONSUMERS_BARRIER, WsLayouts


def p_word_place(w: int) -> tuple[int, int]:
    """(row half r, 16-byte chunk c) of word ``w`` of the e4m3 A operand's registers in P's
    shared tile: word r + 2h of k32 step kk holds positions 32kk + 16h + 4t .. + 3 of row
    g + 8r (``acc_as_fp8_operand_a``), chunk 2kk + h of the row."""
    return w % 2, 2 * (w // 4) + w // 2 % 2


class Consumer(ThreadCoords):
    """Trace-time view of one consumer thread: its warpgroup's MMA fragments, accumulators and
    the coordinates of its scores."""

    def __init__(self, lay: WsLayouts, sQ, sK, sV, sO, sP, sOnes, ctid, m_block, seqlen_q,
                 seqlen_k, q_group, bounds: KeyBounds):
        spec, c = lay.spec, lay.spec.config
        d, tm, tn = spec.head_dim, c.tile_m, c.tile_n
        self.lay, self.spec, self.config = lay, spec, c
        self.m_block, self.seqlen_q, self.seqlen_k, self.q_group = (m_block, seqlen_q, seqlen_k,
                                                                    q_group)
        self.bounds = bounds  # the keys each token sees (``block_info``)
        self.softcap = (None, None)  # soft-capping's run-time factors (in, out)
        self.n_lo_unmasked = None  # a window's lower edge: blocks below it mask again
        wg = cute.arch.make_warp_uniform(ctid // WARPGROUP)
        self.sQ, self.sV, self.sO, self.ctid, self.wg = sQ, sV, sO, ctid, wg
        sVt = sV  # FP8: Vᵀ tiles as stored; else V's tiles seen as (head_dim, keys)
        if not lay.fp8:
            sVt = cute.composition(sV, cute.make_ordered_layout((d, tn, c.stages),
                                                                order=(1, 0, 2)))
        wg_qk, wg_pv = lay.qk_mma.get_slice(wg * WARPGROUP), lay.pv_mma.get_slice(wg * WARPGROUP)
        self.tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        self.tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        self.tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))
        self.thr_qk, self.thr_pv = lay.qk_mma.get_slice(ctid), lay.pv_mma.get_slice(ctid)
        self.acc_O = cute.make_rmem_tensor(self.thr_pv.partition_shape_C((tm, d)),
                                           cutlass.Float32)
        self.acc_O.fill(0.0)
        if lay.p_in_shared:
            self.tOrP = wg_pv.make_fragment_A(wg_pv.partition_A(sP))
        if lay.p_in_shared and not lay.fp8:
            # 16-bit P in the accumulator's layout, stored by stmatrix (four 8x8 tiles a warp)
            self.rP = cute.make_rmem_tensor(self.thr_qk.partition_shape_C((tm, tn)), lay.dtype)
            r2s = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), lay.dtype),
                lay.qk_mma)
            self.r2s_p, self.r2s_p_thr = r2s, r2s.get_slice(ctid)
            self.tPsP = self.r2s_p_thr.partition_D(sP)
        elif lay.p_in_shared:
            # this thread's first word of P (rows g and g + 8 of its warp's 16, 4 keys at 4t):
            # in the 128-byte swizzle row r of a 1 KB-aligned tile has its 16-byte chunks
            # XORed with r % 8 (= g), so here at chunk 0, and chunk c at this ^ (16 c)
            lane = ctid % 32
            row = wg * 64 + ctid % WARPGROUP // 32 * 16 + lane // 4
            self.p_word = sP.iterator.toint() + row * tn + lane // 4 * 16 + lane % 4 * 4
        else:
            p_layout = cute.make_layout(self.thr_qk.partition_shape_C((tm, tn)))
            if lay.fp8:  # P in the e4m3 A operand's register order
                p_layout = cute.make_layout(acc_as_fp8_operand_a(p_layout).shape)
            self.rP = cute.make_rmem_tensor(p_layout, lay.dtype)
        self.gKd = None  # FP8: this K/V head's per-key descales
        self.acc_L = None  # the row sums by the tensor cores (``row_sums.py``)
        if lay.sums_by_mma:
            wg_sum = lay.sum_mma.get_slice(wg * WARPGROUP)
            self.tLrOnes = wg_sum.make_fragment_B(wg_sum.partition_B(sOnes))
            self.tLrP = (wg_sum.make_fragment_A(wg_sum.partition_A(sP)) if lay.p_in_shared
                         else None)
            self.acc_L = cute.make_rmem_tensor(
                lay.sum_mma.get_slice(ctid).partition_shape_C((tm, row_sums.COLUMNS)),
                cutlass.Float32)
            self.acc_L.fill(0.0)

    def set_probabilities(self, acc_S: cute.Tensor):
        """P (the scores after ``softmax.step``) into the P·V MMA's A operand registers: e4m3
        gathered in operand order, or the 16-bit dtype as it lies."""
        if self.lay.p_in_shared:
            self.store_p(acc_S)
        elif self.lay.fp8:
            as_a = cute.make_tensor(acc_S.iterator, acc_as_fp8_operand_a(acc_S.layout))
            self.rP.store(as_a.load().to(E4M3))  # P_SCALE is in p already (softmax p_log2)
        else:
            self.rP.store(acc_S.load().to(self.lay.dtype))

    @cute.jit
    def store_p(self, acc_S: cute.Tensor):
        """P into its shared tile: 16-bit P by ``stmatrix`` from the accumulator's layout; e4m3
        P as the A operand's registers (``acc_as_fp8_operand_a``, in the order Vᵀ's keys are
        stored), the tile's 32-bit words (``p_word_place``). Written after the previous P·V has
        completed; then fenced for the async proxy, and the warp synchronised (its part of the
        wgmma reads only its own 16 rows)."""
        if cutlass.const_expr(not self.lay.fp8):
            self.rP.store(acc_S.load().to(self.lay.dtype))
            cute.copy(self.r2s_p, self.r2s_p_thr.retile(self.rP), self.tPsP)
        else:
            as_a = cute.make_tensor(acc_S.iterator, acc_as_fp8_operand_a(acc_S.layout))
            codes = cute.make_rmem_tensor(cute.make_layout(as_a.shape), E4M3)
            codes.store(as_a.load().to(E4M3))
            words = cute.make_tensor(cute.recast_ptr(codes.iterator, dtype=cutlass.Int32),
                                     cute.make_layout(cute.size(codes) // 4))
            for w in cutlass.range_constexpr(cute.size(words)):
                r, chunk = p_word_place(w)
                st_shared_b32((self.p_word ^ (16 * chunk)) + r * 8 * self.config.tile_n,
                              words[w])
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()

    def pv_products(self, slot) -> list:
        """The P·V group's (tiled MMA, accumulator, A, B): O += P·V of stage ``slot``, and the
        row sums += P·ones where the tensor cores sum the rows."""
        products = [(self.lay.pv_mma, self.acc_O, self.operand_p(),
                     self.tOrVt[None, None, None, slot])]
        if self.lay.sums_by_mma:
            p = self.tLrP if self.lay.p_in_shared else self.operand_p()
            products.append((self.lay.sum_mma, self.acc_L, p, self.tLrOnes))
        return products

    def rescale(self, softmax, correction: cute.Tensor):
        """O (and the MMA's row sums) times each row's correction."""
        softmax.rescale(acc_mn_view(self.acc_O), correction)
        if self.lay.sums_by_mma:
            softmax.rescale(row_sums.sums_view(self.acc_L), correction)

    def operand_p(self) -> cute.Tensor:
        if self.lay.p_in_shared:
            return self.tOrP
        if self.lay.fp8:
            return self.rP
        return cute.make_tensor(self.rP.iterator, acc_as_operand_a(self.rP.layout))

    def new_key_descales(self):
        """FP8 with K descaled per token: registers for the per-key descales of one block's
        scores; else None (a per-head K descale is in the rows' exp2 scales)."""
        if not self.lay.fp8 or self.spec.k_scale != "token":
            return None
        c = self.config
        cols = acc_mn_view(self.thr_qk.partition_C(cute.make_identity_tensor((c.tile_m,
                                                                              c.tile_n))))
        return cute.make_rmem_tensor(cute.size(cols, mode=[1]), cutlass.Float32)

    def new_scores(self):
        c = self.config
        return cute.make_rmem_tensor(self.thr_qk.partition_shape_C((c.tile_m, c.tile_n)),
                                     cutlass.Float32)


@cute.jit
def clear_rows(stage: cute.Tensor, first, ctid, threads: cutlass.Constexpr):
    """Zero rows ``first``.. of a (rows, cols) shared tile, ``threads`` threads a share (this
    one ``ctid``), fenced for the async proxy; then those threads meet at
    ``CONSUMERS_BARRIER`` (none of them reads the tile before all have written)."""
    rows, cols = cute.size(stage, mode=[0]), cute.size(stage, mode=[1])
    chunks = cols // 8  # 16-byte chunks a row: the swizzle moves chunks, not their elements
    zero = cute.make_rmem_tensor((8,), stage.element_type)
    zero.fill(0.0)
    for i in range(ctid, (rows - first) * chunks, threads):
        row = first + i // chunks
        cute.autovec_copy(zero, cute.local_tile(stage[row, None], (8,), (i % chunks,)))
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=CONSUMERS_BARRIER, number_of_threads=threads)
