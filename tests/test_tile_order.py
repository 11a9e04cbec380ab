"""The order a causal grid hands out its query tiles (``kernels/common/tile_order.py``), on the
CPU: every (query tile, head) once, longest first within a section of heads, sections in turn,
the pairs after the last full section head by head."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from flashcore.kernels.common.tile_order import SECTION, causal_tile


@given(m_blocks=st.integers(1, 70), pairs=st.integers(1, 4 * SECTION + 3))
def test_causal_order_is_a_permutation_longest_first_per_section(m_blocks, pairs):
    order = [causal_tile(i, m_blocks, pairs) for i in range(m_blocks * pairs)]
    assert sorted(order) == [(m, h) for m in range(m_blocks) for h in range(pairs)]
    full = pairs // SECTION * SECTION
    group = [h // SECTION if h < full else h for _, h in order]  # a section, or a tail head
    for i in range(1, len(order)):
        (m0, _), (m1, _) = order[i - 1], order[i]
        if group[i] == group[i - 1]:  # never a longer tile later in a section (or a head)
            assert m1 <= m0
        else:  # the next group starts at its longest tile, after all of the previous one
            assert group[i] not in group[:i] and m1 == m_blocks - 1 and m0 == 0
    for i, (m, h) in enumerate(order[: full * m_blocks]):  # a section's heads side by side
        assert h % SECTION == i % SECTION


@given(m_blocks=st.integers(1, 70), pairs=st.integers(1, 4 * SECTION + 3))
def test_no_pairs_in_sections_is_the_per_head_order(m_blocks, pairs):
    """A one-wave grid (``grid.py``) passes ``pairs=0``: head by head, each longest first."""
    order = [causal_tile(i, m_blocks, 0) for i in range(m_blocks * pairs)]
    assert order == [(m, h) for h in range(pairs) for m in reversed(range(m_blocks))]


def test_causal_masked_steps_cover_every_key_block_on_the_diagonal():
    """For every tile of every family's knob grid, and any other tile sizes: the key blocks a
    causal query tile's diagonal crosses (top-left, any tile index) are among the
    ``masked_steps`` walked first with the mask, and no more steps are masked than some tile
    needs. (A 128x192 tile crosses two 192-key blocks where 128m mod 192 is 64 or 128: with
    one masked step its causal output is wrong.)"""
    from flashcore.kernels.common.block_info import KeyBounds, masked_steps
    from flashcore.specs.families import FAMILIES

    tiles = {(tm, tn) for fam in FAMILIES.values() for tm in fam.knobs["tile_m"]
             for tn in fam.knobs["tile_n"]}
    tiles |= {(tm, tn) for tm in range(16, 257, 16) for tn in range(16, 257, 16)}
    for tm, tn in sorted(tiles):
        steps = masked_steps(tm, tn, KeyBounds(causal=True))
        most = 0
        for m in range(2 * tn):  # tile starts repeat with period tn / gcd(tm, tn) <= tn
            first, last = m * tm, m * tm + tm - 1  # rows; row r sees keys <= r
            crossed = last // tn - first // tn + 1
            assert crossed <= steps, (tm, tn, m, crossed, steps)
            most = max(most, crossed)
        assert most == steps, (tm, tn, most, steps)
