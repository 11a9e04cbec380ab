"""Where a CTA sits in the attention grid, shared by the kernel families.

Grid: x walks (batch, head, query tile) with the query tile fastest (so any batch and head count
fits: grid.x allows 2^31 - 1 CTAs), y is the share of the keys (split-KV across CTAs, 1 unless
the spec's ``split_kv``), z the sequence of a packed batch. Causal grids of more CTAs than SMs
run their query tiles longest first, a section of heads at a time (``tile_order.py``). K and V
are read at the query head's group (grouped-query attention: ``heads_q / heads_kv`` query heads
per K/V head; 1 without GQA).
"""


import cutlass
import cutlass.cute as cute

from .sreg import fresh_ctaid, fresh_nctaid, opaque, sm_count
from .tile_order import causal_tile


@cute.jit
def tile_coords(mQ: cute.Tensor, spec: cutlass.Constexpr, q_group=1):
    """(query tile, head, batch, key share) of this CTA. Cheap enough to compute again where
    needed (from a fresh read of the block index, which the compiler cannot merge with the
    first) instead of keeping it live through the key loop (registers). A packed batch
    (``varlen``) has its batch in the grid's z and as many query tiles per head as its longest
    sequence (the grid's x over the heads). With ``packed_tokens`` the head is a K/V head, whose
    rows are its ``q_group`` query heads' tokens (``packed_row``)."""
    lin, split, batch = fresh_ctaid("x"), 0, 0
    if cutlass.const_expr(spec.split_kv):
        split = fresh_ctaid("y")
    heads = _dim(mQ, 1, spec)
    m_blocks = 0
    if cutlass.const_expr(spec.varlen):
        m_blocks = cute.arch.grid_dim()[0] // heads
        batch = fresh_ctaid("z")
    elif cutlass.const_expr(spec.packed_tokens):
        heads = heads // q_group
        m_blocks = cute.ceil_div(_dim(mQ, 2, spec) * q_group, spec.tile_m)
    else:
        m_blocks = cute.ceil_div(_dim(mQ, 2, spec), spec.tile_m)
    m_block, bh = 0, 0
    if cutlass.const_expr(spec.causal):
        pairs = heads if cutlass.const_expr(spec.varlen) else heads * _dim(mQ, 0, spec)
        # a grid of one wave starts every tile at once: sections would only cost instructions
        # on the critical path of a short call; no pairs in sections is the plain per-head order
        pairs = _select(fresh_nctaid("x") > sm_count(), pairs, 0)
        m_block, bh = causal_tile(lin, m_blocks, pairs, select=_select)
    else:
        m_block, bh = lin % m_blocks, lin // m_blocks
    head = bh % heads
    if cutlass.const_expr(not spec.varlen):
        batch = bh // heads
    return m_block, head, batch, split


def _dim(mQ: cute.Tensor, i: int, spec):
    """``mQ.shape[i]``; in a causal grid through an opaque move (``tile_order.py``: the sizes
    are not kept live from the kernel's start to its epilogue)."""
    return opaque(mQ.shape[i]) if spec.causal else mQ.shape[i]


def _select(cond, a, b):
    return cutlass.Int32(cutlass.select_(cond, a, b))


def kv_head_of(head, mQ: cute.Tensor, mK: cute.Tensor):
    """The K/V head of query head ``head`` (grouped-query attention)."""
    return head // (mQ.shape[1] // mK.shape[1])


def packed_row(t: cute.Tensor, batch, kv_head, row, q_group):
    """Row ``row`` of K/V head ``kv_head``'s packed tokens (``spec.packed_tokens``) in a
    (batch, heads, seq, ...) tensor of the query's shape: query head kv_head * q_group +
    row % q_group, token row // q_group (token-major, as ``block_info`` and ``mask`` count
    rows). Its (head_dim,) row of Q or O, or for the LSE a (1,) view of its value."""
    head, token = kv_head * q_group + row % q_group, row // q_group
    if cute.rank(t) == 4:
        return t[batch, head, token, None]
    return cute.local_tile(t[batch, head, None], (1,), (token,))


@cute.jit
def wait_for_previous_grid(spec: cutlass.Constexpr):
    """Programmatic dependent launch (Hopper): the runtime may start this grid while the one
    before it in the stream still runs. Wait for that grid to finish and flush before the first
    global access (it may write our inputs or read our output), then let the next grid start
    its own launch: its CTAs take free slots and wait in turn. Without such a launch both are
    no-ops."""
    if cutlass.const_expr(spec.programmatic_launch):
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
