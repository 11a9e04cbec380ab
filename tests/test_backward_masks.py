"""The backward's walk under masks, on the CPU: which query blocks a key block's CTA visits
(``block_info.query_blocks_seeing``) and which of them need a per-score mask
(``block_info.block_needs_mask``), checked against the token-level definition (``token_keys``)
over small shapes, every alignment and window."""

from __future__ import annotations

import itertools

import pytest

from flashcore.kernels.common.block_info import (
    UNBOUNDED,
    KeyBounds,
    block_needs_mask,
    ceil_div,
    dq_turn,
    query_blocks_seeing,
    token_keys,
)


def _bounds(causal, align, window, sq, sk) -> KeyBounds:
    """As the backward CTA builds them (``mma_sync_bwd.cta.BackwardCta.key_bounds``)."""
    shifted = align == "bottom_right" or window is not None
    left, right = UNBOUNDED, UNBOUNDED
    if window is not None:
        left, right = (UNBOUNDED if w < 0 else w for w in window)
    offset = sk - sq if align == "bottom_right" else 0
    return KeyBounds(causal, shifted, window is not None, offset, left, right)


def _sees(b: KeyBounds, t, j, sk) -> bool:
    lo, hi = token_keys(b, t, sk)
    return lo <= j < hi


MASKS = [(False, "top_left", None), (True, "top_left", None), (True, "bottom_right", None),
         (True, "top_left", (5, 0)), (True, "bottom_right", (40, -1)),
         (False, "top_left", (3, 7)), (False, "bottom_right", (0, 0)),
         (False, "top_left", (-1, 20)), (False, "bottom_right", (33, -1))]


@pytest.mark.parametrize("causal, align, window", MASKS)
@pytest.mark.parametrize("tm, tn", [(64, 128), (64, 64), (128, 64), (32, 32)])
def test_query_blocks_are_exactly_those_that_see_the_key_block(causal, align, window, tm, tn):
    for sq, sk in itertools.product((1, 31, 64, 100, 200), (1, 33, 64, 150, 257)):
        b = _bounds(causal, align, window, sq, sk)
        for n in range(ceil_div(sk, tn)):
            keys = range(n * tn, min((n + 1) * tn, sk))
            lo, hi = query_blocks_seeing(n, tm, tn, sq, sk, b)
            walked = set(range(lo, hi))
            for m in range(ceil_div(sq, tm)):
                rows = range(m * tm, min((m + 1) * tm, sq))
                sees = any(_sees(b, t, j, sk) for t in rows for j in keys)
                if sees:  # every block that contributes is walked
                    assert m in walked, (sq, sk, n, m)
                # and the walk is tight: its first and last blocks see the key block
            for m in (lo, hi - 1) if hi > lo else ():
                rows = range(m * tm, min((m + 1) * tm, sq))
                assert any(_sees(b, t, j, sk) for t in rows for j in keys), (sq, sk, n, m)


@pytest.mark.parametrize("causal, align, window", MASKS)
@pytest.mark.parametrize("tm, tn", [(64, 128), (64, 64), (32, 32)])
def test_a_block_said_to_need_no_mask_hides_no_score(causal, align, window, tm, tn):
    for sq, sk in itertools.product((31, 100, 200), (33, 150, 257)):
        b = _bounds(causal, align, window, sq, sk)
        for n, m in itertools.product(range(ceil_div(sk, tn)), range(ceil_div(sq, tm))):
            if block_needs_mask(m, n, tm, tn, sk, b) > 0:
                continue
            for t in range(m * tm, min((m + 1) * tm, sq)):
                for j in range(n * tn, (n + 1) * tn):  # the whole block: past sk too
                    assert j < sk and _sees(b, t, j, sk), (sq, sk, m, n, t, j)


def test_unmasked_and_top_left_causal_walks_are_the_plain_ones():
    """No mask: every query block; top-left causal: from the block holding query n * tile_n."""
    b = KeyBounds(False)
    assert query_blocks_seeing(3, 64, 128, 1000, 1000, b) == (0, 16)
    c = KeyBounds(True)
    assert query_blocks_seeing(3, 64, 128, 1000, 1000, c) == (6, 16)
    assert block_needs_mask(6, 3, 64, 128, 1000, c) > 0
    assert block_needs_mask(8, 3, 64, 128, 1000, c) <= 0


@pytest.mark.parametrize("causal, align, window", MASKS)
@pytest.mark.parametrize("tm, tn", [(64, 128), (64, 64), (128, 64), (32, 32)])
def test_dq_turn_counts_the_higher_key_blocks_that_walk_the_query_block(causal, align, window,
                                                                        tm, tn):
    """The deterministic backward's order: key block n adds into query block m's dQ after
    exactly ``dq_turn`` others, the higher key blocks whose walks hold m (a wrong count waits
    forever or adds out of order)."""
    for sq, sk in itertools.product((1, 31, 64, 100, 200, 333), (1, 33, 64, 150, 257, 400)):
        b = _bounds(causal, align, window, sq, sk)
        walks = [query_blocks_seeing(n, tm, tn, sq, sk, b) for n in range(ceil_div(sk, tn))]
        for n, (lo, hi) in enumerate(walks):
            for m in range(lo, hi):
                above = sum(1 for lo2, hi2 in walks[n + 1:] if lo2 <= m < hi2)
                assert dq_turn(m, n, tm, tn, sq, sk, b) == above, (sq, sk, n, m)
