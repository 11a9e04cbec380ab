"""GPU tests of the Hopper family (``wgmma_ws``: warpgroup MMA, sm_90a) against the float64
reference, held to the mma_sync family's bound (``test_gpu_attention._allowed``: twice SDPA's
own error plus rounding terms). Ragged lengths (S_q != S_k, not multiples of the tile, 1), GQA,
causal (top-left), LSE; outputs poisoned first, NaN never passes. Skipped on GPUs other than
sm_90."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from flashcore import reference
from flashcore.errors import SpecError
from flashcore.ops import attention
from flashcore.ops.fp8 import attention_fp8, quantize_fp8
from flashcore.ops.masks import masking
from flashcore.specs import AttentionSpec
from tests.gpu_utils import (
    ROUNDED_SUMS_LSE_SLACK,
    WGMMA_CONFIGS,
    WGMMA_FP8_CONFIGS,
    WGMMA_FP8_MASK_CONFIGS,
    WGMMA_HEAD_DIM_CONFIGS,
    WGMMA_MASK_CONFIGS,
    WGMMA_TILE_N_CONFIGS,
    allowed_error,
    check_masked_result,
    current_arch,
    fp8_sums_rounded_p,
    masked_qkv,
    max_abs,
    requires_cuda,
    sdpa,
)

pytestmark = [pytest.mark.gpu, requires_cuda]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# two consumer warpgroups with 2- and 3-block rings, one consumer, three consumers, three
# taking turns (tests.gpu_utils)
CONFIGS = WGMMA_CONFIGS


@pytest.fixture(autouse=True)
def _hopper_only():
    if current_arch() != "sm_90":
        pytest.skip("the wgmma_ws family runs on sm_90 only")


def _check(b, hq, hkv, sq, sk, d, dt, causal, config, return_lse, seed, mag=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = ((torch.randn(b, h, s, d, device="cuda", generator=g) * mag).to(dt)
               for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    out = torch.full_like(q, float("nan"))
    res = attention(q, k, v, causal=causal, config=config, return_lse=return_lse, out=out)
    torch.cuda.synchronize()
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, device=q.device)
    assert torch.isfinite(out).all(), "NaN/Inf or unwritten elements in the output"
    err = max_abs(out, ref)
    kx, vx = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    err_sdpa = max_abs(sdpa(q, kx, vx, causal, None), ref)
    allowed = allowed_error(err_sdpa, ref, dt, q, k, v)
    assert err <= allowed, f"max err {err:.3g} vs SDPA's {err_sdpa:.3g} (allowed {allowed:.3g})"
    if return_lse:
        lse = res[1]
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), "-inf LSE exactly where no key"
        if finite.any():
            assert max_abs(lse[finite], ref_lse[finite]) < 1e-3 * max(1.0, ref_lse.abs().max())


@settings(settings.get_profile("gpu"))
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    sq=st.one_of(st.integers(1, 300), st.integers(1, 2000)),
    sk=st.one_of(st.integers(1, 300), st.integers(1, 3000)),
    d=st.sampled_from([64, 128]),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    causal=st.booleans(),
    config=st.sampled_from(CONFIGS),
    return_lse=st.booleans(),
    log_mag=st.floats(-2, 1),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, hkv=8, group=1, sq=512, sk=512, d=64, dtype="float16", causal=False,
         config=CONFIGS[0], return_lse=False, log_mag=0.0, seed=1)
@example(b=2, hkv=1, group=1, sq=1, sk=1, d=128, dtype="bfloat16", causal=True,
         config=CONFIGS[0], return_lse=True, log_mag=0.0, seed=2)
@example(b=1, hkv=2, group=4, sq=200, sk=77, d=128, dtype="float16", causal=True,
         config=CONFIGS[2], return_lse=True, log_mag=1.0, seed=3)  # rows with no key
@example(b=1, hkv=1, group=2, sq=1000, sk=1500, d=128, dtype="bfloat16", causal=False,
         config=CONFIGS[1], return_lse=False, log_mag=0.0, seed=4)
@example(b=2, hkv=2, group=2, sq=300, sk=1000, d=128, dtype="float16", causal=True,
         config=CONFIGS[0], return_lse=True, log_mag=0.0, seed=5)  # TMA, ragged keys
@example(b=1, hkv=1, group=1, sq=1, sk=1, d=64, dtype="bfloat16", causal=False,
         config=CONFIGS[2], return_lse=True, log_mag=0.0, seed=6)
@example(b=1, hkv=2, group=2, sq=500, sk=333, d=128, dtype="float16", causal=True,
         config=CONFIGS[3], return_lse=True, log_mag=0.0, seed=7)  # three consumers, ragged
@example(b=2, hkv=2, group=1, sq=700, sk=900, d=64, dtype="bfloat16", causal=False,
         config=CONFIGS[4], return_lse=True, log_mag=0.0, seed=8)  # three taking turns
@example(b=1, hkv=2, group=2, sq=777, sk=777, d=64, dtype="float16", causal=True,
         config=CONFIGS[4], return_lse=True, log_mag=0.0, seed=9)  # masked, then unmasked steps
@example(b=2, hkv=2, group=2, sq=500, sk=1000, d=128, dtype="bfloat16", causal=False,
         config=CONFIGS[4], return_lse=True, log_mag=0.0, seed=10)  # d128: P through shared
@example(b=1, hkv=3, group=1, sq=700, sk=555, d=128, dtype="float16", causal=True,
         config=CONFIGS[4], return_lse=True, log_mag=1.0, seed=11)
def test_wgmma_matches_the_reference(b, hkv, group, sq, sk, d, dtype, causal, config,
                                     return_lse, log_mag, seed):
    _check(b, hkv * group, hkv, sq, sk, d, DTYPES[dtype], causal, config, return_lse, seed,
           10.0**log_mag)


@pytest.mark.parametrize("sq", [1600, 333])
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[3], CONFIGS[-1]], ids=str)
def test_causal_grid_sections_cover_every_tile(config, sq):
    """2 batches x 9 heads: 18 (batch, head) pairs, two sections of 8 and one of 2
    (``kernels/common/tile_order.py``), ragged query tiles, GQA, LSE. 1600 queries: 162 or 234
    CTAs, more than the H100's 132 SMs (the sectioned order); 333: one wave (per head)."""
    _check(2, 9, 3, sq, sq + 67, 64, torch.float16, True, config, True, seed=12)


