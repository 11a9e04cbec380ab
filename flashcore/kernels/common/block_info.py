"""Which key blocks a CTA, and each warp group in it, walks: the one definition of the range.

Plain integer arithmetic, written so that it runs on Python ints (``flashcore.reference`` replays
the kernel's block loop with it) and on the DSL's run-time integers inside a kernel (pass
``minimum=cutlass.min`` there). Imports no DSL.

Rows of a query tile are tokens: one row per token, or (``q_group`` > 1) the query heads that
share one K/V head packed into rows token-major (GQA decode): row t * q_group + h is token t.

Which keys a token sees (``KeyBounds``): token ``t`` sees key ``j`` iff ``j < seqlen_k`` and
``t + offset - left <= j <= t + offset + right``, where ``offset`` is 0 for top-left alignment
(torch's ``is_causal``) and ``seqlen_k - seqlen_q`` for bottom-right (the last query token on
the last key), ``right`` is 0 when causal, and a side without a window is ``UNBOUNDED``.
"""

import math
from dataclasses import dataclass

from ...specs.attention import WINDOW_UNBOUNDED as UNBOUNDED


@dataclass(frozen=True)
class KeyBounds:
    """What limits the keys a token sees. ``causal`` and ``shifted`` (bottom-right alignment or a
    window: the general formulas) are compile-time facts; ``offset``, ``left`` and ``right`` may
    be run-time integers."""

    causal: bool
    shifted: bool = False
    windowed: bool = False
    offset: int = 0
    left: int = UNBOUNDED
    right: int = UNBOUNDED

    @property
    def right_edge(self):
        return 0 if self.causal else self.right

    @property
    def bounded_above(self) -> bool:
        return self.causal or self.windowed


def spec_bounds(spec, seqlen_q, seqlen_k, q_group, window_left, window_right) -> KeyBounds:
    """The bounds of a kernel spec's masks (``AttentionSpec``: ``causal``, ``mask_align``,
    ``window``) at run time: bottom-right alignment puts the last query token (rows / q_group
    tokens: packed GQA rows, token-major) on the last key; the window's sizes are kernel
    arguments."""
    if not spec.shifted_mask:
        return KeyBounds(spec.causal)
    offset = 0
    if spec.mask_align == "bottom_right":
        offset = seqlen_k - seqlen_q // q_group
    left, right = (window_left, window_right) if spec.window else (UNBOUNDED, UNBOUNDED)
    return KeyBounds(spec.causal, True, spec.window, offset, left, right)


def token_keys(bounds: KeyBounds, token, seqlen_k, minimum=min, maximum=max):
    """[lo, hi): the keys token ``token`` sees (hi <= lo: none)."""
    hi = seqlen_k
    if bounds.bounded_above:
        hi = minimum(token + bounds.offset + bounds.right_edge + 1, seqlen_k)
    lo = 0
    if bounds.windowed:
        lo = maximum(token + bounds.offset - bounds.left, 0)
    return lo, hi



def ceil_div(a, b):
    return (a + b - 1) // b


