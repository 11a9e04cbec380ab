"""GPU tests of the FP8 (E4M3) path: no overflow for any finite input, bounded error.

Error budget: on i.i.d. Gaussian inputs, e4m3's 3-bit mantissa alone costs about 5.2% relative L2
against exact attention (simulated on the CPU: Q and K rounding ~3.9%, V 2.6%, P 2.4%), and on
a few keys nothing averages out (9 keys: 8.3% seen; one e4m3 rounding is up to 6.25%), so these
tests bound the error at 10% (and cosine 0.995), and check the kernel against the simulated
quantisation, which separates rounding from kernel bugs. The 5% target of the FP8 issue is not
met on such data; see the closing notes.

Inputs reach magnitudes far beyond e4m3's ±448 (1e-3 .. 1e4, outlier tokens, constant and
alternating-sign rows); the softmax scale keeps the logits O(1) as a model's would, because with
logits of 1e5 softmax is a hard argmax that any 3-bit-mantissa rounding may flip.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flashcore import reference
from flashcore.ops import attention
from flashcore.ops.fp8 import attention_fp8, key_permutation, padded_keys, quantize_fp8
from tests.gpu_utils import attention_shapes, requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
WORST = {"rel_l2": 0.0, "vs_sim": 0.0}


def _make(shape, mag, pattern, outlier, dtype, g):
    x = torch.randn(shape, device="cuda", generator=g)
    if pattern == "constant":
        x = torch.ones(shape, device="cuda")
    elif pattern == "alternating":
        x = torch.ones(shape, device="cuda")
        x[..., 1::2] = -1
    if outlier:  # one token far above the rest
        x[:, :, shape[2] // 2, :] *= outlier
    return (x * mag).clamp(-6e4, 6e4).to(dtype)


def _metrics(out, ref):
    o, r = out.double().flatten(), ref.double().flatten().to(out.device)
    rel = ((o - r).norm() / r.norm().clamp_min(1e-300)).item()
    cos = torch.nn.functional.cosine_similarity(o, r, dim=0).item()
    return rel, cos


@settings(settings.get_profile("gpu"))
@given(
    **attention_shapes(4096),
    log_mag=st.tuples(st.floats(-3, 4), st.floats(-3, 4), st.floats(-3, 4)),
    pattern=st.sampled_from(["randn", "randn", "constant", "alternating"]),
    outlier=st.sampled_from([0, 0, 30.0, 1000.0]),
    outlier_in_k=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, h=8, sq=512, sk=512, d=64, dtype="float16", causal=False, log_mag=(0, 0, 0),
         pattern="randn", outlier=0, outlier_in_k=False, seed=1)
@example(b=1, h=8, sq=2048, sk=2048, d=64, dtype="float16", causal=False, log_mag=(0, 0, 0),
         pattern="randn", outlier=0, outlier_in_k=False, seed=2)
@example(b=1, h=8, sq=2048, sk=2048, d=64, dtype="bfloat16", causal=True, log_mag=(4, 4, 4),
         pattern="randn", outlier=1000.0, outlier_in_k=True, seed=3)
def test_fp8_attention_never_overflows_and_stays_accurate(
    b, h, sq, sk, d, dtype, causal, log_mag, pattern, outlier, outlier_in_k, seed
):
    if b * h * sq * sk > 2**27:
        sq = max(1, 2**27 // (b * h * sk))
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = DTYPES[dtype]
    mq, mk, mv = (10.0**m for m in log_mag)
    if dt == torch.float16:  # fp16 inputs cannot exceed 65504
        mq, mk, mv = (min(m, 6e4 / max(outlier, 1) / 5) for m in (mq, mk, mv))
    q = _make((b, h, sq, d), mq, pattern, 0, dt, g)
    k_outlier = outlier if outlier_in_k else 0
    k = _make((b, h, sk, d), mk, "randn", k_outlier, dt, g)
    v = _make((b, h, sk, d), mv, pattern, min(outlier, 30.0), dt, g)
    scale = 1.0 / (math.sqrt(d) * mq * mk)
    out = torch.full_like(q, float("nan"))
    attention(q, k, v, causal=causal, softmax_scale=scale, precision="fp8", out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "NaN/Inf (or unwritten elements) in the FP8 output"
    if b * h * sq * sk <= 2**22:  # the simulated-quantisation reference runs on the CPU
        sim = reference.attention_fp8(q, k, v, causal=causal, softmax_scale=scale)
        rel_sim, cos_sim = _metrics(out, sim)
        WORST["vs_sim"] = max(WORST["vs_sim"], rel_sim)
        # the kernel rounds P against the running row max, the reference against the final one,
        # and sums in another order: they differ by that alone
        assert rel_sim <= 3e-2 and cos_sim >= 0.999, f"vs simulated quantisation {rel_sim:.3g}"
    if not k_outlier:
        exact = reference.attention(q, k, v, causal=causal, softmax_scale=scale, device=q.device)
        rel, cos = _metrics(out, exact)
        WORST["rel_l2"] = max(WORST["rel_l2"], rel)
        assert rel <= 0.1 and cos >= 0.995, f"rel L2 {rel:.3g}, cosine {cos:.5f}"


def test_report_worst_errors():
    print(f"\nFP8 worst relative L2 vs exact: {WORST['rel_l2']:.4g}; "
          f"vs simulated quantisation: {WORST['vs_sim']:.4g}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_quantizer_matches_reference(dtype, d):
    g = torch.Generator(device="cuda").manual_seed(d)
    x = (torch.randn(2, 3, 150, d, device="cuda", generator=g) * 1000).to(dtype)
    x[1, 2, 7, 3] = 60000.0  # outlier, far beyond 448
    codes, descale = reference.quantize_e4m3(x)
    x8, ds = quantize_fp8(x)
    assert torch.allclose(ds.cpu(), descale, rtol=1e-6)
    got = x8.cpu().double()
    assert got.abs().max() <= 448 and torch.isfinite(got).all()
    # equal codes except where the kernel's float32 scale differs by an ulp at a rounding tie
    assert (got != codes).float().mean() < 1e-3
    # transposed + permuted layout for V: position p of each group of 32 holds key perm[p]
    vt8, _ = quantize_fp8(x, transpose=True)
    s_pad = padded_keys(150)
    assert vt8.shape == (2, 3, d, s_pad)
    perm = key_permutation()
    key_at = torch.tensor([g * 32 + perm[p] for g in range(s_pad // 32) for p in range(32)])
    v_back = torch.empty(2, 3, s_pad, d, dtype=torch.float64)
    v_back[:, :, key_at, :] = vt8.cpu().double().transpose(2, 3)
    assert (v_back[:, :, :150] != codes).float().mean() < 1e-3
    assert (v_back[:, :, 150:] == 0).all()  # padding keys are zero
    # per token: each row on its own scale
    t8, tds = quantize_fp8(x, granularity="token")
    tcodes, tdescale = reference.quantize_e4m3(x, "token")
    assert tds.shape == (2, 3, 150) and torch.allclose(tds.cpu(), tdescale, rtol=1e-6)
    assert (t8.cpu().double() != tcodes).float().mean() < 1e-3


def test_low_level_entry_and_errors():
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, 2, 100, 64, device="cuda", generator=g, dtype=torch.float16)
               for _ in range(3))
    q8, qd = quantize_fp8(q, granularity="token")
    k8, kd = quantize_fp8(k, granularity="token")
    vt8, vd = quantize_fp8(v, transpose=True)
    out, lse = attention_fp8(q8, k8, vt8, qd, kd, vd, causal=True, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True, device="cuda")
    assert _metrics(out, ref)[0] < 5e-2
    assert (lse.double() - ref_lse).abs().max() < 0.1
    with pytest.raises(ValueError, match="vt8 has shape"):
        attention_fp8(q8, k8, vt8[..., :64], qd, kd, vd)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        attention_fp8(q, k8, vt8, qd, kd, vd)
