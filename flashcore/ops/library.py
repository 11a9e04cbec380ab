"""flashcore's ops registered with ``torch.library``, so ``torch.compile(fullgraph=True)``,
``torch.export`` and CUDA graphs under ``mode="reduce-overhead"`` trace through them:

    torch.ops.flashcore.attention(q, k, v, causal=..., ...) -> (out, lse)
    torch.ops.flashcore.attention_fp8(q8, k8, vt8, q_descale, k_descale, v_descale, ...)
    torch.ops.flashcore.quantize_fp8(x, transpose=..., granularity=...) -> (x8, descale)
    torch.ops.flashcore.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, ...) -> (out, lse)
    torch.ops.flashcore.attention_paged(q, k_cache, v_cache, block_table, seqlens_k, ...)

Each returns a fixed structure (``lse`` is an empty tensor unless asked for). Each op is written
once: its fake implementation is made from its signature and a function of the shapes it
returns (``_registered``). Eager calls of
``flashcore.ops.attention`` skip this layer (it costs host time) and run the same code directly.

``torch.ops.flashcore.attention`` and ``.attention_varlen`` have autograd formulas
(``flashcore.ops.backward``: the registered ``attention_backward`` and
``attention_varlen_backward`` ops) for 16-bit calls, masks included;
its backward raises an error naming what it lacks for FP8 operands and the FP8 KV cache. The
other ops carry a formula whose backward raises an error that says so, so a compiled model
never trains silently through attention.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor

from ..runtime.scratch import fresh_scratch
from ..specs import TileConfig
from .backward import needs_grad, register_attention_backward
from .backward_varlen import register_varlen_backward
from .eager import explicit_config, run, run_fp8
from .inputs import E4M3
from .quantize import padded_keys, run_quantize
from .serving import run_paged, run_varlen
from .validate import check_out_meta

_NO_GRAD = ("flashcore.ops.attention has no backward yet; run it under torch.no_grad() or "
            "detach its inputs")


def _config_arg(config) -> str | None:
    """A caller's whole ``TileConfig`` as the registered ops carry it, one string (an op's
    schema takes no dataclass): every field, the kernel family included. Plain formatting,
    which torch.compile traces (json's C encoder it cannot)."""
    if config is None:
        return None
    if not isinstance(config, TileConfig):
        raise TypeError(f"attention: config must be a TileConfig, got {type(config).__name__}")
    c = config
    return f"{c.tile_m},{c.tile_n},{c.warps},{c.stages},{c.kv_splits},{c.family}"


def _op_config(config: str | None, tile, warps, stages, kv_splits) -> TileConfig | None:
    """Inside an op: the caller's config (``_config_arg``), or one made of the knobs given."""
    if config is not None:
        if tile is not None or warps is not None or stages is not None or kv_splits is not None:
            raise ValueError("attention: give either config or tile/warps/stages/kv_splits")
        m, n, w, s, k, family = config.split(",")
        return TileConfig((int(m), int(n)), warps=int(w), stages=int(s), kv_splits=int(k),
                          family=family)
    if tile is None:
        return None
    return explicit_config(tuple(tile), warps, stages, kv_splits)  # as eager builds it


def _lse_or_empty(q: Tensor, lse: Tensor | None) -> Tensor:
    return lse if lse is not None else q.new_empty((0,), dtype=torch.float32)


def _fake_of(impl, outputs):
    """A registered op's fake implementation from its real one's signature: ``outputs`` gets
    every argument by name (defaults filled in) and gives the shapes and dtypes the op returns,
    so no op's signature is written twice."""
    signature = inspect.signature(impl)

    def fake(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return outputs(**bound.arguments)

    return fake


def _registered(name: str, outputs):
    """``impl`` registered as ``flashcore::name``, with its fake made by ``_fake_of``. Inside
    the op every scratch tensor is fresh (``runtime.scratch.fresh_scratch``): compiled code may
    run it in a CUDA graph's memory pool."""
    def register(impl):
        @functools.wraps(impl)
        def body(*args, **kwargs):
            with fresh_scratch():
                return impl(*args, **kwargs)

        op = torch.library.custom_op(f"flashcore::{name}", mutates_args=())(body)
        op.register_fake(_fake_of(impl, outputs))
        return op

    return register


def _rows_lse(q: Tensor, return_lse: bool, shape) -> Tensor:
    return q.new_empty(shape, dtype=torch.float32) if return_lse else _lse_or_empty(q, None)


@_registered("attention", lambda q, return_lse, **_: (
    q.new_empty(q.shape), _rows_lse(q, return_lse, q.shape[:3])))
def _attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
               softmax_scale: float | None = None, return_lse: bool = False,
               tile: list[int] | None = None, warps: int | None = None,
               stages: int | None = None, kv_splits: int | None = None,
               num_splits: int | None = None, precision: str = "fp16",
               k_descale: Tensor | None = None,
               v_descale: Tensor | None = None, mask_align: str = "top_left",
               window: list[int] | None = None, softcap: float | None = None,
               config: str | None = None, alibi_slopes: Tensor | None = None,
               deterministic: bool = False) -> tuple[Tensor, Tensor]:
    # ``deterministic`` shapes the backward only (``backward.setup_attention_context``)
    res = run(q, k, v, None if tile is None else tuple(tile), causal, softmax_scale, return_lse,
              _op_config(config, None, None, None, None), warps, stages, kv_splits, num_splits,
              None, precision, k_descale, v_descale, mask_align,
              None if window is None else tuple(window), softcap, alibi_slopes)
    return (res[0], res[1]) if return_lse else (res, _lse_or_empty(q, None))


@_registered("attention_fp8", lambda q8, return_lse, out_dtype, **_: (
    q8.new_empty(q8.shape, dtype=out_dtype), _rows_lse(q8, return_lse, q8.shape[:3])))
def _attention_fp8(q8: Tensor, k8: Tensor, vt8: Tensor, q_descale: Tensor, k_descale: Tensor,
                   v_descale: Tensor, causal: bool = False, softmax_scale: float | None = None,
                   return_lse: bool = False, out_dtype: torch.dtype = torch.float16,
                   tile: list[int] | None = None, warps: int | None = None,
                   stages: int | None = None, kv_splits: int | None = None,
                   num_splits: int | None = None,
                   config: str | None = None) -> tuple[Tensor, Tensor]:
    res = run_fp8(q8, k8, vt8, q_descale, k_descale, v_descale, causal=causal,
                  softmax_scale=softmax_scale, return_lse=return_lse, out_dtype=out_dtype,
                  config=_op_config(config, tile, warps, stages, kv_splits),
                  num_splits=num_splits, out=None)
    return (res[0], res[1]) if return_lse else (res, _lse_or_empty(q8, None))


def _quantized(x, transpose, granularity, **_):
    B, H, S, D = x.shape
    x8 = x.new_empty((B, H, D, padded_keys(S)) if transpose else (B, H, S, D), dtype=E4M3)
    shape = (B, H, S) if granularity == "token" else (B, H)
    return x8, x.new_empty(shape, dtype=torch.float32)


@_registered("quantize_fp8", _quantized)
def _quantize_fp8(x: Tensor, transpose: bool = False, granularity: str = "head",
                  check_finite: bool = False) -> tuple[Tensor, Tensor]:
    return run_quantize(x, transpose=transpose, granularity=granularity,
                        check_finite=check_finite)


@_registered("attention_varlen", lambda q, return_lse, **_: (
    q.new_empty(q.shape), _rows_lse(q, return_lse, (q.shape[1], q.shape[0]))))
def _attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                      cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                      causal: bool = False, softmax_scale: float | None = None,
                      return_lse: bool = False, mask_align: str = "top_left",
                      window: list[int] | None = None, softcap: float | None = None,
                      tile: list[int] | None = None, warps: int | None = None,
                      stages: int | None = None, kv_splits: int | None = None,
                      check_lengths: bool = True, config: str | None = None,
                      alibi_slopes: Tensor | None = None,
                      deterministic: bool = False) -> tuple[Tensor, Tensor]:
    # ``deterministic`` shapes the backward only (``backward_varlen.setup_varlen_context``)
    res = run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                     softmax_scale, return_lse, mask_align=mask_align,
                     window=None if window is None else tuple(window), softcap=softcap,
                     config=_op_config(config, tile, warps, stages, kv_splits),
                     check_lengths=check_lengths, alibi_slopes=alibi_slopes)
    return (res[0], res[1]) if return_lse else (res, _lse_or_empty(q, None))


