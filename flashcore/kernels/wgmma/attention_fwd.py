"""The wgmma family's forward kernel (Hopper, sm_90a): warpgroup MMAs with the softmax of one
key block overlapped with the P·V of the block before (FlashAttention-3's intra-warpgroup
pipelining).

One CTA computes ``tile_m`` query rows of one (batch, head), 64 rows per consumer warpgroup
(``warps / 4`` of them), walking its key blocks from the last to the first so that the blocks
that need masking (the ragged end of the keys, the causal diagonal) come first; causal blocks
above the diagonal are never visited (``common/block_info.py``).

* global->shared: 128-bit ``cp.async`` by every thread into 128-byte-swizzled wgmma layouts
  (``layouts.py``); rows past a sequence end are zero-filled. Rings of ``stages`` K and V
  blocks, V one step behind K (the schedule: ``walk_keys``).
  cp.async writes through the generic proxy and wgmma reads through the async proxy: each
  thread waits for its copies, fences (``fence.proxy.async.shared::cta``), then the CTA
  barrier publishes every thread's part before any warpgroup's wgmma reads it.
* S = Q·Kᵀ: ``wgmma.mma_async`` SS (both from shared memory, K-major), fp32 accumulators,
  64 x tile_n per warpgroup.
* Online softmax in registers on an (rows, keys) view of the accumulator (``fragments.py``).
* O += P·V: ``wgmma.mma_async`` RS: P converted in registers is the A operand as it lies; V
  from shared memory, MN-major. Issued right after the next block's Q·Kᵀ, it runs while that
  block's scores become P; O is rescaled once it has completed.
* Epilogue: O / row sum, converted, through shared memory (Q's buffer) to predicated 16-byte
  stores; natural-log LSE if asked.

Causal masks are top-left (torch's ``is_causal``). Interface and launch geometry are those of
the mma_sync kernel (``flashcore.compiler.abi``): the serving, window, soft-cap and FP8 arguments
are accepted and must be None (the spec checks refuse such specs).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from ..common.block_info import KeyBounds, key_range, masked_steps
from ..common.copies import load_block, load_rows
from ..common.epilogue import store_lse
from ..common.grid import kv_head_of, tile_coords, wait_for_previous_grid
from ..common.mask import mask_scores
from ..common.softmax import OnlineSoftmax
from .fragments import ThreadCoords, acc_as_operand_a, acc_mn_view
from .layouts import WARPGROUP, WgmmaLayouts


class Tile(ThreadCoords):
    """Trace-time view of one CTA's work: its coordinates, key range, shared and global tiles,
    copy partitions and MMA fragments (built once at the kernel's start)."""

    def __init__(self, lay: WgmmaLayouts, storage, mQ: cute.Tensor, mK: cute.Tensor,
                 mV: cute.Tensor, q_group):
        spec, c = lay.spec, lay.spec.config
        d, tm, tn = spec.head_dim, c.tile_m, c.tile_n
        self.lay, self.spec, self.config = lay, spec, c
        self.tidx, _, _ = cute.arch.thread_idx()
        # warp-uniform: the wgmma descriptors derived from it stay in uniform registers
        wg = cute.arch.make_warp_uniform(self.tidx // WARPGROUP)
        self.m_block, head, batch, _ = tile_coords(mQ, spec)
        kv_head = kv_head_of(head, mQ, mK)
        self.seqlen_q, self.seqlen_k = mQ.shape[2], mK.shape[2]
        self.q_group = q_group
        self.bounds = KeyBounds(spec.causal)
        self.n_lo, self.n_hi, _ = key_range(self.m_block, tm, tn, self.seqlen_k, self.bounds,
                                            q_group, 0, 1, 0, 1, cutlass.min, cutlass.max)

        # ---- shared tiles (swizzle on the pointer: byte-address SW128, as wgmma reads it) ----
        self.sQ = storage.sQ.get_tensor(lay.sQ.outer, swizzle=lay.sQ.inner)
        sK = storage.sK.get_tensor(lay.sKV.outer, swizzle=lay.sKV.inner)  # (keys, d, stage)
        sV = storage.sV.get_tensor(lay.sKV.outer, swizzle=lay.sKV.inner)
        # V read as (head_dim, keys, stage): the MN-major B operand of P·V
        sVt = cute.composition(sV, cute.make_ordered_layout((d, tn, c.stages), order=(1, 0, 2)))

        # ---- global tiles, their coordinates, copy partitions --------------------------------
        gQ = cute.local_tile(mQ[batch, head, None, None], (tm, d), (self.m_block, 0))
        gK = cute.local_tile(mK[batch, kv_head, None, None], (tn, d), (None, 0))
        gV = cute.local_tile(mV[batch, kv_head, None, None], (tn, d), (None, 0))
        cQ = cute.local_tile(cute.make_identity_tensor((self.seqlen_q, d)), (tm, d),
                             (self.m_block, 0))
        cKV = cute.local_tile(cute.make_identity_tensor((self.seqlen_k, d)), (tn, d),
                              (None, 0))
        copy = lay.g2s.get_slice(self.tidx)
        self.tQgQ, self.tQsQ, self.tQcQ = (copy.partition_S(gQ), copy.partition_D(self.sQ),
                                           copy.partition_S(cQ))
        self.tKgK, self.tKsK = copy.partition_S(gK), copy.partition_D(sK)
        self.tVgV, self.tVsV = copy.partition_S(gV), copy.partition_D(sV)
        self.tKVcKV = copy.partition_S(cKV)

        # ---- MMA fragments -------------------------------------------------------------------
        # operand descriptors: one set per warpgroup (its 64 rows of Q; all of K and V)
        wg_qk = lay.qk_mma.get_slice(wg * WARPGROUP)
        wg_pv = lay.pv_mma.get_slice(wg * WARPGROUP)
        self.tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(self.sQ))  # (MMA, 1, d/16)
        self.tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))  # (MMA, 1, d/16, stage)
        self.tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))  # (MMA, 1, tn/16, stage)
        # accumulators: per thread
        self.thr_qk = lay.qk_mma.get_slice(self.tidx)
        self.thr_pv = lay.pv_mma.get_slice(self.tidx)
        self.acc_O = cute.make_rmem_tensor(self.thr_pv.partition_shape_C((tm, d)),
                                           cutlass.Float32)
        self.acc_O.fill(0.0)


