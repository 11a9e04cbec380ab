"""GPU tests of flashcore's attention backward (``flashcore.ops.backward``) against autograd of a
float64 reference computed on the GPU, with torch SDPA's own backward error (same dtype) as
the yardstick.

Skipped without CUDA. Build the kernels first: ``python -m tests.gpu_specs --arch sm_89 --only
backward --out DIR`` (see tests/gpu_specs.py).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from flashcore import reference
from flashcore.errors import SpecError
from flashcore.ops.backward import attention_backward
from flashcore.specs import BackwardSpec
from flashcore.specs.backward import (
    HOPPER_BWD_HEAD_DIMS,
    HOPPER_BWD_TILES,
    default_warps_m,
    parse_backward_choices,
)
from tests.gpu_specs import (
    BACKWARD_TEST_CONFIGS,
    BACKWARD_VARIANTS,
    HEAD_DIM_VARLEN_LENGTHS,
    HOPPER_BWD_CONFIGS,
)
from tests.gpu_utils import current_arch, max_abs, poison_, requires_cuda, visible_keys

pytestmark = [pytest.mark.gpu, requires_cuda]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _inputs(b, hq, hkv, sq, sk, d, dtype, seed, magnitude=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(h, s):
        return (torch.randn(b, h, s, d, device="cuda", generator=g) * magnitude).to(dtype)

    return mk(hq, sq), mk(hkv, sk), mk(hkv, sk), mk(hq, sq)


def _reference(q, k, v, causal, scale, masks=None):
    """float64 out and lse of ``flashcore.reference.attention`` (differentiable); ``masks``:
    its mask_align / window / softcap arguments."""
    return reference.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True,
                               device=q.device, **(masks or {}))


def _reference_grads(q, k, v, dout, causal, scale, masks=None):
    """(out, lse, dq, dk, dv): float64 on q's device, by autograd."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = _reference(q64, k64, v64, causal, scale, masks)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def _math_grads(q, k, v, dout, causal, scale, masks):
    """Gradients of torch's attention arithmetic in the inputs' dtype (SDPA's math backend's,
    which takes no soft-cap) with the same masks: the yardstick where SDPA has no such mask.
    Rows that see no key give 0, as the kernels and the reference."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(g, dim=1) for t in (k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ kk.transpose(-1, -2)) * scale
    cap = masks.get("softcap")
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    ok = visible_keys(q.shape[2], k.shape[2], causal, masks.get("mask_align", "top_left"),
                      masks.get("window"), q.device)
    p = torch.softmax(s.masked_fill(~ok, -math.inf), -1).masked_fill(~ok, 0.0)
    (p @ vv).backward(dout)
    return q.grad, k.grad, v.grad


def _sdpa_grads(q, k, v, dout, causal, scale):
    """torch SDPA's gradients in the inputs' dtype: the error our bound is relative to. Its
    fused backends overflow on a negative scale: there it gets -q with |scale| (the same
    logits), and dq is negated back."""
    sign = -1.0 if scale is not None and scale < 0 else 1.0
    q, k, v = (t.detach().clone().requires_grad_() for t in (q * sign, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=None if scale is None else abs(scale),
        enable_gqa=k.shape[1] != q.shape[1])
    out.backward(dout)
    return q.grad * sign, k.grad, v.grad


def _allowed(err_sdpa: float, ref: torch.Tensor, dtype) -> float:
    """2x SDPA's error plus two ulps of the largest gradient (the last rounding to the dtype,
    and P and dS rounded to it before their products, which SDPA's math path keeps finer) and
    an absolute 1e-4."""
    return 2 * err_sdpa + 2 * torch.finfo(dtype).eps * ref.abs().max().item() + 1e-4


def _skip_unless_builds(d, dtype, config, causal, warps_m=()):
    try:
        BackwardSpec(arch=current_arch(), dtype=dtype, head_dim=d, config=config, causal=causal,
                     warps_m=warps_m)
    except SpecError as e:
        pytest.skip(f"does not fit {current_arch()}: {e}")


def _masks(causal, align, window, softcap) -> dict:
    """The mask arguments of one drawn call (a causal window's right side is 0 or -1)."""
    masks = {}
    if align != "top_left":
        masks["mask_align"] = align
    if window is not None:
        masks["window"] = (window[0], min(window[1], 0)) if causal else window
    if softcap is not None:
        masks["softcap"] = softcap
    return masks


def _check(b, hq, hkv, sq, sk, d, dtype, causal, scale, seed, config=None, magnitude=1.0,
           masks=None, warps_m=None, deterministic=False):
    """The three gradients against float64 within SDPA's error; returns them and the call."""
    dt = DTYPES[dtype]
    masks = masks or {}
    q, k, v, dout = _inputs(b, hq, hkv, sq, sk, d, dt, seed, magnitude)
    out, lse, *ref = _reference_grads(q, k, v, dout, causal, scale, masks)
    grads = [poison_(torch.empty_like(q)), poison_(torch.empty_like(k)),
             poison_(torch.empty_like(v))]
    def call(dq, dk, dv):
        return attention_backward(dout, q, k, v, out.to(dt), lse.float(), causal, scale,
                                  config=config, warps_m=warps_m, dq=dq, dk=dk, dv=dv,
                                  deterministic=deterministic, **masks)

    call(*grads)
    torch.cuda.synchronize()
    if masks:
        sdpa = _math_grads(q, k, v, dout, causal, scale, masks)
    else:
        sdpa = _sdpa_grads(q, k, v, dout, causal, scale)
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, ref, sdpa):
        assert got.shape == want.shape and got.dtype == dt, name
        assert torch.isfinite(got).all(), f"{name}: NaN/Inf or unwritten elements"
        err, err_sdpa = max_abs(got, want), max_abs(base, want)
        allowed = _allowed(err_sdpa, want, dt)
        assert err <= allowed, (f"{name}: max err {err:.3g} vs SDPA's {err_sdpa:.3g} "
                                f"(allowed {allowed:.3g})")
    return grads, call


