"""The eager implementations behind the public ops (and the registered ones): validate, plan,
launch. ``run``: ``flashcore.ops.attention``; ``run_fp8``: ``flashcore.ops.fp8.attention_fp8``."""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from typing import NamedTuple

import torch

from ..runtime.device import arch_of
from ..specs import DEFAULT_FAMILY, FAMILIES, TileConfig, family
from ..tuned import table as tuned_table
from . import plan
from .inputs import E4M3, prepared, readable, tensor_arg, transposed_arg
from .launcher import forget as launcher_forget
from .launcher import launch_attention, launch_plan, planned
from .masks import NO_MASK, Masking, call_masking, folded
from .quantize import run_quantize
from .validate import (
    INT32_MAX,
    alibi_arg,
    check_extents,
    check_fp8_call,
    check_kv_descales,
    check_num_splits,
    check_out,
    check_precision,
    check_qkv,
    exact_ints,
    out_apart,
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
                   seqlen_q, precision, features: tuple = (), group: int = 1,
                   pairs: int = 0, slots: int = 0) -> TileConfig:
    """One TileConfig from what the caller gave: ``config`` whole, or ``tile`` and knobs, or
    (``tile=None``) the tuned table's config for a call with these spec ``features`` over
    ``pairs`` (sequence, query head) pairs on ``slots`` SMs (``plan.tuned_config``) with any
    knob the caller set on top. A decode whose ``group`` query heads a K/V head (of one token
    or a few) are packed into more than 16 rows gets a tile that holds them
    (``plan.packed_rows_config``)."""
    if config is not None:
        if not isinstance(config, TileConfig):
            raise TypeError(f"attention: config must be a TileConfig, got {type(config).__name__}")
        if tile is not None or warps is not None or stages is not None or kv_splits is not None:
            raise ValueError("attention: give either config or tile/warps/stages/kv_splits")
        return config
    if tile is not None:
        return explicit_config(tuple(tile), warps, stages, kv_splits)
    tuned = plan.tuned_config(arch, head_dim, causal, seqlen_q, precision, features, pairs,
                              slots)
    if warps is None and stages is None and kv_splits is None:
        if precision not in ("fp16", "fp8kv"):
            return tuned
        return plan.packed_rows_config(tuned, seqlen_q, group, arch, head_dim,
                                       precision == "fp8kv")
    return tuned.replace(**{k: v for k, v in (("warps", warps), ("stages", stages),
                                              ("kv_splits", kv_splits)) if v is not None})


class Call(NamedTuple):
    """What a validated 16-bit call decides apart from its tensors' data and key length
    (``run``): the ``plan_launch`` arguments with ``key_blocks`` left open, the scale's sign,
    the key tile. Memoised per distinct call, so a repeated call (a decode loop, whose key
    length grows) pays for its checks and its config once, and then only binds tensors."""

    serial: int  # names the call's plans in the launcher's memo (never reused)
    shape: tuple  # (B, H, Sq, D) of q and the output
    negate: bool  # a negative softmax_scale runs as -q (``signed_query``)
    tile_n: int
    q_strides: tuple | None  # q's of modes 0-2, where the kernels read q as it is
    plan_args: tuple  # ``launcher.plan_launch``'s arguments (key_blocks: each call's)


_calls: dict[tuple, Call] = {}
_CALL_MEMO_SIZE = 1024  # distinct calls kept (shapes vary without bound in some programs)
_serials = itertools.count()


def run(q, k, v, tile, causal, softmax_scale, return_lse, config, warps, stages, kv_splits,
        num_splits, out, precision, k_descale, v_descale, mask_align="top_left", window=None,
        softcap=None, alibi_slopes=None):
    """The eager implementation (the registered op's too): validate, plan, launch. A 16-bit
    call whose arguments a checked call had before (any key length; an ``out`` of the same
    shape and strides) takes its memoised ``Call``, checks what depends on addresses, and only
    binds and launches."""
    key = None
    if (precision == "fp16" and k_descale is None and v_descale is None
            and alibi_slopes is None and warps is None and stages is None and kv_splits is None
            and exact_ints(tile, num_splits)):
        try:
            qs, ks = q.shape, k.shape
            folds = folded(causal, call_masking(causal, mask_align, window, softcap), qs[2],
                           ks[2])
            key = (qs, ks[0], ks[1], ks[3], q.dtype, k.dtype, v.dtype, q.get_device(),
                   k.get_device(), v.get_device(), q.stride(), folds, tile, config,
                   num_splits, softmax_scale, return_lse, tuned_table.generation,
                   None if out is None else (out.shape, out.stride(), out.dtype,
                                             out.get_device()))
            call = _calls.get(key)
        except (AttributeError, IndexError, TypeError, ValueError):
            call, key = None, None  # not memoisable, or bad: the checks below name the problem
        if (call is not None and v.shape == ks and 0 < ks[2] <= INT32_MAX
                and (out is None or out_apart(out, (q, k, v)))):
            return _launch(call, q, k, v, return_lse, out)
    return _checked(q, k, v, tile, causal, softmax_scale, return_lse, config, warps, stages,
                    kv_splits, num_splits, out, precision, k_descale, v_descale, mask_align,
                    window, softcap, key, alibi_slopes)