def test_wgmma_decode_runs_unsplit():
    """The family has no split-KV kernel: a decode call runs one CTA per tile, and asking for
    splits names the reason."""
    _check(2, 8, 2, 1, 5000, 128, torch.float16, False, CONFIGS[0], True, seed=5)
    q = torch.randn(1, 2, 1, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(SpecError, match="split_kv"):
        attention(q, q, q, config=CONFIGS[0], num_splits=2)


def test_fresh_buffers_of_one_shape_get_the_drivers_descriptors():
    """Each call on fresh tensors of one shape: after the driver's first two encodings the
    pointers are written into the geometry's descriptor (``runtime.tensor_map``): the same
    bytes the driver encodes, and the kernel reads the right tensors."""
    from flashcore.runtime import tensor_map

    tensor_map.clear()
    kept = []  # every call's tensors alive: fresh pointers each call
    for seed in range(5):
        g = torch.Generator(device="cuda").manual_seed(40 + seed)
        q, k, v = (torch.randn(1, h, s, 128, device="cuda", generator=g).to(torch.bfloat16)
                   for h, s in ((4, 300), (2, 333), (2, 333)))
        kept.append((q, k, v))
        out = attention(q, k, v, causal=True, config=CONFIGS[0])
        ref = reference.attention(q, k, v, causal=True, device=q.device)
        assert torch.isfinite(out).all() and max_abs(out, ref) < 2e-2, seed
    patched = [g for g, layout in tensor_map._layouts.items() if type(layout) is bytes]
    assert patched, "no geometry's descriptor was reused"
    for _ in range(3):
        t = torch.empty(1, 4, 333, 128, device="cuda", dtype=torch.bfloat16)
        kept.append(t)
        arg = (t.data_ptr(), *t.shape[:3], *t.stride()[:3])
        for box in (64, 128):
            tensor_map.encode(arg, "bfloat16", 128, box)  # the first two: the driver's
        for box in (64, 128):
            tensor_map._cache.clear()
            assert tensor_map.encode(arg, "bfloat16", 128, box) == tensor_map._encode(
                arg, "bfloat16", 128, box, 64, 128)


def launched(fn) -> tuple:
    """(what ``fn()`` returns, the kernel families it launched: the launcher's kernels,
    recorded on the way)."""
    from unittest import mock

    from flashcore.ops import launcher

    seen, real = [], launcher.launch

    def record(kern, grid, args, device):
        seen.append(kern.artifact.spec.family)
        return real(kern, grid, args, device)

    with mock.patch.object(launcher, "launch", side_effect=record):
        result = fn()
    return result, seen


def test_the_tuned_default_runs_masks_on_the_winner_and_falls_back_for_splits():
    """``tile=None`` runs the table's winner, masks included (a window, bottom-right causal, a
    soft-cap: the warp-specialised family builds them), the same kernel as naming that config,
    so the results are bitwise equal; explicit key splits, which it does not build, run the
    entry's fallback."""
    from flashcore.tuned import table

    tuned = table.entries("sm_90").get(table.key(128, True, "mid"))
    if tuned is None or tuned.fallback is None or tuned.config.family != "wgmma_ws":
        pytest.skip("the shipped sm_90 table has no wgmma_ws winner at d128 causal mid")
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(1, 4, 1500, 128, device="cuda", generator=g).half() for _ in range(3))
    plain = attention(q, k, v, causal=True)
    assert torch.equal(plain, attention(q, k, v, causal=True, config=tuned.config))
    for kwargs in ({"window": (300, 0)}, {"mask_align": "bottom_right"}, {"softcap": 30.0}):
        got, families = launched(lambda kw=kwargs: attention(q, k, v, causal=True, **kw))
        assert families == ["wgmma_ws"], kwargs
        want = attention(q, k, v, causal=True, config=tuned.config, **kwargs)
        assert torch.isfinite(got).all() and torch.equal(got, want), kwargs
    got = attention(q, k, v, causal=True, num_splits=2)
    want = attention(q, k, v, causal=True, config=tuned.fallback, num_splits=2)
    assert torch.isfinite(got).all() and torch.equal(got, want)


