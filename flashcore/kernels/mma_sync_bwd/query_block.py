"""One query block against the CTA's key block: recompute P from the forward's LSE, then
dV += Pᵀ·dO, dP = dO·Vᵀ, dS = P ∘ (dP − D), dK += dSᵀ·Q, dQ += dS·K (fp32 atomics; with
``deterministic``, in key-block order: ``turns.py``). With a
soft-cap, P comes from the capped scores and dS gets its slope: dS = P ∘ (dP − D) ∘ (1 − tanh²).

One stage: the next block's dO is copied in as soon as dV is done with this one's, and its Q
once dK is: their loads run under dK's and dQ's products (one buffer each). Two stages
(``spec.prefetch_rows``): the next block's Q, dO, LSE and D rows go into the other stage when
this block starts (``issue_block``), so its loads run under this whole block, and the block
needs one barrier of its own (P and dS written) instead of three."""


import cutlass
import cutlass.cute as cute

from ..common.block_info import block_needs_mask, dq_turn
from ..common.fragments import mn_view
from ..common.mask import mask_scores, soft_cap
from ..common.mma import gemm_ss
from .atomics import add_into
from .cta import BackwardCta, load_tile
from .dq_layout import turn_bytes
from .turns import pass_turn, wait_turn


@cute.jit
def load_row_values(cta: BackwardCta, rows_of_head, dst, m_block, first: cutlass.Constexpr = 0):
    """cp.async query block ``m_block``'s rows of a (padded: never past its end) per-row
    workspace into ``dst`` (tile_m,), one 4-byte copy a row, by threads ``first`` ..
    ``first + tile_m - 1``."""
    tm = cta.config.tile_m
    block = cute.local_tile(rows_of_head, (tm,), (m_block,))
    e = cta.tidx - first
    if cta.tidx >= first and e < tm:
        cute.copy(cta.lay.rows_atom, cute.local_tile(block, (1,), (e,)),
                  cute.local_tile(dst, (1,), (e,)))


@cute.jit
def issue_block(cta: BackwardCta, head, m_block, slot):
    """cp.async query block ``m_block`` of ``head``: Q, dO and (two stages) its LSE and D rows,
    into stage ``slot`` (the caller commits)."""
    cta.copy_tiles(head, m_block, slot)
    if cutlass.const_expr(cta.spec.prefetch_rows):
        # the two row vectors from different threads where there are enough
        tm, threads = cta.config.tile_m, cta.config.threads
        load_row_values(cta, cta.at_head(cta.src_d, head), cta.sD[None, slot], m_block,
                        tm if threads >= 2 * tm else 0)
        load_row_values(cta, cta.at_head(cta.src_lse, head), cta.sLSE[None, slot], m_block)


@cute.jit
def issue_first(cta: BackwardCta, head, m_block, steps):
    """cp.async the CTA's K and V and, where it walks any, its first query block (``head``,
    ``m_block``) into stage 0: one commit group."""
    cta.copy_keys(steps)
    if steps > 0:
        issue_block(cta, head, m_block, 0)
    cute.arch.cp_async_commit_group()


@cute.jit
def needs_mask(cta: BackwardCta, m_block):
    """Whether some score of (query block, key block) is hidden: a key past the sequence end
    (the ragged last block), or one a row's causal diagonal or window hides."""
    c = cta.config
    hidden = block_needs_mask(m_block, cta.n_block, c.tile_m, c.tile_n, cta.seqlen_k,
                              cta.bounds, cutlass.max)
    return hidden > 0


@cute.jit
def row_values(cta: BackwardCta, block, m_block=0, past_end=None):
    """This thread's rows of ``block``: a query block's (tile_m,) rows of a per-row workspace,
    in global or shared memory. ``past_end`` (a packed batch): the value of rows past the
    sequence's end, which hold the next sequence's."""
    c = cta.config
    rows = mn_view(cta.thr_sdp.partition_C(cute.make_identity_tensor((c.tile_m, c.tile_n))))
    n = cute.size(rows, mode=[0])
    values = cute.make_rmem_tensor(n, cutlass.Float32)
    for r in cutlass.range_constexpr(n):
        values[r] = block[rows[r, 0][0]]
        if cutlass.const_expr(past_end is not None):  # noqa: SIM102 - trace time, then run time
            if m_block * c.tile_m + rows[r, 0][0] >= cta.seqlen_q:
                values[r] = past_end
    return values