@settings(settings.get_profile("gpu"))
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 3),
    ratio=st.sampled_from([1, 2, 4]),
    sq=st.integers(1, 300),
    sk=st.integers(1, 300),
    d=st.sampled_from([64, 128]),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    causal=st.booleans(),
    scale=st.one_of(st.none(), st.floats(0.02, 1.0)),
    align=st.sampled_from(["top_left", "bottom_right"]),
    window=st.one_of(st.none(), st.tuples(st.integers(-1, 300), st.integers(-1, 300))),
    softcap=st.one_of(st.none(), st.floats(1.0, 50.0)),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, hkv=2, ratio=1, sq=128, sk=128, d=64, dtype="float16", causal=False, scale=None,
         align="top_left", window=None, softcap=None, seed=1)
@example(b=2, hkv=1, ratio=4, sq=1, sk=1, d=128, dtype="bfloat16", causal=True, scale=None,
         align="top_left", window=None, softcap=None, seed=2)
@example(b=1, hkv=2, ratio=2, sq=200, sk=77, d=64, dtype="float16", causal=True, scale=0.3,
         align="top_left", window=None, softcap=None, seed=3)
@example(b=1, hkv=1, ratio=1, sq=77, sk=299, d=128, dtype="bfloat16", causal=True, scale=None,
         align="top_left", window=None, softcap=None, seed=4)
@example(b=1, hkv=2, ratio=2, sq=77, sk=299, d=64, dtype="float16", causal=True, scale=None,
         align="bottom_right", window=(40, 0), softcap=20.0, seed=5)  # chunked prefill
@example(b=1, hkv=1, ratio=1, sq=300, sk=200, d=128, dtype="bfloat16", causal=False,
         scale=None, align="bottom_right", window=(3, 17), softcap=None, seed=6)
def test_gradients_match_reference_within_sdpa_error(b, hkv, ratio, sq, sk, d, dtype, causal,
                                                     scale, align, window, softcap, seed):
    """Random shapes, GQA, scales and masks (no mask: SDPA's error is the yardstick; a mask:
    torch's math in the dtype, ``_math_grads``)."""
    _check(b, hkv * ratio, hkv, sq, sk, d, dtype, causal, scale, seed,
           masks=_masks(causal, align, window, softcap))


