"""GPU tests of the masks as data (bottom-right causal, sliding windows, soft-capping) against
the float64 reference, prefill and decode (GQA packed rows, split-KV), with LSE.

The bound is the prefill tests' (``test_gpu_attention._allowed``) with torch's own error taken
from SDPA given the same mask as a boolean ``attn_mask`` (and, for soft-capping, the capped
logits computed by torch in the input dtype's precision). Output and LSE are poisoned first.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flashcore import reference
from flashcore.ops import attention
from tests.gpu_utils import (
    allowed_error,
    check_masked_result,
    head_dims,
    masked_qkv,
    max_abs,
    requires_cuda,
    torch_baseline,
)

pytestmark = [pytest.mark.gpu, requires_cuda]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# the calls both mask properties draw: GQA groups, decode and prefill lengths, every head dim
CALLS = {
    "b": st.integers(1, 2),
    "hkv": st.integers(1, 3),
    "group": st.sampled_from([1, 4]),
    "sq": st.one_of(st.just(1), st.integers(1, 16), st.integers(1, 600)),
    "sk": st.one_of(st.integers(1, 300), st.integers(1, 3000)),
    "d": head_dims(),
    "dtype": st.sampled_from(["float16", "bfloat16"]),
    "causal": st.booleans(),
    "align": st.sampled_from(["top_left", "bottom_right"]),
}


@settings(settings.get_profile("gpu"))
@given(
    **CALLS,
    window=st.one_of(st.none(), st.tuples(st.integers(-1, 700), st.integers(-1, 700))),
    softcap=st.one_of(st.none(), st.floats(0.5, 50)),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, hkv=2, group=4, sq=1, sk=2999, d=128, dtype="float16", causal=True,
         align="bottom_right", window=(511, 0), softcap=None, seed=1)  # decode, window, split
@example(b=2, hkv=1, group=1, sq=300, sk=1000, d=64, dtype="bfloat16", causal=True,
         align="bottom_right", window=None, softcap=30.0, seed=2)  # chunked prefill, softcap
@example(b=1, hkv=1, group=1, sq=500, sk=100, d=64, dtype="float16", causal=True,
         align="bottom_right", window=(10, 0), softcap=None, seed=3)  # rows that see no key
@example(b=1, hkv=2, group=4, sq=1, sk=2500, d=256, dtype="bfloat16", causal=True,
         align="bottom_right", window=(300, 0), softcap=20.0, seed=4)  # wide: every mask
@example(b=1, hkv=1, group=1, sq=400, sk=900, d=96, dtype="float16", causal=True,
         align="bottom_right", window=(100, 0), softcap=30.0, seed=5)
def test_masks_match_the_reference(b, hkv, group, sq, sk, d, dtype, causal, align, window,
                                   softcap, seed):
    if causal and window is not None and window[1] > 0:
        window = (window[0], 0)
    q, k, v = masked_qkv(b, hkv * group, hkv, sq, sk, d, DTYPES[dtype], softcap, seed)
    masks = {"mask_align": align, "window": window, "softcap": softcap}
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, device=q.device,
                                       **masks)
    out = torch.full_like(q, float("nan"))
    res, lse = attention(q, k, v, causal=causal, return_lse=True, out=out, **masks)
    check_masked_result(res, out, lse, ref, ref_lse, q, k, v, causal, align, window, softcap)


def test_window_kernel_walks_only_the_window():
    """A 256-key causal window over 8192 keys: the window kernel's output equals the reference,
    and it matches plain causal attention run on just the keys of each query's window."""
    q, k, v = (torch.randn(1, 2, 8192, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out = attention(q, k, v, causal=True, window=(255, 0))
    i = 5000
    part = attention(q[:, :, i:i + 1], k[:, :, i - 255:i + 1], v[:, :, i - 255:i + 1])
    torch.testing.assert_close(out[:, :, i:i + 1], part, atol=2e-3, rtol=0)


def test_mask_arguments_are_refused_clearly():
    q = torch.randn(1, 1, 8, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="window"):
        attention(q, q, q, window=(1,))
    with pytest.raises(ValueError, match="right of the diagonal"):
        attention(q, q, q, causal=True, window=(4, 4))
    with pytest.raises(ValueError, match="softcap"):
        attention(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match="mask_align"):
        attention(q, q, q, causal=True, mask_align="bottom")
    with pytest.raises(ValueError, match="softcap"):
        attention(q, q, q, softcap=5.0, precision="fp8")


@settings(settings.get_profile("gpu"))
@given(
    **CALLS,
    per_batch=st.booleans(),
    softcap=st.one_of(st.none(), st.floats(2.0, 50)),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, hkv=2, group=4, sq=1, sk=2999, d=128, dtype="float16", causal=False,
         align="bottom_right", per_batch=False, softcap=None, seed=1)  # GQA decode, split
@example(b=2, hkv=1, group=1, sq=300, sk=1000, d=64, dtype="bfloat16", causal=True,
         align="bottom_right", per_batch=True, softcap=30.0, seed=2)  # chunked prefill
def test_alibi_matches_the_reference(b, hkv, group, sq, sk, d, dtype, causal, align, per_batch,
                                     softcap, seed):
    """ALiBi (slopes per head or per (batch, head), the geometric ones of the paper scaled
    by a random factor) against the float64 reference; torch's error from SDPA given the same
    bias (and mask) by hand, in q's dtype."""
    dt = DTYPES[dtype]
    h = hkv * group
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, n, s, d, device="cuda", generator=gen).to(dt)
               for n, s in ((h, sq), (hkv, sk), (hkv, sk)))
    slopes = 2.0 ** (-8.0 * torch.arange(1, h + 1, device="cuda") / h)
    if per_batch:
        slopes = slopes * torch.rand(b, 1, device="cuda", generator=gen) * 2
    slopes = slopes.float()
    masks = {"mask_align": align, "softcap": softcap}
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, device=q.device,
                                       alibi_slopes=slopes, **masks)
    out = torch.full_like(q, float("nan"))
    res, lse = attention(q, k, v, causal=causal, return_lse=True, out=out, alibi_slopes=slopes,
                         **masks)
    torch.cuda.synchronize()
    assert res is out and torch.isfinite(out).all(), "NaN or unwritten elements"
    base = torch_baseline(q, k, v, causal, align, None, softcap, slopes)
    err, err_torch = max_abs(out, ref), max_abs(base, ref)
    allowed = allowed_error(err_torch, ref, dt, q, k, v)
    assert err <= allowed, f"max err {err:.3g} vs torch's {err_torch:.3g} (allowed {allowed:.3g})"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert max_abs(lse[finite], ref_lse[finite]) < 1e-3 * max(1.0, ref_lse.abs().max().item())
