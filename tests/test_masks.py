"""Masks as data (bottom-right alignment, sliding windows, soft-capping), on the CPU: the
kernel's walk over key blocks (which it skips, which it masks) replayed in Python against the
float64 reference's visibility; argument checks; specs, names, the ABI and compiled kernels."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flashcore import reference
from flashcore.compiler.abi import params_for
from flashcore.errors import SpecError
from flashcore.kernels.common.block_info import (
    UNBOUNDED,
    KeyBounds,
    key_range,
    masked_steps,
    token_keys,
)
from flashcore.ops.masks import NO_MASK, Masking, folded, masking
from flashcore.specs import AttentionSpec, TileConfig
from tests.kernels import assert_no_spills_in_loops, compiled_in_fresh_cache


def walked_keys(sq, sk, tm, tn, bounds, q_group=1, splits=1, groups=1):
    """{row: keys} that the kernel's walk (attention_fwd.walk_keys) leaves visible to each row:
    keys of unmasked blocks all count, keys of masked blocks only where ``token_keys`` allows."""
    rows = sq * q_group if q_group > 1 else sq
    seen = {r: [] for r in range(rows)}
    steps = masked_steps(tm, tn, bounds)
    for mb in range(-(-rows // tm)):
        for s in range(splits):
            for g in range(groups):
                lo, hi, lo_unmasked = key_range(mb, tm, tn, sk, bounds, q_group, s, splits, g,
                                                groups)
                masked = [n for n in (hi - 1 - i for i in range(steps)) if n >= lo]
                lowest = max(lo, lo_unmasked) if bounds.windowed else lo
                plain = list(range(hi - 1 - steps, lowest - 1, -1))
                if bounds.windowed:
                    masked += list(range(min(hi - 1 - steps, lowest - 1), lo - 1, -1))
                for r in range(mb * tm, min((mb + 1) * tm, rows)):
                    token = r // q_group  # packed GQA rows are token-major
                    t_lo, t_hi = token_keys(bounds, token, sk)
                    for n in plain:
                        seen[r] += range(n * tn, min((n + 1) * tn, sk))
                    for n in masked:
                        seen[r] += [j for j in range(n * tn, min((n + 1) * tn, sk))
                                    if t_lo <= j < t_hi]
    return seen


def visible(sq, sk, causal, align, window):
    """{row: keys} from the float64 reference's own mask (its output on identity values)."""
    q = torch.zeros(1, 1, sq, 16, dtype=torch.float64)
    k = torch.zeros(1, 1, sk, 16, dtype=torch.float64)
    _, lse = reference.attention(q, k, torch.zeros_like(k), causal=causal, return_lse=True,
                                 mask_align=align, window=window)
    # with all scores 0, lse = log(number of visible keys); the keys themselves follow from
    # the same rule the reference applies
    shift = sk - sq if align == "bottom_right" else 0
    out = {}
    for i in range(sq):
        keys = [j for j in range(sk)
                if (not causal or j <= i + shift)
                and (window is None or window[1] < 0 or j <= i + shift + window[1])
                and (window is None or window[0] < 0 or j >= i + shift - window[0])]
        count = math.exp(lse[0, 0, i].item()) if lse[0, 0, i] > -math.inf else 0
        assert round(count) == len(keys)
        out[i] = keys
    return out


def bounds_of(sq, sk, causal, align, window, q_group=1):
    tokens = sq
    offset = sk - tokens if align == "bottom_right" else 0
    left = right = UNBOUNDED
    if window is not None:
        left, right = (UNBOUNDED if w < 0 else w for w in window)
    shifted = align == "bottom_right" or window is not None
    return KeyBounds(causal, shifted, window is not None, offset, left, right)


windows = st.one_of(st.none(), st.tuples(st.integers(-1, 300), st.integers(-1, 300)))


@settings(max_examples=300, deadline=None)
@given(sq=st.integers(1, 200), sk=st.integers(1, 400), causal=st.booleans(),
       align=st.sampled_from(["top_left", "bottom_right"]), window=windows,
       tile=st.sampled_from([(64, 64), (128, 64), (64, 128), (16, 32), (32, 64), (128, 32)]),
       splits=st.integers(1, 5), groups=st.sampled_from([1, 2]))
