"""One backward CTA, set up once: its key block, K/V head and batch, its shared tiles and their
copy partitions, and the MMA operands of the five products (``layouts.py``)."""


import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from ..common.block_info import UNBOUNDED, KeyBounds, query_blocks_seeing
from ..common.copies import load_block, load_rows
from ..common.mma import SmemOperand
from ..common.sequences import Sequences
from .layouts import BackwardLayouts, transposed


def key_block_coords(mK: cute.Tensor, tile_n: int, highest_first: bool = False,
                     varlen: bool = False):
    """(key block, K/V head, batch) of this CTA (``abi.backward_grid``): y walks chunks of
    (batch, K/V head) pairs, x a chunk's key blocks, its pairs fastest (``highest_first``: from
    the last key block down, so a deterministic CTA's turn never waits on one launched after
    it: ``turns.py``). A packed batch (``varlen``) has its batch in the grid's z and x walks
    the heads' key blocks up to its longest sequence, the key block fastest."""
    x, y, z = cute.arch.block_idx()
    heads = mK.shape[1]
    if cutlass.const_expr(varlen):
        n_blocks = cute.arch.grid_dim()[0] // heads
        n_block = x % n_blocks
        if cutlass.const_expr(highest_first):
            n_block = n_blocks - 1 - n_block
        return n_block, x // n_blocks, z
    n_blocks = cute.ceil_div(mK.shape[2], tile_n)
    chunk = cute.arch.grid_dim()[0] // n_blocks
    n_block = x // chunk
    if cutlass.const_expr(highest_first):
        n_block = n_blocks - 1 - n_block
    pair = y * chunk + x % chunk
    return n_block, pair % heads, pair // heads


