"""One CTA's share of the work, set up once at the kernel's start: which query tile, head, batch
and key range it owns, its global and shared tiles, their copy partitions, and the MMA operands.

The grid and the K/V head of a query head: ``common/grid.py``.
"""


import cutlass
import cutlass.cute as cute

from ..common.block_info import UNBOUNDED, KeyBounds, key_range
from ..common.fragments import mn_view
from ..common.grid import kv_head_of, packed_row, tile_coords
from ..common.mma import SmemOperand
from ..common.sequences import Sequences
from .e4m3_operands import E4m3Operand, output_columns, permuted, query_columns
from .layouts import KernelLayouts


class Cta:
    """Trace-time view of one CTA (or, with kv_splits > 1, of one of its warp groups)."""

    def __init__(self, lay: KernelLayouts, storage, mQ, mK, mV, mKd, mVd, q_group, num_splits,
                 window_left, window_right, seqs: Sequences):
        spec, c = lay.spec, lay.spec.config
        d, tm, tn = spec.head_dim, c.tile_m, c.tile_n
        self.lay, self.spec, self.config = lay, spec, c
        cta_tidx, _, _ = cute.arch.thread_idx()
        self.group, self.tidx = 0, cta_tidx  # kv_splits groups of `warps` warps
        if cutlass.const_expr(c.kv_splits > 1):
            self.group, self.tidx = cta_tidx // c.group_threads, cta_tidx % c.group_threads
        self.m_block, head, batch, split = tile_coords(mQ, spec, q_group)
        if cutlass.const_expr(not spec.split_kv):
            num_splits = 1  # one CTA per query tile: its key range is known at compile time
        packed = spec.packed_tokens  # the grid's heads are K/V heads (``query_tile``)
        self.kv_head = head if cutlass.const_expr(packed) else kv_head_of(head, mQ, mK)
        self.key_descales(mK, mKd, mVd, seqs, batch)
        self.seqs = seqs
        self.seqlen_q, self.seqlen_k = seqs.query_len(mQ, batch), seqs.key_len(mK, batch)
        if cutlass.const_expr(packed):
            self.seqlen_q = self.seqlen_q * q_group
        self.q_group = q_group
        self.key_share(split, num_splits, window_left, window_right)

        # ---- global tiles and their coordinates (for predicates and masks) --------------------
        gQ = self.query_tile(mQ, head, batch)
        if cutlass.const_expr(spec.paged_kv):
            self.mK, self.mV, self.batch = mK, mV, batch  # pages or rows: ``paged_sources``
        else:
            gK = cute.local_tile(seqs.key_rows(mK, batch, self.kv_head), (tn, d), (None, 0))
            if cutlass.const_expr(lay.fp8):  # Vᵀ, padded with zero keys: never ragged
                gV = cute.local_tile(mV[batch, self.kv_head, None, None], (d, tn), (0, None))
            else:
                gV = cute.local_tile(seqs.key_rows(mV, batch, self.kv_head), (tn, d),
                                     (None, 0))
        cQ = cute.local_tile(cute.make_identity_tensor((self.seqlen_q, d)), (tm, d),
                             (self.m_block, 0))
        cKV = cute.local_tile(cute.make_identity_tensor((self.seqlen_k, d)), (tn, d), (None, 0))

        # ---- shared tiles -------------------------------------------------------------------
        g = self.group
        self.sQ = storage.sQ.get_tensor(lay.sQ)
        self.sK_ring = storage.sK.get_tensor(lay.sK_ring)[None, None, None, g]  # (keys, d, stage)
        self.sV_ring = storage.sV.get_tensor(lay.sV_ring)[None, None, None, g]
        if cutlass.const_expr(lay.kv_fp8):
            scales = cute.make_layout((tn, c.stages, c.kv_splits))
            self.sKd = storage.sKd.get_tensor(scales)[None, None, g]  # (keys, stage)
            self.sVd = storage.sVd.get_tensor(scales)[None, None, g]
            # the codes as 16-bit elements: K (keys, d / 2, stage), Vᵀ (d / 2, keys, stage)
            sK = storage.sK.get_tensor(lay.sK_codes, dtype=lay.op_dtype)[None, None, None, g]
            sV = storage.sV.get_tensor(lay.sK_codes, dtype=lay.op_dtype)[None, None, None, g]
            sVt = transposed(sV, d // 2, tn)
        else:
            sK, sVt = self.sK_ring, self.sV_ring  # fp8's V is already (head_dim, keys, stage)
            if cutlass.const_expr(not lay.fp8):
                sVt = transposed(self.sV_ring, d, tn)  # V as (head_dim, keys): P·V's B operand
        if cutlass.const_expr(lay.fp8):
            self.sO = storage.sO.get_tensor(lay.sO)
        else:
            self.sO = cute.make_tensor(self.sQ.iterator, lay.sO)  # Q's buffer, free by then

        # ---- global->shared copy partitions ------------------------------------------------------
        self.q_copy = q_copy = lay.g2s_q.get_slice(self.tidx)
        self.tQsQ, self.tQcQ = q_copy.partition_D(self.sQ), q_copy.partition_S(cQ)
        if cutlass.const_expr(not spec.packed_tokens):
            self.tQgQ = q_copy.partition_S(gQ)
        k_copy, v_copy = lay.g2s_k.get_slice(self.tidx), lay.g2s_v.get_slice(self.tidx)
        self.k_copy = k_copy
        if cutlass.const_expr(spec.paged_kv):
            self.tKsK = k_copy.partition_D(self.sK_ring)
            self.tVsV = v_copy.partition_D(self.sV_ring)
        else:
            self.tKgK, self.tKsK = k_copy.partition_S(gK), k_copy.partition_D(self.sK_ring)
            self.tVgV, self.tVsV = v_copy.partition_S(gV), v_copy.partition_D(self.sV_ring)
        self.tKVcKV = k_copy.partition_S(cKV)
        if cutlass.const_expr(spec.paged_kv):
            self.paged_sources()

        self.mma_operands(sK, sVt)

    def paged_sources(self):
        """Where a paged cache's K and V blocks come from (``pipeline.issue_paged``). With the
        page size compiled in, ``k_paged(i)``/``v_paged(i)`` is the sequence's page i. Else a
        block is gathered a row at a time: ``k_paged(m, key)`` looks up the page of this
        thread's row ``m`` (key ``key``) and keeps it, so ``v_paged(m, key)``, issued after it
        for the same block in every schedule, reuses it (one table read and one division per
        row instead of two)."""
        seqs, batch = self.seqs, self.batch
        if cutlass.const_expr(self.spec.page_size):
            self.k_paged = lambda i: seqs.page(self.mK, batch, self.kv_head, i)
            self.v_paged = lambda i: seqs.page(self.mV, batch, self.kv_head, i)
        else:
            slots = cute.make_rmem_tensor((cute.size(self.tKsK, mode=[1]), 2), cutlass.Int32)

            def k_row(m, key):
                page, row = seqs.paged_slot(self.mK, batch, key)
                slots[m, 0], slots[m, 1] = page, row
                return self.mK[page, self.kv_head, row, None]

            def v_row(m, key):
                return self.mV[slots[m, 0], self.kv_head, slots[m, 1], None]

            self.k_paged, self.v_paged = k_row, v_row

    def query_tile(self, mQ, head, batch):
        """The CTA's (tile_m, head_dim) tile of Q; with ``packed_tokens`` None, and row r of the
        tile is gathered from ``q_row(r)`` (``grid.packed_row``)."""
        spec = self.spec
        if cutlass.const_expr(spec.packed_tokens):
            q_group = self.q_group
            self.q_row = lambda r: packed_row(mQ, batch, head, r, q_group)
            return None
        return cute.local_tile(self.seqs.query_rows(mQ, batch, head),
                               (spec.tile_m, spec.head_dim), (self.m_block, 0))

    def key_descales(self, mK, mKd, mVd, seqs: Sequences, batch):
        """Per-key descales of this K/V head: of K (FP8 operands, or an FP8 KV cache) and of V
        (an FP8 KV cache; FP8 operands scale V per head, in the epilogue). A paged cache's are
        looked up a page at a time: ``gKd(i)`` is page i's."""
        if cutlass.const_expr(self.spec.paged_kv and self.lay.kv_fp8):
            self.gKd = lambda i: seqs.page(mKd, batch, self.kv_head, i)
            self.gVd = lambda i: seqs.page(mVd, batch, self.kv_head, i)
            self.page_size = mK.shape[2]  # the cache's, when not compiled in
        else:
            per_key = mKd is not None and self.spec.k_scale == "token"
            self.gKd = mKd[batch, self.kv_head, None] if per_key else None
            self.gVd = mVd[batch, self.kv_head, None] if self.lay.kv_fp8 else None

    def mma_operands(self, sK, sVt):
        """The MMA operands (Q, K and Vᵀ from shared memory; for an FP8 KV cache Q's permuted
        fragment in registers and the K and V codes) and the output accumulator."""
        lay, c, d = self.lay, self.config, self.spec.head_dim
        mma = lay.tiled_mma
        self.thr_mma = frag = mma.get_slice(self.tidx)
        if cutlass.const_expr(lay.kv_fp8):
            # Q's fragment, read once (the prologue) in the head-dim order of the K codes; a
            # bf16 Q through a fragment of its own, scaled into fp16's range from there
            self.q_src = frag.partition_A(permuted(self.sQ, query_columns(c.tile_m, d)))
            q_layout = frag.make_fragment_A(self.q_src).layout
            self.q_frag = cute.make_rmem_tensor(q_layout, lay.op_dtype)
            self.q_in = (cute.make_rmem_tensor(q_layout, lay.q_dtype) if lay.q_rescaled
                         else self.q_frag)
            self.k = E4m3Operand(mma, sK, False, lay.op_dtype, (c.tile_n, d), self.tidx)
            self.vt = E4m3Operand(mma, sVt, True, lay.op_dtype, (d, c.tile_n), self.tidx)
            # acc_O's unit and the largest so far: P·V sums each block's values scaled into
            # fp16's range (``pipeline.column_scales``), the running sum rescaled when the unit
            # moves
            self.v_unit = cute.make_rmem_tensor(2, cutlass.Float32)
            self.v_unit[0] = 1.0
            self.v_unit[1] = 0.0
        else:
            ld_a, ld_v = lay.ldmatrix_ops()
            self.q = SmemOperand(mma, cute.make_tiled_copy_A, ld_a, lay.op_dtype, self.sQ,
                                 frag.make_fragment_A(frag.partition_A(self.sQ)), self.tidx)
            self.k = SmemOperand(mma, cute.make_tiled_copy_B, ld_a, lay.op_dtype, sK,
                                 frag.make_fragment_B(frag.partition_B(sK[None, None, 0])),
                                 self.tidx)
            self.vt = SmemOperand(mma, cute.make_tiled_copy_B, ld_v, lay.op_dtype, sVt,
                                  frag.make_fragment_B(frag.partition_B(sVt[None, None, 0])),
                                  self.tidx)
        self.acc_O = cute.make_rmem_tensor(frag.partition_shape_C((c.tile_m, d)),
                                           cutlass.Float32)
        self.acc_O.fill(0.0)

    def output_view(self, tile: cute.Tensor) -> cute.Tensor:
        """A (tile_m, head_dim) output tile seen in the column order of ``acc_O`` (permuted
        for an FP8 KV cache, ``e4m3_operands.output_columns``)."""
        if cutlass.const_expr(self.lay.kv_fp8):
            return permuted(tile, output_columns(self.config.tile_m, self.spec.head_dim))
        return tile

    def key_share(self, split, num_splits, window_left, window_right):
        """The key blocks this CTA (group) walks, ``n_hi - 1`` down to ``n_lo``, the lowest that
        no window cuts (``n_lo_unmasked``), and the bounds its masks apply."""
        c = self.config
        self.bounds = self.key_bounds(window_left, window_right)
        self.n_lo, self.n_hi, self.n_lo_unmasked = key_range(
            self.m_block, c.tile_m, c.tile_n, self.seqlen_k, self.bounds, self.q_group, split,
            num_splits, self.group, c.kv_splits, cutlass.min, cutlass.max)
        if cutlass.const_expr(self.spec.varlen):
            # a tile past its sequence's end (the grid covers the longest) walks no keys
            live = cutlass.min(cutlass.max(self.seqlen_q - self.m_block * c.tile_m, 0), 1)
            self.n_hi = self.n_lo + (self.n_hi - self.n_lo) * live

    def key_bounds(self, window_left, window_right) -> KeyBounds:
        """The keys each token sees (``block_info``): bottom-right alignment puts the last
        query token (rows / q_group tokens: packed GQA rows, token-major) on the last key."""
        spec = self.spec
        offset = 0
        if cutlass.const_expr(spec.mask_align == "bottom_right"):
            offset = self.seqlen_k - self.seqlen_q // self.q_group
        left, right = UNBOUNDED, UNBOUNDED
        if cutlass.const_expr(spec.window):
            left, right = window_left, window_right
        return KeyBounds(spec.causal, spec.shifted_mask, spec.window, offset, left, right)

    def score_coords(self, n_block):
        """(query row, key) of each score this thread holds, as an (rows, keys) view."""
        c = self.config
        cS = cute.local_tile(cute.make_identity_tensor((self.seqlen_q, self.seqlen_k)),
                             (c.tile_m, c.tile_n), (self.m_block, n_block))
        return mn_view(self.thr_mma.partition_C(cS))

    def row_coords(self) -> list:
        """The row, within the query tile, of each accumulator row this thread holds (static)."""
        rows = mn_view(self.thr_mma.partition_C(
            cute.make_identity_tensor((self.config.tile_m, self.spec.head_dim))))
        return [rows[r, 0][0] for r in range(cute.size(rows, mode=[0]))]


def transposed(tile: cute.Tensor, cols: int, rows: int) -> cute.Tensor:
    """A (rows, cols, stages) row-major ring read as (cols, rows, stages)."""
    stages = cute.size(tile, mode=[2])
    return cute.composition(tile, cute.make_layout((cols, rows, stages),
                                                   stride=(rows, 1, rows * cols)))