def test_kernel_walk_sees_exactly_the_reference_keys(sq, sk, causal, align, window, tile, splits,
                                                     groups):
    if causal and window is not None and window[1] > 0:
        window = (window[0], 0)
    b = bounds_of(sq, sk, causal, align, window)
    got = walked_keys(sq, sk, *tile, b, splits=splits, groups=groups)
    want = visible(sq, sk, causal, align, window)
    for r in range(sq):
        assert sorted(got[r]) == want[r], (r, got[r][:8], want[r][:8])


@settings(max_examples=100, deadline=None)
@given(sk=st.integers(1, 700), q_group=st.sampled_from([2, 4, 8, 32]), causal=st.booleans(),
       align=st.sampled_from(["top_left", "bottom_right"]), window=windows,
       tile=st.sampled_from([(16, 64), (32, 64), (64, 64)]), splits=st.integers(1, 8))
def test_packed_gqa_rows_walk_their_tokens_keys(sk, q_group, causal, align, window, tile, splits):
    """Decode with the query heads of a K/V head packed into rows: every row is token 0."""
    if causal and window is not None and window[1] > 0:
        window = (window[0], 0)
    b = bounds_of(1, sk, causal, align, window)
    got = walked_keys(1, sk, *tile, b, q_group=q_group, splits=splits)
    want = visible(1, sk, causal, align, window)[0]
    for r in range(q_group):
        assert sorted(got[r]) == want


@settings(max_examples=300, deadline=None)
@given(sq=st.integers(2, 16), sk=st.integers(1, 700), q_group=st.sampled_from([2, 3, 4, 8, 32]),
       causal=st.booleans(), align=st.sampled_from(["top_left", "bottom_right"]),
       window=windows, tile=st.sampled_from([(16, 32), (16, 64), (16, 128), (32, 64), (64, 64)]),
       splits=st.integers(1, 8))
