"""The eager implementations behind the public ops (and the registered ones): validate, plan,
launch. ``run``: ``flashcore.ops.attention``; ``run_fp8``: ``flashcore.ops.fp8.attention_fp8``."""

from __future__ import annotations

import functools
import math
import warnings

import torch

from ..runtime.device import arch_of
from ..specs import TileConfig
from . import plan
from .inputs import E4M3, prepared, tensor_arg, transposed_arg
from .launcher import launch_attention
from .masks import NO_MASK, Masking, call_masking, folded
from .quantize import run_quantize
from .validate import (
    check_extents,
    check_fp8_call,
    check_kv_descales,
    check_num_splits,
    check_out,
    check_precision,
    check_qkv,
    signed_query,
    softmax_scale_of,
)

_warned: set[int] = set()  # devices told that FP8 is emulated there


@functools.lru_cache(maxsize=256)
def explicit_config(tile, warps, stages, kv_splits) -> TileConfig:
    """The TileConfig of explicit knobs (memoised: every eager call with a tile comes here)."""
    return TileConfig(tuple(tile), warps=warps, stages=1 if stages is None else stages,
                      kv_splits=1 if kv_splits is None else kv_splits)


def resolve_config(config, tile, warps, stages, kv_splits, *, arch, head_dim, causal,
                   seqlen_q, precision, features: tuple = (), group: int = 1) -> TileConfig:
    """One TileConfig from what the caller gave: ``config`` whole, or ``tile`` and knobs, or
    (``tile=None``) the tuned table's config for a call with these spec ``features``
    (``plan.tuned_config``) with any knob the caller set on top. A decode whose ``group``
    query heads a K/V head (of one token or a few) are packed into more than 16 rows gets a
    tile that holds them (``plan.packed_rows_config``)."""
    if config is not None:
        if not isinstance(config, TileConfig):
            raise TypeError(f"attention: config must be a TileConfig, got {type(config).__name__}")
        if tile is not None or warps is not None or stages is not None or kv_splits is not None:
            raise ValueError("attention: give either config or tile/warps/stages/kv_splits")
        return config
    if tile is not None:
        return explicit_config(tuple(tile), warps, stages, kv_splits)
    tuned = plan.tuned_config(arch, head_dim, causal, seqlen_q, precision, features)
    if warps is None and stages is None and kv_splits is None:
        if precision not in ("fp16", "fp8kv"):
            return tuned
        return plan.packed_rows_config(tuned, seqlen_q, group, arch, head_dim,
                                       precision == "fp8kv")
    return tuned.replace(**{k: v for k, v in (("warps", warps), ("stages", stages),
                                              ("kv_splits", kv_splits)) if v is not None})