def _ws_masks(causal, align, window, softcap, config, d, dtype="float16", precision="fp16",
              k_scale="token"):
    """The call's masks as ``attention`` normalises them, after skipping (Hypothesis
    ``assume``) a combination the warp-specialised config does not build."""
    if causal and window is not None and window[1] > 0:
        window = (window[0], 0)
    mask = masking(causal, align, window, softcap)
    align_, windowed, capped, _ = mask.spec_fields
    try:
        AttentionSpec(arch="sm_90", dtype=dtype, head_dim=d, config=config, causal=causal,
                      return_lse=True, mask_align=align_, window=windowed, softcap=capped,
                      precision=precision, k_scale=k_scale)
    except SpecError:
        assume(False)
    return {"mask_align": mask.align, "window": mask.window, "softcap": mask.softcap}


def _check_masked(b, hkv, group, sq, sk, d, dtype, causal, align, window, softcap, config,
                  seed):
    """One masked call on ``config`` (skipped where it does not build) against the float64
    reference with the masks tests' bound; the kernel launched must be the wgmma_ws one."""
    masks = _ws_masks(causal, align, window, softcap, config, d, dtype)
    q, k, v = masked_qkv(b, hkv * group, hkv, sq, sk, d, DTYPES[dtype], softcap, seed)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, device=q.device,
                                       **masks)
    out = torch.full_like(q, float("nan"))
    (res, lse), families = launched(lambda: attention(
        q, k, v, causal=causal, return_lse=True, out=out, config=config, **masks))
    assert families == ["wgmma_ws"]
    check_masked_result(res, out, lse, ref, ref_lse, q, k, v, causal, masks["mask_align"],
                        masks["window"], masks["softcap"])


WINDOWS = st.one_of(st.none(), st.tuples(st.integers(-1, 700), st.integers(-1, 700)),
                    st.sampled_from([(0, 0), (-1, 0), (0, -1), (5000, 5000), (-1, 10)]))
# a masked call's dtype and masks, as the Hopper mask properties draw them
MASKED = {"dtype": st.sampled_from(["float16", "bfloat16"]), "causal": st.booleans(),
          "align": st.sampled_from(["top_left", "bottom_right"]), "window": WINDOWS}
SOFTCAPS = st.one_of(st.none(), st.floats(0.5, 50))


def call_shapes(sq_max: int, sk_max: int, short: int = 300, groups=(1, 2, 4),
                dims=(64, 128)) -> dict:
    """A call's batch, K/V heads, query heads per K/V head, lengths (up to ``short``, or up to
    the maxima) and head dim, as the Hopper mask properties draw them."""
    return {"b": st.integers(1, 2), "hkv": st.integers(1, 3), "group": st.sampled_from(groups),
            "sq": st.one_of(st.integers(1, short), st.integers(1, sq_max)),
            "sk": st.one_of(st.integers(1, short), st.integers(1, sk_max)),
            "d": st.sampled_from(dims)}


@settings(settings.get_profile("gpu"))
@given(
    **call_shapes(2000, 3000),
    **MASKED,
    softcap=SOFTCAPS,
    config=st.sampled_from(WGMMA_MASK_CONFIGS),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, hkv=2, group=2, sq=500, sk=130, d=128, dtype="float16", causal=True,
         align="bottom_right", window=None, softcap=None, config=WGMMA_MASK_CONFIGS[0],
         seed=1)  # S_q > S_k: rows before the first key see none (0, LSE -inf)
