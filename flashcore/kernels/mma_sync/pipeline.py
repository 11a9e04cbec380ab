"""Getting K and V blocks into shared memory, for one warp group's key range (walked downwards).

Three schedules, chosen by the spec:

* ``stages == 1`` (FlashAttention-2's K/V overlap): wait K(n), issue V(n), S = Q·Kᵀ, wait V(n),
  issue K(n-1) over K(n), softmax, P·V. The first block's V is issued with its K.
* ``stages > 1``: K and V of each block are one cp.async group, issued ``stages`` blocks ahead
  into a ring; a stage is refilled once every warp is done with it.
* FP8 KV cache: the ring schedule (any ``stages``) of e4m3 K and V and their per-key descales;
  the MMAs convert the codes in registers (``e4m3_operands.py``), the descales go to registers
  and scale the block's scores (K) and probabilities (V). Q has a group of its own, waited for
  in the prologue: its fragment is read into registers once, in the order the K codes need.

Every block commits exactly one cp.async group (possibly empty), so ``wait_group(stages - 1)``
always means "the oldest block in flight has landed".
"""


import cutlass
import cutlass.cute as cute

from ..common.copies import (
    load_block,
    load_gathered,
    load_paged,
    load_rows,
    load_scattered_rows,
    load_vector,
)
from ..common.fragments import mn_view, quad_max
from ..common.pow2 import pow2_above, pow2_inverse
from .cta import Cta
from .e4m3_operands import query_to_fp16

# an FP8 KV cache's V unit (``column_scales``): P·v_descale / unit <= V_HEADROOM in fp16; a
# block's unit stays above V_FLOOR times the largest so far; its exponent at least
# V_LEAST_EXPONENT (biased), so the unit, over V_HEADROOM, is a normal fp32 with a normal inverse
V_HEADROOM = 2.0**15
V_FLOOR = 2.0**-64
V_LEAST_EXPONENT = 16


@cute.jit
def group_sync(cta: Cta, group):
    """Barrier of one warp group's threads (the whole CTA when there is one group)."""
    if cutlass.const_expr(cta.config.kv_splits == 1):
        cute.arch.sync_threads()
    else:
        cute.arch.barrier(barrier_id=1 + group, number_of_threads=cta.config.group_threads)


@cute.jit
def issue_k(cta: Cta, n_block, slot, ragged: cutlass.Constexpr):
    if cutlass.const_expr(cta.spec.paged_kv):
        issue_paged(cta, cta.lay.g2s_k, cta.k_paged, cta.tKsK, n_block, slot, ragged)
    else:
        load_block(cta.lay.g2s_k, cta.tKgK, cta.tKsK, cta.tKVcKV, n_block, slot, cta.seqlen_k,
                   ragged)


@cute.jit
def issue_v(cta: Cta, n_block, slot, ragged: cutlass.Constexpr):
    if cutlass.const_expr(cta.spec.paged_kv):
        issue_paged(cta, cta.lay.g2s_v, cta.v_paged, cta.tVsV, n_block, slot, ragged)
    else:  # fp8 Vᵀ is padded with zero keys: never ragged
        load_block(cta.lay.g2s_v, cta.tVgV, cta.tVsV, cta.tKVcKV, n_block, slot, cta.seqlen_k,
                   ragged and not cta.lay.fp8)


@cute.jit
def issue_paged(cta: Cta, tiled_copy, rows_of, dst, n_block, slot, ragged: cutlass.Constexpr):
    """A K or V block of a paged cache: a page at a time when the spec compiles the page size
    in (``rows_of(i)``: the sequence's page i), else a row at a time (``rows_of(m, key)``:
    ``Cta.paged_sources``)."""
    tile = (cta.config.tile_n, cta.spec.head_dim)
    if cutlass.const_expr(cta.spec.page_size):
        load_paged(tiled_copy, cta.k_copy, rows_of, dst, cta.tKVcKV, n_block, slot,
                   cta.seqlen_k, tile, cta.spec.page_size, ragged)
    else:
        load_gathered(tiled_copy, cta.k_copy, rows_of, dst, cta.tKVcKV, n_block, slot,
                      cta.seqlen_k, tile, ragged)