def refuse_extras(family: str, extras: tuple) -> None:
    """Trace time: the Hopper families take the attention ABI's optional arguments (FP8
    descales, window, soft-cap, serving tables) but build none of them (the spec refuses such
    specs first; this guards a direct call)."""
    if any(x is not None for x in extras):
        raise ValueError(f"{family} attention: FP8 descales, windows, soft-caps and serving "
                         "tables are not supported yet (pass None)")


@cute.jit
def wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
          zero_init: cutlass.Constexpr, wait: cutlass.Constexpr = 0):
    """acc (+)= A·B over the K steps of the fragments, as one wgmma group; then, unless
    ``wait`` is None, wait until at most ``wait`` groups are in flight (``wgmmas``)."""
    wgmmas([(tiled_mma, acc, a, b)], zero_init, wait)


def wgmmas(products: list, zero_init: bool, wait: int | None = 0):
    """Each (tiled_mma, acc, a, b) of ``products``: acc (+)= A·B over the K steps of the
    fragments, all of them one wgmma group; then, unless ``wait`` is None, wait until at most
    ``wait`` groups are in flight.

    ``wgmma.fence`` first: it orders this thread's earlier register writes (the accumulators'
    rescaling, P's conversion) before the asynchronous MMAs read those registers. The first
    step overwrites the accumulator when ``zero_init`` (no fill needed). A fresh atom per
    product: its accumulate flag is mutated, which must not leak into other calls' IR."""
    warpgroup.fence()
    for tiled_mma, acc, a, b in products:  # (trace time: a Python loop, unrolled)
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in range(cute.size(a, mode=[2])):
            cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if wait is not None:
        warpgroup.wait_group(wait)