@example(b=2, hkv=1, group=1, sq=300, sk=1000, d=64, dtype="bfloat16", causal=True,
         align="bottom_right", window=None, softcap=30.0, config=WGMMA_MASK_CONFIGS[1],
         seed=2)  # chunked prefill, soft-capped
@example(b=1, hkv=1, group=4, sq=700, sk=700, d=128, dtype="float16", causal=True,
         align="top_left", window=(0, 0), softcap=None, config=WGMMA_MASK_CONFIGS[0],
         seed=3)  # the diagonal alone
@example(b=1, hkv=2, group=1, sq=200, sk=333, d=64, dtype="float16", causal=False,
         align="bottom_right", window=(5000, 5000), softcap=None, config=WGMMA_MASK_CONFIGS[2],
         seed=4)  # a window wider than the keys
@example(b=1, hkv=1, group=4, sq=130, sk=257, d=128, dtype="bfloat16", causal=False,
         align="top_left", window=(-1, 10), softcap=5.0, config=WGMMA_MASK_CONFIGS[2],
         seed=5)  # unbounded left side, GQA
@example(b=1, hkv=2, group=4, sq=1, sk=2999, d=128, dtype="float16", causal=True,
         align="bottom_right", window=(511, 0), softcap=None, config=WGMMA_MASK_CONFIGS[0],
         seed=6)  # decode, query heads packed into rows, a window
@example(b=1, hkv=2, group=2, sq=777, sk=1500, d=128, dtype="float16", causal=True,
         align="bottom_right", window=(128, 0), softcap=20.0, config=WGMMA_MASK_CONFIGS[3],
         seed=7)  # three consumers of 64-key steps, every mask
@example(b=2, hkv=2, group=1, sq=1000, sk=1000, d=64, dtype="bfloat16", causal=False,
         align="top_left", window=(100, 300), softcap=None, config=WGMMA_MASK_CONFIGS[1],
         seed=8)  # three consumers taking turns, both edges masked
@example(b=1, hkv=1, group=1, sq=1, sk=1, d=64, dtype="float16", causal=True,
         align="bottom_right", window=(0, 0), softcap=50.0, config=WGMMA_MASK_CONFIGS[2],
         seed=9)
@example(b=1, hkv=2, group=2, sq=450, sk=1000, d=128, dtype="float16", causal=False,
         align="top_left", window=None, softcap=10.0, config=WGMMA_MASK_CONFIGS[1],
         seed=10)  # soft-capped, P through shared memory
def test_wgmma_ws_masks_match_the_reference(b, hkv, group, sq, sk, d, dtype, causal, align,
                                            window, softcap, config, seed):
    """The warp-specialised kernels with bottom-right causal (S_q above and below S_k), sliding
    windows (sides -1, 0, wider than the keys) and soft-caps, GQA, LSE, fp16/bf16, d64/d128
    against the float64 reference with the masks tests' bound; rows that see no key give 0
    and LSE -inf. The kernel launched is the named wgmma_ws one."""

    _check_masked(b, hkv, group, sq, sk, d, dtype, causal, align, window, softcap, config,
                  seed)


@settings(settings.get_profile("gpu"))
@given(
    **call_shapes(1500, 2000, dims=(32, 80, 96, 256)),
    **MASKED,
    softcap=SOFTCAPS,
    config=st.sampled_from(WGMMA_HEAD_DIM_CONFIGS),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, hkv=2, group=2, sq=333, sk=1000, d=96, dtype="float16", causal=True,
         align="bottom_right", window=None, softcap=None, config=WGMMA_HEAD_DIM_CONFIGS[0],
         seed=1)  # 64-byte swizzled rows, ragged keys
@example(b=2, hkv=1, group=4, sq=700, sk=700, d=256, dtype="bfloat16", causal=True,
         align="top_left", window=None, softcap=None, config=WGMMA_HEAD_DIM_CONFIGS[1],
         seed=2)  # four 128-byte boxes a row, 128 accumulator registers of O a thread
@example(b=1, hkv=1, group=1, sq=1, sk=1, d=80, dtype="float16", causal=False,
         align="top_left", window=None, softcap=None, config=WGMMA_HEAD_DIM_CONFIGS[2],
         seed=3)  # 32-byte swizzled rows, one key
@example(b=1, hkv=2, group=2, sq=500, sk=777, d=96, dtype="bfloat16", causal=False,
         align="top_left", window=None, softcap=None, config=WGMMA_HEAD_DIM_CONFIGS[3],
         seed=4)  # three consumers, P through shared memory
