"""CPU properties of the E4M3 quantisation the FP8 path uses (reference arithmetic), and the FP8
kernel's compile checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcore import reference
from flashcore.ops.fp8 import key_permutation
from flashcore.spec import AttentionSpec, QuantizeSpec, SpecError


def _tensor(seed, shape, log_mag, dtype, outlier, pattern):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10.0**log_mag
    if pattern == "constant":
        x = torch.full(shape, 10.0**log_mag)
    elif pattern == "alternating":
        x = torch.ones(shape) * 10.0**log_mag
        x[..., 1::2] *= -1
    if outlier:
        x[0, 0, 0, 0] = 10.0 ** (log_mag + 4)
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    s=st.integers(1, 70),
    log_mag=st.floats(-3, 30),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    outlier=st.booleans(),
    pattern=st.sampled_from(["randn", "constant", "alternating"]),
)
def test_scales_never_saturate_and_round_trip_within_e4m3_spacing(
    seed, b, h, s, log_mag, dtype, outlier, pattern
):
    if dtype == torch.float16:
        log_mag = min(log_mag, 4.0)  # fp16 tops out at 65504
    x = _tensor(seed, (b, h, s, 64), log_mag, dtype, outlier, pattern)
    assert torch.isfinite(x.float()).all()
    codes, descale = reference.quantize_e4m3(x)
    assert torch.isfinite(codes).all() and torch.isfinite(descale).all()
    assert (descale > 0).all()
    # every code within the e4m3 range, and the head's largest value lands on (or next to) 448
    assert codes.abs().max() <= reference.E4M3_MAX
    amax = x.float().abs().amax(dim=(2, 3))
    big = amax > reference.AMAX_FLOOR
    assert (codes.abs().amax(dim=(2, 3))[big] >= 416).all()  # 416: the e4m3 step below 448
    # round trip: within half an e4m3 step (relative 2^-4 for normals; 2^-10 absolute for the
    # subnormal range, in units of the scale)
    xs = x.double()
    back = reference.dequantize_e4m3(codes, descale)
    d = descale.double()[:, :, None, None]
    bound = torch.maximum(xs.abs() * 2.0**-4, d * 2.0**-10) * (1 + 1e-6)
    assert ((back - xs).abs() <= bound).all()


def test_e4m3_round_saturates_instead_of_nan():
    x = torch.tensor([500.0, -1e9, 448.0, 0.0])
    assert reference.e4m3_round(x).tolist() == [448.0, -448.0, 448.0, 0.0]


def test_fp8_reference_is_close_to_exact_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = ((torch.randn(1, 2, 96, 64, generator=g) * 300).to(torch.bfloat16) for _ in range(3))
    # raw values far beyond ±448; the softmax scale keeps the logits O(1), as a model's would
    scale = 1.0 / (8.0 * 300 * 300)
    exact = reference.attention(q, k, v, causal=True, softmax_scale=scale)
    sim = reference.attention_fp8(q, k, v, causal=True, softmax_scale=scale)
    rel = ((sim - exact).norm() / exact.norm()).item()
    assert 0 < rel < 5e-2


def test_key_permutation_is_a_permutation_matching_the_mma_register_order():
    perm = key_permutation()
    assert sorted(perm) == list(range(32))
    # thread t of a quad holds accumulator columns {2t, 2t+1} of every n8 tile; A-operand
    # position 16h + 4t + i must hold tile (2h + i//2), column 2t + i%2
    for p in range(32):
        h, rest = divmod(p, 16)
        t, i = divmod(rest, 4)
        assert perm[p] == 8 * (2 * h + i // 2) + 2 * t + i % 2


def test_fp8_specs_refuse_sm80():
    with pytest.raises(SpecError, match="sm_80 does not have"):
        AttentionSpec(arch="sm_80", precision="fp8")
    with pytest.raises(SpecError, match="e4m3 needs"):
        QuantizeSpec(arch="sm_80")


@pytest.mark.parametrize("arch", ["sm_89", "sm_90"])
def test_fp8_kernel_compiles_with_e4m3_mma(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path))
    from flashcore.compiler import compile_many

    att = AttentionSpec(arch=arch, head_dim=128, tile=(128, 64), warps=8, causal=True,
                        precision="fp8")
    quant = QuantizeSpec(arch=arch, dtype="bfloat16", head_dim=128, transpose=True)
    a, qz = compile_many([att, quant], jobs=2)
    n_mma = a.ptx.count("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32")
    # the block loop is emitted once per masked step (causal 128x64: 2) plus once unmasked;
    # per block: S (rows/16 x n/8 x d/32) and O (rows/16 x d/8 x n/32) per warp
    rows = 128 // 8
    per_block = (rows // 16) * (64 // 8) * (128 // 32) + (rows // 16) * (128 // 8) * (64 // 32)
    assert n_mma == 3 * per_block
    assert "mma.sync.aligned.m16n8k16" not in a.ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in a.ptx  # P to e4m3
    assert a.resources.spill_store_bytes in (0, None) and a.resources.stack_frame_bytes == 0
    assert "cvt.rn.satfinite.e4m3x2.f32" in qz.ptx
    assert math.isclose(a.smem_dynamic, att.smem_bytes)
