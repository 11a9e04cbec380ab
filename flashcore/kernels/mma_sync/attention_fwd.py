"""FlashAttention-2-style forward kernels for sm_80 / sm_89 / sm_90, written with CuTe layouts and atoms.

One CTA computes ``tile_m`` query rows of one (batch, head). It walks the key blocks from the last to
the first, so the blocks that need masking (the ragged end of the keys; the diagonal when causal) come
first and initialise the running row max. Per key block, with one K/V stage (FA2's schedule):

    wait K(n) ─ issue V(n) ─ S = Q·Kᵀ ─ wait V(n) ─ issue K(n-1) ─ mask, online softmax ─ O += P·V

(the first block's V is issued by the prologue, with its K). With ``stages`` > 1, K and V of each
block are issued ``stages`` blocks ahead as one cp.async group, into a ring of stages:

    wait block n ─ S = Q·Kᵀ ─ mask, online softmax ─ O += P·V ─ issue block n - stages

With ``kv_splits`` > 1 the CTA holds that many groups of ``warps`` warps; each walks its own share
of the key blocks (its own named barrier), and the groups merge their softmax states and partial
outputs through shared memory at the end. Causal grids run the last query tiles (the most keys)
first.

* global→shared: 128-bit ``cp.async``; rows past the sequence end are zero-filled in shared memory.
* shared layouts: row-major atoms of 128-byte lines under a swizzle that XORs the line index into
  the 16-byte chunk index, so ldmatrix reads are conflict-free.
* shared→registers: ``ldmatrix`` (transposed for fp16 V, which is stored keys × head_dim).
* MMA: warp-level m16n8k16 (fp16/bf16) or m16n8k32 (e4m3), fp32 accumulate; each warp owns
  ``tile_m / warps`` query rows.
* softmax: exp2 with the scale pre-multiplied by log2(e); running max and a per-thread partial row
  sum, reduced over the quad (4 lanes sharing a row) only at the end.
* P is converted in registers and re-viewed as the A operand of P·V (no trip through memory).
* epilogue: O / rowsum through shared memory to 128-bit predicated global stores; optional LSE.

Causal masking is torch's ``is_causal`` (top-left): query i sees key j iff j <= i.

FP8 (``spec.precision == "fp8"``): Q, K and Vᵀ are float8_e4m3fn with descale factors per token
for Q and K and per (batch, head) for V. Each key's descale multiplies its column of scores, each
query's folds into its row's exp2 scale; P is multiplied by ``P_SCALE`` before
its e4m3 conversion (so small probabilities keep normal-range precision) and O by
``v_descale / P_SCALE`` at the end. An m16n8 fp32 accumulator holds, per thread, keys {2t, 2t+1} of
each group of 8, while the e4m3 A operand wants keys {4t..4t+3} of each 16: instead of shuffling
registers, Vᵀ's keys are stored permuted within each 32 (``flashcore.ops.fp8.key_permutation``),
so P's registers are used as they are.

ABI: see ``flashcore.abi`` (the grid is (ceil(seq_q / tile_m), heads, batch), the block
32·warps·kv_splits).
"""


import math

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from ...spec import AttentionSpec

LN_2 = math.log(2.0)
P_SCALE = 256.0  # power of two: exact to apply and to undo

_DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}