@example(b=1, hkv=2, group=1, sq=300, sk=1200, d=256, dtype="float16", causal=True,
         align="bottom_right", window=(200, 0), softcap=20.0, config=WGMMA_HEAD_DIM_CONFIGS[2],
         seed=5)  # one consumer, every mask
@example(b=2, hkv=3, group=1, sq=1000, sk=1000, d=32, dtype="float16", causal=True,
         align="top_left", window=None, softcap=None, config=WGMMA_HEAD_DIM_CONFIGS[3],
         seed=6)
def test_wgmma_ws_head_dims_match_the_reference(b, hkv, group, sq, sk, d, dtype, causal, align,
                                                window, softcap, config, seed):
    """The warp-specialised kernels at head dims 32, 80, 96 and 256 (rows of 64, 160, 192
    and 512 bytes: swizzles of 64, 32, 64 and 128 bytes), masks included, against the float64
    reference with the masks tests' bound. The kernel launched is the named wgmma_ws one."""
    _check_masked(b, hkv, group, sq, sk, d, dtype, causal, align, window, softcap, config,
                  seed)


@settings(settings.get_profile("gpu"))
@given(
    **call_shapes(1500, 2000, dims=(32, 64, 80, 96, 128, 256)),
    **MASKED,
    softcap=SOFTCAPS,
    config=st.sampled_from(WGMMA_TILE_N_CONFIGS),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, hkv=2, group=2, sq=333, sk=1000, d=256, dtype="bfloat16", causal=True,
         align="bottom_right", window=None, softcap=None, config=WGMMA_TILE_N_CONFIGS[0],
         seed=1)  # 80-key blocks: no power of two, the diagonal anywhere in them
@example(b=2, hkv=1, group=4, sq=700, sk=900, d=128, dtype="float16", causal=False,
         align="top_left", window=None, softcap=None, config=WGMMA_TILE_N_CONFIGS[1],
         seed=2)  # 176-key blocks, ping-pong, ragged keys
@example(b=1, hkv=2, group=1, sq=500, sk=777, d=64, dtype="float16", causal=True,
         align="top_left", window=None, softcap=None, config=WGMMA_TILE_N_CONFIGS[2],
         seed=3)  # three consumers, P through shared memory at d64
@example(b=1, hkv=1, group=2, sq=300, sk=1200, d=96, dtype="bfloat16", causal=True,
         align="bottom_right", window=(200, 0), softcap=None, config=WGMMA_TILE_N_CONFIGS[3],
         seed=4)
def test_wgmma_ws_key_blocks_of_any_16_keys(b, hkv, group, sq, sk, d, dtype, causal, align,
                                            window, softcap, config, seed):
    """Key blocks of 80 to 192 keys (``WgmmaWs.knobs``), every head dim and mask, against the
    float64 reference with the masks tests' bound."""
    _check_masked(b, hkv, group, sq, sk, d, dtype, causal, align, window, softcap, config,
                  seed)


@settings(settings.get_profile("gpu"))
@given(
    **call_shapes(700, 1200, short=200, groups=(1, 2)),
    **MASKED,
    config=st.sampled_from(WGMMA_FP8_MASK_CONFIGS),
    k_scale=st.sampled_from(["token", "head"]),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, hkv=2, group=2, sq=300, sk=1000, d=128, dtype="float16", causal=True,
         align="bottom_right", window=None, config=WGMMA_FP8_MASK_CONFIGS[0], k_scale="token",
         seed=1)  # chunked prefill
@example(b=1, hkv=1, group=2, sq=600, sk=150, d=64, dtype="bfloat16", causal=True,
         align="bottom_right", window=(40, 0), config=WGMMA_FP8_MASK_CONFIGS[1],
         k_scale="head", seed=2)  # rows with no key, a window
@example(b=2, hkv=1, group=1, sq=500, sk=700, d=128, dtype="float16", causal=False,
         align="top_left", window=(64, 100), config=WGMMA_FP8_MASK_CONFIGS[1], k_scale="token",
         seed=3)  # both edges masked, P through shared memory