def _checked(q, k, v, tile, causal, softmax_scale, return_lse, config, warps, stages,
             kv_splits, num_splits, out, precision, k_descale, v_descale, mask_align, window,
             softcap, key, alibi_slopes=None):
    """``run`` with every check; a call of ``key`` (not None: memoisable) is remembered."""
    check_qkv(q, k, v)
    alibi = alibi_slopes is not None
    causal, mask = folded(causal, call_masking(causal, mask_align, window, softcap, alibi),
                          q.shape[2], k.shape[2])
    scale = softmax_scale_of(softmax_scale, q.shape[3])
    bias: tuple = ()
    if alibi:
        if precision != "fp16" or k.dtype == E4M3 or scale == 0:
            raise ValueError("attention: alibi_slopes is built for 16-bit q, k and v and a "
                             f"softmax_scale other than 0 (got precision={precision!r}, k "
                             f"{k.dtype}, softmax_scale {scale})")
        alibi_slopes, slopes_arg = alibi_arg(alibi_slopes, q.shape[0], q.shape[1], q)
        bias = (slopes_arg,)
    check_num_splits("attention", num_splits)
    dev = q.get_device()
    if precision != "fp16":
        check_precision(precision, mask.softcap is not None, q.shape[3], k.dtype)
    config = resolve_config(config, tile, warps, stages, kv_splits, arch=arch_of(dev),
                            head_dim=q.shape[3], causal=causal, seqlen_q=q.shape[2],
                            precision="fp8kv" if k.dtype == E4M3 else precision,
                            features=mask.features + _split_feature(num_splits),
                            group=q.shape[1] // k.shape[1], pairs=q.shape[0] * q.shape[1],
                            slots=plan.sm_count(dev))
    B, H, Sq, D = q.shape
    if out is not None:
        check_out(out, q.shape, q.dtype, q.device,
                  {"q": q, "k": k, "v": v, "k_descale": k_descale, "v_descale": v_descale})
    if 0 in (B, H, Sq, k.shape[2]):
        return _empty_result(q, k, return_lse, out)
    negate = scale < 0
    q_strides = q.stride()[:3] if not negate and readable(q) else None
    q, scale = signed_query(q, scale)  # after the checks of the caller's q
    if precision == "fp8":
        return attention_via_fp8(q, k, v, causal=causal, softmax_scale=scale,
                                 return_lse=return_lse, config=config, num_splits=num_splits,
                                 out=out, mask=mask)
    kd, vd = check_kv_descales(k, k_descale, v_descale)
    check_extents(q, k)
    if key is None:  # the general launch (FP8 KV descales, knobs the memo does not take)
        result = out if out is not None else q.new_empty((B, H, Sq, D))
        lse = q.new_empty((B, H, Sq), dtype=torch.float32) if return_lse else None
        # keep any copy prepared() makes alive until the launch: freed earlier, its memory
        # could be handed to a later allocation while the kernel still reads it
        q, q_arg = prepared(q)
        k, k_arg = prepared(k)
        v, v_arg = prepared(v)
        descales = () if kd is None else (kd, vd)
        launch_attention(q, k, result, lse, (q_arg, k_arg, v_arg), descales, config, causal,
                         scale, num_splits, kv_fp8=kd is not None, mask=mask, bias=bias)
        if out is not None:
            torch.autograd.graph.increment_version(out)
        return (result, lse) if return_lse else result
    call = Call(next(_serials), (B, H, Sq, D), negate, config.tile_n, q_strides,
                (dev, B, H, Sq, D, k.shape[1], None, q.dtype, config, causal, return_lse,
                 precision, False, False, mask, False, 0, 0, 0, num_splits, scale))
    if len(_calls) >= _CALL_MEMO_SIZE:
        _calls.clear()
    _calls[key] = call
    return _launch(call, q, k, v, return_lse, out, signed=True)


def _launch(call: Call, q, k, v, return_lse: bool, out, signed: bool = False):
    """Bind a memoised call's tensors and launch it (``signed``: q already is ``signed_query``'s)."""
    if call.negate and not signed:
        q = torch.neg(q)
    result = q.new_empty(call.shape) if out is None else out
    lse = q.new_empty(call.shape[:3], dtype=torch.float32) if return_lse else None
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    b, h, sq, _ = call.shape
    hkv, sk = k.shape[1:3]
    ks, vs = k.stride(), v.stride()
    # ``inputs.readable`` of all three at once (16-bit: strides in multiples of 8 elements;
    # a zero stride, broadcast or not, takes the general path)
    if (call.q_strides is not None and ks[3] == 1 and vs[3] == 1 and not (qp | kp | vp) % 16
            and not (ks[0] | ks[1] | ks[2] | vs[0] | vs[1] | vs[2]) % 8
            and 0 not in ks and 0 not in vs):
        args = ((qp, b, h, sq, *call.q_strides), (kp, b, hkv, sk, *ks[:3]),
                (vp, b, hkv, sk, *vs[:3]))
    else:
        q, q_arg = prepared(q)  # any copies stay alive until the launch (see ``_checked``)
        k, k_arg = prepared(k)
        v, v_arg = prepared(v)
        args = (q_arg, k_arg, v_arg)
    blocks = -(-sk // call.tile_n)
    eager = not plan.capturing()  # eager: short decode grids unsplit (``plan.num_splits``)
    p = planned((call.serial, blocks, eager), (*call.plan_args, eager), blocks)
    launch_plan(p, result, lse, args, ())
    if out is not None:
        torch.autograd.graph.increment_version(out)
    return (result, lse) if return_lse else result


def forget() -> None:
    """Drop the memoised calls and the launcher's plans (after the tuned table changes)."""
    _calls.clear()
    launcher_forget()


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
    fam = family(config.family or DEFAULT_FAMILY[arch])
    if arch not in fam.e4m3_mma_archs and device not in _warned:
        _warned.add(device)
        fast = [f.name for f in FAMILIES.values() if arch in f.e4m3_mma_archs]
        warnings.warn(
            f"flashcore FP8 on {arch} with the {fam.name} family: it has no e4m3 MMA "
            "instruction there (ptxas emulates it with f16 MMAs), so this kernel is slower "
            f"than precision='fp16'; fast on {arch}: {', '.join(fast) or 'none'}",
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
