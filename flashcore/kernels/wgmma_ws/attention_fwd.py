"""The warp-specialised Hopper forward kernel (sm_90a): TMA loads, mbarrier pipelines, a producer
warpgroup and 1-3 consumer warpgroups.

* Warpgroup 0 produces (``producer.py``): its warp 0 issues every load as TMA
  (``cp.async.bulk.tensor``) into swizzled tiles, Q once, then K and V of each key block into
  rings of ``stages`` blocks, each stage guarded by a full mbarrier (TMA's transaction count)
  and an empty one (one arrival per consumer warp). It keeps 24 registers (``setmaxnreg``);
  the consumers take the rest (240 each for two, 160 for three).
* Warpgroups 1.. consume, 64 query rows each, with no CTA barrier in the key loop: the wgmma
  family's overlapped schedule (S_i = Q·K_iᵀ issued, then P_{i-1}·V_{i-1}, softmax of S_i while
  P·V runs), shared softmax, masks and key-block range (``flashcore/kernels/common``). With
  two or three consumers and 128-key blocks they take turns to issue their MMAs (ping-pong,
  ``turns.py``).
* Every tensor but O and LSE reaches the kernel as a TMA descriptor (a 128-byte kernel
  parameter) with its coordinate tensor's run-time extents; flashcore's runtime encodes them
  (``flashcore.runtime.tensor_map``, parameters in ``flashcore.compiler.abi``). TMA zero-fills rows
  past a sequence end; the masked first block hides those keys.
* Three consumers of 128-key steps at head_dim 128 (16-bit or e4m3): P goes to the P·V wgmma
  through a shared tile of its own (``Consumer.store_p``, the SS form): 160 registers a thread
  hold S and O but not P beside them.
* Masks (``common/block_info``, ``common/mask``): bottom-right alignment, a sliding window
  (blocks outside it skipped, those below its lower edge masked again), soft-capping. The
  producer loads the blocks the consumers walk; a tile that sees no key walks none (O 0).
* Epilogue (``epilogue.py``): O / row sum, each consumer warpgroup through its own rows of Q's
  tile (a named barrier of its 128 threads) to 16-byte stores of the rows below seqlen_q;
  natural-log LSE if asked.
* A packed batch (``varlen``): the grid's z is the sequence (``common/sequences``); its rows
  of the (1, heads, total, head_dim) tensors are reached by offsetting the TMA coordinates to
  its start, so a tile's rows past its end are the next sequence's (or TMA's zeros past the
  tensor), which its key bounds mask and its epilogue does not store. Rows no CTA owns are
  zeroed (``common.epilogue.clear_rows_no_cta_owns``), as in the mma_sync family.
* A paged cache (``paged_kv``, its page size compiled in: a multiple of tile_n, or a divisor
  of it of 16 rows or more): the producer finds each key block's page in the block table and
  loads that page's rows at the block's offset, or, pages smaller than a block, one box from
  each of the block's pages into its rows of the stage; the sequence's keys come from
  ``seqlens_k``. The first block walked (the last) may reach past them into the rest of its
  page (or into pages past the sequence's: the table's entries there are clamped into the
  table and the cache), which may hold anything: its V rows there are zeroed in shared memory
  before any P·V reads them (``consumer.clear_rows``), as P is 0 there but 0 * NaN is not.
* ``precision="fp8"``: Q, K and Vᵀ in e4m3 (``flashcore.ops.fp8``'s layout: Vᵀ keys-contiguous,
  permuted within each 32), both MMAs e4m3 wgmma (k32), fp32 accumulators. Vᵀ tiles are the
  K-major B operand the 8-bit wgmma requires; the permutation lets P's accumulator registers
  be the A operand after a gather within each thread (``acc_as_fp8_operand_a``). Descales as
  in the mma_sync family (``common/fp8.py``: per-token K descales scale the score columns, a
  per-head one is in the rows' exp2 scales); O is staged in its own 16-bit tile. With K per
  head, e4m3 bounds every row's max * scale before the loop: a warpgroup whose rows it bounds
  walks its keys in the softmax's rounded form (one FMA a score), any other exactly
  (``common/fp8.offsets_bounded``, ``walk_keys``). FP8's row sums are the tensor
  cores' (P times a tile of ones in the P·V group, ``row_sums.py``) except at head_dim 64
  without a mask (``WgmmaWs.sums_by_mma``).
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..common.block_info import key_range, masked_steps, spec_bounds
from ..common.fp8 import (
    P_SCALE,
    fold_query_descales,
    load_key_descales,
    offsets_bounded,
    scale_columns,
)
from ..common.grid import tile_coords, wait_for_previous_grid
from ..common.mask import mask_scores, soft_cap
from ..common.sequences import Sequences
from ..common.softmax import OnlineSoftmax
from ..hopper.fragments import acc_mn_view
from ..hopper.layouts import WARPGROUP, tma_view
from ..hopper.mma import refuse_extras, wgmma, wgmmas
from .consumer import Consumer, clear_rows
from .epilogue import store_output
from .layouts import EPILOGUE_BARRIER, WsLayouts
from .producer import Producer, v_tiling
from .row_sums import fill_ones, totals
from .turns import Turns


def sequence_rows(spec, serving, mO, mLSE, total_k, batch, head) -> tuple:
    """(seqlen_q, seqlen_k, (first query row, first key row), packed) of this CTA's sequence,
    at trace time. Dense: the tensors' lengths, rows from 0, nothing packed. A packed batch
    (``varlen``): its rows of the (1, heads, total, head_dim) tensors, and for the epilogue
    the (seq, head_dim) and (seq,) views of its output and LSE rows, its (first row, rows)
    and the last sequence's index (``epilogue.store_output``). A paged cache: the sequence's
    keys from ``seqlens_k`` (``total_k`` is then a page's rows; the producer finds the pages).
    (The kernel's dynamic branches cannot carry the ``Sequences`` itself: only what it
    reads.)"""
    if not spec.varlen and not spec.paged_kv:
        return mO.shape[2], total_k, (0, 0), None
    seqs = Sequences(spec, serving)
    seqlen_q, q_start, packed = mO.shape[2], 0, None
    if spec.varlen:
        seqlen_q = seqs.query_len(mO, batch)
        q_start = seqs.q_span[0]
        packed = (seqs.query_rows(mO, batch, head),
                  None if mLSE is None else seqs.query_rows(mLSE, batch, head), seqs.q_span,
                  seqs.cu_q.shape[0] - 2)
    if spec.paged_kv:
        return seqlen_q, seqs.paged_key_len(batch, spec.page_size), (q_start, 0), packed
    k_start, seqlen_k = seqs.packed_keys(total_k, batch)
    return seqlen_q, seqlen_k, (q_start, k_start), packed


class WgmmaWsAttentionForward:
    """Trace-time configuration of one kernel: the spec is Python data (constexpr)."""

    def __init__(self, spec):
        self.spec = spec  # validated by flashcore.specs.families.WgmmaWs
        self.smem_size = 0

    @cute.jit
    def host(self, args):
        """The launch; flashcore keeps only the cubin, and its runtime encodes the descriptors
        these atoms describe (``flashcore.specs.families.WgmmaWs.tensor_map_params``).
        ``args``: ``flashcore.specs.params.ATTENTION``'s; the kernel gets them with each
        operand as its TMA atom and coordinate tensor."""
        lay = WsLayouts(self.spec)
        serving, spec = args.serving, self.spec  # the tables of the layouts the spec names
        unused = (() if spec.varlen else (serving.cu_seqlens_q,)) + (
            (serving.cu_seqlens_k,) if spec.paged_kv else
            () if spec.varlen else (serving.cu_seqlens_k,)) + (
            () if spec.paged_kv else (serving.block_table, serving.seqlens_k))
        refuse_extras("wgmma_ws", unused + (() if lay.fp8 else tuple(args.descales)))
        mQ, mK, mV = args.operands.q, args.operands.k, args.operands.v
        self.smem_size = lay.storage.size_in_bytes()
        c, d = self.spec.config, self.spec.head_dim
        op = cpasync.CopyBulkTensorTileG2SOp()
        atom_q, tma_q = cpasync.make_tiled_tma_atom(op, tma_view(mQ), lay.sQ, (c.tile_m, d))
        # a K (or V) box: a key block, or one page of it where pages are smaller
        box, box_rows = cute.select(lay.sKV, mode=[0, 1]), lay.key_box_rows
        if cutlass.const_expr(box_rows < c.tile_n):
            box = lay.sPage
        atom_k, tma_k = cpasync.make_tiled_tma_atom(op, tma_view(mK), box, (box_rows, d))
        # FP8 Vᵀ (batch, heads, head_dim, keys) is seen as (head_dim, keys, heads, batch)
        if cutlass.const_expr(lay.fp8):
            box = cute.select(lay.sV, mode=[0, 1])
        atom_v, tma_v = cpasync.make_tiled_tma_atom(op, tma_view(mV), box,
                                                    v_tiling(self.spec, box_rows)[0])
        m_blocks = cute.ceil_div(mQ.shape[2], c.tile_m)
        tmas = args.operands._replace(q=(atom_q, tma_q), k=(atom_k, tma_k), v=(atom_v, tma_v))
        self.kernel(args._replace(operands=tmas)).launch(
            grid=(m_blocks * mQ.shape[1] * mQ.shape[0], 1, 1),
            block=[self.spec.threads, 1, 1], smem=self.smem_size)

    @cute.kernel
    def kernel(self, args):
        ops = args.operands  # each the host's TMA atom and coordinate tensor
        (atom_q, tma_q), (atom_k, tma_k), (atom_v, tma_v) = ops.q, ops.k, ops.v
        mO, mLSE = args.outputs.o, args.outputs.lse
        mQd, mKd, mVd = args.descales.q_descale, args.descales.k_descale, args.descales.v_descale
        scale_log2, q_group, masks = args.softmax.scale_log2, args.softmax.q_group, args.masks
        spec, c = self.spec, self.spec.config
        wait_for_previous_grid(spec)
        lay = WsLayouts(spec)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            for atom in (atom_q, atom_k, atom_v):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(lay.storage)
        pipes = lay.pipelines(storage)
        tidx, _, _ = cute.arch.thread_idx()
        sOnes = None  # the row sums' ones (``row_sums.py``)
        if cutlass.const_expr(lay.sums_by_mma):
            sOnes = storage.sOnes.get_tensor(lay.sOnes.outer, swizzle=lay.sOnes.inner)
            fill_ones(sOnes, lay.dtype, tidx, spec.threads)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()  # barriers and ones are ready before anyone waits or reads
        sQ = storage.sQ.get_tensor(lay.sQ.outer, swizzle=lay.sQ.inner)
        sK = storage.sK.get_tensor(lay.sKV.outer, swizzle=lay.sKV.inner)
        sV = storage.sV.get_tensor(lay.sV.outer, swizzle=lay.sV.inner)
        sO = sQ  # the output tile: Q's buffer, or FP8's own 16-bit one
        if cutlass.const_expr(lay.fp8):
            sO = storage.sO.get_tensor(lay.sO.outer, swizzle=lay.sO.inner)
        sP = None  # P's tile, where the P·V wgmma reads it from shared memory
        if cutlass.const_expr(lay.p_in_shared):
            sP = storage.sP.get_tensor(lay.sP.outer, swizzle=lay.sP.inner)
        m_block, head, batch, _ = tile_coords(mO, spec)
        kv_head = head // (mO.shape[1] // tma_k.shape[2])
        seqlen_q, seqlen_k, starts, packed = sequence_rows(
            spec, args.serving, mO, mLSE, tma_k.shape[0], batch, head)
        bounds = spec_bounds(spec, seqlen_q, seqlen_k, q_group, masks.window_left,
                             masks.window_right)
        # the producer loads blocks n_hi - 1 down to n_lo, every one the consumers walk
        n_lo, n_hi, n_lo_unmasked = key_range(m_block, c.tile_m, c.tile_n, seqlen_k, bounds,
                                              q_group, 0, 1, 0, 1, cutlass.min, cutlass.max)
        if cutlass.const_expr(spec.varlen):  # a query tile past its sequence's rows: no keys
            n_hi = cutlass.Int32(cutlass.select_(m_block * c.tile_m < seqlen_q, n_hi, n_lo))
        if warp < 4:
            cute.arch.setmaxregister_decrease(lay.producer_regs)
            if warp < Producer(spec).warps and n_hi > n_lo:  # (no key block: nothing read)
                Producer(spec).produce(pipes, (atom_q, atom_k, atom_v), (tma_q, tma_k, tma_v),
                                       (sQ, sK, sV), m_block, head, kv_head, batch, n_lo,
                                       n_hi, starts, args.serving, warp)
        else:
            cute.arch.setmaxregister_increase(lay.consumer_regs)
            cons = Consumer(lay, sQ, sK, sV, sO, sP, sOnes, tidx - WARPGROUP, m_block,
                            seqlen_q, seqlen_k, q_group, bounds)
            cons.softcap = (masks.softcap_in, masks.softcap_out)
            cons.n_lo_unmasked = n_lo_unmasked
            # FP8: p comes out times P_SCALE (one FMA), the row sums with it: O / sum needs
            # only V's descale
            softmax = OnlineSoftmax(cute.size(acc_mn_view(cons.acc_O), mode=[0]), scale_log2,
                                    form="exact" if lay.fp8 else "offset",
                                    p_log2=math.log2(P_SCALE) if lay.fp8 else 0.0,
                                    sums="mma" if lay.sums_by_mma else "rows")
            o_scale = None
            if cutlass.const_expr(lay.fp8 and spec.k_scale == "token"):
                fold_query_descales(cons, softmax, mQd[batch, head, None], scale_log2)
                cons.gKd = mKd[batch, kv_head, None]
            elif cutlass.const_expr(lay.fp8):
                fold_query_descales(cons, softmax, mQd[batch, head, None], scale_log2,
                                    mKd[batch, kv_head])
            if cutlass.const_expr(lay.fp8):
                o_scale = mVd[batch, kv_head]
            if cutlass.const_expr(lay.fp8 and spec.k_scale == "head"):
                # every scale a row's scores see is in its exp2 scale, and e4m3 operands bound
                # the scores: where that bounds the offsets, the key loop in the rounded form
                softmax.rounded = offsets_bounded(cons, softmax, spec.head_dim,
                                                  EPILOGUE_BARRIER + cons.wg, WARPGROUP)
            if n_hi > n_lo:
                self.walk_keys(cons, softmax, pipes, n_lo, n_hi)
            softmax.finish(None if cons.acc_L is None else totals(cons.acc_L))
            store_output(cons, softmax, mO, mLSE, head, batch, o_scale, packed)

    # ---- consumers -----------------------------------------------------------------------------
    @cute.jit
    def walk_keys(self, cons: Consumer, softmax: OnlineSoftmax, pipes, n_lo, n_hi):
        """The key loop, in the rounded softmax form where the warpgroup's offsets are bounded
        (``softmax.rounded``, run time), else in the softmax's own."""
        if cutlass.const_expr(softmax.rounded is None):
            self.consume(cons, softmax, pipes, n_lo, n_hi)
        else:
            rounded = softmax.in_form("rounded")
            if softmax.rounded:
                self.consume(cons, rounded, pipes, n_lo, n_hi)
            else:
                self.consume(cons, softmax, pipes, n_lo, n_hi)

    @cute.jit
    def consume(self, cons: Consumer, softmax: OnlineSoftmax, pipes, n_lo, n_hi):
        """Step 0 (Q·K₀ᵀ alone), the masked steps, the unmasked ones, the last block's P·V;
        each step's MMAs issued in this warpgroup's turn (``turns``)."""
        c = self.spec.config
        pipe_q, pipe_k, pipe_v = pipes
        turns = Turns(cons.wg, cons.lay.consumers, c.tile_n)
        turns.open()
        pipe_q.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        ks = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, c.stages)
        if cutlass.const_expr(self.spec.paged_kv):
            # the first block's rows past the sequence's keys are the rest of its last page,
            # whatever that holds: P is 0 there, and 0 * NaN is not
            self.clear_keys_past_end(pipe_v, ks, cons.sV, cons.ctid, cons.seqlen_k, n_hi)
        pipe_k.consumer_wait(ks)
        kd = cons.new_key_descales()
        self.load_key_descales(cons, kd, n_hi - 1, masked=True)
        acc_S = cons.new_scores()
        turns.wait()
        wgmma(cons.lay.qk_mma, acc_S, cons.tSrQ, cons.tSrK[None, None, None, ks.index],
              zero_init=True, wait=None)
        turns.pass_on()
        warpgroup.wait_group(0)
        pipe_k.consumer_release(ks)
        S = acc_mn_view(acc_S)
        self.scale_keys(S, kd)
        self.load_key_descales(cons, kd, cutlass.max(n_hi - 2, n_lo), masked=True)
        self.cap_scores(cons, S)
        mask_scores(S, cons.score_coords(n_hi - 1), cons.seqlen_k, cons.bounds, cons.q_group)
        cons.rescale(softmax, softmax.step(S))
        cons.set_probabilities(acc_S)
        blocks, steps_masked = n_hi - n_lo, masked_steps(c.tile_m, c.tile_n, cons.bounds)
        if cutlass.const_expr(steps_masked == 1):  # step 0 was the only one
            for i in range(1, blocks):
                ks = self.overlapped_step(cons, softmax, pipes, turns, ks, kd, n_hi - 1 - i,
                                          n_lo, masked=False)
        elif cutlass.const_expr(not self.spec.window):
            # one loop that masks its first steps (a run-time branch): a loop of masked steps
            # and one of unmasked ones, two copies of the step, spilled 192-row tiles
            masked = cutlass.min(steps_masked, blocks)
            for i in range(1, blocks):
                ks = self.overlapped_step(cons, softmax, pipes, turns, ks, kd, n_hi - 1 - i,
                                          n_lo, masked=i < masked)
        else:
            # a window masks its first steps and, from step ``lower`` on, the blocks below
            # n_lo_unmasked (its lower edge), in the same one loop: step i masks unless
            # top <= i < lower
            top, lower = cutlass.min(steps_masked, blocks), n_hi - cons.n_lo_unmasked
            for i in range(1, blocks):
                ks = self.overlapped_step(cons, softmax, pipes, turns, ks, kd, n_hi - 1 - i,
                                          n_lo, masked=cutlass.min(i + 1 - top, lower - i) <= 0)
        pipe_v.consumer_wait(ks)
        turns.wait()
        self.pv(cons, ks.index, wait=None)
        turns.pass_on()
        warpgroup.wait_group(0)
        pipe_v.consumer_release(ks)
        turns.close()

    @cute.jit
    def clear_keys_past_end(self, pipe_v, ks, sV, ctid, seqlen_k, n_hi):
        """V rows of the first block (n_hi - 1) past the sequence's keys zeroed once they have
        landed, by every consumer thread (``consumer.clear_rows``)."""
        c = self.spec.config
        past = cutlass.max(seqlen_k - (n_hi - 1) * c.tile_n, 0)
        if past < c.tile_n:
            pipe_v.consumer_wait(ks)
            clear_rows(sV[None, None, ks.index], past, ctid, c.warps // 4 * WARPGROUP)

    @cute.jit
    def overlapped_step(self, cons: Consumer, softmax: OnlineSoftmax, pipes, turns: Turns, ks,
                        kd, n_block, n_lo, masked):
        """S of block ``n_block`` issued, then P·V of the block before (in this warpgroup's
        turn); softmax of S while P·V runs; K's stage released after the softmax, V's once P·V
        has completed. ``masked``: False (known at compile time) or a run-time flag. FP8: ``kd``
        holds this block's key descales (loaded a step ahead: a global load's latency is longer
        than an e4m3 Q·Kᵀ) and is refilled with the next block's."""
        _, pipe_k, pipe_v = pipes
        vs = ks.clone()
        ks.advance()
        if cutlass.const_expr(turns.on):  # both blocks in before the turn (V came first)
            pipe_v.consumer_wait(vs)
        pipe_k.consumer_wait(ks)
        acc_S = cons.new_scores()
        turns.wait()
        wgmma(cons.lay.qk_mma, acc_S, cons.tSrQ, cons.tSrK[None, None, None, ks.index],
              zero_init=True, wait=None)
        if cutlass.const_expr(not turns.on):
            pipe_v.consumer_wait(vs)
        self.pv(cons, vs.index, wait=None)
        turns.pass_on()
        warpgroup.wait_group(1)
        S = acc_mn_view(acc_S)
        self.scale_keys(S, kd)
        self.cap_scores(cons, S)
        # blocks go down: below an unmasked block every key lies inside (n_lo: a spare load)
        self.load_key_descales(cons, kd, cutlass.max(n_block - 1, n_lo),
                               masked=masked is not False)
        if cutlass.const_expr(masked is not False):
            coords, seqlen_k, bounds, q_group = (cons.score_coords(n_block), cons.seqlen_k,
                                                 cons.bounds, cons.q_group)
            if masked:  # (the run-time if carries only these locals)
                mask_scores(S, coords, seqlen_k, bounds, q_group)
        correction = softmax.step(S)
        # ptxas hoists the wait for P·V to the earliest point it may, and an mbarrier arrive
        # is one it does not cross: released before the softmax, K's arrive let the wait go
        # above the row max where a masking branch ends just before it (bottom-right, windows)
        pipe_k.consumer_release(ks)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(vs)
        cons.rescale(softmax, correction)
        cons.set_probabilities(acc_S)
        return ks

    @cute.jit
    def load_key_descales(self, cons: Consumer, kd, n_block, masked: cutlass.Constexpr):
        """FP8: the descales of this thread's keys of block ``n_block`` into ``kd`` (a block
        that may reach past seqlen_k is checked); else nothing."""
        if cutlass.const_expr(kd is not None):
            load_key_descales(kd, cons.score_coords(n_block), cons.gKd, cons.seqlen_k,
                              inside=not masked)

    @cute.jit
    def cap_scores(self, cons: Consumer, S: cute.Tensor):
        """Soft-capping (before the mask: a hidden score stays -inf)."""
        if cutlass.const_expr(self.spec.softcap):
            soft_cap(S, *cons.softcap)

    @cute.jit
    def scale_keys(self, S: cute.Tensor, k_descale):
        if cutlass.const_expr(k_descale is not None):  # each key's descale scales its column
            scale_columns(S, k_descale)

    @cute.jit
    def pv(self, cons: Consumer, slot, wait: cutlass.Constexpr):
        wgmmas(cons.pv_products(slot), zero_init=False, wait=wait)