def test_wgmma_ws_fp8_masks_match_their_simulation(b, hkv, group, sq, sk, d, dtype, causal,
                                                   align, window, config, k_scale, seed):
    """FP8 operands under bottom-right causal and windows: against the replay of the kernel's
    tile walk under the same masks (``reference.attention_fp8``) within the QGMMA bound, as
    close to exact attention as the replay, LSE -inf exactly where a row sees no key."""
    masks = _ws_masks(causal, align, window, None, config, d, dtype, "fp8", k_scale)
    masks.pop("softcap")
    hq, dt = hkv * group, DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g).to(dt)
               for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    out = torch.full_like(q, float("nan"))
    if k_scale == "token":
        res = attention(q, k, v, causal=causal, precision="fp8", config=config,
                        return_lse=True, out=out, **masks)
    else:
        from flashcore.ops.eager import run_fp8  # attention_fp8's eager path, with masks

        (q8, qd), (k8, kd), (vt8, vd) = (quantize_fp8(q, granularity="token"), quantize_fp8(k),
                                         quantize_fp8(v, transpose=True))
        res = run_fp8(q8, k8, vt8, qd, kd, vd, causal=causal, return_lse=True, out_dtype=dt,
                      config=config, out=out,
                      mask=masking(causal, masks["mask_align"], masks["window"], None))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "NaN/Inf or unwritten elements in the FP8 output"
    kx, vx = (t.repeat_interleave(group, dim=1) for t in (k, v))
    sim = reference.attention_fp8(q, kx, vx, causal=causal, tile=config.tile, device=q.device,
                                  k_scale=k_scale,
                                  sum_rounded_p=fp8_sums_rounded_p(config, d, causal), **masks)
    tol = FP8_SIM_TOL * (2 if sk < 128 else 1)
    if sim.abs().max() > 0:
        assert _rel_l2(out, sim) <= tol
    exact, exact_lse = reference.attention(q, kx, vx, causal=causal, return_lse=True,
                                           device=q.device, **masks)
    if exact.abs().max() > 0:
        assert _rel_l2(out, exact) <= _rel_l2(sim, exact) + FP8_EXACT_MARGIN
    finite = torch.isfinite(exact_lse)
    assert torch.equal(torch.isfinite(res[1]), finite), "-inf LSE exactly where no key"
    if finite.any():
        assert max_abs(res[1][finite], exact_lse[finite]) < 0.25


# FP8 operands (e4m3 wgmma, SASS QGMMA) in the warp-specialised family (tests.gpu_utils)
FP8_CONFIGS = WGMMA_FP8_CONFIGS
# Relative L2 against the float64 replay of the kernel's quantised arithmetic. The mma_sync
# family's FP8 kernel matches it to 3e-6..8e-6; e4m3 wgmma (QGMMA) does not accumulate in IEEE
# fp32 (Hopper's FP8 tensor cores keep fewer mantissa bits), which costs 1.9e-3..5.1e-3 on the
# same inputs (one and many key blocks alike: not a drift over blocks). So the
# bound here is 1e-2, and the error against exact attention must match the replay's.
FP8_SIM_TOL = 1e-2
FP8_EXACT_MARGIN = 5e-3  # rel L2 vs exact may exceed the replay's by this much


def _rel_l2(out, ref) -> float:
    o, r = out.double().flatten(), ref.double().flatten().to(out.device)
    return ((o - r).norm() / r.norm().clamp_min(1e-300)).item()


@settings(settings.get_profile("gpu"))
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    sq=st.one_of(st.integers(1, 200), st.integers(1, 700)),
    sk=st.one_of(st.integers(1, 200), st.integers(1, 1200)),
    d=st.sampled_from([64, 128]),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    causal=st.booleans(),
    config=st.sampled_from(FP8_CONFIGS),
    return_lse=st.booleans(),
    k_scale=st.sampled_from(["token", "head"]),
    log_mag=st.floats(-3, 4),
    logit_gain=st.sampled_from([1.0, 1.0, 100.0]),
    seed=st.integers(0, 2**31 - 1),
)
@example(b=1, hkv=2, group=2, sq=300, sk=1000, d=128, dtype="float16", causal=True,
         config=FP8_CONFIGS[0], return_lse=True, k_scale="head", log_mag=0.0, logit_gain=1.0,
         seed=1)  # ragged keys
@example(b=2, hkv=1, group=1, sq=1, sk=1, d=64, dtype="bfloat16", causal=False,
         config=FP8_CONFIGS[1], return_lse=True, k_scale="token", log_mag=3.0, logit_gain=1.0, seed=2)
@example(b=1, hkv=1, group=4, sq=1, sk=700, d=128, dtype="float16", causal=False,
         config=FP8_CONFIGS[2], return_lse=False, k_scale="token", log_mag=0.0, logit_gain=1.0,
         seed=3)  # decode, packed GQA
@example(b=1, hkv=2, group=1, sq=500, sk=333, d=64, dtype="bfloat16", causal=True,
         config=FP8_CONFIGS[3], return_lse=True, k_scale="head", log_mag=-2.0, logit_gain=1.0,
         seed=4)  # rows with no key
@example(b=1, hkv=2, group=2, sq=700, sk=1200, d=128, dtype="float16", causal=False,
         config=FP8_CONFIGS[0], return_lse=True, k_scale="head", log_mag=1.0, logit_gain=100.0,
         seed=5)  # logits of hundreds