@cute.jit
def issue_block(cta: Cta, n_block, slot, ragged: cutlass.Constexpr):
    """K and V of one block into ring stage ``slot`` (and their descales for an FP8 KV cache)."""
    issue_k(cta, n_block, slot, ragged)
    issue_v(cta, n_block, slot, ragged)
    if cutlass.const_expr(cta.lay.kv_fp8):
        issue_scales(cta, cta.gKd, cta.sKd, n_block, slot)
        issue_scales(cta, cta.gVd, cta.sVd, n_block, slot)


@cute.jit
def issue_scales(cta: Cta, g_scale, s_scale, n_block, slot):
    """The per-key descales of one block into ring stage ``slot`` (0 past the last key).
    ``g_scale``: the (keys,) descales of this K/V head, or for a paged cache a function of a
    page index giving that page's (page_size,) descales."""
    tn = cta.config.tile_n
    first = n_block * tn
    if cutlass.const_expr(cta.spec.paged_kv):
        page_size = cta.spec.page_size  # compiled in: the division is a shift
        if cutlass.const_expr(not page_size):
            page_size = cta.page_size

        def element_of(e):
            key = first + e
            return cute.local_tile(g_scale(key // page_size), (1,), (key % page_size,))
    else:
        block = cute.local_tile(g_scale, (tn,), (n_block,))

        def element_of(e):
            return cute.local_tile(block, (1,), (e,))
    load_vector(cta.lay.scale_atom, element_of, s_scale[None, slot], cta.tidx,
                cta.config.group_threads, tn, first, cta.seqlen_k)


@cute.jit
def prologue(cta: Cta):
    """Issue Q (the first warp group loads it for all) and this group's first K/V blocks. For
    a bf16 Q an FP8 KV cache multiplies in fp16: returns the factor its scores come out scaled
    by (``e4m3_operands.query_to_fp16``); else None."""
    kv_fp8 = cta.lay.kv_fp8
    if cta.group == 0:
        if cutlass.const_expr(cta.spec.packed_tokens):
            load_scattered_rows(cta.lay.g2s_q, cta.q_copy, cta.q_row, cta.tQsQ, cta.tQcQ,
                                cta.seqlen_q, (cta.config.tile_m, cta.spec.head_dim))
        else:
            load_rows(cta.lay.g2s_q, cta.tQgQ, cta.tQsQ, cta.tQcQ, cta.seqlen_q)
    if cutlass.const_expr(kv_fp8):
        cute.arch.cp_async_commit_group()
    n_last = cta.n_hi - 1
    if cutlass.const_expr(cta.config.stages == 1 and not kv_fp8):
        # Q and the first K, then the first V, as two groups (a short problem has few blocks
        # per CTA; each would otherwise wait one more DRAM round trip for its V)
        if cta.n_hi > cta.n_lo:
            issue_k(cta, n_last, 0, True)
        cute.arch.cp_async_commit_group()
        if cta.n_hi > cta.n_lo:
            issue_v(cta, n_last, 0, True)
        cute.arch.cp_async_commit_group()
    else:
        # the first `stages` blocks, one group each (Q joins the first, unless it has its own)
        for i in cutlass.range_constexpr(cta.config.stages):
            if n_last - i >= cta.n_lo:
                issue_block(cta, n_last - i, i, i == 0)
            cute.arch.cp_async_commit_group()
    if cutlass.const_expr(kv_fp8):
        # Q's group is the oldest: once it has landed, its fragment goes to registers while
        # the blocks are in flight
        cute.arch.cp_async_wait_group(cta.config.stages)
        cute.arch.sync_threads()
        cute.autovec_copy(cta.q_src, cta.q_in)  # plain loads, once per CTA
        if cutlass.const_expr(cta.lay.q_rescaled):
            return query_to_fp16(cta.q_in, cta.q_frag)
    elif cutlass.const_expr(cta.config.kv_splits > 1):
        # the first group's loads hold Q for everyone: they must land before anyone reads it
        cute.arch.cp_async_wait_group(1 if cta.config.stages == 1 else cta.config.stages - 1)
        cute.arch.sync_threads()
    return None


@cute.jit
def before_scores(cta: Cta, n_block, slot, first: cutlass.Constexpr):
    """Block ``n_block``'s K (and for the ring schedules its V) is in the tiles the MMAs read.
    For an FP8 KV cache returns this thread's (K, V) descales of its score columns."""
    stages = cta.config.stages
    if cutlass.const_expr(stages > 1 or cta.lay.kv_fp8):  # the ring schedule
        cute.arch.cp_async_wait_group(stages - 1)  # block n's group is the oldest in flight
        group_sync(cta, cta.group)
        if cutlass.const_expr(cta.lay.kv_fp8):
            return column_scales(cta, slot)
    elif cutlass.const_expr(first):
        cute.arch.cp_async_wait_group(1)  # K(n) has landed; V(n) may still be in flight
        group_sync(cta, cta.group)
    else:
        cute.arch.cp_async_wait_group(0)  # K(n) has landed; every warp is done with V(n+1)
        group_sync(cta, cta.group)
        issue_v(cta, n_block, 0, False)
        cute.arch.cp_async_commit_group()
    return None


@cute.jit
def after_scores(cta: Cta, n_block):
    """FA2 schedule: V(n) lands and K(n-1) is issued over K(n), which every warp has read."""
    if cutlass.const_expr(cta.config.stages == 1 and not cta.lay.kv_fp8):
        cute.arch.cp_async_wait_group(0)
        group_sync(cta, cta.group)
        if n_block > cta.n_lo:
            issue_k(cta, n_block - 1, 0, False)
            cute.arch.cp_async_commit_group()


@cute.jit
def after_block(cta: Cta, n_block, slot):
    """Ring schedule: every warp is done with this stage; refill it with block n - stages."""
    if cutlass.const_expr(cta.config.stages > 1 or cta.lay.kv_fp8):
        group_sync(cta, cta.group)
        if n_block - cta.config.stages >= cta.n_lo:
            issue_block(cta, n_block - cta.config.stages, slot, False)
        cute.arch.cp_async_commit_group()


@cute.jit
def column_scales(cta: Cta, slot):
    """The K and V descales of the keys whose scores this thread holds, from ring stage
    ``slot`` (read before the stage is refilled), and the factor the running output takes.

    P·v_descale goes to the fp16 P·V MMA in units of the block's: the least power of two above
    its largest V descale, over 2^15 (so P·v_descale / unit <= 2^15, and a key 2^29 under the
    block's largest is still a normal fp16), but never under the largest unit so far over 2^64
    (a block of tiny descales, zero tokens' among them, cannot shrink the unit so far that the
    running output, kept in the unit, overflows fp32). The running output is rescaled by old
    unit / new unit (exact: powers of two). The four lanes of a quad hold all the block's keys,
    so every quad finds the same unit."""
    c = cta.config
    cols = mn_view(cta.thr_mma.partition_C(cute.make_identity_tensor((c.tile_m, c.tile_n))))
    n = cute.size(cols, mode=[1])
    k_scale = cute.make_rmem_tensor(n, cutlass.Float32)
    v_scale = cute.make_rmem_tensor(n, cutlass.Float32)
    for j in cutlass.range_constexpr(n):
        key = cols[0, j][1]
        k_scale[j] = cta.sKd[key, slot]
        v_scale[j] = cta.sVd[key, slot]
    above, _ = pow2_above(quad_max(v_scale.load().reduce(cute.ReductionOp.MAX, 0.0, 0)),
                          V_LEAST_EXPONENT)
    unit = cute.arch.fmax(above * (1.0 / V_HEADROOM), cta.v_unit[1] * V_FLOOR)
    inverse = pow2_inverse(unit)
    v_scale.store(v_scale.load() * inverse)
    rescale = cta.v_unit[0] * inverse
    cta.v_unit[0] = unit
    cta.v_unit[1] = cute.arch.fmax(cta.v_unit[1], unit)
    return k_scale, v_scale, rescale
