"""Split-KV across CTAs in one launch: the last CTA of a query tile's shares merges them.

Each share's CTA writes its normalised fp32 rows and their LSE (the split epilogue), fences
them at GPU scope and counts itself on its query tile's arrival counter (an int32 per CTA of
the grid's x, zero before the launch). The CTA that counts last reads every share's rows back
(from L2: they were just written) and writes O = Σ_s exp(lse_s - lse) O_s with
lse = log Σ_s exp(lse_s), in the output dtype, then sets the counter back to zero for the next
launch. The combine kernel (``kernels/combine.py``) does the same merge as a second launch: a
CUDA graph replays that one, where a launch costs about a microsecond; an eager call runs this
one, where each launch costs microseconds of host time.

The merge is load latency: a thread takes ``ITEMS`` (row, 16-byte chunk) pairs of the tile's
rows and ``SHARES`` shares a round, every load of the round issued before any is used, and
keeps each pair's running max, sum and output across rounds (a share past the last has weight
0; a row no share saw gets 0 and lse -inf).
"""


import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .grid import packed_row
from .softmax import LN_2, LOG2_E
from .sreg import fresh_ctaid

VEC = 4  # fp32 columns a pair: one 16-byte load
ITEMS = 4  # (row, chunk) pairs a thread merges at once
SHARES = 4  # shares a round loads for each pair


@dsl_user_op
def count_arrival(address, *, loc=None, ip=None) -> cutlass.Int32:
    """``atom.acq_rel.gpu`` add of 1 to the int32 at global ``address``; the count before it.
    Release: the CTA's fenced rows are visible to whoever sees the new count; acquire: the CTA
    that counts last sees every other share's rows."""
    value = llvm.inline_asm(cutlass.Int32.mlir_type,
                            [cutlass.Int64(address).ir_value(loc=loc, ip=ip)],
                            "atom.acq_rel.gpu.global.add.s32 $0, [$1], 1;", "=r,l",
                            has_side_effects=True, loc=loc, ip=ip)
    return cutlass.Int32(value)


@cute.jit
def last_share_merges(spec: cutlass.Constexpr, merged, mOp, mLSEp, flag, tile, tidx,
                      num_splits, q_group):
    """After this CTA's partial rows are stored (by any of its threads): count it on its query
    tile's counter, and if it is the last of ``num_splits``, merge the tile. ``merged``: the
    spec's ``merge`` arguments (the output, its LSE or None, the counters); ``mOp``, ``mLSEp``:
    the partials; ``flag``: an int32 of shared memory no thread still uses; ``tile``: this
    CTA's (query tile, head, batch) as ``grid.tile_coords`` gives them; ``tidx``: its thread."""
    cute.arch.fence_acq_rel_gpu()  # this thread's partial rows, before the count
    cute.arch.sync_threads()
    if tidx == 0:
        counter = fresh_ctaid("x")
        last = count_arrival((merged.arrivals.iterator + counter).toint()) == num_splits - 1
        flag[0] = cutlass.Int32(cutlass.select_(last, 1, 0))
        if last:  # every share has counted: ready for the next launch
            merged.arrivals[counter] = 0
    cute.arch.sync_threads()
    if flag[0] == 1:
        cute.arch.fence_acq_rel_gpu()
        merge_tile(spec, merged.out, merged.out_lse, mOp, mLSEp, tile, tidx, num_splits,
                   q_group)


@cute.jit
def merge_tile(spec: cutlass.Constexpr, mO, mLSE, mOp, mLSEp, tile, tidx, num_splits, q_group):
    """The tile's rows of every share into ``mO`` (and ``mLSE``): row r of the partials' head
    is ``grid.packed_row``'s (query head, token) of the output."""
    m_block, head, batch = tile
    threads, tm = spec.threads, spec.config.tile_m
    chunks = spec.head_dim // VEC
    batch_size = mO.shape[0]
    items = cutlass.min(mOp.shape[2] - m_block * tm, tm) * chunks
    for first in range(tidx, items, threads * ITEMS):
        top = cute.make_rmem_tensor((ITEMS,), cutlass.Float32)
        total = cute.make_rmem_tensor((ITEMS,), cutlass.Float32)
        acc = cute.make_rmem_tensor((VEC, ITEMS), cutlass.Float32)
        top.fill(-cutlass.Float32.inf)
        total.fill(0.0)
        acc.fill(0.0)
        lse = cute.make_rmem_tensor((SHARES, ITEMS), cutlass.Float32)
        part = cute.make_rmem_tensor((VEC, SHARES, ITEMS), cutlass.Float32)
        for s0 in range(0, num_splits, SHARES):
            # every load of the round first (a pair or share past the last reads the last again)
            for u in cutlass.range_constexpr(SHARES):
                at = cutlass.min(s0 + u, num_splits - 1) * batch_size + batch
                for i in cutlass.range_constexpr(ITEMS):
                    item = cutlass.min(first + i * threads, items - 1)
                    row = m_block * tm + item // chunks
                    lse[u, i] = mLSEp[at, head, row]
                    cute.autovec_copy(cute.local_tile(mOp[at, head, row, None], (VEC,),
                                                      (item % chunks,)), part[None, u, i])
            for u in cutlass.range_constexpr(SHARES):
                if s0 + u >= num_splits:
                    for i in cutlass.range_constexpr(ITEMS):
                        lse[u, i] = -cutlass.Float32.inf
            for i in cutlass.range_constexpr(ITEMS):
                new_top = top[i]
                for u in cutlass.range_constexpr(SHARES):
                    new_top = cute.arch.fmax(new_top, lse[u, i])
                safe = 0.0 if new_top == -cutlass.Float32.inf else new_top
                keep = cute.math.exp2((top[i] - safe) * LOG2_E, fastmath=True)
                acc[None, i] = acc[None, i].load() * keep
                total[i] = total[i] * keep
                for u in cutlass.range_constexpr(SHARES):
                    w = cute.math.exp2((lse[u, i] - safe) * LOG2_E, fastmath=True)
                    acc[None, i] = acc[None, i].load() + part[None, u, i].load() * w
                    total[i] = total[i] + w
                top[i] = new_top
        for i in cutlass.range_constexpr(ITEMS):
            item = first + i * threads
            if item < items:
                row, chunk = m_block * tm + item // chunks, item % chunks
                inverse = 0.0 if total[i] == 0.0 else 1.0 / total[i]
                out = cute.make_rmem_tensor((VEC,), mO.element_type)
                out.store((acc[None, i].load() * inverse).to(mO.element_type))
                cute.autovec_copy(out, cute.local_tile(
                    packed_row(mO, batch, head, row, q_group), (VEC,), (chunk,)))
                if cutlass.const_expr(mLSE is not None):  # noqa: SIM102 - trace, then run time
                    if chunk == 0:
                        value = -cutlass.Float32.inf
                        if total[i] != 0.0:
                            value = top[i] + cute.math.log2(total[i], fastmath=False) * LN_2
                        packed_row(mLSE, batch, head, row, q_group)[0] = value