def run(q, k, v, tile, causal, softmax_scale, return_lse, config, warps, stages, kv_splits,
        num_splits, out, precision, k_descale, v_descale, mask_align="top_left", window=None,
        softcap=None):
    """The eager implementation (the registered op's too): validate, plan, launch."""
    check_qkv(q, k, v)
    causal, mask = folded(causal, call_masking(causal, mask_align, window, softcap), q.shape[2],
                          k.shape[2])
    softmax_scale = softmax_scale_of(softmax_scale, q.shape[3])
    check_num_splits("attention", num_splits)
    dev = q.get_device()
    if precision != "fp16":
        check_precision(precision, mask.softcap is not None, q.shape[3], k.dtype)
    config = resolve_config(config, tile, warps, stages, kv_splits, arch=arch_of(dev),
                            head_dim=q.shape[3], causal=causal, seqlen_q=q.shape[2],
                            precision="fp8kv" if k.dtype == E4M3 else precision,
                            features=mask.features + _split_feature(num_splits),
                            group=q.shape[1] // k.shape[1])
    B, H, Sq, D = q.shape
    if out is not None:
        check_out(out, q.shape, q.dtype, q.device,
                  {"q": q, "k": k, "v": v, "k_descale": k_descale, "v_descale": v_descale})
    if 0 in (B, H, Sq, k.shape[2]):
        return _empty_result(q, k, return_lse, out)
    q, softmax_scale = signed_query(q, softmax_scale)  # after the checks of the caller's q
    if precision == "fp8":
        return attention_via_fp8(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                 return_lse=return_lse, config=config, num_splits=num_splits,
                                 out=out, mask=mask)
    kd, vd = check_kv_descales(k, k_descale, v_descale)
    check_extents(q, k)
    result = out if out is not None else q.new_empty((B, H, Sq, D))
    lse = q.new_empty((B, H, Sq), dtype=torch.float32) if return_lse else None
    # keep any copy prepared() makes alive until the launch: freed earlier, its memory could be
    # handed to a later allocation while the kernel still reads it
    q, q_arg = prepared(q)
    k, k_arg = prepared(k)
    v, v_arg = prepared(v)
    descales = () if kd is None else (kd, vd)
    launch_attention(q, k, result, lse, (q_arg, k_arg, v_arg), descales, config, causal,
                     softmax_scale, num_splits, kv_fp8=kd is not None, mask=mask)
    if out is not None:
        torch.autograd.graph.increment_version(out)
    return (result, lse) if return_lse else result


def _split_feature(num_splits: int | None) -> tuple:
    return (("split_kv", True),) if num_splits is not None and num_splits > 1 else ()


def _empty_result(q, k, return_lse, out):
    """Like SDPA: empty outputs for empty queries; zeros (and lse -inf) when there is no key."""
    B, H, Sq, D = q.shape
    result = out if out is not None else q.new_empty((B, H, Sq, D))
    result.zero_()
    lse = q.new_full((B, H, Sq), -math.inf, dtype=torch.float32) if return_lse else None
    return (result, lse) if return_lse else result


def run_fp8(
    q8: torch.Tensor,
    k8: torch.Tensor,
    vt8: torch.Tensor,
    q_descale: torch.Tensor,
    k_descale: torch.Tensor,
    v_descale: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    out_dtype: torch.dtype = torch.float16,
    config: TileConfig | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    mask: Masking = NO_MASK,
):
    """``flashcore.ops.fp8.attention_fp8``, eager."""
    inputs = {"q8": q8, "k8": k8, "vt8": vt8, "q_descale": q_descale, "k_descale": k_descale,
              "v_descale": v_descale}
    q8, k8, vt8, qd, kd, vd = check_fp8_call(q8, k8, vt8, q_descale, k_descale, v_descale,
                                             out_dtype)
    B, H, Sq, D = q8.shape
    softmax_scale = softmax_scale_of(softmax_scale, D)
    q8, softmax_scale = signed_query(q8, softmax_scale)
    device = q8.get_device()
    arch = arch_of(device)
    if config is None:
        config = plan.tuned_config(arch, D, causal, Sq, "fp8" if kd.dim() == 3 else "fp8khead",
                                   mask.features + _split_feature(num_splits))
    if arch == "sm_90" and config.family != "wgmma_ws" and device not in _warned:
        _warned.add(device)
        warnings.warn(
            f"flashcore FP8 on sm_90 with the {config.family or 'mma_sync'} family: Hopper has "
            "no e4m3 mma.sync (ptxas emulates it with f16 MMAs), so this kernel is slower than "
            "precision='fp16'; the wgmma_ws family (e4m3 wgmma) is fast",
            RuntimeWarning,
            stacklevel=3,
        )
    given = out
    if out is None:
        out = torch.empty((B, H, Sq, D), dtype=out_dtype, device=q8.device)
    else:
        check_out(out, (B, H, Sq, D), out_dtype, q8.device, inputs, "attention_fp8")
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q8.device) if return_lse else None
    launch_attention(q8, k8, out, lse, (tensor_arg(q8), tensor_arg(k8), transposed_arg(vt8)),
                     (qd, kd, vd), config, causal, softmax_scale, num_splits, precision="fp8",
                     mask=mask)
    if given is not None:
        torch.autograd.graph.increment_version(given)
    return (out, lse) if return_lse else out


def attention_via_fp8(q, k, v, *, causal, softmax_scale, return_lse, config, num_splits, out,
                      mask: Masking = NO_MASK):
    """Quantise fp16/bf16 q, k, v, then ``attention_fp8``; the output has q's dtype."""
    q8, qd = run_quantize(q, granularity="token")
    k8, kd = run_quantize(k, granularity="token")
    vt8, vd = run_quantize(v, transpose=True)
    return run_fp8(
        q8, k8, vt8, qd, kd, vd, causal=causal, softmax_scale=softmax_scale,
        return_lse=return_lse, out_dtype=q.dtype, config=config, num_splits=num_splits, out=out,
        mask=mask,
    )
