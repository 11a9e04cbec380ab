"""After the key loop: merge the CTA's warp groups (kv_splits > 1), then write the output.

* Final output: O / row sum (times the FP8 output scale) through shared memory to 16-byte
  predicated global stores; optional LSE.
* Split-KV across CTAs (``spec.split_kv``): this CTA's share, normalised, as fp32 rows of
  (num_splits · batch, heads, rows, head_dim) and its LSE; the combine kernel merges the shares.
* A packed batch (``varlen``): rows that no CTA computes, whatever the tables say, are written
  as 0 (LSE -inf), so the output never shows what its memory held before.
"""


import cutlass
import cutlass.cute as cute

from ..common.copies import copy_row
from ..common.epilogue import clear_rows_no_cta_owns, store_lse
from ..common.fragments import mn_view
from ..common.grid import packed_row, tile_coords
from ..common.softmax import OnlineSoftmax
from .cta import Cta
from .pipeline import group_sync


@cute.jit
def merge_groups(cta: Cta, softmax: OnlineSoftmax, storage):
    """Merge the warp groups' softmax states into the first group's registers: each publishes
    its row max and sum; every group rescales its O to the common max; the others add theirs
    into the first through fp32 shared memory."""
    c, d, g = cta.config, cta.spec.head_dim, cta.group
    sML = storage.sML.get_tensor(cute.make_layout((c.tile_m, 2, c.kv_splits)))
    sAcc = storage.sAcc.get_tensor(
        cute.make_layout((c.tile_m, d, c.kv_splits - 1), stride=(d, 1, c.tile_m * d)))
    rows = cta.row_coords()
    lane = cute.arch.lane_idx()
    for r in cutlass.range_constexpr(len(rows)):
        if lane % 4 == 0:
            sML[rows[r], 0, g] = softmax.row_max[r]
            sML[rows[r], 1, g] = softmax.row_sum[r]
    cute.arch.sync_threads()
    O = mn_view(cta.acc_O)
    for r in cutlass.range_constexpr(len(rows)):
        row = rows[r]
        scale_log2 = softmax.row_scale[r]
        new_max = sML[row, 0, 0]
        for j in cutlass.range_constexpr(1, c.kv_splits):
            new_max = cute.arch.fmax(new_max, sML[row, 0, j])
        safe_max = 0.0 if new_max == -cutlass.Float32.inf else new_max
        total = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(c.kv_splits):
            total += sML[row, 1, j] * cute.math.exp2((sML[row, 0, j] - safe_max) * scale_log2,
                                                     fastmath=True)
        mine = cute.math.exp2((softmax.row_max[r] - safe_max) * scale_log2, fastmath=True)
        O[r, None] = O[r, None].load() * mine
        softmax.row_max[r] = new_max
        softmax.row_sum[r] = total
    # (partitions taken outside the run-time `if`s: the DSL cannot carry `cta` through them)
    acc_O = cta.acc_O
    mine_acc = cta.thr_mma.partition_C(sAcc[None, None, cutlass.max(g - 1, 0)])
    others = [cta.thr_mma.partition_C(sAcc[None, None, j]) for j in range(c.kv_splits - 1)]
    if g > 0:
        mine_acc.store(acc_O.load())
    cute.arch.sync_threads()
    if g == 0:
        for j in cutlass.range_constexpr(c.kv_splits - 1):
            acc_O.store(acc_O.load() + others[j].load())


@cute.jit
def normalise(cta: Cta, softmax: OnlineSoftmax, o_scale):
    O = mn_view(cta.acc_O)
    for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
        O[r, None] = O[r, None].load() * (softmax.inverse_sum(r) * o_scale)