def _smem_atom(elem_bits: int, row_elems: int):
    """Row-major (8, row) atom whose 16-byte chunks are XOR-swizzled by the 128-byte line index."""
    elem_bytes = elem_bits // 8
    chunk_bits = int(math.log2(16 // elem_bytes))  # elements per 16-byte chunk
    row_chunks = row_elems * elem_bytes // 16
    b = min(3, int(math.log2(row_chunks)))
    return cute.make_composed_layout(
        cute.make_swizzle(b, chunk_bits, 3), 0, cute.make_layout((8, row_elems), stride=(row_elems, 1))
    )


class AttentionForward:
    """Trace-time configuration of one kernel; everything here is Python data (constexpr)."""

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.out_dtype = _DTYPES[spec.dtype]
        self.fp8 = spec.precision == "fp8"
        self.op_dtype = cutlass.Float8E4M3FN if self.fp8 else self.out_dtype
        self.head_dim = spec.head_dim
        self.tile_m, self.tile_n = spec.tile
        self.threads = spec.threads
        self.group_threads = spec.group_threads  # threads sharing one key range
        self.splits = spec.kv_splits
        self.stages = spec.stages  # K/V blocks in flight (1: FA2's K/V overlap, below)
        self.warps = spec.warps
        self.causal = spec.causal
        self.return_lse = spec.return_lse

    # ------------------------------------------------------------------------------------------
    # Host side: layouts and atoms (Python data), then the launch. flashcore keeps only the
    # kernel's cubin; its runtime repeats this launch geometry (flashcore.abi).
    # ------------------------------------------------------------------------------------------
    def _config(self):
        op, d, tm, tn = self.op_dtype, self.head_dim, self.tile_m, self.tile_n
        row_atom = _smem_atom(op.width, 64 if (op.width == 16 or d < 128) else 128)
        sQ_layout = cute.tile_to_shape(row_atom, (tm, d), (0, 1))
        # K and V: one tile per stage and key split (the last two modes); each split's group
        # reads its own
        kv_modes = (self.stages, self.splits)
        sK_layout = cute.tile_to_shape(row_atom, (tn, d, *kv_modes), (0, 1, 2, 3))
        if self.fp8:  # Vᵀ tile: head_dim rows of tile_n keys
            sV_layout = cute.tile_to_shape(
                _smem_atom(op.width, min(tn, 128)), (d, tn, *kv_modes), (0, 1, 2, 3)
            )
        else:
            sV_layout = sK_layout
        sO_layout = cute.tile_to_shape(_smem_atom(16, 64), (tm, d), (0, 1))

        def g2s(row_elems):
            per_copy = 128 // op.width
            tpr = min(row_elems, 128 * 8 // op.width) // per_copy  # threads per atom row
            atom = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), op, num_bits_per_copy=128
            )
            return cute.make_tiled_copy_tv(
                atom,
                cute.make_layout((self.group_threads // tpr, tpr), stride=(tpr, 1)),
                cute.make_layout((1, per_copy)),
            )

        g2s_qk = g2s(cute.size(row_atom.outer.shape[1]))
        g2s_v = g2s(cute.size(sV_layout.outer.shape[1])) if self.fp8 else g2s_qk
        out_per_copy = 128 // self.out_dtype.width
        r2g_o = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=128),
            cute.make_layout((self.group_threads // 8, 8), stride=(8, 1)),
            cute.make_layout((1, out_per_copy)),
        )
        if self.fp8:
            mma_op = warp.MmaFP8Op(op, cutlass.Float32, (16, 8, 32))
            perm_k = 32
        else:
            mma_op = warp.MmaF16BF16Op(op, cutlass.Float32, (16, 8, 16))
            perm_k = 16
        tiled_mma = cute.make_tiled_mma(
            mma_op, (self.warps, 1, 1), permutation_mnk=(self.warps * 16, 16, perm_k)
        )
        return sQ_layout, sK_layout, sV_layout, sO_layout, g2s_qk, g2s_v, r2g_o, tiled_mma

    def _shared_storage(self, sQ_layout, sK_layout, sV_layout, sO_layout):
        op, out, fp8, splits = self.op_dtype, self.out_dtype, self.fp8, self.splits
        n_ml = splits * 2 * self.tile_m  # per split: row max and row sum
        n_acc = (splits - 1) * self.tile_m * self.head_dim  # all splits but the first: fp32 O

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[op, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[op, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[op, cute.cosize(sV_layout)], 1024]
            if fp8:  # e4m3 Q cannot hold the 16-bit output tile: O gets its own buffer
                sO: cute.struct.Align[cute.struct.MemRange[out, cute.cosize(sO_layout)], 1024]
            if splits > 1:
                sML: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, n_ml], 1024]
                sAcc: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, n_acc], 1024]

        return SharedStorage

    @cute.jit
    def host(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        scale_log2: cutlass.Float32,
    ):
        cfg = self._config()
        storage = self._shared_storage(*cfg[:4])
        self.smem_size = storage.size_in_bytes()  # read back by the build: the launch ABI
        grid = (cute.ceil_div(mQ.shape[2], self.tile_m), cute.size(mQ.shape[1]), cute.size(mQ.shape[0]))
        self.kernel(mQ, mK, mV, mO, mLSE, scale_log2, *cfg, storage).launch(
            grid=grid, block=[self.threads, 1, 1], smem=self.smem_size
        )

    @cute.jit
    def host_fp8(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mVt: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mQd: cute.Tensor,
        mKd: cute.Tensor,
        mVd: cute.Tensor,
        scale_log2: cutlass.Float32,
    ):
        cfg = self._config()
        storage = self._shared_storage(*cfg[:4])
        self.smem_size = storage.size_in_bytes()
        grid = (cute.ceil_div(mQ.shape[2], self.tile_m), cute.size(mQ.shape[1]), cute.size(mQ.shape[0]))
        self.kernel_fp8(mQ, mK, mVt, mO, mLSE, mQd, mKd, mVd, scale_log2, *cfg, storage).launch(
            grid=grid, block=[self.threads, 1, 1], smem=self.smem_size
        )

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        scale_log2: cutlass.Float32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
        g2s_qk: cute.TiledCopy, g2s_v: cute.TiledCopy, r2g_o: cute.TiledCopy,
        tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr,
    ):
        self.wait_for_inputs()
        self.attend(
            mQ, mK, mV, mO, mLSE, scale_log2, cutlass.Float32(1.0), sQ_layout, sK_layout, sV_layout,
            sO_layout, g2s_qk, g2s_v, r2g_o, tiled_mma, SharedStorage,
        )

    @cute.kernel
    def kernel_fp8(
        self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        mQd: cute.Tensor, mKd: cute.Tensor, mVd: cute.Tensor, scale_log2: cutlass.Float32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
        g2s_qk: cute.TiledCopy, g2s_v: cute.TiledCopy, r2g_o: cute.TiledCopy,
        tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr,
    ):
        self.wait_for_inputs()
        _, head, batch = cute.arch.block_idx()
        # score(i, j) = (q8_i · k8_j) * q_descale_i * k_descale_j; O = (P8 · v8) * v_descale / P_SCALE
        o_scale = mVd[batch, head] * (1.0 / P_SCALE)
        self.attend(
            mQ, mK, mVt, mO, mLSE, scale_log2, o_scale, sQ_layout, sK_layout, sV_layout, sO_layout,
            g2s_qk, g2s_v, r2g_o, tiled_mma, SharedStorage, mQd, mKd,
        )

    @cute.jit
    def attend(
        self, mQ, mK, mV, mO, mLSE, scale_log2, o_scale, sQ_layout, sK_layout, sV_layout, sO_layout,
        g2s_qk, g2s_v, r2g_o, tiled_mma, SharedStorage: cutlass.Constexpr, mQd=None, mKd=None,
    ):
        cta_tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = self.tile_index()
        # kv_splits groups of `warps` warps; each works like a CTA of its own on its key range
        split, tidx = 0, cta_tidx
        if cutlass.const_expr(self.splits > 1):
            split = cta_tidx // self.group_threads
            tidx = cta_tidx % self.group_threads
        seqlen_q = mQ.shape[2]
        seqlen_k = mK.shape[2]
        tile_m, tile_n, d = self.tile_m, self.tile_n, self.head_dim

        n_block_max = cute.ceil_div(seqlen_k, tile_n)
        if cutlass.const_expr(self.causal):
            # top-left causal: rows of this block see keys < (m_block + 1) * tile_m
            n_block_max = cutlass.min(n_block_max, cute.ceil_div((m_block + 1) * tile_m, tile_n))
        # this group's key blocks: [n_lo, n_hi), possibly empty
        n_lo, n_hi = 0, n_block_max
        if cutlass.const_expr(self.splits > 1):
            per_split = cute.ceil_div(n_block_max, self.splits)
            n_lo = split * per_split
            n_hi = cutlass.min(n_lo + per_split, n_block_max)

        # ---- tiles of this CTA ------------------------------------------------------------------
        gQ = cute.local_tile(mQ[batch, head, None, None], (tile_m, d), (m_block, 0))
        gK = cute.local_tile(mK[batch, head, None, None], (tile_n, d), (None, 0))
        if cutlass.const_expr(self.fp8):  # Vᵀ, padded with zero keys: never ragged
            gV = cute.local_tile(mV[batch, head, None, None], (d, tile_n), (0, None))
        else:
            gV = cute.local_tile(mV[batch, head, None, None], (tile_n, d), (None, 0))
        # coordinates (row, col) of every element, for predicates and masks
        cQ = cute.local_tile(cute.make_identity_tensor((seqlen_q, d)), (tile_m, d), (m_block, 0))
        cKV = cute.local_tile(cute.make_identity_tensor((seqlen_k, d)), (tile_n, d), (None, 0))

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sK_layout)[None, None, None, split]  # (keys, d, stage)
        sV = storage.sV.get_tensor(sV_layout)[None, None, None, split]
        if cutlass.const_expr(self.fp8):
            sVt = sV  # already (head_dim, keys)
            sO = storage.sO.get_tensor(sO_layout)
        else:
            # V read as (head_dim, keys): the B operand of P·V
            sVt = cute.composition(
                sV, cute.make_layout((d, tile_n, self.stages), stride=(tile_n, 1, tile_n * d))
            )
            sO = cute.make_tensor(sQ.iterator, sO_layout)  # Q's buffer, free by the epilogue

        g2s = g2s_qk.get_slice(tidx)
        g2s_vt = g2s_v.get_slice(tidx)
        tQgQ = g2s.partition_S(gQ)
        tQsQ = g2s.partition_D(sQ)
        tQcQ = g2s.partition_S(cQ)
        tKgK = g2s.partition_S(gK)
        tKsK = g2s.partition_D(sK)
        tVgV = g2s_vt.partition_S(gV)
        tVsV = g2s_vt.partition_D(sV)
        tKVcKV = g2s.partition_S(cKV)

        # ---- MMA fragments ----------------------------------------------------------------------
        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((tile_m, d)), cutlass.Float32)
        acc_O.fill(0.0)

        if cutlass.const_expr(self.fp8):
            ld_a = warp.LdMatrix8x16x8bOp(num_matrices=4)
            ld_v = ld_a
        else:
            ld_a = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
            ld_v = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
        s2r_Q = cute.make_tiled_copy_A(cute.make_copy_atom(ld_a, self.op_dtype), tiled_mma)
        s2r_K = cute.make_tiled_copy_B(cute.make_copy_atom(ld_a, self.op_dtype), tiled_mma)
        s2r_V = cute.make_tiled_copy_B(cute.make_copy_atom(ld_v, self.op_dtype), tiled_mma)
        s2r_Q_thr = s2r_Q.get_slice(tidx)
        s2r_K_thr = s2r_K.get_slice(tidx)
        s2r_V_thr = s2r_V.get_slice(tidx)
        tSsQ = s2r_Q_thr.partition_S(sQ)
        tSrQ_view = s2r_Q_thr.retile(tSrQ)
        tSsK = s2r_K_thr.partition_S(sK)  # every partition of K and V has a last stage mode
        tSrK_view = s2r_K_thr.retile(tSrK)
        tOsVt = s2r_V_thr.partition_S(sVt)
        tOrVt_view = s2r_V_thr.retile(tOrVt)

        # ---- prologue -------------------------------------------------------------------------
        if split == 0:
            self.load_rows(g2s_qk, tQgQ, tQsQ, tQcQ, seqlen_q)
        n_last = n_hi - 1
        if cutlass.const_expr(self.stages == 1):
            # Q and the first K, then the first V, as two groups (V too: a short problem has few
            # blocks per CTA, and each would otherwise wait one more DRAM round trip for its V)
            if n_hi > n_lo:
                self.load_block(g2s_qk, tKgK, tKsK, tKVcKV, n_last, 0, seqlen_k, ragged=True)
            cute.arch.cp_async_commit_group()
            if n_hi > n_lo:
                self.load_v(g2s_v, tVgV, tVsV, tKVcKV, n_last, 0, seqlen_k, ragged=True)
            cute.arch.cp_async_commit_group()
        else:
            # the first `stages` K and V blocks, one group each (Q joins the first)
            for i in cutlass.range_constexpr(self.stages):
                if n_last - i >= n_lo:
                    self.load_block(g2s_qk, tKgK, tKsK, tKVcKV, n_last - i, i, seqlen_k, i == 0)
                    self.load_v(g2s_v, tVgV, tVsV, tKVcKV, n_last - i, i, seqlen_k, i == 0)
                cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.splits > 1):
            # the first group loaded Q for all: it must land before anyone reads it
            cute.arch.cp_async_wait_group(1 if self.stages == 1 else self.stages - 1)
            cute.arch.sync_threads()

        # running softmax state, one entry per accumulator row this thread holds
        acc_O_mn = self.mn_view(acc_O)
        row_max = cute.make_rmem_tensor(cute.size(acc_O_mn, mode=[0]), cutlass.Float32)
        row_sum = cute.make_rmem_tensor(cute.size(acc_O_mn, mode=[0]), cutlass.Float32)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)
        # each row's exp2 scale: the softmax scale, times its query's descale for fp8
        row_scale = cute.make_rmem_tensor(cute.size(acc_O_mn, mode=[0]), cutlass.Float32)
        row_scale.fill(scale_log2)
        if cutlass.const_expr(self.fp8):
            rows = self.row_coords(thr_mma)
            for r in cutlass.range_constexpr(cute.size(row_scale)):
                row = m_block * tile_m + rows[r]
                if row < seqlen_q:
                    row_scale[r] = scale_log2 * mQd[batch, head, row]

        frags = (tSrQ, tSrK, tOrVt, tSsQ, tSrQ_view, tSsK, tSrK_view, tOsVt, tOrVt_view)
        softmax_state = (row_max, row_sum, row_scale, mKd)
        copies = (s2r_Q, s2r_K, s2r_V)
        gmem = (g2s_qk, g2s_v, tKgK, tKsK, tVgV, tVsV, tKVcKV)

        # Blocks that need a mask come first: the ragged last key block, and for causal the
        # ceil(tile_m / tile_n) blocks that touch the diagonal.
        mask_steps = 1
        if cutlass.const_expr(self.causal):
            mask_steps = (tile_m + tile_n - 1) // tile_n
        # (A split's first blocks are masked too: harmless where nothing is out of range.)
        # The i-th block walked (block n_hi - 1 - i) uses K/V stage i % stages.
        for step in cutlass.range_constexpr(mask_steps):
            n_block = n_hi - 1 - step
            if n_block >= n_lo:
                self.one_block(
                    n_block, n_lo, split, step % self.stages, m_block, seqlen_q, seqlen_k,
                    thr_mma, tiled_mma, frags, copies, gmem, acc_O, softmax_state, masked=True,
                    ragged=(step == 0), first=(step == 0),
                )
        for n_block in range(n_hi - 1 - mask_steps, n_lo - 1, -1):
            slot = 0
            if cutlass.const_expr(self.stages > 1):
                slot = (n_hi - 1 - n_block) % self.stages
            self.one_block(
                n_block, n_lo, split, slot, m_block, seqlen_q, seqlen_k, thr_mma, tiled_mma,
                frags, copies, gmem, acc_O, softmax_state, masked=False, ragged=False,
            )

        for r in cutlass.range_constexpr(cute.size(row_sum)):
            row_sum[r] = self.quad_sum(row_sum[r])
        if cutlass.const_expr(self.splits > 1):
            self.combine_splits(storage, split, tidx, thr_mma, acc_O, row_max, row_sum, row_scale)
        if split == 0:
            self.epilogue(
                mO, mLSE, o_scale, seqlen_q, sO, r2g_o, thr_mma, tiled_mma, tidx, acc_O, row_max,
                row_sum, row_scale,
            )

    @cute.jit
    def wait_for_inputs(self):
        """Programmatic dependent launch (Hopper): the runtime may start this grid while the one
        before it in the stream still runs. Wait for that grid to finish and flush before the first
        global access (it may write our inputs or read our output), then let the next grid start
        its own launch: its CTAs take free slots and wait in turn. Without such a launch both are
        no-ops."""
        if cutlass.const_expr(self.spec.programmatic_launch):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def tile_index(self):
        """(query tile, head, batch) of this CTA. Causal grids run the last query tiles (the
        ones that see the most keys) first, so no long CTA is left for the tail of the grid.
        Read again where needed rather than kept live through the key loop (registers)."""
        m_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.causal):
            m_block = cute.arch.grid_dim()[0] - 1 - m_block
        return m_block, head, batch

    @cute.jit
    def epilogue(
        self, mO, mLSE, o_scale, seqlen_q, sO, r2g_o, thr_mma, tiled_mma, tidx, acc_O, row_max,
        row_sum, row_scale,
    ):
        """O / row sum (times the fp8 output scale), through shared memory to 16-byte stores."""
        acc_O_mn = self.mn_view(acc_O)
        tile_m, d = self.tile_m, self.head_dim
        m_block, head, batch = self.tile_index()
        cQ = cute.local_tile(cute.make_identity_tensor((seqlen_q, d)), (tile_m, d), (m_block, 0))

        for r in cutlass.range_constexpr(cute.size(row_sum)):
            total = row_sum[r]
            inv = cute.arch.rcp_approx(total)
            # a row that saw no key has sum 0: write 0, not NaN
            inv = 0.0 if total == 0.0 else inv
            acc_O_mn[r, None] = acc_O_mn[r, None].load() * (inv * o_scale)

        if cutlass.const_expr(self.return_lse):
            self.store_lse(mLSE, batch, head, m_block, seqlen_q, thr_mma, row_max, row_sum, row_scale)

        rO = cute.make_rmem_tensor(acc_O.layout, self.out_dtype)
        rO.store(acc_O.load().to(self.out_dtype))
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype), tiled_mma
        )
        r2s_thr = r2s.get_slice(tidx)
        self.group_sync(0)  # every warp is done reading sQ (O may reuse it)
        cute.copy(r2s, r2s_thr.retile(rO), r2s_thr.partition_D(sO))
        self.group_sync(0)

        gO = cute.local_tile(mO[batch, head, None, None], (tile_m, d), (m_block, 0))
        r2g = r2g_o.get_slice(tidx)
        tOsO = r2g.partition_S(sO)
        tOgO = r2g.partition_D(gO)
        tOcO = r2g.partition_D(cQ)
        tOrO = cute.make_rmem_tensor_like(tOgO, self.out_dtype)
        cute.autovec_copy(tOsO, tOrO)
        for m in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
            if cute.elem_less(tOcO[0, m, 0][0], seqlen_q):
                cute.copy(r2g_o, tOrO[None, m, None], tOgO[None, m, None])

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_rows(self, tiled_copy, src, dst, coords, seqlen):
        """cp.async a tile, zero-filling the rows at or past ``seqlen``."""
        for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
            if cute.elem_less(coords[0, m, 0][0], seqlen):
                cute.copy(tiled_copy, src[None, m, None], dst[None, m, None])
            else:
                dst[None, m, None].fill(0)

    @cute.jit
    def load_block(self, tiled_copy, src, dst, coords, n_block, slot, seqlen_k,
                   ragged: cutlass.Constexpr):
        """cp.async key block n of K or V into stage ``slot``; if ``ragged``, rows past the keys
        are zero-filled."""
        if cutlass.const_expr(ragged):
            self.load_rows(
                tiled_copy, src[None, None, None, n_block], dst[None, None, None, slot],
                coords[None, None, None, n_block], seqlen_k,
            )
        else:
            cute.copy(tiled_copy, src[None, None, None, n_block], dst[None, None, None, slot])

    @cute.jit
    def load_v(self, g2s_v, tVgV, tVsV, tKVcKV, n_block, slot, seqlen_k, ragged: cutlass.Constexpr):
        # fp8 Vᵀ is padded with zero keys: never ragged
        self.load_block(g2s_v, tVgV, tVsV, tKVcKV, n_block, slot, seqlen_k, ragged and not self.fp8)

    @cute.jit
    def one_block(
        self, n_block, n_lo, split, slot, m_block, seqlen_q, seqlen_k, thr_mma, tiled_mma, frags,
        copies, gmem, acc_O, softmax_state, masked: cutlass.Constexpr, ragged: cutlass.Constexpr,
        first: cutlass.Constexpr = False,
    ):
        """One key block: S = Q·Kᵀ, mask, online softmax, O += P·V, with its loads.

        One stage (FA2's schedule): wait K(n), issue V(n), S, wait V(n), issue K(n-1) over
        K(n), softmax, P·V. Several stages: K and V of block n were issued ``stages`` blocks
        ago; wait for them, compute, then issue block n - stages into the freed stage."""
        tSrQ, tSrK, tOrVt, tSsQ, tSrQ_view, tSsK, tSrK_view, tOsVt, tOrVt_view = frags
        s2r_Q, s2r_K, s2r_V = copies
        g2s_qk, g2s_v, tKgK, tKsK, tVgV, tVsV, tKVcKV = gmem
        tSsK = tSsK[None, None, None, slot]  # this block's stage
        tOsVt = tOsVt[None, None, None, slot]

        acc_S = cute.make_rmem_tensor(
            thr_mma.partition_shape_C((self.tile_m, self.tile_n)), cutlass.Float32
        )
        acc_S.fill(0.0)
        k_descale = None
        if cutlass.const_expr(self.fp8):
            # issued before the MMAs so their global-load latency hides behind them
            k_descale = self.load_k_descale(softmax_state[3], acc_S, thr_mma, m_block, n_block,
                                            seqlen_q, seqlen_k)

        if cutlass.const_expr(self.stages > 1):
            # block n's group is the oldest of `stages` in flight
            cute.arch.cp_async_wait_group(self.stages - 1)
            self.group_sync(split)
        elif cutlass.const_expr(first):
            # K(n) has landed; V(n), loaded by the prologue, may still be in flight
            cute.arch.cp_async_wait_group(1)
            self.group_sync(split)
        else:
            # K(n) has landed; every warp is done with the previous V
            cute.arch.cp_async_wait_group(0)
            self.group_sync(split)
            self.load_v(g2s_v, tVgV, tVsV, tKVcKV, n_block, 0, seqlen_k, ragged)
            cute.arch.cp_async_commit_group()

        # S = Q · K^T, software-pipelined over head_dim: load k+1 while multiplying k
        k_steps = cute.size(tSsQ, mode=[2])
        cute.copy(s2r_Q, tSsQ[None, None, 0], tSrQ_view[None, None, 0])
        cute.copy(s2r_K, tSsK[None, None, 0], tSrK_view[None, None, 0])
        for k in cutlass.range_constexpr(k_steps):
            if cutlass.const_expr(k + 1 < k_steps):
                cute.copy(s2r_Q, tSsQ[None, None, k + 1], tSrQ_view[None, None, k + 1])
                cute.copy(s2r_K, tSsK[None, None, k + 1], tSrK_view[None, None, k + 1])
            cute.gemm(tiled_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)

        if cutlass.const_expr(self.stages == 1):
            # V(n) has landed; every warp is done reading K(n): prefetch K(n-1) over it
            cute.arch.cp_async_wait_group(0)
            self.group_sync(split)
            if n_block > n_lo:
                self.load_block(g2s_qk, tKgK, tKsK, tKVcKV, n_block - 1, 0, seqlen_k, ragged=False)
                cute.arch.cp_async_commit_group()

        self.online_softmax(
            acc_S, acc_O, softmax_state, thr_mma, m_block, n_block, seqlen_q, seqlen_k, masked,
            k_descale,
        )

        # P in the operand precision, re-viewed as the A operand of P·V
        if cutlass.const_expr(self.fp8):
            # Gather in the A operand's value order on the fp32 accumulator (4-byte elements:
            # any stride is fine), then convert into a compact fragment: the MMA takes each
            # 32-bit register as 4 consecutive bytes of the fragment's storage.
            acc_as_a = cute.make_tensor(acc_S.iterator, self.acc_as_fp8_operand_a(acc_S.layout))
            tOrP = cute.make_rmem_tensor(acc_as_a.shape, self.op_dtype)
            tOrP.store((acc_as_a.load() * P_SCALE).to(self.op_dtype))
        else:
            rP = cute.make_rmem_tensor(acc_S.layout, self.op_dtype)
            rP.store(acc_S.load().to(self.op_dtype))
            tOrP = cute.make_tensor(rP.iterator, self.acc_as_operand_a(rP.layout))

        v_steps = cute.size(tOrP, mode=[2])
        cute.copy(s2r_V, tOsVt[None, None, 0], tOrVt_view[None, None, 0])
        for k in cutlass.range_constexpr(v_steps):
            if cutlass.const_expr(k + 1 < v_steps):
                cute.copy(s2r_V, tOsVt[None, None, k + 1], tOrVt_view[None, None, k + 1])
            cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrVt[None, None, k], acc_O)

        if cutlass.const_expr(self.stages > 1):
            # every warp is done with this stage: refill it with block n - stages
            self.group_sync(split)
            n_next = n_block - self.stages
            if n_next >= n_lo:
                self.load_block(g2s_qk, tKgK, tKsK, tKVcKV, n_next, slot, seqlen_k, ragged=False)
                self.load_v(g2s_v, tVgV, tVsV, tKVcKV, n_next, slot, seqlen_k, ragged=False)
            cute.arch.cp_async_commit_group()

    @cute.jit
    def online_softmax(
        self, acc_S, acc_O, softmax_state, thr_mma, m_block, n_block, seqlen_q, seqlen_k,
        masked: cutlass.Constexpr, k_descale=None,
    ):
        row_max, row_sum, row_scale, _ = softmax_state
        S = self.mn_view(acc_S)
        O = self.mn_view(acc_O)
        if cutlass.const_expr(masked):
            tScS = self.score_coords(thr_mma, m_block, n_block, seqlen_q, seqlen_k)
        if cutlass.const_expr(self.fp8):  # each key's descale multiplies its column of scores
            for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                    S[r, c] = S[r, c] * k_descale[c]
        if cutlass.const_expr(masked):
            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                limit = seqlen_k
                if cutlass.const_expr(self.causal):
                    limit = cutlass.min(tScS[r, 0][0] + 1, seqlen_k)
                for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                    if cute.elem_less(limit, tScS[0, c][1] + 1):
                        S[r, c] = -cutlass.Float32.inf

        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            scale_log2 = row_scale[r]
            row = S[r, None].load()
            prev_max = row_max[r]
            cur_max = self.quad_max(row.reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0))
            cur_max = cute.arch.fmax(prev_max, cur_max)
            # A row with nothing visible yet keeps max = -inf; exponentiate against 0 instead so
            # exp2(-inf) = 0 rather than NaN. The stored max stays -inf.
            safe_max = 0.0 if cur_max == -cutlass.Float32.inf else cur_max
            if cutlass.const_expr(self.fp8):
                # (s - max) first: exact near the max, so the row max gets p = 1 however large
                # the logits (e4m3 inputs of any magnitude); one more instruction per score
                p = cute.math.exp2((row - safe_max) * scale_log2, fastmath=True)
                correction = cute.math.exp2((prev_max - safe_max) * scale_log2, fastmath=True)
            else:
                # FA2's form, one FMA: s * scale - max * scale rounds only its (small) result;
                # the rounding of max * scale (relative 6e-8) shifts p once logits pass ~1e5
                offset = safe_max * scale_log2
                p = cute.math.exp2(
                    cute.math.fma(
                        row, cute.full_like(row, scale_log2), cute.full_like(row, -offset)
                    ),
                    fastmath=True,
                )
                correction = cute.math.exp2(
                    cute.math.fma(prev_max, scale_log2, -offset), fastmath=True
                )
            row_sum[r] = row_sum[r] * correction + p.reduce(cute.ReductionOp.ADD, 0.0, 0)
            row_max[r] = cur_max
            O[r, None] = O[r, None].load() * correction
            S[r, None] = p

    @cute.jit
    def group_sync(self, split):
        """Barrier of one split's threads (the whole CTA when there is one split)."""
        if cutlass.const_expr(self.splits == 1):
            cute.arch.sync_threads()
        else:
            cute.arch.barrier(barrier_id=1 + split, number_of_threads=self.group_threads)

    @cute.jit
    def combine_splits(self, storage, split, tidx, thr_mma, acc_O, row_max, row_sum, row_scale):
        """Merge the splits' softmax states into the first split's registers.

        Each split publishes its row max and sum; every split rescales its O to the common max;
        the others add theirs into the first through fp32 shared memory."""
        tile_m, d = self.tile_m, self.head_dim
        sML = storage.sML.get_tensor(cute.make_layout((tile_m, 2, self.splits)))
        sAcc = storage.sAcc.get_tensor(
            cute.make_layout((tile_m, d, self.splits - 1), stride=(d, 1, tile_m * d))
        )
        rows = self.row_coords(thr_mma)
        lane = cute.arch.lane_idx()
        for r in cutlass.range_constexpr(cute.size(row_max)):
            if lane % 4 == 0:
                sML[rows[r], 0, split] = row_max[r]
                sML[rows[r], 1, split] = row_sum[r]
        cute.arch.sync_threads()
        O = self.mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_max)):
            row = rows[r]
            scale_log2 = row_scale[r]
            new_max = sML[row, 0, 0]
            for g in cutlass.range_constexpr(1, self.splits):
                new_max = cute.arch.fmax(new_max, sML[row, 0, g])
            safe_max = 0.0 if new_max == -cutlass.Float32.inf else new_max
            total = cutlass.Float32(0.0)
            for g in cutlass.range_constexpr(self.splits):
                total += sML[row, 1, g] * cute.math.exp2(
                    (sML[row, 0, g] - safe_max) * scale_log2, fastmath=True
                )
            mine = cute.math.exp2((row_max[r] - safe_max) * scale_log2, fastmath=True)
            O[r, None] = O[r, None].load() * mine
            row_max[r] = new_max
            row_sum[r] = total
        if split > 0:
            tAcc = thr_mma.partition_C(sAcc[None, None, split - 1])
            tAcc.store(acc_O.load())
        cute.arch.sync_threads()
        if split == 0:
            for g in cutlass.range_constexpr(self.splits - 1):
                acc_O.store(acc_O.load() + thr_mma.partition_C(sAcc[None, None, g]).load())

    @cute.jit
    def load_k_descale(self, mKd, acc_S, thr_mma, m_block, n_block, seqlen_q, seqlen_k):
        """The descales of the keys whose scores this thread holds (1 past the last key)."""
        _, head, batch = cute.arch.block_idx()  # (head and batch are never reordered)
        cols = self.score_coords(thr_mma, m_block, n_block, seqlen_q, seqlen_k)
        kd = cute.make_rmem_tensor(cute.size(cols, mode=[1]), cutlass.Float32)
        for c in cutlass.range_constexpr(cute.size(cols, mode=[1])):
            col = cols[0, c][1]
            kd[c] = cutlass.Float32(1.0)
            if col < seqlen_k:
                kd[c] = mKd[batch, head, col]
        return kd

    @cute.jit
    def store_lse(self, mLSE, batch, head, m_block, seqlen_q, thr_mma, row_max, row_sum, row_scale):
        """lse = max * scale + ln(sum), natural log; -inf for a row that saw no key."""
        gLSE = cute.local_tile(mLSE[batch, head, None], (self.tile_m,), (m_block,))
        rows = self.row_coords(thr_mma)
        lane = cute.arch.lane_idx()
        for r in cutlass.range_constexpr(cute.size(row_sum)):
            lse = (row_max[r] * row_scale[r] + cute.math.log2(row_sum[r], fastmath=False)) * LN_2
            lse = -cutlass.Float32.inf if row_sum[r] == 0.0 else lse
            if lane % 4 == 0 and m_block * self.tile_m + rows[r] < seqlen_q:
                gLSE[rows[r]] = lse

    # ------------------------------------------------------------------------------------------
    # register-layout helpers (pure layout algebra, no instructions)
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def score_coords(self, thr_mma, m_block, n_block, seqlen_q, seqlen_k):
        """(row, key) of each score this thread holds, as an (rows, cols) view."""
        cS = cute.local_tile(
            cute.make_identity_tensor((seqlen_q, seqlen_k)),
            (self.tile_m, self.tile_n),
            (m_block, n_block),
        )
        return self.mn_view(thr_mma.partition_C(cS))

    def row_coords(self, thr_mma) -> list:
        """The row, within the query tile, of each accumulator row this thread holds (static)."""
        rows = self.mn_view(
            thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        )
        return [rows[r, 0][0] for r in range(cute.size(rows, mode=[0]))]

    @staticmethod
    def mn_view(acc: cute.Tensor) -> cute.Tensor:
        """Re-view an m16n8 accumulator fragment ((2, 2), M, N) as (rows, cols).

        In the fragment's first mode, the inner 2 is a pair of adjacent columns and the outer 2
        the rows r and r + 8, so rows = (outer 2, M) and cols = (inner 2, N).
        """
        shape = acc.layout.shape
        compact = cute.make_layout(shape)
        mn = cute.make_layout(
            ((shape[0][1], shape[1]), (shape[0][0], shape[2])),
            stride=((compact.stride[0][1], compact.stride[1]), (compact.stride[0][0], compact.stride[2])),
        )
        return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))

    @staticmethod
    def acc_as_operand_a(layout: cute.Layout) -> cute.Layout:
        """((2, 2), M, N) accumulator of m16n8 tiles -> ((2, 2, 2), M, N / 2) A operand of m16n8k16.

        Two neighbouring n8 accumulator tiles hold exactly the registers one k16 A tile needs.
        """
        split = cute.logical_divide(layout, (None, None, 2))
        return cute.make_layout(
            ((split.shape[0], split.shape[2][0]), split.shape[1], split.shape[2][1]),
            stride=((split.stride[0], split.stride[2][0]), split.stride[1], split.stride[2][1]),
        )

    @staticmethod
    def acc_as_fp8_operand_a(layout: cute.Layout) -> cute.Layout:
        """((2, 2), M, N) accumulator -> the 16 values of m16n8k32 e4m3 A tiles, (16, M, N / 4).

        A register a_v holds (row g + 8·r, key 16·h + 4t + i) for v = i + 4r + 8h. From four
        neighbouring n8 tiles j the thread holds (row g + 8·r, key 8j + 2t + c). Taking
        a_v = tile (2h + i // 2), column c = i % 2, row r gives key 16h + 8(i // 2) + 2t + i % 2
        for position 16h + 4t + i: the permutation Vᵀ's keys are stored in.
        """
        (s_c, s_r), s_m, s_n = layout.stride
        _, m, n = layout.shape
        return cute.make_layout(
            (((2, 2), 2, 2), m, n // 4),
            stride=(((s_c, s_n), s_r, 2 * s_n), s_m, 4 * s_n),
        )

    @staticmethod
    def quad_max(x):
        x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
        return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))

    @staticmethod
    def quad_sum(x):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
        return x + cute.arch.shuffle_sync_bfly(x, offset=1)