def key_blocks_seen(m_block, tile_m: int, tile_n: int, seqlen_k, bounds: KeyBounds, q_group,
                    minimum=min, maximum=max):
    """[lo, hi, lo_unmasked): the key blocks the rows of query tile ``m_block`` can see, and the
    first of them that no row's window cuts from below (blocks from there up need no mask but
    for the top ones, see ``masked_steps``)."""
    n = ceil_div(seqlen_k, tile_n)
    if bounds.shifted:
        first = m_block * tile_m // q_group
        last = ((m_block + 1) * tile_m - 1) // q_group
        last_lo, hi_key = token_keys(bounds, last, seqlen_k, minimum, maximum)
        lo_key, _ = token_keys(bounds, first, seqlen_k, minimum, maximum)
        lo = minimum(lo_key // tile_n, n)
        hi = maximum(minimum(ceil_div(maximum(hi_key, 0), tile_n), n), lo)
        if bounds.windowed:  # every row sees all of block b once b * tile_n >= last's lo key
            return lo, hi, maximum(minimum(ceil_div(last_lo, tile_n), hi), lo)
        return lo, hi, lo
    if bounds.causal:
        # the tile's last token: its last row, or 0 for packed heads
        n = minimum(n, ceil_div((m_block + 1) * tile_m, tile_n * q_group))
    return 0, n, 0


def query_blocks_seeing(n_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k,
                        bounds: KeyBounds, minimum=min, maximum=max):
    """[lo, hi): the query blocks some token of which sees a key of key block ``n_block`` (the
    backward's walk: ``key_blocks_seen`` transposed; one token a row). Token t sees keys
    [lo_t, hi_t) (``token_keys``), so it sees the block's keys [k0, k1) iff
    t + offset + right >= k0 (bounded above) and t + offset - left < k1 (windowed). Empty when
    hi <= lo."""
    first, last = 0, seqlen_q
    k0 = n_block * tile_n
    if bounds.bounded_above:
        first = maximum(k0 - bounds.offset - bounds.right_edge, 0)
    if bounds.windowed:
        k1 = minimum(k0 + tile_n, seqlen_k)
        last = maximum(minimum(k1 - bounds.offset + bounds.left, seqlen_q), 0)
    lo, hi = first // tile_m, ceil_div(last, tile_m)
    if bounds.bounded_above:  # no token in [first, last): walk nothing, even inside one block
        live = minimum(maximum(last - first, 0), 1)
        hi = lo + maximum(hi - lo, 0) * live
    return lo, hi



def dq_turn(m_block, n_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, bounds: KeyBounds,
            minimum=min):
    """How many key blocks above ``n_block`` walk query block ``m_block`` (which ``n_block``
    walks): its place in the order the deterministic backward adds into that block's dQ, the
    highest key block first. Under a causal diagonal that is the order in which the walks reach
    a query block (a higher key block starts its walk higher), so no CTA waits long. The walks'
    starts (``query_blocks_seeing``) never fall as the key block rises, and every block above
    ``n_block`` ends its walk past ``m_block``: the blocks above that walk it are those up to
    the last whose first row can see the block, key (m + 1)·tile_m − 1 + offset + right (or
    the last query's, if that is lower)."""
    n_blocks = ceil_div(seqlen_k, tile_n)
    last = n_blocks
    if bounds.bounded_above:  # positive: this key block sees some row of the query block
        reach = minimum((m_block + 1) * tile_m, seqlen_q) + bounds.offset + bounds.right_edge
        last = minimum(ceil_div(reach, tile_n), n_blocks)
    return last - 1 - n_block


def block_needs_mask(m_block, n_block, tile_m: int, tile_n: int, seqlen_k, bounds: KeyBounds,
                     maximum=max):
    """> 0 where some score of (query block, key block) is hidden: a key past the sequence end
    (the ragged last block), a key past the first row's upper bound, or (windowed) one below
    the last row's lower bound; <= 0 where the block needs no mask (one token a row)."""
    past_end = (n_block + 1) * tile_n - seqlen_k
    if not bounds.bounded_above:
        return past_end
    over = (n_block + 1) * tile_n - (m_block * tile_m + bounds.offset + bounds.right_edge + 1)
    hidden = maximum(past_end, over)
    if bounds.windowed:
        hidden = maximum(hidden, (m_block + 1) * tile_m - 1 + bounds.offset - bounds.left
                         - n_block * tile_n)
    return hidden


def share(n_blocks, parts, index, minimum=min):
    """[lo, hi): part ``index`` of ``parts`` near-equal shares of ``n_blocks`` blocks (later
    parts may be empty)."""
    per = ceil_div(n_blocks, parts)
    lo = minimum(index * per, n_blocks)
    return lo, minimum(lo + per, n_blocks)


def key_range(m_block, tile_m: int, tile_n: int, seqlen_k, bounds: KeyBounds, q_group,
              cta_split, num_splits, group, kv_splits: int, minimum=min, maximum=max):
    """[lo, hi, lo_unmasked): the key blocks warp group ``group`` (of ``kv_splits``) of the CTA
    that holds share ``cta_split`` (of ``num_splits``, split-KV across CTAs) of query tile
    ``m_block`` walks, from ``hi - 1`` down to ``lo``; blocks below ``lo_unmasked`` are masked
    (a window's lower edge)."""
    first, n, unmasked = key_blocks_seen(m_block, tile_m, tile_n, seqlen_k, bounds, q_group,
                                         minimum, maximum)
    lo, hi = share(n - first, num_splits, cta_split, minimum)
    g_lo, g_hi = share(hi - lo, kv_splits, group, minimum)
    return first + lo + g_lo, first + lo + g_hi, unmasked


def masked_steps(tile_m: int, tile_n: int, bounds: KeyBounds) -> int:
    """How many blocks, from the top of each walk, are masked: the topmost block (it may hold
    the ragged end of the keys), or for causal tiles every block the diagonal can cross: query
    tile m starts at key m * tile_m, at most tile_n - gcd(tile_m, tile_n) keys into a block, so
    its tile_m diagonal keys span at most ceil((tile_n - gcd + tile_m) / tile_n) blocks
    (ceil(tile_m / tile_n) when one tile size divides the other; 2 for a 128x192 tile, whose
    diagonal crosses a block boundary wherever 128m mod 192 is 64 or 128). A shifted diagonal
    (bottom-right alignment, or a window's upper edge) starts anywhere in a block: one more.
    These are the highest blocks of the whole key range, so whichever share (of a split CTA or
    warp group) holds one holds it among its own first steps; masking a few blocks that need
    no mask is harmless. Packed GQA rows (``q_group`` > 1) of one query token see one key
    block when causal, so one step covers it; rows of several tokens start their diagonal
    anywhere in a block, which only the shifted count allows for (``ops.plan.packs_tokens``
    packs them under a top-left causal mask only while every token sees just the first
    block)."""
    if bounds.shifted:
        return ceil_div(tile_m, tile_n) + 1
    if not bounds.causal:
        return 1
    return ceil_div(tile_n - math.gcd(tile_m, tile_n) + tile_m, tile_n)
