"""The producer warpgroup of the warp-specialised Hopper kernel (``attention_fwd.py``): Q once,
then K and V of each key block the consumers walk, as TMA copies into the stages of their rings
(dense, a packed batch's rows from its start, or a paged cache's pages), issued by warp 0, or
by all four where a block spans several pages."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync

from ...specs.families import WgmmaWs
from ..common.sequences import cache_page


def v_tiling(spec, rows: int | None = None) -> tuple:
    """One V stage's tile of the TMA view and the coordinate that walks the key blocks:
    (keys, head_dim), or FP8 Vᵀ's (head_dim, keys); ``rows``: a box's keys where that is
    less than a block (a paged cache's smaller pages)."""
    c, d = spec.config, spec.head_dim
    if spec.precision == "fp8":
        return (d, c.tile_n), (0, None)
    return (rows or c.tile_n, d), (None, 0)


PRODUCER_WARPS = 4  # the producer warpgroup's


class Producer:
    """Trace-time configuration of the producer warpgroup: warp 0 issues every load, or, with
    pages smaller than a key block, the four warps share a block's boxes (``load_pages``)."""

    def __init__(self, spec):
        self.spec = spec
        self.small_pages = WgmmaWs.key_box_rows(spec) < spec.config.tile_n
        self.warps = PRODUCER_WARPS if self.small_pages else 1  # warps that issue loads

    @cute.jit
    def produce(self, pipes, atoms, tmas, smem, m_block, head, kv_head, batch, n_lo, n_hi,
                starts, serving, warp):
        """Warp 0: Q, then K and V of blocks n_hi - 1 down to n_lo, each into the next free
        stage of its ring (TMA issued by one elected lane; the full barrier counts the bytes).
        A packed batch's sequence starts at rows ``starts`` (of Q, of K and V) of batch 0: its
        tiles' rows past its end are the next sequence's (or TMA's zeros past the tensor),
        which the masks and the epilogue leave unused. A paged cache's key block lies inside
        one page (``WgmmaWs.copies_whole_pages``): its page is looked up in the block table
        (``serving``) and the block is that page's rows at its offset; or it spans whole
        pages, each a box of its own, shared by the warps (``warp`` is this one's)."""
        c, d = self.spec.config, self.spec.head_dim
        (atom_q, atom_k, atom_v), (tma_q, tma_k, tma_v), (sQ, sK, sV) = atoms, tmas, smem
        if cutlass.const_expr(self.warps > 1):  # warp 0 loads Q
            if warp == 0:
                self.load_q(pipes[0], atom_q, tma_q, sQ, m_block, head, batch, starts)
        else:
            self.load_q(pipes[0], atom_q, tma_q, sQ, m_block, head, batch, starts)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, c.stages)
        if cutlass.const_expr(self.small_pages):
            for i in range(n_hi - n_lo):
                self.load_pages(pipes, (atom_k, atom_v), (tma_k, tma_v), (sK, sV), kv_head,
                                batch, n_hi - 1 - i, serving.block_table, state, warp)
                state.advance()
        elif cutlass.const_expr(self.spec.paged_kv):
            table, per_page = serving.block_table, self.spec.page_size // c.tile_n
            for i in range(n_hi - n_lo):
                n_block = n_hi - 1 - i
                page = cache_page(table, tma_k.shape[3], batch, n_block // per_page)
                sKt, gKt = self.key_tiles(atom_k, sK, tma_k[None, None, kv_head, page],
                                          (c.tile_n, d))
                sVt, gVt = self.key_tiles(atom_v, sV, tma_v[None, None, kv_head, page],
                                          *v_tiling(self.spec))
                self.load_kv(pipes, (atom_k, atom_v), (gKt, sKt, gVt, sVt),
                             n_block % per_page, state)
                state.advance()
        else:
            k_rows = tma_k[None, None, kv_head, batch]
            v_rows = tma_v[None, None, kv_head, batch]
            if cutlass.const_expr(self.spec.varlen):
                k_rows = cute.domain_offset((starts[1], 0), tma_k[None, None, kv_head, 0])
                v_rows = cute.domain_offset((starts[1], 0), tma_v[None, None, kv_head, 0])
            sKt, gKt = self.key_tiles(atom_k, sK, k_rows, (c.tile_n, d))
            sVt, gVt = self.key_tiles(atom_v, sV, v_rows, *v_tiling(self.spec))
            for i in range(n_hi - n_lo):
                self.load_kv(pipes, (atom_k, atom_v), (gKt, sKt, gVt, sVt), n_hi - 1 - i,
                             state)
                state.advance()

    @cute.jit
    def load_q(self, pipe_q, atom_q, tma_q, sQ, m_block, head, batch, starts):
        """Q's tile, once."""
        c, d = self.spec.config, self.spec.head_dim
        q_rows = tma_q[None, None, head, batch]
        if cutlass.const_expr(self.spec.varlen):
            q_rows = cute.domain_offset((starts[0], 0), tma_q[None, None, head, 0])
        gQ = cute.local_tile(q_rows, (c.tile_m, d), (m_block, 0))
        sQt, gQt = cpasync.tma_partition(atom_q, 0, cute.make_layout(1),
                                         cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_q.producer_acquire(q_state)
        cute.copy(atom_q, gQt, sQt, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))

    @staticmethod
    def key_tiles(atom, smem: cute.Tensor, rows: cute.Tensor, tile, coord=(None, 0)) -> tuple:
        """(stages' TMA views, the key blocks' TMA views) of K or V ``rows``."""
        blocks = cute.local_tile(rows, tile, coord)
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2),
                                     cute.group_modes(blocks, 0, 2))

    @cute.jit
    def load_kv(self, pipes, atoms, tiles, n_block, state):
        """K and V of key block ``n_block`` of ``tiles`` (``key_tiles``' of K, then of V) into
        stage ``state``."""
        _, pipe_k, pipe_v = pipes
        atom_k, atom_v = atoms
        gKt, sKt, gVt, sVt = tiles
        pipe_k.producer_acquire(state)
        cute.copy(atom_k, gKt[None, n_block], sKt[None, state.index],
                  tma_bar_ptr=pipe_k.producer_get_barrier(state))
        pipe_v.producer_acquire(state)
        cute.copy(atom_v, gVt[None, n_block], sVt[None, state.index],
                  tma_bar_ptr=pipe_v.producer_get_barrier(state))

    @cute.jit
    def load_pages(self, pipes, atoms, tmas, smem, kv_head, batch, n_block, table, state,
                   warp):
        """This warp's share of K and V of key block ``n_block`` of a paged cache whose pages
        are smaller than a block, into stage ``state``: one TMA box a page, into the page's
        rows of the stage; page j of the block is warp j % 4's, its K and its V box (a box's
        issue is a chain of dependent instructions: the warps' chains run side by side).
        Warp 0 waits for each stage and arms its full barrier with the whole block's bytes
        (the others' boxes may land first: the count goes below zero until it does); the
        others only wait. The last block's entries past the table's row read its last entry
        (keys past the sequence's, masked, their V rows cleared:
        ``attention_fwd.clear_keys_past_end``)."""
        rows, d = self.spec.page_size, self.spec.head_dim
        boxes = self.spec.config.tile_n // rows
        turns = -(-boxes // PRODUCER_WARPS)  # pages a warp takes at most
        pages, last = tmas[0].shape[3], table.shape[1] - 1
        slots = []
        for t in cutlass.range_constexpr(turns):
            j = warp + PRODUCER_WARPS * t
            slots.append(cache_page(table, pages, batch,
                                    cutlass.min(n_block * boxes + j, last)))
        one = cute.make_layout(1)
        for k in cutlass.range_constexpr(2):  # K, then V
            pipe, atom, tma, ring = pipes[1 + k], atoms[k], tmas[k], smem[k]
            if warp == 0:
                pipe.producer_acquire(state)  # waits, and arms the full barrier
            else:
                pipe.sync_object_empty.wait(state.index, state.phase)
            stage = ring[None, None, state.index]
            for t in cutlass.range_constexpr(turns):
                j = warp + PRODUCER_WARPS * t
                if j < boxes:  # (every warp's, where the warps divide the pages)
                    s_box, g_box = cpasync.tma_partition(
                        atom, 0, one,
                        cute.group_modes(cute.local_tile(stage, (rows, d), (j, 0)), 0, 2),
                        cute.group_modes(cute.local_tile(tma[None, None, kv_head, slots[t]],
                                                         (rows, d), (0, 0)), 0, 2))
                    cute.copy(atom, g_box, s_box,
                              tma_bar_ptr=pipe.producer_get_barrier(state))
