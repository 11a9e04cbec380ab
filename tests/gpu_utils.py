"""Helpers shared by the GPU tests (importable without CUDA)."""

from __future__ import annotations

import math

import torch

from flashcore.specs import HEAD_DIMS, AttentionSpec, TileConfig
from flashcore.specs.families import WgmmaWs

requires_cuda = None
try:
    import pytest

    requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
except ImportError:  # pragma: no cover
    pass


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN so any element the kernel fails to write shows up."""
    return t.fill_(float("nan"))


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def head_dims(dims=HEAD_DIMS):
    """A Hypothesis strategy of head dims (default: every one the forward builds).
    ``FLASHCORE_TEST_HEAD_DIMS=32,96`` narrows any such draw to those dims, so a GPU run can
    spend its examples on some of them."""
    import os

    from hypothesis import strategies as st

    focus = os.environ.get("FLASHCORE_TEST_HEAD_DIMS")
    if focus:
        chosen = [d for d in dims if str(d) in focus.split(",")]
        dims = chosen or list(dims)
    return st.sampled_from(list(dims))


def attention_shapes(max_seq: int, dims=HEAD_DIMS) -> dict:
    """Hypothesis strategies for the shape, dtype and masking of one attention call: batch 1-4,
    heads 1-16, sequence lengths up to ``max_seq`` (short ones drawn often), a head dim of
    ``dims``."""
    from hypothesis import strategies as st

    return {
        "b": st.integers(1, 4),
        "h": st.integers(1, 16),
        "sq": st.one_of(st.integers(1, 300), st.integers(1, max_seq)),
        "sk": st.one_of(st.integers(1, 300), st.integers(1, max_seq)),
        "d": head_dims(dims),
        "dtype": st.sampled_from(["bfloat16", "float16"]),
        "causal": st.booleans(),
    }


# (tile, warps, kv_splits) of the split-KV kernels the GPU tests check
SPLIT_CONFIGS = [((32, 64), 2, 4), ((64, 64), 4, 2), ((16, 32), 1, 4), ((32, 64), 1, 2)]
FP8_SPLIT_CONFIGS = [((32, 64), 2, 4)]
# (tile, warps, kv_splits, stages) of the multi-stage K/V kernels the GPU tests check
# an FP8 KV cache's configs in test_fp8_kv_cache_in_every_kind_of_config: each ring depth, key
# tile, warp count and in-CTA key split
FP8_KV_CONFIGS = [
    TileConfig((16, 32), warps=1, stages=1),
    TileConfig((16, 64), warps=1, stages=3),
    TileConfig((16, 128), warps=1, stages=2),
    TileConfig((32, 64), warps=2, stages=2, kv_splits=2),
    TileConfig((64, 64), warps=4, stages=2),
]
# the Hopper family's configs of tests/test_gpu_wgmma.py (TMA from a producer warpgroup,
# runtime-encoded descriptors): two consumer warpgroups, 64- and 128-key blocks, one consumer,
# three consumers, three taking turns
WGMMA_CONFIGS = [TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws"),
                 TileConfig((128, 64), warps=8, stages=3, family="wgmma_ws"),
                 TileConfig((64, 64), warps=4, stages=2, family="wgmma_ws"),
                 TileConfig((192, 64), warps=12, stages=2, family="wgmma_ws"),
                 TileConfig((192, 128), warps=12, stages=2, family="wgmma_ws")]
# the warp-specialised family's masks (bottom-right causal, windows, soft-caps): two consumers
# (the d128 causal winner), three of 128-key steps (the d128 full winner; there P through
# shared memory, which builds no soft-cap beside a mask), one consumer, three of 64-key steps
WGMMA_MASK_CONFIGS = [TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws"),
                      TileConfig((192, 128), warps=12, stages=2, family="wgmma_ws"),
                      TileConfig((64, 64), warps=4, stages=2, family="wgmma_ws"),
                      TileConfig((192, 64), warps=12, stages=2, family="wgmma_ws")]
# the Hopper family at head dims 32, 80, 96 and 256: two consumers of 128-key steps (64-key at
# d256, whose 128-key tiles overflow shared memory), one consumer, three of 128-key steps (P
# through shared memory at d80 and d96; d256 has no room for three); a config a head dim does
# not build is skipped where it is drawn
WGMMA_HEAD_DIM_CONFIGS = [TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws"),
                          TileConfig((128, 64), warps=8, stages=2, family="wgmma_ws"),
                          TileConfig((64, 64), warps=4, stages=2, family="wgmma_ws"),
                          TileConfig((192, 128), warps=12, stages=2, family="wgmma_ws")]
# the Hopper family's key blocks other than 64 and 128 keys: FlashAttention-3's d256 128x80
# (shared memory full at two stages), d128 128x176, three consumers of 192 (d64) and 144 (d96)
# keys with P through shared memory, 112 keys in three stages, one consumer of 96
WGMMA_TILE_N_CONFIGS = [TileConfig((128, 80), warps=8, stages=2, family="wgmma_ws"),
                        TileConfig((128, 176), warps=8, stages=2, family="wgmma_ws"),
                        TileConfig((192, 192), warps=12, stages=2, family="wgmma_ws"),
                        TileConfig((192, 144), warps=12, stages=2, family="wgmma_ws"),
                        TileConfig((128, 112), warps=8, stages=3, family="wgmma_ws"),
                        TileConfig((64, 96), warps=4, stages=2, family="wgmma_ws")]
# packed batches on the Hopper family: two consumers of 128- and 64-key steps, three
WGMMA_VARLEN_CONFIGS = [TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws"),
                        TileConfig((128, 64), warps=8, stages=2, family="wgmma_ws"),
                        TileConfig((192, 128), warps=12, stages=2, family="wgmma_ws")]
# a paged cache on the Hopper family: 128- and 64-key blocks (pages of whole blocks), three
# consumers
WGMMA_PAGED_CONFIGS = [TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws"),
                       TileConfig((128, 64), warps=8, stages=2, family="wgmma_ws"),
                       TileConfig((192, 128), warps=12, stages=2, family="wgmma_ws")]


def wgmma_page_sizes(config: TileConfig) -> dict:
    """The page sizes tests/test_gpu_serving.py draws for a Hopper paged config, by kind: a
    key block spans two pages, pages of 16 rows (the smallest box), is one, or is half of one."""
    tn = config.tile_n
    return {"two a block": tn // 2, "16 rows": 16, "a block": tn, "two blocks": 2 * tn}


# FP8 operands with masks: the d128 causal winner, and three consumers taking turns
WGMMA_FP8_MASK_CONFIGS = [TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws"),
                          TileConfig((192, 128), warps=12, stages=2, family="wgmma_ws")]
# FP8 operands (e4m3 wgmma): 128- and 64-key blocks (Vᵀ's 128- and 64-byte swizzles), three
# consumers taking turns (the d64 long winners: 192x128 full, 192x64 causal)
WGMMA_FP8_CONFIGS = [TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws"),
                     TileConfig((128, 64), warps=8, stages=3, family="wgmma_ws"),
                     TileConfig((64, 64), warps=4, stages=2, family="wgmma_ws"),
                     TileConfig((192, 128), warps=12, stages=2, family="wgmma_ws"),
                     TileConfig((192, 64), warps=12, stages=3, family="wgmma_ws"),
                     # the d128 K-per-head winner: at d128, P through shared memory
                     TileConfig((192, 128), warps=12, stages=4, family="wgmma_ws")]


# How far the log of a row sum of e4m3-rounded P can lie from that of the unrounded P: each p
# but the row max (exactly P_SCALE) moves by at most 2**-4 of itself, so the sum by less than
# 2**-4 of it. Rows of few keys come near it (about half of it with 2-3 keys).
ROUNDED_SUMS_LSE_SLACK = -math.log1p(-(2.0**-4))


def fp8_sums_rounded_p(config: TileConfig | None, head_dim: int, causal: bool) -> bool:
    """Whether an FP8 call's kernel sums its rows from P as rounded for P·V (its tensor cores
    sum them: ``WgmmaWs.sums_by_mma``, warp-specialised FP8 kernels), which the simulation
    must replay (``reference.attention_fp8(sum_rounded_p=...)``)."""
    if config is None or config.family != "wgmma_ws":
        return False
    spec = AttentionSpec(arch="sm_90", head_dim=head_dim, causal=causal, precision="fp8",
                         config=config)
    return WgmmaWs.sums_by_mma(spec)


STAGE_CONFIGS = [((64, 64), 4, 1, 2), ((128, 64), 8, 1, 3), ((32, 64), 2, 2, 2), ((16, 32), 1, 1, 3)]


def current_arch() -> str:
    """The arch whose kernels run here (``FLASHCORE_ARCH`` may pick an older one)."""
    from flashcore.runtime.device import arch_of

    return arch_of(torch.cuda.current_device())


def skip_unless_fits(head_dim: int, precision: str = "fp16", kv_fp8: bool = False,
                     **knobs) -> None:
    """Skip a test whose config does not fit this arch (an L4's 99 KB of shared memory when the
    sm_89 kernels run on an H100 from their PTX)."""
    import pytest

    from flashcore.errors import SpecError
    from flashcore.specs import AttentionSpec, TileConfig

    try:
        AttentionSpec(arch=current_arch(), head_dim=head_dim, precision=precision,
                      kv_fp8=kv_fp8, config=TileConfig(knobs.pop("tile"), **knobs))
    except SpecError as e:
        pytest.skip(f"does not fit {current_arch()}: {e}")


# the error yardsticks the GPU tests share: SDPA and torch in the inputs' dtype
def sdpa(q, k, v, causal, scale):
    """SDPA, the baseline of our error bound (K/V may have fewer heads: GQA). Its flash and
    efficient backends overflow on a negative scale (NaN on the H100 with torch 2.11):
    there it gets -q with |scale|, the same logits."""
    if scale is not None and scale < 0:
        q, scale = -q, -scale
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def allowed_error(err_sdpa, ref, dtype, q=None, k=None, v=None, scale=None) -> float:
    """2x SDPA's own error + 1e-4, plus two terms for what rounding alone may do:
    - one output ulp: where torch cannot use its flash backend (top-left causal, S_q != S_k) it
      falls back to kernels that keep P in fp32, while an FA2-class kernel rounds P to the input
      dtype before P·V, which can flip the output's last bit (bf16, |O| ~ 300: 2.0 vs 0.61 seen);
    - fp32 rounding of the logits: with |s| ~ 1e5 (|x| ~ 100, scale 1) a row whose two best keys
      differ by 0.018 (1.5 fp32 ulps) is decided by summation order (13.2 vs SDPA's 0.38 on that
      one row of 10854 seen); the term is 4 eps32 max|s| spread(v), ~4e-4 for |s| ~ 100.
    """
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(ref.abs().max().item(), 1e-30)))
    logits = 0.0
    if q is not None:
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each query head's K/V head
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else abs(scale)
        s_max = (q.double() @ k.double().transpose(-1, -2)).abs().max().item() * sc
        spread = (v.double().amax() - v.double().amin()).item()
        logits = 4 * torch.finfo(torch.float32).eps * s_max * spread
    return 2 * err_sdpa + 1e-4 + ulp + logits


def visible_keys(sq, sk, causal, align, window, device):
    shift = sk - sq if align == "bottom_right" else 0
    i = torch.arange(sq, device=device)[:, None] + shift
    j = torch.arange(sk, device=device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        ok &= j <= i
    if window is not None:
        if window[1] >= 0:
            ok &= j <= i + window[1]
        if window[0] >= 0:
            ok &= j >= i - window[0]
    return ok


def torch_baseline(q, k, v, causal, align, window, softcap, alibi_slopes=None):
    """torch's attention in q's dtype with the same masks: SDPA with a boolean mask, or for
    soft-capping and ALiBi the biased logits by hand (fp32 logits, P rounded to q's dtype)."""
    g = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(g, dim=1) for t in (k, v))
    sq, sk = q.shape[2], k.shape[2]
    ok = visible_keys(sq, sk, causal, align, window, q.device)
    if softcap is None and alibi_slopes is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=ok)
    else:
        s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if alibi_slopes is not None:
            i = torch.arange(sq, device=q.device)[:, None] + (sk - sq if align == "bottom_right"
                                                              else 0)
            j = torch.arange(sk, device=q.device)[None, :]
            slopes = alibi_slopes.float().expand(q.shape[0], q.shape[1])[:, :, None, None]
            s = s - slopes * (i - j).abs().float()
        s = s.masked_fill(~ok, -math.inf)
        out = (torch.softmax(s, -1).to(q.dtype).float() @ v.float()).to(q.dtype)
    return out.nan_to_num(0.0)  # rows that see no key: 0, as the kernel and the reference