@cute.jit
def store_output(cta: Cta, softmax: OnlineSoftmax, mQ, mO, mLSE, o_scale):
    """The final output, in the output dtype, through shared memory to 16-byte stores."""
    lay, c, d, packed = cta.lay, cta.config, cta.spec.head_dim, cta.spec.packed_tokens
    m_block, head, batch, _ = tile_coords(mQ, cta.spec, cta.q_group)
    normalise(cta, softmax, o_scale)
    if cutlass.const_expr(mLSE is not None):
        if cutlass.const_expr(packed):
            store_lse(cta, softmax, lambda r: packed_row(mLSE, batch, head, r, cta.q_group),
                      m_block, scattered=True)
        else:
            store_lse(cta, softmax, cta.seqs.query_rows(mLSE, batch, head), m_block)

    rO = cute.make_rmem_tensor(cta.acc_O.layout, lay.out_dtype)
    rO.store(cta.acc_O.load().to(lay.out_dtype))
    r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                     lay.out_dtype), lay.tiled_mma)
    r2s_thr = r2s.get_slice(cta.tidx)
    group_sync(cta, 0)  # every warp is done reading sQ (O may reuse it)
    cute.copy(r2s, r2s_thr.retile(rO), r2s_thr.partition_D(cta.output_view(cta.sO)))
    group_sync(cta, 0)

    cO = cute.local_tile(cute.make_identity_tensor((cta.seqlen_q, d)), (c.tile_m, d),
                         (m_block, 0))
    r2g = lay.r2g_o.get_slice(cta.tidx)
    gO = None
    if cutlass.const_expr(packed):
        # each row goes to its (query head, token) (``packed_row``, ``copy_row``): a compact
        # stand-in gives the registers their shape (a row stride of 0 would make the rows share
        # registers)
        gO = cute.make_tensor(mO.iterator, cute.make_layout((c.tile_m, d), stride=(d, 1)))
    else:
        gO = cute.local_tile(cta.seqs.query_rows(mO, batch, head), (c.tile_m, d), (m_block, 0))
    tOsO, tOgO, tOcO = r2g.partition_S(cta.sO), r2g.partition_D(gO), r2g.partition_D(cO)
    tOrO = cute.make_rmem_tensor_like(tOgO, lay.out_dtype)
    cute.autovec_copy(tOsO, tOrO)
    for m in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
        row = tOcO[0, m, 0][0]
        if cute.elem_less(row, cta.seqlen_q):
            if cutlass.const_expr(packed):
                copy_row(lay.r2g_o, r2g.partition_D,
                         packed_row(mO, batch, head, row, cta.q_group), tOrO[None, m, None], m,
                         (c.tile_m, d), store=True)
            else:
                cute.copy(lay.r2g_o, tOrO[None, m, None], tOgO[None, m, None])
    if cutlass.const_expr(cta.spec.varlen):
        clear_unowned_rows(cta, mO, mLSE, m_block, head, batch)


@cute.jit
def clear_unowned_rows(cta: Cta, mO, mLSE, m_block, head, batch):
    """``common.epilogue.clear_unowned_rows`` for this CTA's group of threads."""
    clear_rows_no_cta_owns(cta.seqs.q_span, cta.seqs.cu_q.shape[0] - 2, mO, mLSE, m_block,
                           head, batch, cta.config.tile_m,
                           cta.config.group_threads, cta.tidx, cta.lay.out_dtype,
                           cta.spec.head_dim)


@cute.jit
def store_partials(cta: Cta, softmax: OnlineSoftmax, mQ, mO, mLSE, o_scale):
    """This CTA's share of the keys: normalised fp32 output rows and their LSE, at batch index
    split · batch_size + batch of the workspace."""
    c, d = cta.config, cta.spec.head_dim
    m_block, head, batch, split = tile_coords(mQ, cta.spec, cta.q_group)
    at = split * mQ.shape[0] + batch
    normalise(cta, softmax, o_scale)
    store_lse(cta, softmax, mLSE[at, head, None], m_block)
    gO = mn_view(cta.thr_mma.partition_C(cta.output_view(
        cute.local_tile(mO[at, head, None, None], (c.tile_m, d), (m_block, 0)))))
    cO = mn_view(cta.thr_mma.partition_C(cute.local_tile(
        cute.make_identity_tensor((cta.seqlen_q, d)), (c.tile_m, d), (m_block, 0))))
    O = mn_view(cta.acc_O)
    for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
        if cO[r, 0][0] < cta.seqlen_q:
            for col in cutlass.range_constexpr(cute.size(O, mode=[1])):
                gO[r, col] = O[r, col]