@cute.jit
def capped_slopes(S: cute.Tensor, dP: cute.Tensor, dpsum, scale_in):
    """dP − D times the soft-cap's slope 1 − tanh², tanh = capped S · scale / c: what dS = P ∘
    dP then needs. Before the mask: every capped score is finite here, so a masked one's P of
    0 gives dS = 0 (after it, −inf would give 0 · −inf)."""
    for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
        t = S[r, None].load() * scale_in
        dP[r, None] = (dP[r, None].load() - dpsum[r]) * (cute.full_like(t, 1.0) - t * t)


@cute.jit
def turn_index(cta: BackwardCta, head, m_block):
    """Where (batch, head, query block)'s counter sits among the flat counters: only their
    base pointer stays live through the kernel. A packed batch's sequences each have as many
    counters a head as its longest sequence has query blocks: the counters' count over the
    (sequence, head) pairs."""
    if cutlass.const_expr(cta.spec.varlen):
        pairs = (cta.seqs.cu_q.shape[0] - 1) * cta.heads
        blocks = cta.dq_turns.shape[0] // pairs
        return (cta.batch * cta.heads + head) * blocks + m_block
    blocks = cute.ceil_div(cta.seqlen_q, cta.config.tile_m)
    return ((cta.batch * cta.heads + head) * blocks + m_block)


