"""GPU tests of negative softmax scales, through every entry point.

A kernel subtracts each row's running max of q·k before exp2; that bounds the scaled logits
only for a scale >= 0. With a negative one the max became the row's minimum and p overflowed
(inf in a 16-bit P once the logits spread over ~11, 448 in e4m3 almost at once), silently.
The ops now run a negative scale as -q with |scale| (``flashcore.ops.validate.signed_query``).
16-bit outputs are checked against the float64 reference within the bound of
``test_gpu_attention`` (2x SDPA's own error + 1e-4 + rounding terms); FP8 ones against the
float64 simulation of the same arithmetic on -q (``reference.attention_fp8``). Outputs are
poisoned with NaN, and the scales spread the logits far past where p overflowed.
"""

from __future__ import annotations

import pytest
import torch

from flashcore import reference
from flashcore.ops import attention, attention_paged, attention_varlen
from flashcore.ops.fp8 import attention_fp8, quantize_fp8
from flashcore.runtime.device import arch_of
from flashcore.specs import TileConfig
from tests.gpu_utils import allowed_error, fp8_sums_rounded_p, max_abs, requires_cuda, sdpa
from tests.test_gpu_fp8 import SIM_TOL
from tests.test_gpu_wgmma import FP8_EXACT_MARGIN, FP8_SIM_TOL, _rel_l2

pytestmark = [pytest.mark.gpu, requires_cuda]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# unit Gaussians: q·k has a spread of ~70 over 700 keys at d 128 (~50 at d 64), so these scales
# spread the logits over ~25-200, where p overflowed
SCALES = [-0.5, -3.0]
FP8_SCALES = [-0.0625, -0.25]  # logits of O(1) to ~10: e4m3 P saturated at once before
HOPPER_FP16 = TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws")
HOPPER_FP8 = TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws")


def _randn(*shape, dtype, g):
    return torch.randn(*shape, device="cuda", generator=g).to(dtype)


def _check_16bit(out, lse, q, k, v, causal, scale, what):
    """out (and lse, unless None) against the float64 reference of ``scale`` itself (not of
    -q)."""
    ref, ref_lse = reference.attention(q, k, v, causal=causal, softmax_scale=scale,
                                       return_lse=True, device=q.device)
    assert torch.isfinite(out).all(), f"{what}: NaN, inf or unwritten elements"
    err, err_sdpa = max_abs(out, ref), max_abs(sdpa(q, k, v, causal, scale), ref)
    allowed = allowed_error(err_sdpa, ref, q.dtype, q, k, v, scale)
    assert err <= allowed, f"{what}: max err {err:.3g}, SDPA {err_sdpa:.3g}, allowed {allowed:.3g}"
    if lse is not None:
        assert max_abs(lse, ref_lse) < 1e-3 * max(1.0, ref_lse.abs().max().item()), f"{what}: lse"


def _configs(arch: str) -> list:
    """(config, return_lse) of the kernels the prefill test runs: the tuned one, the (64, 64)
    mma.sync tile, on Hopper the warp-specialised family (the GPU test catalogs' kernels)."""
    return [(None, True), (TileConfig((64, 64)), False)] + (
        [(HOPPER_FP16, True)] if arch == "sm_90" else [])


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_negative_scale_prefill(scale, causal, dtype):
    """Prefill with GQA, ragged lengths and LSE: the tuned kernel, the (64, 64) mma.sync tile
    and on Hopper the warp-specialised family."""
    g = torch.Generator(device="cuda").manual_seed(int(-scale * 10) + causal)
    dt = DTYPES[dtype]
    q = _randn(2, 4, 333, 128, dtype=dt, g=g)
    k, v = (_randn(2, 2, 700, 128, dtype=dt, g=g) for _ in range(2))
    for config, return_lse in _configs(arch_of(q.get_device())):
        out = torch.full_like(q, float("nan"))
        res = attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=return_lse,
                        out=out, config=config)
        lse = res[1] if return_lse else None
        torch.cuda.synchronize()
        _check_16bit(out, lse, q, k, v, causal, scale, f"config {config}")


