"""The Hopper backward kernel: the mma_sync backward's walk (``mma_sync_bwd/attention_bwd.py``:
one CTA per (batch, K/V head, block of ``tile_n`` keys), every query block of every query head
of the K/V head's group that sees some key of the block, dK and dV in registers, dQ into the
fp32 accumulator by ``red.global.add``, in key-block order when ``deterministic``), each step's
five products as warpgroup MMAs (``layouts.py``).

The next query block's Q and dO go into the other stage while this block's first MMAs run: by
TMA from warp 0 over dense batches (``loads.py``), else by every thread's cp.async, with the
LSE and D rows always by cp.async. Every warp computes: warpgroup w holds keys 64w .. 64w + 63
of the block. Per block: Sᵀ and dPᵀ; Pᵀ and dSᵀ; dV (while dSᵀ goes to shared memory and the
CTA meets); dQ, then dK, whose MMAs run while dQ is staged for its bulk reduction (or added).
Over dense batches with dQ added in bulk, the warp-specialised kernel
(``warp_specialized.py``) runs the same products with a producer warpgroup in front.
ABI: ``flashcore.specs.params.BACKWARD``.
"""



import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from ..common.mask import mask_keys_in_rows, soft_cap
from ..common.sequences import Sequences
from ..hopper.fragments import acc_as_operand_a, acc_mn_view
from ..hopper.layouts import WARPGROUP
from ..hopper.mma import wgmmas
from ..mma_sync_bwd.attention_bwd import AttentionBackward
from ..mma_sync_bwd.cta import BackwardCta
from ..mma_sync_bwd.dq_layout import turn_bytes
from ..mma_sync_bwd.epilogue import store_key_grads
from ..mma_sync_bwd.layouts import transposed
from ..mma_sync_bwd.query_block import add_dq, issue_block, issue_first, needs_mask
from .dq_bulk import issue_dq, stage_dq, wait_dq_done, wait_dq_read
from .layouts import HopperBackwardLayouts
from .loads import TensorShape, copy_pair, init_barriers, tma_inputs


