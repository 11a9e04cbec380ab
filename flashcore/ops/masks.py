"""The masks of one attention call as one value: where the causal diagonal sits, a sliding
window, logit soft-capping. Checked once here; the spec gets its compile-time flags from it
(``spec_fields``), the kernel its run-time arguments (``scalars``)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..specs.attention import MASK_ALIGNS
from ..specs.attention import WINDOW_UNBOUNDED as UNBOUNDED

WINDOW_MAX = 2**31 - 1  # a side is an int32 kernel argument; from UNBOUNDED on it limits nothing


@dataclass(frozen=True)
class Masking:
    """``align``: "top_left" (torch's ``is_causal``: query i sees keys j <= i) or
    "bottom_right" (the last query sees the last key: query i sees j <= i + S_k - S_q; the
    convention of FlashAttention >= 2.1 and torch's ``causal_lower_right``). ``window``:
    (left, right), query i sees keys i - left .. i + right on its diagonal, -1 for no limit on
    a side (the convention of ``flash_attn_func(window_size=...)``); with ``causal`` right is
    0. ``softcap``: logits become softcap * tanh(logits / softcap), logits being the scaled
    scores (Gemma 2). ``alibi``: ALiBi's bias -slope * |i + offset - j| is added to the logits
    (offset: the diagonal's, by ``align``); the slopes are the call's tensor."""

    align: str = "top_left"
    window: tuple[int, int] | None = None
    softcap: float | None = None
    alibi: bool = False

    @functools.cached_property
    def spec_fields(self) -> tuple[str, bool, bool, bool]:
        """(mask_align, window, softcap, alibi) of the AttentionSpec (part of every call's
        kernel key: worked out once per Masking)."""
        return self.align, self.window is not None, self.softcap is not None, self.alibi

    @property
    def shifted(self) -> bool:
        """The kernels' general diagonal (``AttentionSpec.shifted_mask``): bottom-right
        alignment or a window."""
        return self.align == "bottom_right" or self.window is not None

    @functools.cached_property
    def features(self) -> tuple:
        """The spec fields as (name, value) pairs (``flashcore.tuned.table.lookup``)."""
        align, window, softcap, alibi = self.spec_fields
        return (("mask_align", align), ("window", window), ("softcap", softcap),
                ("alibi", alibi))

    def scalars(self, softmax_scale: float) -> tuple:
        """The kernel's run-time mask arguments, in ABI order (``flashcore.compiler.abi``).

        ``softmax_scale`` is >= 0 here (``signed_query``). With 0 every logit is 0, and so is
        every capped one (cap * tanh(0)): both soft-cap factors are then 0, not cap / 0."""
        args: tuple = ()
        if self.window is not None:
            # a side of UNBOUNDED or more reaches past any sequence: the kernel's no-limit value
            left, right = (UNBOUNDED if w < 0 or w >= UNBOUNDED else w for w in self.window)
            args += ((left,), (right,))
        if self.softcap is not None:
            if softmax_scale == 0:
                args += ((0.0,), (0.0,))
            else:
                args += ((softmax_scale / self.softcap,), (self.softcap / softmax_scale,))
        return args


NO_MASK = Masking()


@functools.lru_cache(maxsize=256)
def masking(causal: bool, align: str, window, softcap, alibi: bool = False) -> Masking:
    """The checked Masking of an attention call's arguments (errors name the argument)."""
    if align not in MASK_ALIGNS:
        raise ValueError(f"attention: mask_align must be one of {MASK_ALIGNS}, got {align!r}")
    if window is not None:
        if (not isinstance(window, tuple) or len(window) != 2
                or any(isinstance(w, bool) or not isinstance(w, int) or not -1 <= w <= WINDOW_MAX
                       for w in window)):
            raise ValueError(f"attention: window must be (left, right), each an int in "
                             f"0..{WINDOW_MAX} or -1 for no limit on that side, got {window!r}")
        if causal and window[1] > 0:
            raise ValueError(f"attention: window={window} looks right of the diagonal, which "
                             "causal=True forbids; use right 0 (or -1)")
        if window == (-1, -1) or (causal and window[0] == -1):
            window = None  # no limit on either side: not a window
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"attention: softcap must be a number, got {softcap!r}")
        if softcap == 0:
            softcap = None  # flash_attn's convention: 0 turns it off
        elif not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"attention: softcap must be a finite number > 0, got {softcap!r}")
        else:
            softcap = float(softcap)
    if align != "top_left" and not causal and window is None and not alibi:
        align = "top_left"  # nothing to align: the same kernel as no mask
    return Masking(align, window, softcap, alibi)


def call_masking(causal, align: str, window, softcap, alibi: bool = False) -> Masking:
    """The Masking of one call's arguments (``causal`` checked too; ``alibi``: the call gives
    slopes): NO_MASK without masks, else ``masking`` of them (a window given as a list is taken
    as a tuple)."""
    if not isinstance(causal, bool):
        raise TypeError(f"attention: causal must be a bool, got {causal!r}")
    if align == "top_left" and window is None and softcap is None and not alibi:
        return NO_MASK
    return masking(causal, align, tuple(window) if isinstance(window, (list, tuple)) else window,
                   softcap, alibi)


def folded(causal: bool, masks: Masking, seqlen_q: int, seqlen_k: int,
           exact: bool = True) -> tuple[bool, Masking]:
    """The same attention of a dense (seqlen_q, seqlen_k) call with the fewest mask features,
    so the canonical spec runs (and the fast families, which build fewer masks, can run it).
    ``exact=False``: the lengths are the longest of a serving batch's sequences (any sequence
    may be shorter), where every rule below holds but the alignment one (S_q = S_k for the
    longest says nothing of the others).

    Query i sees keys i + offset - left .. i + offset + right (offset: S_k - S_q bottom-right,
    else 0; right 0 when causal). Each rule keeps every row's keys exactly:
    * a window side no row's range reaches past is no limit: both (or, causal, the left one)
      free means no window;
    * a diagonal at or past the last key for the first row (top-left with one key,
      bottom-right with one query) hides nothing: not causal;
    * bottom-right with S_q = S_k is top-left; alignment without causal, a window or ALiBi
      means nothing.
    Soft-capping and ALiBi always change the logits: they stay (ALiBi's bias keeps the
    diagonal it is measured from)."""
    if not (causal or masks.window is not None) or 0 in (seqlen_q, seqlen_k):
        return causal, masks
    offset = seqlen_k - seqlen_q if masks.align == "bottom_right" else 0
    window = masks.window
    if window is not None:
        left, right = window
        left_free = left < 0 or left >= seqlen_q - 1 + offset
        right_free = causal or right < 0 or right >= seqlen_k - 1 - offset
        if left_free and right_free:
            window = None
    if causal and window is None and offset >= seqlen_k - 1:
        causal = False
    align = masks.align
    if (offset == 0 and exact) or not (causal or window is not None or masks.alibi):
        align = "top_left"
    if (align, window) == (masks.align, masks.window):
        return causal, masks
    if (align, window, masks.softcap, masks.alibi) == ("top_left", None, None, False):
        return causal, NO_MASK
    # the memoised instance: its spec fields and features are worked out once, not per call
    return causal, masking(causal, align, window, masks.softcap, masks.alibi)

