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
from flashcore.errors import SpecError
from flashcore.ops import attention, attention_varlen
from tests.gpu_utils import (
    SPLIT_CONFIGS,
    STAGE_CONFIGS,
    allowed_error,
    attention_shapes,
    current_arch,
    max_abs,
    requires_cuda,
    sdpa,
    skip_unless_fits,
)

pytestmark = [pytest.mark.gpu, requires_cuda]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _inputs(b, h, sq, sk, d, dtype, magnitude, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda s: (torch.randn(b, h, s, d, device="cuda", generator=g) * magnitude).to(dtype)
    return mk(sq), mk(sk), mk(sk)


def _check_against_sdpa(q, k, v, causal, scale, tile=(64, 64)):
    ref = reference.attention(q, k, v, causal=causal, softmax_scale=scale, device=q.device)
    out = torch.full_like(q, float("nan"))  # poisoned: an unwritten element fails isfinite
    attention(q, k, v, tile=tile, causal=causal, softmax_scale=scale, out=out)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "NaN/Inf in the output"
    err = max_abs(out, ref)
    err_sdpa = max_abs(sdpa(q, k, v, causal, scale), ref)
    allowed = allowed_error(err_sdpa, ref, q.dtype, q, k, v, scale)
    assert err <= allowed, f"max err {err:.3g} vs SDPA's {err_sdpa:.3g} (allowed {allowed:.3g})"
    rel = (out.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    return err, err_sdpa, rel.item()


@settings(settings.get_profile("gpu"))
@given(
    **attention_shapes(2048),
    scale=st.one_of(st.none(), st.floats(0.01, 1.0), st.floats(-1.0, -0.01)),
    log_mag=st.floats(-3, 2),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, h=8, sq=512, sk=512, d=64, dtype="float16", causal=False, scale=None, log_mag=0, seed=1)
@example(b=2, h=3, sq=1, sk=1, d=128, dtype="bfloat16", causal=True, scale=None, log_mag=0, seed=2)
@example(b=1, h=2, sq=200, sk=77, d=64, dtype="float16", causal=True, scale=0.3, log_mag=1, seed=3)
@example(b=2, h=4, sq=300, sk=300, d=128, dtype="float16", causal=False, scale=-0.5, log_mag=0,
         seed=4)  # a negative scale: runs as -q (p overflowed fp16 before)
@example(b=1, h=3, sq=333, sk=701, d=96, dtype="bfloat16", causal=True, scale=None, log_mag=0,
         seed=5)  # three 64-byte swizzle lines a row
@example(b=2, h=2, sq=257, sk=190, d=256, dtype="float16", causal=False, scale=None, log_mag=1,
         seed=6)  # 128 output registers a thread
@example(b=1, h=4, sq=100, sk=1000, d=32, dtype="float16", causal=True, scale=None, log_mag=0,
         seed=7)  # rows of 64 bytes
@example(b=1, h=2, sq=130, sk=77, d=80, dtype="bfloat16", causal=False, scale=None, log_mag=0,
         seed=8)  # five 32-byte lines
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
    skip_unless_fits(d, tile=tile)
    q, k, v = _inputs(2, 3, 333, 190, d, torch.float16, 1.0, seed=hash((tile, causal, d)) % 2**31)
    ref = reference.attention(q, k, v, causal=causal, device=q.device)
    out = attention(q, k, v, tile=tile, causal=causal)
    err = max_abs(out, ref)
    err_sdpa = max_abs(sdpa(q, k, v, causal, None), ref)
    assert torch.isfinite(out).all()
    assert err <= allowed_error(err_sdpa, ref, q.dtype)


@pytest.mark.parametrize("sq", [600, 100])
@pytest.mark.parametrize("tile", [(64, 64), (32, 64)])
def test_causal_grid_sections_cover_every_tile(tile, sq):
    """2 batches x 9 heads: 18 (batch, head) pairs, two sections of 8 and one of 2
    (``kernels/common/tile_order.py``), ragged query tiles; the output is poisoned first. 600
    queries: 180 or 342 CTAs, more than an H100's or an L4's SMs (the sectioned order); 100:
    36 or 72 (one wave on an H100, the per-head order; on an L4's 58 SMs only the first)."""
    q, k, v = _inputs(2, 9, sq, sq - 45, 64, torch.float16, 1.0, seed=11)
    _check_against_sdpa(q, k, v, True, None, tile=tile)


def _check_with_lse(q, k, v, causal, **knobs):
    """Poisoned output and LSE of one kernel configuration against the float64 reference."""
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, device=q.device)
    out = torch.full_like(q, float("nan"))
    _, lse = attention(q, k, v, causal=causal, return_lse=True, out=out, **knobs)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "NaN or unwritten elements"
    err = max_abs(out, ref)
    err_sdpa = max_abs(sdpa(q, k, v, causal, None), ref)
    assert err <= allowed_error(err_sdpa, ref, q.dtype), f"max err {err:.3g} vs SDPA's {err_sdpa:.3g}"
    assert max_abs(lse, ref_lse) < 1e-3 * max(1.0, ref_lse.abs().max().item())


@pytest.mark.parametrize("config", SPLIT_CONFIGS, ids=lambda c: f"{c[0]}w{c[1]}k{c[2]}")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", [(333, 700), (700, 333), (77, 40), (512, 512), (1, 1)])
def test_kv_splits(config, causal, d, sq, sk):
    """Split-KV CTAs: ranges that divide unevenly, splits with no key block at all (sk=40),
    causal rows whose first blocks are masked."""
    tile, warps, splits = config
    skip_unless_fits(d, tile=tile, warps=warps, kv_splits=splits)
    q, k, v = _inputs(2, 3, sq, sk, d, torch.float16, 1.0, seed=hash((config, causal, d, sq)) % 2**31)
    _check_with_lse(q, k, v, causal, tile=tile, warps=warps, kv_splits=splits)


@pytest.mark.parametrize("config", STAGE_CONFIGS, ids=lambda c: f"{c[0]}w{c[1]}k{c[2]}s{c[3]}")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", [(333, 700), (700, 333), (77, 40), (1, 1)])
def test_stages(config, causal, d, sq, sk):
    """K/V blocks in flight several at a time: fewer blocks than stages (sk=40, 1), a ragged
    first block, causal tiles, and stages with key splits."""
    tile, warps, splits, stages = config
    skip_unless_fits(d, tile=tile, warps=warps, kv_splits=splits, stages=stages)
    q, k, v = _inputs(2, 3, sq, sk, d, torch.bfloat16, 1.0, seed=hash((config, causal, d, sq)) % 2**31)
    _check_with_lse(q, k, v, causal, tile=tile, warps=warps, kv_splits=splits, stages=stages)


def test_every_element_written_and_deterministic():
    q, k, v = _inputs(2, 4, 257, 131, 64, torch.bfloat16, 1.0, seed=11)
    a = torch.full_like(q, float("nan"))
    b = torch.full_like(q, float("nan"))
    attention(q, k, v, causal=True, out=a)
    attention(q, k, v, causal=True, out=b)
    assert torch.isfinite(a).all(), "unwritten (NaN-poisoned) elements"
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
    assert max_abs(out, ref) <= allowed_error(max_abs(sdpa(q, k, v, False, None), ref), ref, q.dtype)
    # a non-contiguous last dim is copied, not misread
    qt = torch.randn(2, 4, 64, 200, device="cuda", dtype=torch.float16).transpose(2, 3)
    out2 = attention(qt, k, v)
    ref2 = reference.attention(qt, k, v, device=q.device)
    assert max_abs(out2, ref2) <= allowed_error(max_abs(sdpa(qt, k, v, False, None), ref2), ref2,
                                           qt.dtype)


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


def test_chained_calls_wait_for_each_other():
    """Each call reads what the previous one wrote, or overwrites what it read. On Hopper they
    are launched with PDL (the next grid starts while the last drains), so a missing or late
    griddepcontrol.wait would show as a difference from the same chain run with syncs."""
    from flashcore.ops import launcher

    q, k, v = _inputs(4, 16, 1024, 1024, 64, torch.float16, 1.0, seed=21)

    def chain(sync: bool):
        x, kk = q, k.clone()
        outs = []
        for _ in range(4):
            x = attention(x, kk, v)  # reads the previous output
            outs.append(x)
            if sync:
                torch.cuda.synchronize()
        # overwrites kk, which the call before it (still draining) reads
        last = attention(x, kk, v)
        attention(q, k, v, out=kk)
        if sync:
            torch.cuda.synchronize()
        return outs + [last, kk]

    expected = chain(sync=True)
    for _ in range(3):
        got = chain(sync=False)
        torch.cuda.synchronize()
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
    ref = reference.attention(expected[0], k, v, device=q.device)
    assert max_abs(expected[1], ref) < 1e-2
    if current_arch() == "sm_90":  # the chain above ran with PDL
        used = [p.kern for p in launcher._plans.values() if p.kern.programmatic]
        assert used, "Hopper kernels were not launched with programmatic serialisation"


def test_copied_inputs_live_until_the_launch():
    """k and v with a strided last dim are copied before the launch; were a copy freed first, the
    caching allocator would hand its memory to the output (same size) while the kernel reads it."""
    for _ in range(3):
        q, k, v = _inputs(2, 4, 256, 256, 64, torch.float16, 1.0, seed=31)
        kt = k.transpose(2, 3).contiguous().transpose(2, 3)  # same values, last dim strided
        vt = v.transpose(2, 3).contiguous().transpose(2, 3)
        assert kt.stride(3) != 1
        out = attention(q, kt, vt)
        ref = reference.attention(q, k, v, device=q.device)
        assert max_abs(out, ref) <= allowed_error(max_abs(sdpa(q, k, v, False, None), ref), ref,
                                             q.dtype)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device():
    q, k, v = _inputs(1, 2, 100, 100, 64, torch.float16, 1.0, seed=9)
    q1, k1, v1 = q.to("cuda:1"), k.to("cuda:1"), v.to("cuda:1")
    out1 = attention(q1, k1, v1)
    assert out1.device == q1.device
    assert torch.equal(out1.cpu(), attention(q, k, v).cpu())
    # inputs (or out=) on two devices are refused by name, never launched on either
    with pytest.raises(ValueError, match="devices differ"):
        attention(q, k1, v1)
    with pytest.raises(ValueError, match="on cuda:1; expected"):
        attention(q, k, v, out=torch.empty_like(q1))
    cu = torch.tensor([0, 100], dtype=torch.int32, device="cuda:1")
    with pytest.raises(ValueError, match="cu_seqlens_q is on cuda:1, q on cuda:0"):
        attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu,
                         cu, 100, 100)