class HopperCta(BackwardCta):
    """Trace-time view of one CTA: the mma_sync CTA's coordinates, bounds and copies
    (``BackwardCta``'s methods), with warpgroup MMA fragments over the swizzled tiles."""

    def __init__(self, lay: HopperBackwardLayouts, storage, mQ, mK, mV, window_left,
                 window_right, seqs: Sequences):
        tma = lay.spec.loads_by_tma  # Q, K, V: (TMA atom, coordinate tensor) pairs
        shapes = (TensorShape(mQ[1]), TensorShape(mK[1])) if tma else (mQ, mK)
        self.place(lay, *shapes, window_left, window_right, seqs)
        spec, c = self.spec, self.config
        if spec.warp_specialized:  # the MMA warpgroups follow the producer's: their own index
            self.tidx = self.tidx - WARPGROUP
        d, tm, tn = spec.head_dim, c.tile_m, c.tile_n

        def tile(buf, layout):
            return buf.get_tensor(layout.outer, swizzle=layout.inner)

        self.sQ, self.sdO = tile(storage.sQ, lay.sQ), tile(storage.sdO, lay.sQ)
        self.sK, self.sV = tile(storage.sK, lay.sK), tile(storage.sV, lay.sK)
        self.sdS = tile(storage.sdS, lay.sdS)
        self.sLSE = storage.sLSE.get_tensor(lay.sRows)
        self.sD = storage.sD.get_tensor(lay.sRows)
        self.sdQ = storage.sdQ.get_tensor(lay.sdQ) if spec.bulk_dq else None
        if tma:
            self.tma_kv, self.mbar = (mK, mV), storage.mbar.data_ptr()
            e = lay.dtype.width // 8
            self.key_bytes, self.tile_bytes = 2 * tn * d * e, 2 * tm * d * e
            init_barriers(self.mbar, c.stages, self.tidx,
                          c.warps if spec.warp_specialized else 0)
        else:
            self.copies(mK, mV)

        # warpgroup MMA fragments (each warpgroup's slice; the thread slices for coordinates)
        wg = cute.arch.make_warp_uniform(self.tidx // WARPGROUP)
        sdp = lay.mma_sdp.get_slice(wg * WARPGROUP)
        self.tSrK = sdp.make_fragment_A(sdp.partition_A(self.sK))
        self.tSrV = sdp.make_fragment_A(sdp.partition_A(self.sV))
        self.tSrQ = sdp.make_fragment_B(sdp.partition_B(self.sQ))
        self.tSrdO = sdp.make_fragment_B(sdp.partition_B(self.sdO))
        dkv = lay.mma_dkv.get_slice(wg * WARPGROUP)
        self.tKrQt = dkv.make_fragment_B(dkv.partition_B(transposed(self.sQ, tm, d)))
        self.tVrdOt = dkv.make_fragment_B(dkv.partition_B(transposed(self.sdO, tm, d)))
        self.wg = wg
        dq = lay.mma_dq.get_slice(0 if lay.dq_single else wg * WARPGROUP)
        self.tQrdS = dq.make_fragment_A(dq.partition_A(transposed(self.sdS, tn, tm)))
        self.tQrKt = dq.make_fragment_B(dq.partition_B(transposed(self.sK, tn, d)))
        self.thr_sdp = lay.mma_sdp.get_slice(self.tidx)
        self.thr_dkv = lay.mma_dkv.get_slice(self.tidx)
        self.thr_dq = lay.mma_dq.get_slice(self.tidx % WARPGROUP if lay.dq_single
                                           else self.tidx)
        r2s = lay.r2s_ds.get_slice(self.tidx)
        self.r2s_ds, self.tdSsdS = r2s, r2s.partition_D(self.sdS)
        self.tdQsdQ = self.thr_dq.partition_C(self.sdQ) if spec.bulk_dq else None
        self.key_grads()

    @cute.jit
    def copy_keys(self, steps):
        """K and V: by TMA where the CTA walks some query block (``loads.py``), else
        ``BackwardCta``'s cp.async."""
        if cutlass.const_expr(self.spec.loads_by_tma):
            if steps > 0:
                copy_pair(self.tma_kv, (self.sK, self.sV), self.kv_head, self.batch,
                          (self.config.tile_n, self.spec.head_dim), self.n_block,
                          self.mbar + self.config.stages, self.key_bytes)
        else:
            BackwardCta.copy_keys(self, steps)

    @cute.jit
    def copy_tiles(self, head, m_block, slot, more_bytes: cutlass.Constexpr = 0):
        """Q and dO: by TMA (``loads.py``; the stage's barrier also expects ``more_bytes``,
        the warp-specialised kernel's rows), else ``BackwardCta``'s cp.async."""
        if cutlass.const_expr(self.spec.loads_by_tma):
            copy_pair(self.tma_q_do, (self.sQ, self.sdO), head, self.batch,
                      (self.config.tile_m, self.spec.head_dim), m_block, self.mbar + slot,
                      self.tile_bytes + more_bytes, slot)
        else:
            BackwardCta.copy_tiles(self, head, m_block, slot)

    @cute.jit
    def wait_tiles(self, step):
        """Step ``step``'s Q and dO landed in its stage (the first step: K and V too), for
        the warpgroup MMAs: a TMA's bytes on its barrier; cp.async's, this thread's copies
        fenced for the async proxy (the caller's barrier makes them everyone's)."""
        if cutlass.const_expr(self.spec.loads_by_tma):
            if step == 0:
                cute.arch.mbarrier_wait(self.mbar + self.config.stages, 0)
            cute.arch.mbarrier_wait(self.mbar + step % 2, (step // 2) % 2)
        else:
            cute.arch.fence_proxy("async.shared", space="cta")


@cute.jit
def next_block(head, m_block, lo, per_head):
    """The step after (``head``, ``m_block``): every role walks the same (head, query block)
    sequence, counted without divisions."""
    nxt_head, nxt_m = head, m_block + 1
    if nxt_m == lo + per_head:
        nxt_head, nxt_m = head + 1, lo
    return nxt_head, nxt_m


@cute.jit
def p_and_ds(cta: HopperCta, acc_S, acc_dP, m_block, scale_log2, slot):
    """Pᵀ and dSᵀ in place of the Sᵀ and dPᵀ accumulators of block ``m_block`` (Sᵀ's MMAs
    done, dPᵀ's waited for here)."""
    tm, tn = cta.config.tile_m, cta.config.tile_n
    S, dP = acc_mn_view(acc_S), acc_mn_view(acc_dP)  # (keys, query rows)
    # each column's query row within the block (static); its LSE (log2) and D are read from
    # shared memory where each is used, not held in registers for the whole block
    local = acc_mn_view(cta.thr_sdp.partition_C(cute.make_identity_tensor((tn, tm))))
    cols = cute.size(S, mode=[1])

    def lse_of(j):
        row = local[0, j][1]
        if cutlass.const_expr(cta.spec.varlen):  # past the sequence: the next one's rows
            return cutlass.select_(m_block * tm + row >= cta.seqlen_q, cutlass.Float32.inf,
                                   cta.sLSE[row, slot])
        return cta.sLSE[row, slot]

    def d_of(j):
        return cta.sD[local[0, j][1], slot]

    if cutlass.const_expr(cta.spec.softcap):  # dPᵀ first: its slope needs the capped Sᵀ
        warpgroup.wait_group(0)
        soft_cap(S, *cta.softcap)  # S -> (c / scale) · tanh(S · scale / c), as the forward
        for j in cutlass.range_constexpr(cols):  # dP - D times the cap's slope 1 - tanh²
            t = S[None, j].load() * cta.softcap[0]
            dP[None, j] = (dP[None, j].load() - d_of(j)) * (cute.full_like(t, 1.0) - t * t)
    coords = acc_mn_view(cta.thr_sdp.partition_C(cute.local_tile(
        cute.make_identity_tensor((cta.seqlen_k, cta.seqlen_q)), (tn, tm),
        (cta.n_block, m_block))))
    if needs_mask(cta, m_block):
        mask_keys_in_rows(S, coords, cta.seqlen_k, cta.bounds)
    # Pᵀ = exp2(Sᵀ · scale · log2 e − LSE · log2 e), dSᵀ = Pᵀ ∘ (dPᵀ − D)
    for j in cutlass.range_constexpr(cols):
        col = S[None, j].load()
        p = cute.math.exp2(cute.math.fma(col, cute.full_like(col, scale_log2),
                                         cute.full_like(col, -lse_of(j))), fastmath=True)
        S[None, j] = p
        if cutlass.const_expr(cta.spec.softcap):
            dP[None, j] = p * dP[None, j].load()
    if cutlass.const_expr(not cta.spec.softcap):
        warpgroup.wait_group(0)  # dPᵀ, while P's exponentials ran
        for j in cutlass.range_constexpr(cols):
            dP[None, j] = S[None, j].load() * (dP[None, j].load() - d_of(j))


@cute.jit
def issue_dv(cta: HopperCta, acc_S, acc_dP, slot):
    """Pᵀ and dSᵀ in the 16-bit dtype, and dV += Pᵀ·dO issued (A in place in the registers);
    returns dSᵀ's registers."""
    lay = cta.lay
    rP = cute.make_rmem_tensor(acc_S.layout, lay.dtype)
    rP.store(acc_S.load().to(lay.dtype))
    rdS = cute.make_rmem_tensor(acc_dP.layout, lay.dtype)
    rdS.store(acc_dP.load().to(lay.dtype))
    rP_a = cute.make_tensor(rP.iterator, acc_as_operand_a(rP.layout))
    wgmmas([(lay.mma_dkv, cta.acc_dV, rP_a, cta.tVrdOt[None, None, None, slot])], False, None)
    return rdS


@cute.jit
def query_block(cta: HopperCta, mdQacc, head, m_block, scale_log2, slot, nxt):
    """Block ``m_block`` of query head ``head``, its Q, dO, LSE and D rows landed in stage
    ``slot`` (``HopperCta.wait_tiles``). ``nxt``: (whether there is a next block, its
    head, its query block), whose Q, dO, LSE and D rows are copied into the other stage while
    this block's first products run."""
    c, d, lay = cta.config, cta.spec.head_dim, cta.lay
    tm, tn = c.tile_m, c.tile_n
    acc_S = cute.make_rmem_tensor(cta.thr_sdp.partition_shape_C((tn, tm)), cutlass.Float32)
    acc_dP = cute.make_rmem_tensor(cta.thr_sdp.partition_shape_C((tn, tm)), cutlass.Float32)
    # two groups: P's exponentials run while dPᵀ's MMAs do (no soft-cap)
    wgmmas([(lay.mma_sdp, acc_S, cta.tSrK, cta.tSrQ[None, None, None, slot])], True, None)
    wgmmas([(lay.mma_sdp, acc_dP, cta.tSrV, cta.tSrdO[None, None, None, slot])], True, None)
    # the next block's copies: their address arithmetic runs under this block's MMAs
    if nxt[0]:
        issue_block(cta, nxt[1], nxt[2], 1 - slot)
    cute.arch.cp_async_commit_group()
    warpgroup.wait_group(1)

    p_and_ds(cta, acc_S, acc_dP, m_block, scale_log2, slot)
    rdS = issue_dv(cta, acc_S, acc_dP, slot)  # its MMAs run while dSᵀ goes to shared memory
    # dSᵀ to shared memory for dQ: every warpgroup's keys before either reads it
    cute.copy(cta.r2s_ds, cta.r2s_ds.retile(rdS), cta.tdSsdS)
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.sync_threads()
    # dQ = dS·K, then dK += dSᵀ·Q: dQ's adds (or staging) run under dK's MMAs
    rdS_a = cute.make_tensor(rdS.iterator, acc_as_operand_a(rdS.layout))
    dk = (lay.mma_dkv, cta.acc_dK, rdS_a, cta.tKrQt[None, None, None, slot])
    acc_dQ = cute.make_rmem_tensor(cta.thr_dq.partition_shape_C((tm, d)), cutlass.Float32)
    mine = not lay.dq_single or cta.wg == 0  # (d96: the first warpgroup's dQ alone)
    if mine:
        wgmmas([(lay.mma_dq, acc_dQ, cta.tQrdS, cta.tQrKt)], True, None)
    wgmmas([dk], False, 1)  # dV's and dQ's groups done, dK's in flight
    if cutlass.const_expr(cta.spec.bulk_dq):
        if mine:
            stage_dq(acc_dQ, cta.tdQsdQ, slot, dq_turn_bytes(cta, mdQacc, head, m_block))
    else:
        add_dq(cta, acc_dQ, mdQacc, head, m_block, mine)
    # dK landed; the staged dQ is fenced for the bulk copy only once no MMA is in flight
    warpgroup.wait_group(0)
    if cutlass.const_expr(cta.spec.bulk_dq):
        cute.arch.fence_proxy("async.shared", space="cta")


@cute.jit
def dq_turn_bytes(cta: HopperCta, mdQacc, head, m_block):
    """The XOR that places this thread's dQ values of block ``m_block`` (``dq_layout``)."""
    dst = cta.thr_dq.partition_C(dq_block(cta, mdQacc, head, m_block))
    return cutlass.Int32(turn_bytes(dst, mdQacc, cta.spec.head_dim))


def dq_block(cta: HopperCta, mdQacc, head, m_block) -> cute.Tensor:
    """Query block ``m_block``'s rows of head ``head`` in the fp32 dQ accumulator."""
    return cute.local_tile(cta.query_rows(mdQacc, head), (cta.config.tile_m, cta.spec.head_dim),
                           (m_block, 0))


class HopperBackward(AttentionBackward):
    layouts = HopperBackwardLayouts
    cta = HopperCta

    def kernel_args(self, lay: HopperBackwardLayouts, args):
        """Q, K, V and dO as TMA atoms over dense batches (``loads.py``)."""
        if self.spec.loads_by_tma:
            return args._replace(inputs=tma_inputs(self.spec, lay, args.inputs))
        return args

    @cute.kernel
    def kernel(self, args):
        mdQacc = args.workspaces.dq_accum
        cta, first, lo, per_head, steps = self.begin(args)
        issue_first(cta, first, lo, steps)
        bulk = self.spec.bulk_dq
        # (head, query block) of the last step, this one and the next, walked without divisions
        last_head, last_m = cutlass.Int32(first), cutlass.Int32(lo)
        head, m_block = cutlass.Int32(first), cutlass.Int32(lo)
        for step in range(steps):
            # this step's tiles landed, seen by the async proxy; every warpgroup is done with
            # the last step's (its dQ product waited), so the other stage and dSᵀ are free;
            # (bulk dQ) the last step's block is staged whole and this step's buffer was read
            cute.arch.cp_async_wait_group(0)
            HopperCta.wait_tiles(cta, step)  # (through the class: a method call on ``cta``
            # in the loop would make the DSL carry ``cta`` as loop state)
            if cutlass.const_expr(bulk):
                wait_dq_read(cta.tidx)
            cute.arch.sync_threads()
            slot = step % 2
            if cutlass.const_expr(bulk):  # noqa: SIM102 - compile time, then run time
                if step > 0:
                    issue_dq(cta.sdQ, dq_block(cta, mdQacc, last_head, last_m), 1 - slot,
                             cta.tidx)
            next_head, next_m = next_block(head, m_block, lo, per_head)
            query_block(cta, mdQacc, head, m_block, args.scales.scale_log2, slot,
                        (step + 1 < steps, next_head, next_m))
            last_head, last_m = head, m_block
            head, m_block = next_head, next_m
        cute.arch.cp_async_wait_group(0)  # K and V landed even where no step ran
        if cutlass.const_expr(bulk):  # the last block's dQ, and every reduction done
            cute.arch.sync_threads()
            if steps > 0:
                issue_dq(cta.sdQ, dq_block(cta, mdQacc, last_head, last_m), (steps - 1) % 2,
                         cta.tidx)
            wait_dq_done(cta.tidx)
        store_key_grads(cta, args.grads.dk, args.grads.dv, args.scales.scale)
