"""GPU tests of flashcore.ops.attention against a float64 reference and torch SDPA's own error.

Skipped without CUDA. Run on the device before resolving kernel work (see README).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flashcore import reference
from flashcore.ops import attention
from tests.gpu_utils import max_abs, requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _inputs(b, h, sq, sk, d, dtype, magnitude, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda s: (torch.randn(b, h, s, d, device="cuda", generator=g) * magnitude).to(dtype)
    return mk(sq), mk(sk), mk(sk)


def _sdpa(q, k, v, causal, scale):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _check_against_sdpa(q, k, v, causal, scale, tile=(64, 64)):
    ref = reference.attention(q, k, v, causal=causal, softmax_scale=scale, device=q.device)
    out = attention(q, k, v, tile=tile, causal=causal, softmax_scale=scale)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "NaN/Inf in the output"
    err = max_abs(out, ref)
    err_sdpa = max_abs(_sdpa(q, k, v, causal, scale), ref)
    assert err <= 2 * err_sdpa + 1e-4, f"max err {err:.3g} vs SDPA's {err_sdpa:.3g}"
    rel = (out.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    return err, err_sdpa, rel.item()


@settings(settings.get_profile("gpu"))
@given(
    b=st.integers(1, 4),
    h=st.integers(1, 16),
    sq=st.one_of(st.integers(1, 300), st.integers(1, 2048)),
    sk=st.one_of(st.integers(1, 300), st.integers(1, 2048)),
    d=st.sampled_from([64, 128]),
    dtype=st.sampled_from(sorted(DTYPES)),
    causal=st.booleans(),
    scale=st.one_of(st.none(), st.floats(0.01, 1.0)),
    log_mag=st.floats(-3, 2),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, h=8, sq=512, sk=512, d=64, dtype="float16", causal=False, scale=None, log_mag=0, seed=1)
@example(b=2, h=3, sq=1, sk=1, d=128, dtype="bfloat16", causal=True, scale=None, log_mag=0, seed=2)
@example(b=1, h=2, sq=200, sk=77, d=64, dtype="float16", causal=True, scale=0.3, log_mag=1, seed=3)
def test_matches_reference_within_sdpa_error(b, h, sq, sk, d, dtype, causal, scale, log_mag, seed):
    # keep the float64 reference's score matrix within a few GB
    if b * h * sq * sk > 2**27:
        sq = max(1, 2**27 // (b * h * sk))
    q, k, v = _inputs(b, h, sq, sk, d, DTYPES[dtype], 10.0**log_mag, seed)
    _check_against_sdpa(q, k, v, causal, scale)


@pytest.mark.parametrize("tile", [(64, 64), (128, 64), (64, 128), (128, 128), (32, 64), (16, 32)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_tiles(tile, causal, d):
    q, k, v = _inputs(2, 3, 333, 190, d, torch.float16, 1.0, seed=hash((tile, causal, d)) % 2**31)
    ref = reference.attention(q, k, v, causal=causal, device=q.device)
    out = attention(q, k, v, tile=tile, causal=causal)
    err = max_abs(out, ref)
    err_sdpa = max_abs(_sdpa(q, k, v, causal, None), ref)
    assert torch.isfinite(out).all()
    assert err <= 2 * err_sdpa + 1e-4


def test_every_element_written_and_deterministic():
    q, k, v = _inputs(2, 4, 257, 131, 64, torch.bfloat16, 1.0, seed=11)
    # poison the allocator's free blocks: the output is allocated inside the op, so fill a
    # same-sized buffer with NaN and free it first, then check the result has no NaN.
    junk = torch.full((2, 4, 257, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    del junk
    a = attention(q, k, v, causal=True)
    b = attention(q, k, v, causal=True)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b), "two runs differ"


def test_lse_matches_reference():
    q, k, v = _inputs(2, 2, 150, 300, 128, torch.float16, 1.0, seed=5)
    for causal in (False, True):
        out, lse = attention(q, k, v, causal=causal, return_lse=True)
        ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, device=q.device)
        assert lse.shape == (2, 2, 150) and lse.dtype == torch.float32
        assert torch.isfinite(lse).all()
        assert max_abs(lse, ref_lse) < 1e-3 * max(1.0, ref_lse.abs().max().item())
        assert max_abs(out, ref) < 1e-2


def test_strided_inputs():
    # (batch, seq, heads, dim) storage viewed as (batch, heads, seq, dim): last dim contiguous
    base = torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.float16)
    q = base.transpose(1, 2)
    k = torch.randn(2, 90, 4, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
    v = torch.randn(2, 90, 4, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
    ref = reference.attention(q, k, v, device=q.device)
    out = attention(q, k, v)
    assert max_abs(out, ref) <= 2 * max_abs(_sdpa(q, k, v, False, None), ref) + 1e-4
    # a non-contiguous last dim is copied, not misread
    qt = torch.randn(2, 4, 64, 200, device="cuda", dtype=torch.float16).transpose(2, 3)
    out2 = attention(qt, k, v)
    ref2 = reference.attention(qt, k, v, device=q.device)
    assert max_abs(out2, ref2) <= 2 * max_abs(_sdpa(qt, k, v, False, None), ref2) + 1e-4


def test_non_default_stream_and_cuda_graph():
    q, k, v = _inputs(1, 8, 512, 512, 64, torch.float16, 1.0, seed=7)
    expected = attention(q, k, v, causal=True)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        on_stream = attention(q, k, v, causal=True)
    s.synchronize()
    assert torch.equal(on_stream, expected)

    g = torch.cuda.CUDAGraph()
    static_out = None
    with torch.cuda.graph(g):
        static_out = attention(q, k, v, causal=True)
    static_out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, expected)
    # new inputs through the same graph
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, attention(q, k, v, causal=True))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device():
    q, k, v = _inputs(1, 2, 100, 100, 64, torch.float16, 1.0, seed=9)
    q1, k1, v1 = q.to("cuda:1"), k.to("cuda:1"), v.to("cuda:1")
    out1 = attention(q1, k1, v1)
    assert out1.device == q1.device
    assert torch.equal(out1.cpu(), attention(q, k, v).cpu())


def test_bad_gpu_inputs_rejected():
    q, k, v = _inputs(1, 2, 16, 16, 64, torch.float16, 1.0, seed=1)
    with pytest.raises(TypeError, match="dtypes differ"):
        attention(q, k.bfloat16(), v)
    with pytest.raises(ValueError, match="head_dim 96"):
        z = torch.randn(1, 2, 16, 96, device="cuda", dtype=torch.float16)
        attention(z, z, z)
    with pytest.raises(ValueError, match="empty"):
        e = torch.empty(1, 2, 0, 64, device="cuda", dtype=torch.float16)
        attention(e, k, v)
    with pytest.raises(ValueError, match="on cpu"):
        attention(q.cpu(), k, v)
    assert math.isfinite(attention(q, k, v).float().sum().item())