@example(b=2, hkv=2, group=2, sq=450, sk=450, d=64, dtype="float16", causal=True,
         config=FP8_CONFIGS[4], return_lse=True, k_scale="token", log_mag=0.0, logit_gain=1.0,
         seed=6)  # the d64 causal winner, rows ragged against its 192-row tile
@example(b=1, hkv=2, group=2, sq=450, sk=1000, d=128, dtype="bfloat16", causal=False,
         config=FP8_CONFIGS[5], return_lse=True, k_scale="head", log_mag=0.0, logit_gain=1.0,
         seed=7)  # the d128 K-per-head winner: P through shared memory, rows ragged
@example(b=1, hkv=1, group=1, sq=200, sk=333, d=128, dtype="float16", causal=True,
         config=FP8_CONFIGS[5], return_lse=False, k_scale="token", log_mag=1.0,
         logit_gain=100.0, seed=8)
@example(b=2, hkv=3, group=1, sq=696, sk=564, d=128, dtype="bfloat16", causal=True,
         config=FP8_CONFIGS[4], return_lse=True, k_scale="head", log_mag=2.9, logit_gain=1.0,
         seed=9)  # three consumers of 64-key steps at d128: P stays in registers
@example(b=1, hkv=2, group=2, sq=777, sk=777, d=64, dtype="float16", causal=True,
         config=FP8_CONFIGS[3], return_lse=True, k_scale="head", log_mag=0.0, logit_gain=1.0,
         seed=10)  # the d64 causal K-per-head winner: one loop masks its first two steps