def test_bad_gpu_inputs_rejected():
    q, k, v = _inputs(1, 2, 16, 16, 64, torch.float16, 1.0, seed=1)
    with pytest.raises(TypeError, match="dtypes differ"):
        attention(q, k.bfloat16(), v.bfloat16())
    with pytest.raises(ValueError, match="head_dim 48"):
        z = torch.randn(1, 2, 16, 48, device="cuda", dtype=torch.float16)
        attention(z, z, z)
    with pytest.raises(ValueError, match="on cpu"):
        attention(q.cpu(), k, v)
    # kernel knobs: 0 is not "unset", it is an error (also with the tuned tile)
    with pytest.raises(SpecError, match="kv_splits=0"):
        attention(q, k, v, kv_splits=0)
    with pytest.raises(SpecError, match="stages=0"):
        attention(q, k, v, tile=None, stages=0)
    with pytest.raises(SpecError, match="over 512"):
        attention(q, k, v, tile=(128, 64), warps=8, kv_splits=4)
    with pytest.raises(ValueError, match="whole multiple of the key/value heads"):
        attention(q, k[:, :1].expand(1, 3, 16, 64), v[:, :1].expand(1, 3, 16, 64))
    with pytest.raises(ValueError, match="num_splits"):
        attention(q, k, v, num_splits=0)
    assert math.isfinite(attention(q, k, v).float().sum().item())


def test_forward_only_head_dims_refuse_what_they_lack():
    """d96 runs forward; inputs that require grad are refused naming the head dim (the backward
    builds 64 and 128), unless allow_no_grad; FP8 operands and an FP8 KV cache are refused."""
    q, k, v = _inputs(1, 2, 40, 40, 96, torch.float16, 1.0, seed=3)
    want = reference.attention(q, k, v, causal=True, device=q.device)
    g = [t.clone().requires_grad_() for t in (q, k, v)]
    with pytest.raises(RuntimeError, match="head_dim=96"):
        attention(*g, causal=True)
    out = attention(*g, causal=True, allow_no_grad=True)
    assert not out.requires_grad and max_abs(out, want) < 2e-2
    with pytest.raises(ValueError, match="precision='fp8' is built for head_dim"):
        attention(q, k, v, precision="fp8")
    k8, v8 = (t.to(torch.float8_e4m3fn) for t in (k, v))
    ones = torch.ones(1, 2, 40, device="cuda")
    with pytest.raises(ValueError, match="FP8 KV cache is built for head_dim"):
        attention(q, k8, v8, k_descale=ones, v_descale=ones)