@pytest.mark.parametrize("num_splits", [None, 5])
@pytest.mark.parametrize("scale", SCALES)
def test_negative_scale_decode(num_splits, scale):
    """One query token of 8 heads against 2 K/V heads (packed GQA rows), split over CTAs or as
    the planner chooses; the combine merges the shares' LSEs."""
    g = torch.Generator(device="cuda").manual_seed(7 + (num_splits or 0))
    q = _randn(3, 8, 1, 128, dtype=torch.float16, g=g)
    k, v = (_randn(3, 2, 4000, 128, dtype=torch.float16, g=g) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    _, lse = attention(q, k, v, softmax_scale=scale, return_lse=True, out=out,
                       num_splits=num_splits)
    torch.cuda.synchronize()
    _check_16bit(out, lse, q, k, v, False, scale, f"num_splits={num_splits}")


@pytest.mark.parametrize("scale", FP8_SCALES)
@pytest.mark.parametrize("causal", [False, True])
def test_negative_scale_fp8(scale, causal):
    """precision="fp8" (16-bit inputs quantised by the op) and ``attention_fp8`` (the caller's
    e4m3 q, K per head): each against the simulation of -q with |scale| (the bounds of
    tests/test_gpu_fp8.py, or of tests/test_gpu_wgmma.py for Hopper's e4m3 wgmma), and no
    further from the exact attention of ``scale`` than that simulation."""
    g = torch.Generator(device="cuda").manual_seed(11 + causal)
    q = _randn(2, 4, 333, 128, dtype=torch.float16, g=g)
    k, v = (_randn(2, 2, 700, 128, dtype=torch.float16, g=g) for _ in range(2))
    hopper = arch_of(q.get_device()) == "sm_90"
    config = HOPPER_FP8 if hopper else TileConfig((64, 64))
    out = torch.full_like(q, float("nan"))
    attention(q, k, v, causal=causal, softmax_scale=scale, precision="fp8", out=out,
              config=config)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    tol, margin = (FP8_SIM_TOL, FP8_EXACT_MARGIN) if hopper else (SIM_TOL, 0.0)
    kx, vx = (t.repeat_interleave(2, dim=1) for t in (k, v))
    sim = reference.attention_fp8(-q, kx, vx, causal=causal, softmax_scale=-scale,
                                  tile=config.tile, device=q.device,
                                  sum_rounded_p=fp8_sums_rounded_p(config, 128, causal))
    exact = reference.attention(q, k, v, causal=causal, softmax_scale=scale, device=q.device)
    assert _rel_l2(out, sim) <= tol
    assert _rel_l2(out, exact) <= _rel_l2(sim, exact) + margin + 1e-3

    q8, qd = quantize_fp8(q, granularity="token")
    k8, kd = quantize_fp8(k)  # per (batch, head)
    vt8, vd = quantize_fp8(v, transpose=True)
    out8 = torch.full_like(q, float("nan"))
    attention_fp8(q8, k8, vt8, qd, kd, vd, causal=causal, softmax_scale=scale, out=out8,
                  config=config)
    torch.cuda.synchronize()
    assert torch.isfinite(out8).all()
    sim = reference.attention_fp8(-q, kx, vx, causal=causal, softmax_scale=-scale,
                                  tile=config.tile, device=q.device, k_scale="head",
                                  sum_rounded_p=fp8_sums_rounded_p(config, 128, causal))
    assert _rel_l2(out8, sim) <= tol


@pytest.mark.parametrize("scale", SCALES)
def test_negative_scale_varlen_and_paged(scale):
    """A packed batch of two sequences, and decode against a paged cache of the same keys."""
    g = torch.Generator(device="cuda").manual_seed(23)
    lens = [300, 129]
    d, hq, hkv = 64, 4, 2
    q = _randn(sum(lens), hq, d, dtype=torch.float16, g=g)
    k, v = (_randn(sum(lens), hkv, d, dtype=torch.float16, g=g) for _ in range(2))
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    # (bottom-right: the serving catalogs' causal kernels; the same mask where S_q = S_k)
    _, lse = attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                              softmax_scale=scale, return_lse=True, out=out,
                              config=TileConfig((64, 64)), mask_align="bottom_right")
    torch.cuda.synchronize()
    for b in range(2):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        qb, kb, vb, ob = (t[rows].transpose(0, 1)[None] for t in (q, k, v, out))  # (1, H, S, D)
        _check_16bit(ob, lse[None, :, rows], qb, kb, vb, True, scale, f"varlen sequence {b}")

    page = 16
    pages = [-(-n // page) for n in lens]
    table = torch.full((2, max(pages)), -1, dtype=torch.int32, device="cuda")
    k_cache = torch.zeros(sum(pages), page, hkv, d, dtype=torch.float16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    at = 0
    for b, n in enumerate(lens):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        for i in range(pages[b]):
            table[b, i] = at
            chunk = slice(i * page, min((i + 1) * page, n))
            k_cache[at, : chunk.stop - chunk.start] = k[rows][chunk]
            v_cache[at, : chunk.stop - chunk.start] = v[rows][chunk]
            at += 1
    qd = _randn(2, hq, 1, d, dtype=torch.float16, g=g)
    out = torch.full_like(qd, float("nan"))
    _, lse = attention_paged(qd, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32,
                             device="cuda"), softmax_scale=scale, return_lse=True, out=out)
    torch.cuda.synchronize()
    for b in range(2):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        kb, vb = (t[rows].transpose(0, 1)[None] for t in (k, v))
        _check_16bit(out[b:b + 1], lse[b:b + 1], qd[b:b + 1], kb, vb, False, scale,
                     f"paged sequence {b}")
