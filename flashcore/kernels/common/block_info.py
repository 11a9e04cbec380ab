"""Which key blocks a CTA, and each warp group in it, walks: the one definition of the range.

Plain integer arithmetic, written so that it runs on Python ints (``flashcore.reference`` replays
the kernel's block loop with it) and on the DSL's run-time integers inside a kernel (pass
``minimum=cutlass.min`` there). Imports nothing.

Rows of a query tile are tokens: one row per token, or (``q_group`` > 1) the query heads that
share one K/V head packed into the rows of a single query token (GQA decode), all token 0.
Causal masking is top-left (torch's ``is_causal``): token ``t`` sees keys ``j <= t``.
"""



def ceil_div(a, b):
    return (a + b - 1) // b


def key_blocks_seen(m_block, tile_m: int, tile_n: int, seqlen_k, causal: bool, q_group,
                    minimum=min):
    """How many key blocks (from block 0) the rows of query tile ``m_block`` can see."""
    n = ceil_div(seqlen_k, tile_n)
    if causal:
        # the tile's last token: its last row, or 0 for packed heads
        n = minimum(n, ceil_div((m_block + 1) * tile_m, tile_n * q_group))
    return n


def share(n_blocks, parts, index, minimum=min):
    """[lo, hi): part ``index`` of ``parts`` near-equal shares of ``n_blocks`` blocks (later
    parts may be empty)."""
    per = ceil_div(n_blocks, parts)
    lo = minimum(index * per, n_blocks)
    return lo, minimum(lo + per, n_blocks)


def key_range(m_block, tile_m: int, tile_n: int, seqlen_k, causal: bool, q_group,
              cta_split, num_splits, group, kv_splits: int, minimum=min):
    """[lo, hi): the key blocks warp group ``group`` (of ``kv_splits``) of the CTA that holds
    share ``cta_split`` (of ``num_splits``, split-KV across CTAs) of query tile ``m_block``
    walks, from ``hi - 1`` down to ``lo``."""
    n = key_blocks_seen(m_block, tile_m, tile_n, seqlen_k, causal, q_group, minimum)
    lo, hi = share(n, num_splits, cta_split, minimum)
    g_lo, g_hi = share(hi - lo, kv_splits, group, minimum)
    return lo + g_lo, lo + g_hi


def masked_steps(tile_m: int, tile_n: int, causal: bool) -> int:
    """How many blocks, from the top of each walk, are masked: the topmost block (it may hold
    the ragged end of the keys), or for causal tiles the ceil(tile_m / tile_n) blocks that can
    touch the diagonal. These are the highest blocks of the whole key range, so whichever share
    (of a split CTA or warp group) holds one holds it among its own first steps; masking a few
    blocks that need no mask is harmless. With ``q_group`` > 1 (packed GQA rows, used for a
    single query token) a tile sees one key block when causal, so one step covers it."""
    return ceil_div(tile_m, tile_n) if causal else 1