def test_packed_tokens_rows_walk_their_tokens_keys(sq, sk, q_group, causal, align, window, tile,
                                                    splits):
    """Multi-token decode with each K/V head's (token, head) pairs packed token-major into
    rows (``plan.pack_tokens``): row t * q_group + h sees exactly token t's keys."""
    if causal and window is not None and window[1] > 0:
        window = (window[0], 0)
    # a top-left causal diagonal is packed only while every token sees just the first block
    assert sq <= tile[1]
    b = bounds_of(sq, sk, causal, align, window)
    got = walked_keys(sq, sk, *tile, b, q_group=q_group, splits=splits)
    want = visible(sq, sk, causal, align, window)
    for r in range(sq * q_group):
        assert sorted(got[r]) == want[r // q_group], (r, got[r][:8], want[r // q_group][:8])


def ws_walked_keys(sq, sk, tm, tn, bounds, q_group=1):
    """{row: keys} that the warp-specialised kernel's walk (``wgmma_ws/attention_fwd.consume``)
    leaves visible: one CTA's blocks n_hi - 1 down to n_lo in one loop, step 0 masked, step i
    masked at run time where i < masked_steps or (a window) its block lies below n_lo_unmasked,
    written as the kernel writes it."""
    rows = sq * q_group if q_group > 1 else sq
    seen = {r: [] for r in range(rows)}
    top = masked_steps(tm, tn, bounds)
    for mb in range(-(-rows // tm)):
        lo, hi, lo_unmasked = key_range(mb, tm, tn, sk, bounds, q_group, 0, 1, 0, 1)
        blocks = hi - lo
        for i in range(blocks):
            n = hi - 1 - i
            if i == 0:
                masked = True
            elif top == 1:
                masked = False
            elif not bounds.windowed:
                masked = i < min(top, blocks)
            else:
                masked = min(i + 1 - min(top, blocks), hi - lo_unmasked - i) <= 0
            for r in range(mb * tm, min((mb + 1) * tm, rows)):
                t_lo, t_hi = token_keys(bounds, r // q_group, sk)
                seen[r] += [j for j in range(n * tn, min((n + 1) * tn, sk))
                            if not masked or t_lo <= j < t_hi]
    return seen


@settings(max_examples=300, deadline=None)
@given(sq=st.integers(1, 500), sk=st.integers(1, 700), causal=st.booleans(),
       align=st.sampled_from(["top_left", "bottom_right"]), window=windows,
       tile=st.sampled_from([(64, 64), (128, 64), (128, 128), (192, 64), (192, 128)]))
def test_warp_specialised_walk_sees_exactly_the_reference_keys(sq, sk, causal, align, window,
                                                               tile):
    """The Hopper kernel's single loop, masking its top steps and (a window) the steps below
    the window's lower edge by a run-time flag, against the reference's visibility: rows that
    see no key (bottom-right rows before the first key, windows past the keys) walk none."""
    if causal and window is not None and window[1] > 0:
        window = (window[0], 0)
    b = bounds_of(sq, sk, causal, align, window)
    got = ws_walked_keys(sq, sk, *tile, b)
    want = visible(sq, sk, causal, align, window)
    for r in range(sq):
        assert sorted(got[r]) == want[r], (r, got[r][:8], want[r][:8])


def test_a_window_skips_the_blocks_outside_it():
    b = KeyBounds(True, True, True, 0, 255, 0)  # causal, window of 256 keys
    lo, hi, lo_unmasked = key_range(60, 64, 64, 8192, b, 1, 0, 1, 0, 1)
    assert (lo, hi) == (56, 61) and lo_unmasked == 57  # 5 blocks of 64, not 61
    assert masked_steps(64, 64, b) == 2


def test_reference_softcap_and_bottom_right():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 64, generator=g, dtype=torch.float64) * 4 for n in (5, 9, 9))
    out = reference.attention(q, k, v, softcap=3.0)
    s = q @ k.transpose(-1, -2) / 8
    want = torch.softmax(3.0 * torch.tanh(s / 3.0), -1) @ v
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    br = reference.attention(q, k, v, causal=True, mask_align="bottom_right")
    allowed = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)  # torch's causal_lower_right
    want = torch.softmax(s.masked_fill(~allowed, -math.inf), -1) @ v
    torch.testing.assert_close(br, want, rtol=1e-12, atol=1e-12)


def test_masking_arguments_are_checked_and_normalised():
    assert masking(False, "top_left", None, None) == NO_MASK
    assert masking(True, "top_left", (-1, 0), None) == Masking()  # plain causal
    assert masking(False, "top_left", (-1, -1), 0) == NO_MASK  # no limit, softcap 0 = off
    assert masking(False, "bottom_right", None, None) == NO_MASK  # nothing to align
    m = masking(True, "bottom_right", (128, 0), 30)
    assert m.spec_fields == ("bottom_right", True, True, False)
    alibi = masking(False, "bottom_right", None, None, True)  # ALiBi measures from the diagonal
    assert alibi.align == "bottom_right" and alibi.features[-1] == ("alibi", True)
    assert masking(False, "top_left", None, None, True) != NO_MASK
    assert m.scalars(0.125) == ((128,), (0,), (0.125 / 30,), (30 / 0.125,))
    for bad, what in [((True, "middle", None, None), "mask_align"),
                      ((False, "top_left", (1, 2, 3), None), "window"),
                      ((False, "top_left", (-2, 0), None), "window"),
                      ((True, "top_left", (4, 4), None), "right of the diagonal"),
                      ((False, "top_left", None, -1.0), "softcap"),
                      ((False, "top_left", None, math.inf), "softcap")]:
        with pytest.raises(ValueError, match=what):
            masking(*bad)
    with pytest.raises(TypeError, match="softcap"):
        masking(False, "top_left", None, "5")


def test_spec_fields_name_validate_and_shape_the_abi():
    base = AttentionSpec(arch="sm_89", causal=True)
    s = base.replace(mask_align="bottom_right", window=True, softcap=True)
    assert s.name.endswith("_causal_br_window_softcap")
    assert AttentionSpec.from_json(s.to_json()) == s
    names = [p.name for p in params_for(s)]
    assert names[-4:] == ["window_left", "window_right", "softcap_in", "softcap_out"]
    assert [p.name for p in params_for(base)][-1] == "num_splits"
    with pytest.raises(SpecError, match="mask_align"):
        AttentionSpec(mask_align="bottom_right")  # neither causal nor a window
    with pytest.raises(SpecError, match="mask_align"):
        AttentionSpec(causal=True, mask_align="diagonal")
    with pytest.raises(SpecError, match="softcap"):
        AttentionSpec(arch="sm_89", precision="fp8", softcap=True)
    alibi = base.replace(causal=False, mask_align="bottom_right", alibi=True)
    assert alibi.name.endswith("_br_alibi") and [p.name for p in params_for(alibi)][-1] == (
        "alibi_slopes")
    assert AttentionSpec.from_json(alibi.to_json()) == alibi
    assert "alibi" not in base.to_json()  # specs without it keep their JSON and cache keys
    for bad in ({"precision": "fp8"}, {"kv_fp8": True}, {"packed_tokens": True}):
        with pytest.raises(SpecError, match="alibi"):
            AttentionSpec(arch="sm_89", head_dim=64, alibi=True, **bad)
    for serving in ({"varlen": True}, {"paged_kv": True}, {"varlen": True, "paged_kv": True}):
        assert AttentionSpec(arch="sm_89", head_dim=64, alibi=True, **serving).alibi
    with pytest.raises(SpecError, match="alibi"):
        AttentionSpec(arch="sm_90", head_dim=128, alibi=True,
                      config=TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws"))


MASK_SPECS = [
    AttentionSpec(arch="sm_89", head_dim=128, causal=True, mask_align="bottom_right",
                  config=TileConfig((64, 64)), return_lse=True),
    AttentionSpec(arch="sm_89", head_dim=64, causal=True, window=True, softcap=True,
                  config=TileConfig((64, 64))),
    AttentionSpec(arch="sm_90", dtype="bfloat16", head_dim=128, window=True,
                  mask_align="bottom_right", split_kv=True, config=TileConfig((16, 64), warps=1)),
]


@pytest.fixture(scope="module")
def mask_artifacts(tmp_path_factory):
    return compiled_in_fresh_cache(MASK_SPECS, tmp_path_factory)


@pytest.mark.parametrize("spec", MASK_SPECS, ids=lambda s: s.name)
def test_mask_kernels_compile_with_their_abi_and_no_spills(mask_artifacts, spec):
    art = mask_artifacts[spec]
    assert len(art.params) == len(params_for(spec))  # checked against the PTX .entry
    assert_no_spills_in_loops(art, spec.name)
    body = art.ptx[art.ptx.index(".entry"):]
    # soft-capping: a full-precision tanh (no tanh.approx: its 2^-11 error times the cap
    # moves logits), so one more exp2 per score than the softmax's
    assert "tanh.approx" not in body
    if spec.softcap:
        assert body.count("ex2.approx") >= 2 * spec.tile_m * spec.tile_n // spec.threads


@settings(max_examples=300, deadline=None)
@given(sq=st.integers(1, 9), sk=st.integers(1, 9), causal=st.booleans(),
       align=st.sampled_from(["top_left", "bottom_right"]),
       window=st.one_of(st.none(), st.tuples(st.integers(-1, 12), st.integers(-1, 12))),
       softcap=st.sampled_from([None, 2.0]), alibi=st.booleans())
def test_folded_masks_keep_every_rows_keys(sq, sk, causal, align, window, softcap, alibi):
    """A fold never changes what any row sees: the float64 reference gives the same output and
    LSE (-inf rows included) with the folded masks (ALiBi's bias too)."""
    if causal and window is not None and window[1] > 0:
        window = (window[0], 0)
    masks = masking(causal, align, window, softcap, alibi)
    f_causal, f_masks = folded(causal, masks, sq, sk)
    g = torch.Generator().manual_seed(sq * 31 + sk)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (sq, sk, sk))
    slopes = torch.tensor([0.5, 0.125], dtype=torch.float64)

    def run(c, m):
        return reference.attention(q, k, v, causal=c, mask_align=m.align, window=m.window,
                                   softcap=m.softcap, return_lse=True,
                                   alibi_slopes=slopes if m.alibi else None)

    (out, lse), (f_out, f_lse) = run(causal, masks), run(f_causal, f_masks)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(f_lse))
    torch.testing.assert_close(f_out, out, rtol=1e-12, atol=1e-12)
    finite = torch.isfinite(lse)
    torch.testing.assert_close(f_lse[finite], lse[finite], rtol=1e-12, atol=1e-12)
    assert (f_masks.softcap, f_masks.alibi) == (masks.softcap, masks.alibi)