class BackwardCta:
    """Trace-time view of one CTA."""

    def __init__(self, lay: BackwardLayouts, storage, mQ, mK, mV, window_left=None,
                 window_right=None, seqs: Sequences | None = None):
        self.place(lay, mQ, mK, window_left, window_right, seqs)
        spec = self.spec
        # ---- shared tiles -------------------------------------------------------------------
        self.sQ = storage.sQ.get_tensor(lay.sQ)
        self.sdO = storage.sdO.get_tensor(lay.sQ)
        self.sK = storage.sK.get_tensor(lay.sK)
        self.sV = storage.sV.get_tensor(lay.sK)
        self.sP = storage.sP.get_tensor(lay.sPdS)
        self.sdS = storage.sdS.get_tensor(lay.sPdS)
        if cutlass.const_expr(spec.prefetch_rows):
            self.sLSE = storage.sLSE.get_tensor(lay.sRows)
            self.sD = storage.sD.get_tensor(lay.sRows)
        self.copies(mK, mV)
        self.operands()
        self.key_grads()

    def place(self, lay, mQ, mK, window_left, window_right, seqs: Sequences):
        """Where this CTA sits: its key block, K/V head and batch entry, the lengths of that
        entry's sequences and the keys each token sees (the Hopper CTA's too)."""
        spec = lay.spec
        self.lay, self.spec, self.config = lay, spec, spec.config
        self.tidx, _, _ = cute.arch.thread_idx()
        self.n_block, self.kv_head, self.batch = key_block_coords(mK, spec.tile_n,
                                                                  spec.deterministic,
                                                                  spec.varlen)
        self.heads = mQ.shape[1]
        self.q_group = mQ.shape[1] // mK.shape[1]
        # where this batch entry's rows live (a packed batch: its offsets' rows)
        self.seqs = seqs
        self.seqlen_q = seqs.query_len(mQ, self.batch)
        self.seqlen_k = seqs.key_len(mK, self.batch)
        self.bounds = self.key_bounds(window_left, window_right)

    def copies(self, mK, mV):
        """The global->shared partitions over the shared tiles (``sQ``, ``sdO``, ``sK``,
        ``sV``): K and V of this key block, and each query block's Q and dO rows."""
        d, tm, tn = self.spec.head_dim, self.config.tile_m, self.config.tile_n
        self.g2s = g2s = self.lay.g2s.get_slice(self.tidx)
        gK = cute.local_tile(self.key_rows(mK), (tn, d), (self.n_block, 0))
        gV = cute.local_tile(self.key_rows(mV), (tn, d), (self.n_block, 0))
        cKV = cute.local_tile(cute.make_identity_tensor((self.seqlen_k, d)), (tn, d),
                              (self.n_block, 0))
        self.tKgK, self.tKsK = g2s.partition_S(gK), g2s.partition_D(self.sK)
        self.tVgV, self.tVsV = g2s.partition_S(gV), g2s.partition_D(self.sV)
        self.tKVcKV = g2s.partition_S(cKV)
        self.tQsQ, self.tQsdO = g2s.partition_D(self.sQ), g2s.partition_D(self.sdO)
        # (atom, rows, cols, query block): the coordinates of every query block's rows
        self.tQcQ = g2s.partition_S(cute.local_tile(
            cute.make_identity_tensor((self.seqlen_q, d)), (tm, d), (None, 0)))

    def query_sources(self, mQ, mdO, mLSE2, mD, first):
        """Each thread's copy sources at query head ``first``, made once: the partitioned Q and
        dO tiles (atom, rows, cols, query block) and the row workspaces' rows. A step moves
        them to its own head by one offset (``at_head``) instead of locating the head's rows
        again (batch, sequence start, partition) for every copy."""
        d, tm = self.spec.head_dim, self.config.tile_m
        self.first_head = first

        def tiles(mX):
            return self.g2s.partition_S(cute.local_tile(self.query_rows(mX, first), (tm, d),
                                                        (None, 0)))

        if self.spec.loads_by_tma:  # (TMA atom, coordinate tensor) pairs: ``wgmma_bwd.loads``
            self.tma_q_do = (mQ, mdO)
        else:
            self.src_q, self.src_do = (tiles(mQ), mQ.stride[1]), (tiles(mdO), mdO.stride[1])
        self.src_lse = (self.query_rows(mLSE2, first), mLSE2.stride[1])
        self.src_d = (self.query_rows(mD, first), mD.stride[1])

    def at_head(self, source, head) -> cute.Tensor:
        """``source`` (one of ``query_sources``') at query head ``head``."""
        t, head_stride = source
        return cute.make_tensor(t.iterator + (head - self.first_head) * head_stride, t.layout)

    @cute.jit
    def copy_keys(self, steps):
        """cp.async the key block's K and V, rows past the keys zero-filled (``steps``: the
        query blocks the CTA walks; it copies them even where it walks none)."""
        load_rows(self.lay.g2s, self.tKgK, self.tKsK, self.tKVcKV, self.seqlen_k)
        load_rows(self.lay.g2s, self.tVgV, self.tVsV, self.tKVcKV, self.seqlen_k)

    @cute.jit
    def copy_tiles(self, head, m_block, slot):
        """cp.async query block ``m_block`` of ``head``'s Q and dO into stage ``slot``."""
        load_tile(self, self.src_q, self.tQsQ, head, m_block, slot)
        load_tile(self, self.src_do, self.tQsdO, head, m_block, slot)

    def key_grads(self):
        """dK and dV of this key block, fp32 in the dK/dV product's accumulators, zeroed."""
        shape = self.thr_dkv.partition_shape_C((self.config.tile_n, self.spec.head_dim))
        self.acc_dK = cute.make_rmem_tensor(shape, cutlass.Float32)
        self.acc_dV = cute.make_rmem_tensor(shape, cutlass.Float32)
        self.acc_dK.fill(0.0)
        self.acc_dV.fill(0.0)

    def key_rows(self, t: cute.Tensor) -> cute.Tensor:
        """This CTA's K/V head's rows of K-shaped ``t`` (K, V, dK, dV) as (seq, head_dim)."""
        return self.seqs.key_rows(t, self.batch, self.kv_head)

    def query_rows(self, t: cute.Tensor, head) -> cute.Tensor:
        """Query head ``head``'s rows of Q-shaped ``t`` (Q, dO, the dQ accumulator: (seq,
        head_dim); the row workspaces: (seq,)). A packed batch's rows past this sequence's end
        are the next sequence's (or the workspace's padding): the walk zero-fills Q and dO
        there and gives those rows no probability (``query_block.row_values``)."""
        return self.seqs.query_rows(t, self.batch, head)

    def operands(self):
        """The ldmatrix-fed operands: Q, K, dO, V as they are (S and dP); Pᵀ, dSᵀ, dOᵀ, Qᵀ
        (dV and dK, read transposed); dS and Kᵀ (dQ)."""
        lay, c, d, tidx, dt = self.lay, self.config, self.spec.head_dim, self.tidx, self.lay.dtype
        tm, tn = c.tile_m, c.tile_n
        ld = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
        ldt = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
        A, B = cute.make_tiled_copy_A, cute.make_tiled_copy_B

        def operand(mma, thr, make_copy, op, tile, first):
            frag = (thr.make_fragment_A(thr.partition_A(first)) if make_copy is A
                    else thr.make_fragment_B(thr.partition_B(first)))
            return SmemOperand(mma, make_copy, op, dt, tile, frag, tidx)

        mma = lay.mma_sdp
        self.thr_sdp = thr = mma.get_slice(tidx)
        self.q = operand(mma, thr, A, ld, self.sQ, self.sQ[None, None, 0])
        self.do = operand(mma, thr, A, ld, self.sdO, self.sdO[None, None, 0])
        self.k = operand(mma, thr, B, ld, self.sK, self.sK)
        self.v = operand(mma, thr, B, ld, self.sV, self.sV)

        mma = lay.mma_dkv
        self.thr_dkv = thr = mma.get_slice(tidx)
        sPt, sdSt = transposed(self.sP, tm, tn), transposed(self.sdS, tm, tn)
        sQt, sdOt = transposed(self.sQ, tm, d), transposed(self.sdO, tm, d)
        self.pt = operand(mma, thr, A, ldt, sPt, sPt)
        self.dst = operand(mma, thr, A, ldt, sdSt, sdSt)
        self.qt = operand(mma, thr, B, ldt, sQt, sQt[None, None, 0])
        self.dot = operand(mma, thr, B, ldt, sdOt, sdOt[None, None, 0])

        mma = lay.mma_dq
        self.thr_dq = thr = mma.get_slice(tidx)
        sKt = transposed(self.sK, tn, d)
        self.ds = operand(mma, thr, A, ld, self.sdS, self.sdS)
        self.kt = operand(mma, thr, B, ldt, sKt, sKt)

    def key_bounds(self, window_left, window_right) -> KeyBounds:
        """The keys each token sees (``block_info``): bottom-right alignment puts the last query
        on the last key (a row is a token here: the query heads of a group are walked one after
        another, never packed into rows)."""
        spec = self.spec
        offset = 0
        if cutlass.const_expr(spec.mask_align == "bottom_right"):
            offset = self.seqlen_k - self.seqlen_q
        left, right = UNBOUNDED, UNBOUNDED
        if cutlass.const_expr(spec.window):
            left, right = window_left, window_right
        return KeyBounds(spec.causal, spec.shifted_mask, spec.window, offset, left, right)

    def query_blocks(self):
        """[lo, hi): the query blocks some row of which sees a key of this block (none where
        the block lies past a packed sequence's keys: the grid is sized by the longest)."""
        c = self.config
        lo, hi = query_blocks_seeing(self.n_block, c.tile_m, c.tile_n, self.seqlen_q,
                                     self.seqlen_k, self.bounds, cutlass.min, cutlass.max)
        if cutlass.const_expr(self.spec.varlen):
            live = cutlass.min(cutlass.max(self.seqlen_k - self.n_block * c.tile_n, 0), 1)
            hi = lo + cutlass.max(hi - lo, 0) * live
        return lo, hi


@cute.jit
def load_tile(cta: BackwardCta, source, dst, head, m_block, slot):
    """cp.async the (batch, head, query block) tile of Q or dO (``source``: ``cta.src_q`` or
    ``cta.src_do``) into stage ``slot`` of its partitioned shared tile ``dst``, rows past the
    sequence zero-filled."""
    load_block(cta.lay.g2s, cta.at_head(source, head), dst, cta.tQcQ, m_block, slot,
               cta.seqlen_q, True)