@settings(settings.get_profile("gpu"))
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 3),
    ratio=st.sampled_from([1, 2, 4]),
    sq=st.integers(1, 400),
    sk=st.integers(1, 400),
    d=st.sampled_from(HOPPER_BWD_HEAD_DIMS),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    causal=st.booleans(),
    align=st.sampled_from(["top_left", "bottom_right"]),
    window=st.one_of(st.none(), st.tuples(st.integers(-1, 300), st.integers(-1, 300))),
    softcap=st.one_of(st.none(), st.floats(1.0, 50.0)),
    config=st.sampled_from(HOPPER_BWD_CONFIGS),
    deterministic=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, hkv=2, ratio=2, sq=333, sk=190, d=128, dtype="float16", causal=True,
         align="top_left", window=None, softcap=None, config=HOPPER_BWD_CONFIGS[0],
         deterministic=False, seed=1)
@example(b=2, hkv=1, ratio=4, sq=190, sk=333, d=64, dtype="bfloat16", causal=False,
         align="top_left", window=None, softcap=None, config=HOPPER_BWD_CONFIGS[0],
         deterministic=True, seed=2)
@example(b=1, hkv=2, ratio=2, sq=333, sk=190, d=64, dtype="float16", causal=True,
         align="top_left", window=None, softcap=None, config=HOPPER_BWD_CONFIGS[1],
         deterministic=False, seed=7)  # d64's 128-row blocks: ragged on both sides
@example(b=2, hkv=1, ratio=3, sq=129, sk=257, d=64, dtype="bfloat16", causal=True,
         align="bottom_right", window=(50, 0), softcap=15.0, config=HOPPER_BWD_CONFIGS[1],
         deterministic=True, seed=8)
@example(b=1, hkv=1, ratio=2, sq=77, sk=299, d=128, dtype="bfloat16", causal=True,
         align="bottom_right", window=(40, 0), softcap=20.0, config=HOPPER_BWD_CONFIGS[0],
         deterministic=False, seed=3)
@example(b=2, hkv=3, ratio=1, sq=206, sk=79, d=96, dtype="float16", causal=True,
         align="top_left", window=None, softcap=None, config=HOPPER_BWD_CONFIGS[0],
         deterministic=True, seed=3217)  # d96 rows copied whole (three 32-wide lines)
@example(b=2, hkv=1, ratio=3, sq=333, sk=190, d=96, dtype="bfloat16", causal=False,
         align="top_left", window=None, softcap=None, config=HOPPER_BWD_CONFIGS[0],
         deterministic=False, seed=9)  # d96 warp-specialised: dQ by the first warpgroup alone
@example(b=1, hkv=2, ratio=2, sq=77, sk=299, d=96, dtype="float16", causal=True,
         align="bottom_right", window=(40, 0), softcap=20.0, config=HOPPER_BWD_CONFIGS[0],
         deterministic=False, seed=10)
def test_hopper_backward_matches_reference(b, hkv, ratio, sq, sk, d, dtype, causal, align,
                                           window, softcap, config, deterministic, seed):
    """The Hopper backward (``kernels/wgmma_bwd``: warpgroup MMAs, Sᵀ by keys in rows): random
    shapes over ragged key and query blocks, GQA, every mask, dQ's adds free or in turns; a
    deterministic call repeats bit for bit."""
    if current_arch() != "sm_90":
        pytest.skip("the Hopper backward runs on sm_90")
    assume(config.tile in HOPPER_BWD_TILES[d])
    grads, call = _check(b, hkv * ratio, hkv, sq, sk, d, dtype, causal, None, seed,
                         config=config, masks=_masks(causal, align, window, softcap),
                         deterministic=deterministic)
    if deterministic:
        again = [torch.empty_like(g) for g in grads]
        call(*again)
        assert all(torch.equal(x, y) for x, y in zip(grads, again))