@settings(max_examples=200, deadline=None)
@given(longest=st.tuples(st.integers(1, 9), st.integers(1, 9)),
       lengths=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1,
                        max_size=4),
       causal=st.booleans(), align=st.sampled_from(["top_left", "bottom_right"]),
       window=st.one_of(st.none(), st.tuples(st.integers(-1, 12), st.integers(-1, 12))),
       alibi=st.booleans())
@example(longest=(5, 5), lengths=[(3, 5), (5, 2)], causal=True, align="bottom_right",
         window=None, alibi=False)  # equal longest lengths: still bottom-right
@example(longest=(1, 9), lengths=[(1, 4), (0, 2)], causal=True, align="bottom_right",
         window=(3, 0), alibi=True)
def test_serving_folds_keep_every_sequences_keys(longest, lengths, causal, align, window,
                                                 alibi):
    """``exact=False`` folds from the longest lengths of a batch (varlen's max_seqlen_q/k, a
    paged cache's capacity) hold for every shorter sequence too."""
    if causal and window is not None and window[1] > 0:
        window = (window[0], 0)
    masks = masking(causal, align, window, None, alibi)
    f_causal, f_masks = folded(causal, masks, *longest, exact=False)
    slopes = torch.tensor([0.5, 0.125], dtype=torch.float64)
    for sq, sk in lengths:
        sq, sk = min(sq, longest[0]), min(sk, longest[1])
        if 0 in (sq, sk):
            continue
        g = torch.Generator().manual_seed(sq * 31 + sk)
        q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64)
                   for n in (sq, sk, sk))

        def run(c, m, q=q, k=k, v=v):
            return reference.attention(q, k, v, causal=c, mask_align=m.align, window=m.window,
                                       return_lse=True, alibi_slopes=slopes if m.alibi else None)

        (out, lse), (f_out, f_lse) = run(causal, masks), run(f_causal, f_masks)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(f_lse)), (sq, sk)
        torch.testing.assert_close(f_out, out, rtol=1e-12, atol=1e-12)