@_registered("attention_paged", lambda q, return_lse, cu_seqlens_q, **_: (
    q.new_empty(q.shape), _rows_lse(q, return_lse, (q.shape[1], q.shape[0])
                                    if cu_seqlens_q is not None else q.shape[:3])))
def _attention_paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                     seqlens_k: Tensor, causal: bool = False, softmax_scale: float | None = None,
                     return_lse: bool = False, cu_seqlens_q: Tensor | None = None,
                     max_seqlen_q: int | None = None, mask_align: str = "top_left",
                     window: list[int] | None = None, softcap: float | None = None,
                     tile: list[int] | None = None, warps: int | None = None,
                     stages: int | None = None, kv_splits: int | None = None,
                     num_splits: int | None = None, check_lengths: bool = True,
                     k_descale: Tensor | None = None, v_descale: Tensor | None = None,
                     config: str | None = None,
                     alibi_slopes: Tensor | None = None) -> tuple[Tensor, Tensor]:
    res = run_paged(q, k_cache, v_cache, block_table, seqlens_k, causal, softmax_scale,
                    return_lse, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                    mask_align=mask_align, window=None if window is None else tuple(window),
                    softcap=softcap, config=_op_config(config, tile, warps, stages, kv_splits),
                    num_splits=num_splits, check_lengths=check_lengths, k_descale=k_descale,
                    v_descale=v_descale, alibi_slopes=alibi_slopes)
    return (res[0], res[1]) if return_lse else (res, _lse_or_empty(q, None))