def test_wgmma_ws_fp8_matches_its_simulation(b, hkv, group, sq, sk, d, dtype, causal, config,
                                             return_lse, k_scale, log_mag, logit_gain, seed):
    """The e4m3 kernel against ``reference.attention_fp8`` replaying its tile's block walk
    (same scales, e4m3 roundings of Q, K, V and of P against the running max; K descaled per
    token, or per head with its descale in the rows' exp2 scales), within the
    bound the tensor cores' FP8 accumulation allows (``FP8_SIM_TOL``), and as close to exact
    attention as the replay; inputs of any magnitude (1e-3 .. 1e4) stay finite. The row sums'
    logs (LSE) are those of the exact attention of the quantised inputs, -inf exactly where a
    row sees no key. ``logit_gain`` 100 gives logits of tens to hundreds (query rows scaled
    by 0.2 .. 1), where only an exp2 of (s - max) * scale keeps p exact at the row max."""
    hq, dt = hkv * group, DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(seed)
    mag = 10.0**log_mag
    q, k, v = ((torch.randn(b, h, s, d, device="cuda", generator=g) * mag).to(dt)
               for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    scale = logit_gain / (d**0.5 * mag * mag)  # logits O(logit_gain) at any input magnitude
    if logit_gain > 1.0:
        rows = torch.rand(b, hq, sq, 1, device="cuda", generator=g) * 0.8 + 0.2
        q = (q.float() * rows).to(dt)
    out = torch.full_like(q, float("nan"))
    if k_scale == "token":  # as attention(precision="fp8") quantises
        res = attention(q, k, v, causal=causal, softmax_scale=scale, precision="fp8",
                        config=config, return_lse=return_lse, out=out)
    else:
        (q8, qd), (k8, kd), (vt8, vd) = (quantize_fp8(q, granularity="token"), quantize_fp8(k),
                                         quantize_fp8(v, transpose=True))
        res = attention_fp8(q8, k8, vt8, qd, kd, vd, causal=causal, softmax_scale=scale,
                            return_lse=return_lse, out_dtype=dt, config=config, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "NaN/Inf or unwritten elements in the FP8 output"
    kx, vx = (t.repeat_interleave(group, dim=1) for t in (k, v))  # per-token/head scales kept
    sim = reference.attention_fp8(q, kx, vx, causal=causal, softmax_scale=scale,
                                  tile=config.tile, device=q.device, k_scale=k_scale,
                                  sum_rounded_p=fp8_sums_rounded_p(config, d, causal))
    # QGMMA's accumulation error is relative to the scores: logits of hundreds move p by
    # percents, so those examples are held to 0.1 (a wrong max or exp2 argument is O(1))
    tol, margin = (FP8_SIM_TOL, FP8_EXACT_MARGIN) if logit_gain == 1.0 else (0.1, 0.1)
    if sk < 128:
        # a P whose exp2 lies at an e4m3 rounding boundary can round the other way in the
        # kernel (ex2.approx in fp32) than in the replay: one code, 6-12% of that P; among few
        # keys it moves its row by percents (32 keys, bf16: one row of four 2% off, the rest
        # <= 4e-4, rel L2 about 1e-2, while exact attention and the replay agree)
        tol *= 2
    err = _rel_l2(out, sim)
    assert err <= tol, f"vs simulated quantisation: rel L2 {err:.3g}"
    exact, exact_lse = reference.attention(q, kx, vx, causal=causal, softmax_scale=scale,
                                           return_lse=True, device=q.device)
    if exact.abs().max() > 0:  # (a row with no key is 0 in all three)
        ours, replay = _rel_l2(out, exact), _rel_l2(sim, exact)
        assert ours <= replay + margin, f"vs exact {ours:.3g}, replay {replay:.3g}"
    if return_lse:
        exact = exact_lse
        finite = torch.isfinite(exact)
        assert torch.equal(torch.isfinite(res[1]), finite), "-inf LSE exactly where no key"
        if finite.any():  # e4m3's rounding of Q and K moves the logits by a few percent
            assert max_abs(res[1][finite], exact[finite]) < 0.25 * logit_gain


@pytest.mark.parametrize("causal", [False, True])
def test_wgmma_ws_fp8_k_per_head_walks_keys_in_either_softmax_form(causal):
    """K descaled per head: e4m3 operands bound every score, so each row's |max * scale| is
    bounded by its exp2 scale, and a warp whose rows stay below 2**16 (log2 units) walks its
    keys with a rounded-up offset (one FMA a score), any other warp exactly. Rows 64..79 (one
    warp of the second consumer) get queries 1000x larger, so that warp takes the exact loop,
    the others the rounded one. Every row must match the replay; its LSE that of exact
    attention of the dequantised inputs (what the tensor cores multiply), within the slack of
    row sums of e4m3-rounded P where the tensor cores sum them."""
    g = torch.Generator(device="cuda").manual_seed(31 + causal)
    q = torch.randn(1, 2, 300, 128, device="cuda", generator=g)
    q[:, :, 64:80] *= 1000.0
    q = q.half()
    k, v = (torch.randn(1, 1, 700, 128, device="cuda", generator=g).half() for _ in range(2))
    (q8, qd), (k8, kd), (vt8, vd) = (quantize_fp8(q, granularity="token"), quantize_fp8(k),
                                     quantize_fp8(v, transpose=True))
    out = torch.full_like(q, float("nan"))
    _, lse = attention_fp8(q8, k8, vt8, qd, kd, vd, causal=causal, return_lse=True, out=out,
                           config=FP8_CONFIGS[0])
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    kx, vx = (t.repeat_interleave(2, dim=1) for t in (k, v))
    sim = reference.attention_fp8(q, kx, vx, causal=causal, tile=FP8_CONFIGS[0].tile,
                                  device=q.device, k_scale="head",
                                  sum_rounded_p=fp8_sums_rounded_p(FP8_CONFIGS[0], 128, causal))
    q_deq = q8.double() * qd[..., None].double()
    k_deq = (k8.double() * kd[..., None, None].double()).repeat_interleave(2, dim=1)
    _, lse_deq = reference.attention(q_deq, k_deq, vx.double(), causal=causal,
                                     return_lse=True, device=q.device)
    big = torch.zeros(300, dtype=torch.bool, device="cuda")
    big[64:80] = True
    for rows, tol in ((~big, FP8_SIM_TOL), (big, 0.1)):  # logits of thousands: a hard argmax
        assert _rel_l2(out[:, :, rows], sim[:, :, rows]) <= tol
        err = (lse[:, :, rows].double() - lse_deq[:, :, rows].to(lse.device)).abs()
        slack = ROUNDED_SUMS_LSE_SLACK if fp8_sums_rounded_p(FP8_CONFIGS[0], 128, causal) else 0
        bound = 2e-2 + slack + 1e-2 * lse_deq[:, :, rows].abs().to(lse.device)
        assert (err <= bound).all(), err.max()


def test_fp8_on_hopper_takes_the_wgmma_family_without_a_warning():
    """Naming the warp-specialised family runs e4m3 wgmma (no emulation warning); the
    mma_sync family's FP8 on sm_90 still warns that it is emulated."""
    import warnings

    from flashcore.ops import eager

    q = torch.randn(1, 2, 130, 128, device="cuda", dtype=torch.float16)
    eager._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = attention(q, q, q, precision="fp8", config=FP8_CONFIGS[0])
    assert torch.isfinite(out).all()
    with pytest.warns(RuntimeWarning, match="emulates"):
        attention(q, q, q, precision="fp8", tile=(64, 64))