@pytest.mark.parametrize("masks", [
    {"mask_align": "bottom_right"}, {"window": (64, 0)}, {"window": (0, 0)},
    {"mask_align": "bottom_right", "window": (100, 0), "softcap": 10.0},
    {"softcap": 2.0}, {"window": (30, 90), "causal": False},
    {"mask_align": "bottom_right", "window": (-1, 5), "causal": False},
], ids=str)
@pytest.mark.parametrize("sq,sk", [(333, 190), (190, 333), (1, 257)])
@pytest.mark.parametrize("d", [64, 128])
def test_masks(masks, sq, sk, d):
    """Each mask over ragged blocks, more queries than keys and fewer (bottom-right: rows above
    the shifted diagonal see nothing), a one-token decode row; GQA 4/2."""
    masks = dict(masks)
    causal = masks.pop("causal", True)
    _check(1, 4, 2, sq, sk, d, "float16", causal, None, seed=sq + sk + d, masks=masks)


@pytest.mark.parametrize("config", BACKWARD_TEST_CONFIGS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", [(333, 190), (190, 333), (64, 64)])
def test_tiles(config, causal, d, sq, sk):
    """Each explicit tile: ragged query and key blocks, more queries than keys and fewer, the
    causal diagonal across blocks; GQA 6/2."""
    _skip_unless_builds(d, "bfloat16", config, causal, default_warps_m(d, config))
    _check(2, 6, 2, sq, sk, d, "bfloat16", causal, None, seed=sq * 7 + sk, config=config)


@pytest.mark.parametrize("variant", BACKWARD_VARIANTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_benchmark_variants(variant, causal, d, dtype):
    """The benchmark's variants of the main kernel (warp layouts, stages, tiles): ragged
    blocks, a long query walk (the two stages alternate), GQA 4/2."""
    choice = parse_backward_choices(variant).get(d)
    if choice is None:
        pytest.skip(f"the variant has no d{d} choice")
    config, warps_m = choice
    _skip_unless_builds(d, dtype, config, causal,
                        default_warps_m(d, config) if warps_m is None else warps_m)
    _check(1, 4, 2, 700, 333, d, dtype, causal, None, seed=d + causal, config=config,
           warps_m=warps_m)


@pytest.mark.parametrize("scale", [-0.5, 0.01, 2.0])
def test_any_scale(scale):
    """A negative scale runs as -q with |scale| (dq negated back); small and large ones."""
    _check(1, 4, 4, 150, 90, 64, "float16", True, scale, seed=7)


def test_large_logits():
    """|x| ~ 10: logits in the hundreds, P far from uniform."""
    _check(1, 2, 1, 130, 260, 128, "float16", False, None, seed=8, magnitude=3.0)


def test_rows_that_see_no_key_give_zero_gradient():
    """A row whose LSE is -inf (it saw no key: its output is 0) gives dq = 0 and adds nothing
    to dk and dv, never NaN: as if its output gradient were 0."""
    q, k, v, dout = _inputs(1, 4, 2, 97, 150, 64, torch.float16, seed=9)
    dead = torch.tensor([0, 5, 63, 64, 96], device="cuda")
    out, lse, *_ = _reference_grads(q, k, v, dout, False, None)
    out[:, :, dead] = 0
    lse[:, :, dead] = -math.inf
    dq, dk, dv = attention_backward(dout, q, k, v, out.half(), lse.float())
    quiet = dout.clone()
    quiet[:, :, dead] = 0
    _, _, ref_dq, ref_dk, ref_dv = _reference_grads(q, k, v, quiet, False, None)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert (dq[:, :, dead] == 0).all()
    for got, want in ((dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        assert max_abs(got, want) <= 1e-2 * max(1.0, want.abs().max().item())


def test_keys_no_query_sees_get_zero_gradient():
    """Causal with S_k > S_q: the key blocks past the last query are seen by no row (their
    CTAs walk no query block) and get dk = dv = 0, written (the buffers are poisoned)."""
    _check(1, 2, 2, 40, 300, 64, "float16", True, None, seed=10)


def test_lse_gradient():
    """With the LSE used in the loss too, its gradient joins dS (dS = P ∘ (dP − D + dlse))."""
    q, k, v, dout = _inputs(1, 2, 2, 70, 90, 64, torch.float16, seed=11)
    dlse = torch.randn(1, 2, 70, device="cuda", dtype=torch.float32)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = _reference(q64, k64, v64, False, None)
    (out * dout.double()).sum().add((lse * dlse.double()).sum()).backward()
    dq, dk, dv = attention_backward(dout, q, k, v, out.detach().half(), lse.detach().float(),
                                    dlse=dlse)
    for got, want in ((dq, q64.grad), (dk, k64.grad), (dv, v64.grad)):
        assert max_abs(got, want) <= 1e-2 * max(1.0, want.abs().max().item())


@settings(settings.get_profile("gpu"))
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    ratio=st.sampled_from([1, 3]),
    sq=st.integers(1, 700),
    sk=st.integers(1, 700),
    d=st.sampled_from([64, 128]),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    causal=st.booleans(),
    align=st.sampled_from(["top_left", "bottom_right"]),
    window=st.one_of(st.none(), st.tuples(st.integers(-1, 400), st.integers(-1, 400))),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=2, hkv=2, ratio=3, sq=700, sk=650, d=128, dtype="bfloat16", causal=True,
         align="bottom_right", window=(300, 0), seed=0)
def test_deterministic_gradients_are_right_and_repeat_bit_for_bit(b, hkv, ratio, sq, sk, d,
                                                                  dtype, causal, align, window,
                                                                  seed):
    """``deterministic=True``: the gradients are as right as the default's, and three more runs
    give the same bits (dQ's adds take turns per query block in key-block order; a wrong turn
    would hang or differ)."""
    if causal and window is not None:
        window = (window[0], 0)
    masks = {"mask_align": align, "window": window}
    if not causal and window is None and align == "bottom_right":
        masks = {}
    first, call = _check(b, hkv * ratio, hkv, sq, sk, d, dtype, causal, None, seed,
                         masks=masks, deterministic=True)
    for _ in range(3):
        again = [poison_(torch.empty_like(t)) for t in first]
        call(*again)
        for name, a, g in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, g), f"{name} differs between deterministic runs"


def test_deterministic_through_autograd_and_torchs_flag():
    """``attention(..., deterministic=True)`` and torch's deterministic mode reach the kernel:
    the same gradient bits every run, on a shape whose query blocks get 16 key blocks' adds."""
    from flashcore.ops import attention

    q, k, v, dout = _inputs(2, 8, 2, 2048, 2048, 128, torch.bfloat16, seed=21)

    def grads(**kw):
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        attention(*x, causal=True, **kw).backward(dout)
        return [t.grad for t in x]

    a = grads(deterministic=True)
    for _ in range(3):
        assert all(torch.equal(x, y) for x, y in zip(a, grads(deterministic=True)))
    torch.use_deterministic_algorithms(True)
    try:
        b = grads()
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    _, _, *ref = _reference_grads(q, k, v, dout, True, None)
    for got, want in zip(a, ref):
        assert max_abs(got, want) <= 1e-2 * max(1.0, want.abs().max().item())


def test_dk_dv_deterministic():
    """dk and dv sum a K/V head's query heads inside one CTA: bitwise the same every run (dq
    adds fp32 atomics in whatever order the CTAs reach them)."""
    q, k, v, dout = _inputs(2, 8, 2, 257, 131, 128, torch.bfloat16, seed=12)
    out, lse, *_ = _reference_grads(q, k, v, dout, True, None)
    a = attention_backward(dout, q, k, v, out.bfloat16(), lse.float(), True)
    b = attention_backward(dout, q, k, v, out.bfloat16(), lse.float(), True)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert max_abs(a[0], b[0]) <= 1e-2


def test_empty_and_strided_inputs():
    q, k, v, dout = _inputs(1, 2, 2, 0, 10, 64, torch.float16, seed=13)
    lse = torch.empty(1, 2, 0, device="cuda")
    dq, dk, dv = attention_backward(dout, q, k, v, dout, lse)
    assert dq.shape == q.shape and (dk == 0).all() and (dv == 0).all()
    # (batch, seq, heads, dim) storage viewed as (batch, heads, seq, dim)
    base = [torch.randn(1, 120, 2, 64, device="cuda", dtype=torch.float16) for _ in range(4)]
    q, k, v, dout = (t.transpose(1, 2) for t in base)
    out, lse, *ref = _reference_grads(q, k, v, dout, True, None)
    got = attention_backward(dout, q, k, v, out.half(), lse.float(), True)
    for g, want in zip(got, ref):
        assert max_abs(g, want) <= 1e-2 * max(1.0, want.abs().max().item())
    # K and V broadcast over the batch (an expand, stride 0: copied for the TMA copies of the
    # Hopper backward); dK and dV are each batch entry's own
    q, _, _, dout = _inputs(2, 2, 2, 96, 96, 64, torch.float16, seed=14)
    k, v = (torch.randn(1, 2, 96, 64, device="cuda", dtype=torch.float16).expand(2, 2, 96, 64)
            for _ in range(2))
    out, lse, *ref = _reference_grads(q, k, v, dout, False, None)
    got = attention_backward(dout, q, k, v, out.half(), lse.float(), False)
    for g, want in zip(got, ref):
        assert max_abs(g, want) <= 1e-2 * max(1.0, want.abs().max().item())


def test_masked_call_through_autograd():
    """``attention(..., mask_align, window, softcap)`` is differentiable: its masks reach the
    backward through the registered op."""
    from flashcore.ops import attention

    masks = {"mask_align": "bottom_right", "window": (60, 0), "softcap": 15.0}
    q, k, v, dout = _inputs(1, 4, 2, 100, 140, 64, torch.float16, seed=15)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attention(q, k, v, causal=True, **masks).backward(dout)
    _, _, *ref = _reference_grads(q, k, v, dout, True, None, masks)
    base = _math_grads(q, k, v, dout, True, None, masks)
    for got, want, b in zip((q.grad, k.grad, v.grad), ref, base):
        assert max_abs(got, want) <= _allowed(max_abs(b, want), want, torch.float16)


def test_through_autograd():
    """``flashcore.ops.attention`` under autograd (once the ops are wired to the backward)."""
    from flashcore.ops import attention

    q, k, v, dout = _inputs(1, 4, 2, 100, 140, 64, torch.float16, seed=14)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    try:
        out = attention(q, k, v, causal=True)
        out.backward(dout)
    except RuntimeError as e:
        if "no backward" in str(e):
            pytest.skip("torch.ops.flashcore.attention is not wired to the backward yet")
        raise
    _, _, *ref = _reference_grads(q, k, v, dout, True, None)
    sdpa = _sdpa_grads(q, k, v, dout, True, None)
    for got, want, base in zip((q.grad, k.grad, v.grad), ref, sdpa):
        assert max_abs(got, want) <= _allowed(max_abs(base, want), want, torch.float16)


class _Block(torch.nn.Module):
    """A pre-norm transformer block with grouped-query causal attention (``attend`` runs it)."""

    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, x, attend):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        a = attend(q.bfloat16(), k.bfloat16(), v.bfloat16()).float()
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


def _train(attend, steps: int, seed: int = 0, device: str = "cuda") -> list[float]:
    """Losses of a small GQA language model trained from ``seed`` on a synthetic task that
    needs attention (each sequence repeats a random pattern of ``period`` tokens: a token is
    the one ``period`` places back), attention through ``attend``."""
    torch.manual_seed(seed)
    vocab, dim, seq, batch, period = 97, 512, 256, 8, 7
    emb, pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(seq, dim)
    blocks = torch.nn.ModuleList(_Block(dim, 8, 2) for _ in range(2))
    head = torch.nn.Linear(dim, vocab)
    model = torch.nn.ModuleList([emb, pos, blocks, head]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device=device).manual_seed(seed)
    losses = []
    for _ in range(steps):
        pattern = torch.randint(0, vocab, (batch, period), device=device, generator=g)
        ids = pattern.repeat(1, -(-(seq + 1) // period))[:, :seq + 1]
        x = emb(ids[:, :-1]) + pos.weight
        for block in blocks:
            x = block(x, attend)
        loss = torch.nn.functional.cross_entropy(head(x).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_training_loop_matches_sdpa():
    """A small GQA transformer (8 query heads of 64 over 2 K/V heads) trained 300 steps with
    flashcore's attention and with SDPA from the same seed: both learn the task (the loss falls below a tenth of its start), and their
    losses stay within 2% (mean of the last 20 steps) of each other: the backward trains as
    SDPA's does, not just differentiates. (On a CPU, SDPA's attention in bfloat16 and in float16
    end 0.1% apart.)"""
    from flashcore.ops import attention

    ours = _train(lambda q, k, v: attention(q, k, v, causal=True), 300)
    theirs = _train(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True), 300)
    tail_ours, tail_theirs = (sum(x[-20:]) / 20 for x in (ours, theirs))
    assert all(math.isfinite(x) for x in ours)
    assert tail_theirs < 0.1 * theirs[0] and tail_ours < 0.1 * ours[0], (ours[::30], theirs[::30])
    assert abs(tail_ours - tail_theirs) <= 0.02 * max(tail_theirs, 0.05), (tail_ours, tail_theirs)


@settings(settings.get_profile("gpu"))
@given(
    lengths=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), min_size=1,
                     max_size=4),
    hkv=st.integers(1, 2),
    ratio=st.sampled_from([1, 4]),
    d=st.sampled_from([64, 128]),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.tuples(st.integers(-1, 200), st.integers(-1, 200))),
    softcap=st.one_of(st.none(), st.floats(2.0, 50.0)),
    seed=st.integers(0, 2**31 - 1),
)
@example(lengths=[(77, 145), (0, 30), (130, 130), (1, 0)], hkv=2, ratio=4, d=128,
         dtype="bfloat16", causal=True, window=None, softcap=None, seed=0)