@cute.jit
def publish_shared():
    """Make this thread's landed cp.async (and zero-fill) writes visible to every warpgroup's
    wgmma: generic-proxy writes, fenced into the async proxy, then the CTA barrier."""
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.sync_threads()


class WgmmaAttentionForward:
    """Trace-time configuration of one kernel: the spec is Python data (constexpr)."""

    def __init__(self, spec):
        self.spec = spec  # validated by flashcore.specs.families.Wgmma
        self.smem_size = 0

    @cute.jit
    def host(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor | None,
        mQd: cute.Tensor | None,
        mKd: cute.Tensor | None,
        mVd: cute.Tensor | None,
        scale_log2: cutlass.Float32,
        q_group: cutlass.Int32,
        num_splits: cutlass.Int32,
        window_left: cutlass.Int32 | None = None,
        window_right: cutlass.Int32 | None = None,
        softcap_in: cutlass.Float32 | None = None,
        softcap_out: cutlass.Float32 | None = None,
        cu_seqlens_q: cute.Tensor | None = None,
        cu_seqlens_k: cute.Tensor | None = None,
        block_table: cute.Tensor | None = None,
        seqlens_k: cute.Tensor | None = None,
    ):
        """The launch; flashcore keeps only the kernel's cubin and its runtime repeats this
        geometry (``flashcore.compiler.abi.attention_grid``)."""
        refuse_extras("wgmma", (mQd, mKd, mVd, window_left, window_right, softcap_in,
                                softcap_out, cu_seqlens_q, cu_seqlens_k, block_table, seqlens_k))
        lay = WgmmaLayouts(self.spec)
        self.smem_size = lay.storage.size_in_bytes()  # read back by the build: the launch ABI
        m_blocks = cute.ceil_div(mQ.shape[2], self.spec.config.tile_m)
        self.kernel(mQ, mK, mV, mO, mLSE, mQd, mKd, mVd, scale_log2, q_group, num_splits,
                    window_left, window_right, softcap_in, softcap_out, cu_seqlens_q,
                    cu_seqlens_k, block_table, seqlens_k).launch(
            grid=(m_blocks * mQ.shape[1] * mQ.shape[0], num_splits, 1),
            block=[self.spec.threads, 1, 1], smem=self.smem_size,
        )

    @cute.kernel
    def kernel(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
        mLSE: cute.Tensor | None, mQd: cute.Tensor | None, mKd: cute.Tensor | None,
        mVd: cute.Tensor | None, scale_log2: cutlass.Float32, q_group: cutlass.Int32,
        num_splits: cutlass.Int32, window_left: cutlass.Int32 | None,
        window_right: cutlass.Int32 | None, softcap_in: cutlass.Float32 | None,
        softcap_out: cutlass.Float32 | None, cu_seqlens_q: cute.Tensor | None,
        cu_seqlens_k: cute.Tensor | None, block_table: cute.Tensor | None,
        seqlens_k: cute.Tensor | None,
    ):
        wait_for_previous_grid(self.spec)
        lay = WgmmaLayouts(self.spec)
        storage = cutlass.memory.SmemAllocator().allocate(lay.storage)
        tile = Tile(lay, storage, mQ, mK, mV, q_group)
        softmax = OnlineSoftmax(cute.size(acc_mn_view(tile.acc_O), mode=[0]), scale_log2,
                                form="offset")
        self.prologue(tile)
        self.walk_keys(tile, softmax)
        # nothing is in flight after a walk; a CTA with no key block (no keys at all) still
        # has its Q copy, which must land before the epilogue reuses Q's buffer
        cute.arch.cp_async_wait_group(0)
        softmax.finish()
        self.store_output(tile, softmax, mQ, mO, mLSE)

    # ---- key loop --------------------------------------------------------------------------
    # Step i of the walk is key block n_hi - 1 - i. Softmax overlaps the tensor cores (FA3's
    # intra-warpgroup pipelining): step i issues S_i = Q·K_iᵀ and then O += P_{i-1}·V_{i-1},
    # waits for S_i only, forms P_i while P·V runs, then waits for it and rescales O. So V
    # trails K by one step: K and V each have a ring of ``stages`` blocks, and step i's loads
    # are K_{i+stages-1} (over K_{i-1}, whose Q·Kᵀ completed in step i-1) and V_{i+stages-2}
    # (over V_{i-2}, whose P·V completed in step i-1), one cp.async group a step. Every thread
    # waits for its copies, fences them into the async proxy and passes the CTA barrier
    # (``publish_shared``) before any wgmma reads them; a thread reaches step i's barrier only
    # after its own waits of step i - 1, so the barrier also frees the two stages refilled.

    @cute.jit
    def walk_keys(self, tile: Tile, softmax: OnlineSoftmax):
        """The first ``masked_steps`` steps masked (unrolled), the rest in a loop, then the last
        block's P·V."""
        c = self.spec.config
        steps = masked_steps(c.tile_m, c.tile_n, tile.bounds)
        rP = cute.make_rmem_tensor(tile.thr_qk.partition_shape_C((c.tile_m, c.tile_n)),
                                   tile.lay.dtype)
        for i in cutlass.range_constexpr(steps):
            if tile.n_hi - 1 - i >= tile.n_lo:
                self.key_step(tile, softmax, rP, i, masked=True, first=i == 0)
        for i in range(steps, tile.n_hi - tile.n_lo):
            self.key_step(tile, softmax, rP, i, masked=False, first=False)
        if tile.n_hi > tile.n_lo:
            last = tile.n_hi - 1 - tile.n_lo
            cute.arch.cp_async_wait_group(0)  # V of the last step
            publish_shared()
            self.pv(tile, rP, last % c.stages, wait=0)

    @cute.jit
    def key_step(self, tile: Tile, softmax: OnlineSoftmax, rP: cute.Tensor, i,
                 masked: cutlass.Constexpr, first: cutlass.Constexpr):
        c, lay = self.spec.config, tile.lay
        stages = c.stages
        n_block = tile.n_hi - 1 - i
        # K_i and V_{i-1} landed: stages - 2 younger groups may still be in flight
        cute.arch.cp_async_wait_group(stages - 2)
        publish_shared()
        self.refill(tile, i + stages - 1, i + stages - 2, v_ragged=first and stages == 2)
        acc_S = cute.make_rmem_tensor(tile.thr_qk.partition_shape_C((c.tile_m, c.tile_n)),
                                      cutlass.Float32)
        wgmma(lay.qk_mma, acc_S, tile.tSrQ, tile.tSrK[None, None, None, i % stages],
              zero_init=True, wait=None)
        if cutlass.const_expr(not first):
            self.pv(tile, rP, (i - 1) % stages, wait=None)
        warpgroup.wait_group(0 if first else 1)  # S_i (P·V may still run)

        S = acc_mn_view(acc_S)
        if cutlass.const_expr(masked):
            mask_scores(S, tile.score_coords(n_block), tile.seqlen_k, tile.bounds, tile.q_group)
        correction = softmax.step(S)
        if cutlass.const_expr(not first):
            warpgroup.wait_group(0)  # P_{i-1}·V_{i-1}: O and rP are free
        softmax.rescale(acc_mn_view(tile.acc_O), correction)
        rP.store(acc_S.load().to(lay.dtype))

    @cute.jit
    def pv(self, tile: Tile, rP: cute.Tensor, slot, wait: cutlass.Constexpr):
        """O += P·V from V's ring stage ``slot``; P, converted, is the RS A operand as it lies."""
        tOrP = cute.make_tensor(rP.iterator, acc_as_operand_a(rP.layout))
        wgmma(tile.lay.pv_mma, tile.acc_O, tOrP, tile.tOrVt[None, None, None, slot],
              zero_init=False, wait=wait)

    # ---- loads -----------------------------------------------------------------------------
    @cute.jit
    def prologue(self, tile: Tile):
        """Q with K_0, then K_j with V_{j-1} for j < stages - 1: one group each (only step 0's
        block may be ragged)."""
        load_rows(tile.lay.g2s, tile.tQgQ, tile.tQsQ, tile.tQcQ, tile.seqlen_q)
        for j in cutlass.range_constexpr(self.spec.config.stages - 1):
            if cutlass.const_expr(j == 0):
                self.issue(tile, tile.tKgK, tile.tKsK, 0, ragged=True)
                cute.arch.cp_async_commit_group()
            else:
                self.refill(tile, j, j - 1, v_ragged=j == 1)

    @cute.jit
    def refill(self, tile: Tile, k_step, v_step, v_ragged: cutlass.Constexpr):
        """One cp.async group: K of step ``k_step`` and V of step ``v_step`` into their ring
        stages, each if the step is in the walk (committed even when empty: the waits count
        groups)."""
        self.issue(tile, tile.tKgK, tile.tKsK, k_step, ragged=False)
        self.issue(tile, tile.tVgV, tile.tVsV, v_step, ragged=v_ragged)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def issue(self, tile: Tile, src, dst, step, ragged: cutlass.Constexpr):
        n_block = tile.n_hi - 1 - step
        if n_block >= tile.n_lo:
            load_block(tile.lay.g2s, src, dst, tile.tKVcKV, n_block,
                       step % self.spec.config.stages, tile.seqlen_k, ragged)

    # ---- epilogue ----------------------------------------------------------------------------
    @cute.jit
    def store_output(self, tile: Tile, softmax: OnlineSoftmax, mQ: cute.Tensor,
                     mO: cute.Tensor, mLSE: cute.Tensor | None):
        """O / row sum in the output dtype, through shared memory (Q's buffer) to 16-byte
        stores of the rows below seqlen_q; the LSE of those rows if asked."""
        lay, c, d = tile.lay, self.spec.config, self.spec.head_dim
        # coordinates read again (cheap) rather than kept live through the key loop
        m_block, head, batch, _ = tile_coords(mQ, self.spec)
        O = acc_mn_view(tile.acc_O)
        for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
            O[r, None] = O[r, None].load() * softmax.inverse_sum(r)
        if cutlass.const_expr(mLSE is not None):
            store_lse(tile, softmax, mLSE[batch, head, None], m_block)

        rO = cute.make_rmem_tensor(tile.acc_O.layout, lay.dtype)
        rO.store(tile.acc_O.load().to(lay.dtype))
        sO = tile.sQ  # (tile_m, d), same layout; every Q·Kᵀ has completed
        r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                         lay.dtype), lay.pv_mma)
        r2s_thr = r2s.get_slice(tile.tidx)
        cute.arch.sync_threads()  # every warpgroup's last wgmma on sQ has completed
        cute.copy(r2s, r2s_thr.retile(rO), r2s_thr.partition_D(sO))
        cute.arch.sync_threads()

        gO = cute.local_tile(mO[batch, head, None, None], (c.tile_m, d), (m_block, 0))
        cO = cute.local_tile(cute.make_identity_tensor((tile.seqlen_q, d)), (c.tile_m, d),
                             (m_block, 0))
        r2g = lay.r2g_o.get_slice(tile.tidx)
        tOsO, tOgO, tOcO = r2g.partition_S(sO), r2g.partition_D(gO), r2g.partition_D(cO)
        tOrO = cute.make_rmem_tensor_like(tOgO, lay.dtype)
        cute.autovec_copy(tOsO, tOrO)
        for m in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
            if cute.elem_less(tOcO[0, m, 0][0], tile.seqlen_q):
                cute.copy(lay.r2g_o, tOrO[None, m, None], tOgO[None, m, None])