def check_masked_result(res, out, lse, ref, ref_lse, q, k, v, causal, align, window, softcap):
    """A call's poisoned ``out`` (returned as ``res``) and LSE against the float64 reference
    (``ref``, ``ref_lse``) within the prefill tests' bound around torch's own error with the
    same masks."""
    torch.cuda.synchronize()
    assert res is out and torch.isfinite(out).all(), "NaN or unwritten elements"
    err = max_abs(out, ref)
    err_torch = max_abs(torch_baseline(q, k, v, causal, align, window, softcap), ref)
    allowed = allowed_error(err_torch, ref, q.dtype, q, k, v)
    assert err <= allowed, f"max err {err:.3g} vs torch's {err_torch:.3g} (allowed {allowed:.3g})"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "-inf LSE exactly where no key is seen"
    if finite.any():
        assert max_abs(lse[finite], ref_lse[finite]) < 1e-3 * max(1.0, ref_lse.abs().max().item())


def masked_qkv(b, hq, hkv, sq, sk, d, dtype, softcap, seed):
    """Fresh normal q, k, v of a masked call's test; with a soft-cap q is tripled, so that
    logits of a few units make the cap bite."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=gen).to(dtype)
               for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    if softcap is not None:
        q = (q.float() * 3).to(dtype)
    return q, k, v