def _no_backward(ctx, *grads):
    raise RuntimeError(_NO_GRAD)


def _save_nothing(ctx, inputs, output):
    pass


for _op in (_attention_fp8, _attention_paged):
    _op.register_autograd(_no_backward, setup_context=_save_nothing)
register_attention_backward(_attention)
register_varlen_backward(_attention_varlen)


def _traced(res, lse, out, return_lse, op: str = "attention"):
    """A registered op's (out, lse) as the public function returns them (into ``out``, which
    must be exactly what eager takes: its shape, dtype and device)."""
    if out is not None:
        check_out_meta(out, tuple(res.shape), res.dtype, res.device, op)
        out.copy_(res)
        res = out
    return (res, lse) if return_lse else res


def attention_op(q, k, v, *, tile, causal, softmax_scale, return_lse, config, warps, stages,
                 kv_splits, num_splits, out, precision, k_descale, v_descale,
                 mask_align="top_left", window=None, softcap=None, alibi_slopes=None,
                 deterministic=False):
    """``flashcore.ops.attention`` through the registered op (tracing, tensor subclasses,
    autograd). Under grad the op always computes the LSE: its backward needs it."""
    keep_lse = return_lse or needs_grad(q, k, v)
    res, lse = torch.ops.flashcore.attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=keep_lse,
        tile=None if tile is None else list(tile), warps=warps, stages=stages,
        kv_splits=kv_splits, num_splits=num_splits, config=_config_arg(config),
        precision=precision, k_descale=k_descale, v_descale=v_descale, mask_align=mask_align,
        window=None if window is None else list(window),
        softcap=None if softcap is None else float(softcap), alibi_slopes=alibi_slopes,
        deterministic=deterministic)
    return _traced(res, lse, out, return_lse)


def attention_fp8_op(q8, k8, vt8, q_descale, k_descale, v_descale, *, causal, softmax_scale,
                     return_lse, out_dtype, config, num_splits, out):
    res, lse = torch.ops.flashcore.attention_fp8(
        q8, k8, vt8, q_descale, k_descale, v_descale, causal=causal,
        softmax_scale=softmax_scale, return_lse=return_lse, out_dtype=out_dtype,
        num_splits=num_splits, config=_config_arg(config))
    return _traced(res, lse, out, return_lse, "attention_fp8")


def quantize_fp8_op(x, *, transpose, granularity, check_finite=False):
    return torch.ops.flashcore.quantize_fp8(x, transpose=transpose, granularity=granularity,
                                            check_finite=check_finite)


def attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                        causal, softmax_scale, return_lse, mask_align, window, softcap, tile,
                        config, out, check_lengths, alibi_slopes=None, deterministic=False):
    """``flashcore.ops.attention_varlen`` through the registered op (tracing, autograd). Under
    grad the op always computes the LSE: its backward needs it."""
    res, lse = torch.ops.flashcore.attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        softmax_scale=softmax_scale, return_lse=return_lse or needs_grad(q, k, v),
        mask_align=mask_align,
        window=None if window is None else list(window),
        softcap=None if softcap is None else float(softcap),
        tile=None if tile is None else list(tile), check_lengths=check_lengths,
        config=_config_arg(config), alibi_slopes=alibi_slopes, deterministic=deterministic)
    return _traced(res, lse, out, return_lse, "attention_varlen")


def attention_paged_op(q, k_cache, v_cache, block_table, seqlens_k, *, causal, softmax_scale,
                       return_lse, cu_seqlens_q, max_seqlen_q, mask_align, window, softcap,
                       tile, config, num_splits, out, check_lengths, k_descale=None,
                       v_descale=None, alibi_slopes=None):
    """``flashcore.ops.attention_paged`` through the registered op (tracing)."""
    res, lse = torch.ops.flashcore.attention_paged(
        q, k_cache, v_cache, block_table, seqlens_k, causal=causal, softmax_scale=softmax_scale,
        return_lse=return_lse, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
        mask_align=mask_align, window=None if window is None else list(window),
        softcap=None if softcap is None else float(softcap),
        tile=None if tile is None else list(tile), num_splits=num_splits,
        check_lengths=check_lengths, k_descale=k_descale, v_descale=v_descale,
        config=_config_arg(config), alibi_slopes=alibi_slopes)
    return _traced(res, lse, out, return_lse, "attention_paged")
