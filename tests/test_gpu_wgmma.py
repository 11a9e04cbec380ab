"""GPU tests of the Hopper family (``wgmma``: warpgroup MMA, sm_90a) against the float64
reference, held to the mma_sync family's bound (``test_gpu_attention._allowed``: twice SDPA's
own error plus rounding terms). Ragged lengths (S_q != S_k, not multiples of the tile, 1), GQA,
causal (top-left), LSE; outputs poisoned first, NaN never passes. Skipped on GPUs other than
sm_90."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flashcore import reference
from flashcore.errors import SpecError
from flashcore.ops import attention
from flashcore.spec import TileConfig
from tests.gpu_utils import current_arch, max_abs, requires_cuda
from tests.test_gpu_attention import _allowed, _sdpa

pytestmark = [pytest.mark.gpu, requires_cuda]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# (tile, warps, stages): two warpgroups with 2- and 3-block rings, one warpgroup
CONFIGS = [TileConfig((128, 128), warps=8, stages=2, family="wgmma"),
           TileConfig((128, 64), warps=8, stages=3, family="wgmma"),
           TileConfig((64, 128), warps=4, stages=2, family="wgmma"),
           # warp-specialised: TMA from a producer warpgroup (runtime-encoded descriptors)
           TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws"),
           TileConfig((128, 64), warps=8, stages=3, family="wgmma_ws"),
           TileConfig((64, 64), warps=4, stages=2, family="wgmma_ws"),
           TileConfig((192, 64), warps=12, stages=2, family="wgmma_ws"),  # three consumers
           TileConfig((192, 128), warps=12, stages=2, family="wgmma_ws")]  # three, in turns


@pytest.fixture(autouse=True)
def _hopper_only():
    if current_arch() != "sm_90":
        pytest.skip("the wgmma family runs on sm_90 only")


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
    err_sdpa = max_abs(_sdpa(q, kx, vx, causal, None), ref)
    allowed = _allowed(err_sdpa, ref, dt, q, k, v)
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
         config=CONFIGS[3], return_lse=True, log_mag=0.0, seed=5)  # TMA, ragged keys
@example(b=1, hkv=1, group=1, sq=1, sk=1, d=64, dtype="bfloat16", causal=False,
         config=CONFIGS[5], return_lse=True, log_mag=0.0, seed=6)
@example(b=1, hkv=2, group=2, sq=500, sk=333, d=128, dtype="float16", causal=True,
         config=CONFIGS[6], return_lse=True, log_mag=0.0, seed=7)  # three consumers, ragged
@example(b=2, hkv=2, group=1, sq=700, sk=900, d=64, dtype="bfloat16", causal=False,
         config=CONFIGS[7], return_lse=True, log_mag=0.0, seed=8)  # three taking turns
def test_wgmma_matches_the_reference(b, hkv, group, sq, sk, d, dtype, causal, config,
                                     return_lse, log_mag, seed):
    _check(b, hkv * group, hkv, sq, sk, d, DTYPES[dtype], causal, config, return_lse, seed,
           10.0**log_mag)


def test_wgmma_decode_runs_unsplit():
    """The family has no split-KV kernel: a decode call runs one CTA per tile, and asking for
    splits names the reason."""
    _check(2, 8, 2, 1, 5000, 128, torch.float16, False, CONFIGS[0], True, seed=5)
    q = torch.randn(1, 2, 1, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(SpecError, match="split_kv"):
        attention(q, q, q, config=CONFIGS[0], num_splits=2)


def test_the_tuned_default_falls_back_where_the_family_lacks_a_feature():
    """``tile=None`` runs the table's winner; a call the winner's family does not build (a
    window, bottom-right causal, a soft-cap, explicit key splits) runs the entry's fallback:
    the same kernel as naming that config, so the results are bitwise equal."""
    from flashcore.tuned import table

    tuned = table.entries("sm_90").get(table.key(128, True, "mid"))
    if tuned is None or tuned.fallback is None:
        pytest.skip("the shipped sm_90 table has no Hopper winner at d128 causal mid")
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(1, 4, 1500, 128, device="cuda", generator=g).half() for _ in range(3))
    plain = attention(q, k, v, causal=True)
    assert torch.equal(plain, attention(q, k, v, causal=True, config=tuned.config))
    for kwargs in ({"window": (300, 0)}, {"mask_align": "bottom_right"}, {"softcap": 30.0},
                   {"num_splits": 2}):
        got = attention(q, k, v, causal=True, **kwargs)
        want = attention(q, k, v, causal=True, config=tuned.fallback, **kwargs)
        assert torch.isfinite(got).all() and torch.equal(got, want), kwargs