def test_serving_folds_drop_the_decode_diagonal_but_not_an_equal_length_alignment():
    br = masking(True, "bottom_right", None, None)
    assert folded(True, br, 1, 4096, exact=False) == (False, Masking())  # decode
    assert folded(True, br, 64, 64, exact=False) == (True, br)  # shorter sequences shift
    assert folded(True, br, 64, 64) == (True, Masking())  # dense: S_q = S_k is top-left


def test_folds_pick_the_canonical_masks():
    br = masking(True, "bottom_right", None, None)
    assert folded(True, br, 64, 64) == (True, Masking())  # S_q = S_k: top-left
    assert folded(True, br, 1, 4096) == (False, Masking())  # one query sees every key
    assert folded(True, br, 16, 4096) == (True, br)  # a real shift stays
    assert folded(True, Masking(), 1, 4096) == (True, Masking())  # top-left decode sees key 0
    wide = masking(True, "top_left", (5000, 0), None)
    assert folded(True, wide, 4096, 4096) == (True, Masking())  # wider than the keys
    assert folded(True, wide, 8192, 8192) == (True, wide)
    alibi = masking(False, "bottom_right", None, None, True)
    assert folded(False, alibi, 5, 9) == (False, alibi)  # the bias's diagonal stays
    assert folded(False, alibi, 9, 9) == (False, alibi)  # (no causal: nothing folds)
    causal_alibi = masking(True, "bottom_right", None, None, True)
    assert folded(True, causal_alibi, 64, 64) == (True, Masking(alibi=True))
    assert folded(True, causal_alibi, 1, 4096) == (False, alibi)
    both = masking(False, "bottom_right", (300, 300), 1.5)
    assert folded(False, both, 100, 200) == (False, Masking(softcap=1.5))
    assert folded(False, both, 100, 1000)[1].window == (300, 300)



def test_gpu_tests_mask_helpers_run_on_the_cpu():
    """The GPU tests' mask helpers are plain host code: run here, where those tests skip, so a
    change of the masks' fields cannot break them unseen."""
    from tests.gpu_utils import WGMMA_MASK_CONFIGS
    from tests.test_gpu_wgmma import _ws_masks

    masks = _ws_masks(True, "bottom_right", (64, 3), 30.0, WGMMA_MASK_CONFIGS[0], 128)
    assert masks == {"mask_align": "bottom_right", "window": (64, 0), "softcap": 30.0}