def test_varlen_gradients_match_each_sequences_reference(lengths, hkv, ratio, d, dtype, causal,
                                                         window, softcap, seed):
    """``attention_varlen`` through autograd: each sequence's dq, dk, dv against autograd of
    its own float64 reference (FlashAttention's bottom-right masks), within 2x the error of
    torch's arithmetic in the dtype; rows of k in no sequence get 0, nothing is NaN."""
    _check_varlen(lengths, hkv, ratio, d, dtype, causal, window, softcap, seed)


def _check_varlen(lengths, hkv, ratio, d, dtype, causal, window, softcap, seed,
                  deterministic=False):
    """One packed call's gradients, sequence by sequence, against float64 (above); with
    ``deterministic``, a second run gives the same bits."""
    from flashcore.ops import attention_varlen

    if causal and window is not None:
        window = (window[0], 0)
    masks = {"mask_align": "bottom_right", "window": window, "softcap": softcap}
    if not causal and window is None:
        masks["mask_align"] = "top_left"
    dt = DTYPES[dtype]
    hq = hkv * ratio
    g = torch.Generator(device="cuda").manual_seed(seed)
    sq = [a for a, _ in lengths]
    sk = [b for _, b in lengths]
    cu_q = torch.tensor([0] + list(itertools.accumulate(sq)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(itertools.accumulate(sk)), dtype=torch.int32, device="cuda")
    tq, tk = sum(sq), sum(sk) + 5  # five rows of k and v in no sequence

    def mk(rows, h):
        return torch.randn(rows, h, d, device="cuda", generator=g).to(dt)

    q, k, v, dout = mk(tq, hq), mk(tk, hkv), mk(tk, hkv), mk(tq, hq)

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention_varlen(*leaves, cu_q, cu_k, max(sq), max(sk), causal,
                               deterministic=deterministic, **masks)
        out.backward(dout)
        return [t.grad for t in leaves]

    got = run()
    if deterministic:
        assert all(torch.equal(x, y) for x, y in zip(got, run()))
    for t in got:
        assert torch.isfinite(t).all()
    assert (got[1][sum(sk):] == 0).all() and (got[2][sum(sk):] == 0).all()
    for b in range(len(lengths)):
        qs = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ks = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if qs.stop == qs.start or ks.stop == ks.start:
            if ks.stop > ks.start:
                assert (got[1][ks] == 0).all() and (got[2][ks] == 0).all()
            continue

        def seq(t, s):
            return t[s].transpose(0, 1)[None]

        sq_, sk_, sv_, sdo = seq(q, qs), seq(k, ks), seq(v, ks), seq(dout, qs)
        _, _, *ref = _reference_grads(sq_, sk_, sv_, sdo, causal, None, masks)
        base = _math_grads(sq_, sk_, sv_, sdo, causal, None, masks)
        for name, full, s, want, yard in zip(("dq", "dk", "dv"), got, (qs, ks, ks), ref, base):
            mine = full[s].transpose(0, 1)[None]
            err, err_math = max_abs(mine, want), max_abs(yard, want)
            allowed = _allowed(err_math, want, dt)
            assert err <= allowed, (f"sequence {b} {name}: max err {err:.3g} vs torch's "
                                    f"{err_math:.3g} (allowed {allowed:.3g})")


def test_varlen_deterministic_repeats_bit_for_bit():
    """A packed batch's ``deterministic=True`` gradients: the same bits every run, and the
    default's values (sequences of several key blocks, GQA, bottom-right causal)."""
    from flashcore.ops import attention_varlen

    lengths = [(700, 650), (0, 40), (333, 900), (129, 1)]
    cu_q = torch.tensor([0, *itertools.accumulate(a for a, _ in lengths)], dtype=torch.int32,
                        device="cuda")
    cu_k = torch.tensor([0, *itertools.accumulate(b for _, b in lengths)], dtype=torch.int32,
                        device="cuda")
    g = torch.Generator(device="cuda").manual_seed(31)
    q = torch.randn(int(cu_q[-1]), 8, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(int(cu_k[-1]), 2, 128, device="cuda", generator=g).bfloat16()
    v = torch.randn(int(cu_k[-1]), 2, 128, device="cuda", generator=g).bfloat16()
    dout = torch.randn_like(q)

    def grads(deterministic):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        attention_varlen(*x, cu_q, cu_k, 700, 900, True, mask_align="bottom_right",
                         deterministic=deterministic).backward(dout)
        return [t.grad for t in x]

    a = grads(True)
    for _ in range(3):
        assert all(torch.equal(x, y) for x, y in zip(a, grads(True)))
    for x, y in zip(a, grads(False)):
        assert max_abs(x, y) <= 2e-2 * max(1.0, y.abs().max().item())


@pytest.mark.parametrize("d", [32, 80, 96, 256])
@pytest.mark.parametrize("case", ["plain", "causal", "masks"])
def test_head_dims_beyond_64_and_128(d, case):
    """The other head dims the forward builds (their own tiles, swizzle lines and copy passes,
    ``specs.backward.default_backward_config``): ragged blocks, more queries than keys and
    fewer, GQA 6/2, and the masks together (bottom-right causal window with a soft-cap)."""
    if case == "plain":
        _check(2, 6, 2, 333, 190, d, "float16", False, None, seed=d)
    elif case == "causal":
        _check(2, 6, 2, 190, 333, d, "bfloat16", True, None, seed=d + 1)
    else:
        _check(1, 6, 2, 77, 299, d, "float16", True, 0.2, seed=d + 2,
               masks={"mask_align": "bottom_right", "window": (100, 0), "softcap": 10.0})


@pytest.mark.parametrize("d", [32, 80, 96, 256])
def test_head_dims_packed_and_deterministic(d):
    """A packed batch at the other head dims (an empty sequence, one longer than its keys),
    deterministic: right per sequence and the same bits twice."""
    _check_varlen(HEAD_DIM_VARLEN_LENGTHS, 2, 3, d, "bfloat16", True, None, None,
                  seed=d, deterministic=True)
