"""GPU tests of the FP8 (E4M3) path: no overflow for any finite input, bounded error.

Two references. The simulated quantised computation (``reference.attention_fp8`` with the
kernel's tile) repeats the kernel's arithmetic in float64: same scales, same e4m3 roundings of
Q, K, V, and of P against the running max block by block. The kernel must match it to fp32
tolerance (``SIM_TOL``): that separates kernel bugs from quantisation error. Against exact
attention the error is e4m3's: on i.i.d. Gaussian inputs its 3-bit mantissa alone costs about
5.2% relative L2 (simulated: Q and K rounding ~3.9%, V 2.6%, P 2.4%), and on a few keys nothing
averages out (9 keys: 8.3% seen; one e4m3 rounding is up to 6.25%), so that bound is 10% (and
cosine 0.995). A 5% target sits inside that spread.

Inputs reach magnitudes far beyond e4m3's ±448 (1e-3 .. 1e4, outlier tokens, constant and
alternating-sign rows). The property test scales the softmax so logits stay O(1) as a model's
would; ``test_fp8_huge_logits_default_scale`` covers the default scale on such inputs, a hard
argmax, against the simulation.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flashcore import reference
from flashcore.ops import attention, plan
from flashcore.ops.fp8 import attention_fp8, key_permutation, padded_keys, quantize_fp8
from flashcore.runtime.device import arch_of
from flashcore.specs import FP8_HEAD_DIMS, TileConfig
from tests.gpu_utils import (
    FP8_SPLIT_CONFIGS,
    ROUNDED_SUMS_LSE_SLACK,
    attention_shapes,
    fp8_sums_rounded_p,
    requires_cuda,
    skip_unless_fits,
)

pytestmark = [pytest.mark.gpu, requires_cuda]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
WORST = {"rel_l2": 0.0, "vs_sim": 0.0}
SIM_TOL = 2e-3  # kernel vs its float64 simulation (2.2e-4 seen with O(1) logits)


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
    **attention_shapes(4096, FP8_HEAD_DIMS),
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
    # the tile and one share of the keys per row, as the simulation below replays them
    attention(q, k, v, causal=causal, softmax_scale=scale, precision="fp8", out=out,
              tile=(64, 64), num_splits=1)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "NaN/Inf (or unwritten elements) in the FP8 output"
    if b * h * sq * sk <= 2**22:  # the simulated-quantisation reference runs on the CPU
        # the kernel's own computation in float64: same scales, same e4m3 roundings of Q, K, V
        # and of P (against the running max, key block by key block): what is left is fp32
        # accumulation order and exp2/reciprocal approximations
        sim = reference.attention_fp8(q, k, v, causal=causal, softmax_scale=scale, tile=(64, 64))
        rel_sim, _ = _metrics(out, sim)
        WORST["vs_sim"] = max(WORST["vs_sim"], rel_sim)
        assert rel_sim <= SIM_TOL, f"vs simulated quantisation {rel_sim:.3g}"
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


@pytest.mark.parametrize("shape", [(1, 2, 1, 64), (1, 1, 33, 128), (3, 5, 1000, 64)])
def test_per_head_scale_comes_from_every_share_of_rows(shape):
    """A per-(batch, head) scale is the max of 32 partial maxima, each over a share of the
    rows (at S = 1 all but one share is empty, at 33 ragged): the same descale and codes as
    the reference, for V's transposed layout too, with an all-zero head (its scale from the
    amax floor) finite."""
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    y = torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)
    y[0, 0] = 0
    y[-1, -1, -1, -1] = -3000.0  # the last share's amax
    codes, descale = reference.quantize_e4m3(y)
    for y8, yd in (quantize_fp8(y), quantize_fp8(y, transpose=True)):
        assert torch.allclose(yd.cpu(), descale, rtol=1e-6)
        assert torch.isfinite(y8.float()).all()
    y8, _ = quantize_fp8(y)
    assert (y8.cpu().double() != codes).float().mean() < 1e-3


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


@pytest.mark.parametrize("config", FP8_SPLIT_CONFIGS, ids=lambda c: f"{c[0]}w{c[1]}k{c[2]}")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", [(333, 700), (77, 40)])
def test_fp8_kv_splits(config, causal, d, sq, sk):
    """The FP8 kernel with split key ranges: same answer as the simulated quantisation."""
    tile, warps, splits = config
    skip_unless_fits(d, precision="fp8", tile=tile, warps=warps, kv_splits=splits)
    g = torch.Generator(device="cuda").manual_seed(sq * d + causal)
    q, k, v = (torch.randn(2, 3, s, d, device="cuda", generator=g, dtype=torch.float16)
               for s in (sq, sk, sk))
    out = torch.full_like(q, float("nan"))
    attention(q, k, v, tile=tile, warps=warps, kv_splits=splits, causal=causal, precision="fp8",
              out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    sim = reference.attention_fp8(q, k, v, causal=causal, tile=tile, kv_splits=splits)
    rel, _ = _metrics(out, sim)
    assert rel <= SIM_TOL, f"vs simulated quantisation {rel:.3g}"


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_stages(d, causal):
    """The FP8 kernel with two K/V stages in flight: same answer as its simulation."""
    g = torch.Generator(device="cuda").manual_seed(d + causal)
    q, k, v = (torch.randn(2, 3, s, d, device="cuda", generator=g, dtype=torch.float16)
               for s in (333, 700, 700))
    out = torch.full_like(q, float("nan"))
    attention(q, k, v, tile=(64, 64), warps=4, stages=2, causal=causal, precision="fp8", out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    sim = reference.attention_fp8(q, k, v, causal=causal, tile=(64, 64))
    rel, _ = _metrics(out, sim)
    assert rel <= SIM_TOL, f"vs simulated quantisation {rel:.3g}"


@pytest.mark.parametrize("dtype,mag", [(torch.float16, 3e3), (torch.bfloat16, 1e4),
                                       (torch.bfloat16, 1e6)])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_huge_logits_default_scale(dtype, mag, causal):
    """Inputs far beyond e4m3's range with the default 1/sqrt(d) scale: logits of 1e7-1e13, a
    hard argmax. The row max must still get p = 1 (no exp2 of a rounded product), so the output
    is finite and equals the simulated quantised computation."""
    g = torch.Generator(device="cuda").manual_seed(int(mag) + causal)
    q, k, v = ((torch.randn(2, 4, 300, 64, device="cuda", generator=g) * mag).to(dtype)
               for _ in range(3))
    out = torch.full_like(q, float("nan"))
    attention(q, k, v, causal=causal, precision="fp8", out=out, tile=(64, 64))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    sim = reference.attention_fp8(q, k, v, causal=causal, tile=(64, 64))
    rel, _ = _metrics(out, sim)
    assert rel <= 1e-2, f"vs simulated quantisation {rel:.3g}"


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_decode_split_over_ctas(splits, causal):
    """One query token (and a few) against split keys: each share's P is rounded against its own
    running max; the simulation replays the shares and merges them."""
    g = torch.Generator(device="cuda").manual_seed(splits + causal)
    for sq in (1, 7):
        q, k, v = (torch.randn(2, 4, s, 128, device="cuda", generator=g, dtype=torch.float16)
                   for s in (sq, 700, 700))
        out = torch.full_like(q, float("nan"))
        attention(q, k, v, causal=causal, precision="fp8", out=out, tile=(16, 64), warps=1,
                  num_splits=splits)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        sim = reference.attention_fp8(q, k, v, causal=causal, tile=(16, 64), num_splits=splits)
        rel, _ = _metrics(out, sim)
        assert rel <= SIM_TOL, f"vs simulated quantisation {rel:.3g}"


@pytest.mark.parametrize("tile,splits", [((64, 64), None), (None, None), ((16, 64), 3)],
                         ids=["64x64", "tuned", "decode-split3"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_fp8_key_descaled_per_head(tile, splits, causal, d):
    """K quantised per (batch, head) (``quantize_fp8``'s default granularity): its descale is
    folded into each row's exp2 scale, and the kernel matches the simulation of per-head K.
    Keys of magnitudes 1e-2 .. 30 (one head's outlier token sets every key's scale), GQA,
    ragged lengths, LSE; outputs poisoned."""
    g = torch.Generator(device="cuda").manual_seed(d * 7 + causal)
    sq = 1 if splits else 333
    q = torch.randn(2, 4, sq, d, device="cuda", generator=g, dtype=torch.float16)
    k, v = (torch.randn(2, 2, 700, d, device="cuda", generator=g, dtype=torch.float16)
            for _ in range(2))
    k[:, :, 5] *= 30.0  # an outlier token: per head, the other keys lose bits, not range
    k[:, 1] *= 1e-2
    scale = 1.0 / (d**0.5 * 10.0)  # the outlier's logits stay O(1)
    q8, qd = quantize_fp8(q, granularity="token")
    k8, kd = quantize_fp8(k)  # per (batch, head)
    vt8, vd = quantize_fp8(v, transpose=True)
    assert kd.shape == (2, 2)
    config = None if tile is None else TileConfig(tile, warps=1 if tile == (16, 64) else 4)
    out = torch.full_like(q, float("nan"))
    res = attention_fp8(q8, k8, vt8, qd, kd, vd, causal=causal, softmax_scale=scale,
                        return_lse=True, config=config, num_splits=splits, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    ke, ve = (t.repeat_interleave(2, dim=1) for t in (k, v))
    ran = config or plan.tuned_config(arch_of(0), d, causal, sq, "fp8khead")
    sim = reference.attention_fp8(q, ke, ve, causal=causal, softmax_scale=scale, tile=ran.tile,
                                  num_splits=splits or 1, k_scale="head",
                                  sum_rounded_p=fp8_sums_rounded_p(ran, d, causal))
    rel, _ = _metrics(out, sim)
    # the warp-specialised family's e4m3 wgmma accumulates with fewer bits (test_gpu_wgmma)
    tol = 1e-2 if ran.family == "wgmma_ws" else SIM_TOL
    assert rel <= tol, f"vs simulated per-head K quantisation {rel:.3g}"
    # the row sums add P, unrounded: the LSE is exact attention's over the dequantised inputs;
    # where the tensor cores sum P as P·V reads it (e4m3), within their rounding's slack
    deq = [reference.dequantize_e4m3(*reference.quantize_e4m3(t, g))
           for t, g in ((q, "token"), (ke, "head"), (ve, "head"))]
    deq_lse = reference.attention(*deq, causal=causal, softmax_scale=scale, return_lse=True,
                                  device="cuda")[1]
    slack = ROUNDED_SUMS_LSE_SLACK if fp8_sums_rounded_p(ran, d, causal) else 0.0
    assert (res[1].double() - deq_lse).abs().max() < 2e-2 + slack
    with pytest.raises(ValueError, match=r"k_descale must be float32 of shape \(2, 2, 700\) or "
                                         r"\(2, 2\)"):
        attention_fp8(q8, k8, vt8, qd, kd[:, :1], vd)