@cute.jit
def query_block(cta: BackwardCta, mdQacc, head, m_block, scale_log2, has_next, next_head,
                next_m, slot):
    """Block ``m_block`` of query head ``head``, whose Q and dO (two stages: and rows) have
    landed in stage ``slot``; with one stage, issues the next block's (``has_next``: there is
    one) as this one's tiles free up (two: the caller issued it already)."""
    c, d = cta.config, cta.spec.head_dim
    staged = cta.spec.prefetch_rows
    tm, tn = c.tile_m, c.tile_n
    # a packed batch's rows past the sequence: log2 LSE +inf, so P = 0 there (as the
    # workspace's padding rows hold it)
    past_end = cutlass.Float32.inf if cutlass.const_expr(cta.spec.varlen) else None
    if cutlass.const_expr(staged):
        lse2 = row_values(cta, cta.sLSE[None, slot], m_block, past_end)
        dpsum = row_values(cta, cta.sD[None, slot])
    else:  # issued before the MMAs, whose time hides the loads' latency
        lse2 = row_values(cta, cute.local_tile(cta.at_head(cta.src_lse, head), (tm,),
                                               (m_block,)), m_block, past_end)
        dpsum = row_values(cta, cute.local_tile(cta.at_head(cta.src_d, head), (tm,), (m_block,)))

    acc_S = cute.make_rmem_tensor(cta.thr_sdp.partition_shape_C((tm, tn)), cutlass.Float32)
    acc_S.fill(0.0)
    gemm_ss(cta.lay.mma_sdp, acc_S, cta.q, cta.q.stage(slot), cta.k, cta.k.smem)
    acc_dP = cute.make_rmem_tensor(cta.thr_sdp.partition_shape_C((tm, tn)), cutlass.Float32)
    acc_dP.fill(0.0)
    gemm_ss(cta.lay.mma_sdp, acc_dP, cta.do, cta.do.stage(slot), cta.v, cta.v.smem)

    # P = exp2(S · scale · log2 e − LSE · log2 e): a masked score, or a row that saw no key
    # (its log2 LSE is +inf), gives 0
    S = mn_view(acc_S)
    dP = mn_view(acc_dP)
    if cutlass.const_expr(cta.spec.softcap):
        soft_cap(S, *cta.softcap)  # as the forward: S -> (c / scale) · tanh(S · scale / c)
        capped_slopes(S, dP, dpsum, cta.softcap[0])
    coords = mn_view(cta.thr_sdp.partition_C(cute.local_tile(
        cute.make_identity_tensor((cta.seqlen_q, cta.seqlen_k)), (tm, tn),
        (m_block, cta.n_block))))
    if needs_mask(cta, m_block):
        mask_scores(S, coords, cta.seqlen_k, cta.bounds, 1)
    for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
        row = S[r, None].load()
        p = cute.math.exp2(cute.math.fma(row, cute.full_like(row, scale_log2),
                                         cute.full_like(row, -lse2[r])), fastmath=True)
        S[r, None] = p
        if cutlass.const_expr(cta.spec.softcap):  # dP holds (dP − D) · (1 − tanh²) already
            dP[r, None] = p * dP[r, None].load()
        else:
            dP[r, None] = p * (dP[r, None].load() - dpsum[r])

    # P and dS to shared memory in the input dtype: the next products read them transposed
    dt = cta.lay.dtype
    r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt),
                                 cta.lay.mma_sdp)
    r2s_thr = r2s.get_slice(cta.tidx)
    rP = cute.make_rmem_tensor(acc_S.layout, dt)
    rP.store(acc_S.load().to(dt))
    rdS = cute.make_rmem_tensor(acc_dP.layout, dt)
    rdS.store(acc_dP.load().to(dt))
    cute.copy(r2s, r2s_thr.retile(rP), r2s_thr.partition_D(cta.sP))
    cute.copy(r2s, r2s_thr.retile(rdS), r2s_thr.partition_D(cta.sdS))
    cute.arch.sync_threads()

    gemm_ss(cta.lay.mma_dkv, cta.acc_dV, cta.pt, cta.pt.smem, cta.dot, cta.dot.stage(slot))
    if cutlass.const_expr(not staged):
        cute.arch.sync_threads()  # every warp is done with this block's dO
        if has_next:
            load_tile(cta, cta.src_do, cta.tQsdO, next_head, next_m, slot)
        cute.arch.cp_async_commit_group()
    gemm_ss(cta.lay.mma_dkv, cta.acc_dK, cta.dst, cta.dst.smem, cta.qt, cta.qt.stage(slot))
    if cutlass.const_expr(not staged):
        cute.arch.sync_threads()  # and with its Q
        if has_next:
            load_tile(cta, cta.src_q, cta.tQsQ, next_head, next_m, slot)
        cute.arch.cp_async_commit_group()
    acc_dQ = cute.make_rmem_tensor(cta.thr_dq.partition_shape_C((tm, d)), cutlass.Float32)
    acc_dQ.fill(0.0)
    gemm_ss(cta.lay.mma_dq, acc_dQ, cta.ds, cta.ds.smem, cta.kt, cta.kt.smem)
    add_dq(cta, acc_dQ, mdQacc, head, m_block)


@cute.jit
def add_dq(cta: BackwardCta, acc_dQ, mdQacc, head, m_block, adds=True):
    """This block's dQ into the fp32 accumulator (``deterministic``: at this key block's turn,
    ``turns.py``). ``adds`` (run time): whether this thread holds a share of dQ (a thread
    without one still takes the turn's barriers)."""
    c, d = cta.config, cta.spec.head_dim
    gdQ = cute.local_tile(cta.query_rows(mdQacc, head), (c.tile_m, d), (m_block, 0))
    if cutlass.const_expr(cta.spec.deterministic):
        wait_turn(cta.dq_turns, turn_index(cta, head, m_block),
                  dq_turn(m_block, cta.n_block, c.tile_m, c.tile_n, cta.seqlen_q, cta.seqlen_k,
                          cta.bounds, cutlass.min), cta.tidx)
    dst, pairs = cta.thr_dq.partition_C(gdQ), cta.spec.arch == "sm_90"
    if adds:
        add_into(acc_dQ, dst, pairs, turn_bytes(dst, mdQacc, d))
    if cutlass.const_expr(cta.spec.deterministic):
        pass_turn(cta.dq_turns, turn_index(cta, head, m_block), cta.tidx)
