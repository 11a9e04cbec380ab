"""``flashcore.ops.attention``: validate, pick the kernel spec, launch on torch's current stream."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ..build.abi import LOG2_E, attention_grid
from ..runtime.device import arch_of
from ..runtime.launch import kernel_for, launch
from ..spec import HEAD_DIMS, AttentionSpec, TileConfig
from ..tuning.table import bucket_of, lookup
from .inputs import DTYPE_NAMES, prepared, tensor_arg

_DTYPE_NAMES = DTYPE_NAMES

# (device index, dtype, head_dim, config, causal, lse) -> LoadedKernel
_kernels: dict[tuple, Any] = {}
_NO_LSE = (0, 0, 0, 0, 0, 0)


@functools.lru_cache(maxsize=256)
def _explicit_config(tile, warps, stages, kv_splits) -> TileConfig:
    """The TileConfig of explicit knobs (memoised: every eager call with a tile comes here)."""
    return TileConfig(tuple(tile), warps=warps, stages=1 if stages is None else stages,
                      kv_splits=1 if kv_splits is None else kv_splits)


def resolve_config(config, tile, warps, stages, kv_splits, *, arch, head_dim, causal,
                   seqlen_q, precision) -> TileConfig:
    """One TileConfig from what the caller gave: ``config`` whole, or ``tile`` and knobs, or
    (``tile=None``) the tuned table's config with any knob the caller set on top."""
    knobs = {"warps": warps, "stages": stages, "kv_splits": kv_splits}
    if config is not None:
        if not isinstance(config, TileConfig):
            raise TypeError(f"attention: config must be a TileConfig, got {type(config).__name__}")
        if tile is not None or any(v is not None for v in knobs.values()):
            raise ValueError("attention: give either config or tile/warps/stages/kv_splits")
        return config
    if tile is not None:
        return _explicit_config(tuple(tile), warps, stages, kv_splits)
    tuned = lookup(arch, head_dim, causal, bucket_of(seqlen_q), precision)
    changes = {k: v for k, v in knobs.items() if v is not None}
    return tuned.replace(**changes) if changes else tuned


def _get_kernel(device: int, dtype: torch.dtype, d: int, config: TileConfig, causal, lse):
    """The loaded kernel for this config on CUDA device index ``device`` (built once)."""
    key = (device, dtype, d, config, causal, lse)
    k = _kernels.get(key)
    if k is None:
        spec = AttentionSpec(arch=arch_of(device), dtype=DTYPE_NAMES[dtype], head_dim=d,
                             config=config, causal=causal, return_lse=lse)
        k = _kernels[key] = kernel_for(spec, device)
    return k


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise an error naming the first problem with q, k, v; return quietly if there is none."""
    # Fast path, one pass over the attributes (every call pays for it); the named errors below.
    try:
        qs, ks, vs, dt = q.shape, k.shape, v.shape, q.dtype
        if (
            len(qs) == 4 and len(ks) == 4 and len(vs) == 4
            and dt in _DTYPE_NAMES and k.dtype == dt and v.dtype == dt
            and qs[3] in HEAD_DIMS and ks[3] == qs[3] and vs[3] == qs[3]
            and ks[:2] == qs[:2] and vs[:3] == ks[:3]
            and 0 not in qs and 0 not in ks
            and q.is_cuda and k.is_cuda and v.is_cuda
            and q.get_device() == k.get_device() == v.get_device()
        ):
            return
    except AttributeError:  # not a tensor: named below
        pass
    _explain(q, k, v)


def _explain(q, k, v) -> None:
    # Shape and dtype problems are reported before device ones, so each is named precisely.
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"attention: {name} must have 4 dims (batch, heads, seq, head_dim), "
                f"got shape {tuple(t.shape)}"
            )
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(
                f"attention: {name} has dtype {t.dtype}; supported are float16 and bfloat16"
            )
        if t.numel() == 0:
            raise ValueError(f"attention: {name} is empty (shape {tuple(t.shape)})")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"attention: dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    B, H, _, D = q.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"attention: head_dim {D} is not supported; supported are {HEAD_DIMS}")
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != B or t.shape[1] != H or t.shape[3] != D:
            raise ValueError(
                f"attention: {name} has shape {tuple(t.shape)}, expected ({B}, {H}, seq_k, {D}) "
                f"to match q {tuple(q.shape)}"
            )
    if k.shape[2] != v.shape[2]:
        raise ValueError(
            f"attention: k and v sequence lengths differ ({k.shape[2]} vs {v.shape[2]})"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_cuda:
            raise ValueError(f"attention: {name} is on {t.device}; flashcore runs on CUDA tensors")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention: devices differ: q {q.device}, k {k.device}, v {v.device}")


def _check_out(out: torch.Tensor, q: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"attention: out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"attention: out is {tuple(out.shape)} {out.dtype} on {out.device}; expected "
            f"{tuple(q.shape)} {q.dtype} on {q.device}"
        )
    st = out.stride()
    if st[3] != 1 or out.data_ptr() % 16 or any(s % 8 for s in st[:3]):
        raise ValueError(
            "attention: out needs a contiguous last dim, a 16-byte aligned base and strides "
            f"that are multiples of 8 elements; got strides {st}"
        )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tile: tuple[int, int] | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    config: TileConfig | None = None,
    warps: int | None = None,
    stages: int | None = None,
    kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    precision: str = "fp16",
):
    """softmax(scale · q kᵀ [+ causal mask]) v, like torch's SDPA, for (batch, heads, seq, head_dim).

    ``causal`` follows torch's ``is_causal`` (top-left: query i sees keys j <= i). A query row that
    sees no key gets 0. With ``return_lse`` also returns the float32 log-sum-exp (batch, heads,
    seq_q) of the scaled scores (natural log; -inf for a row with no visible key).

    ``out``, if given, receives the result: shape and dtype of q, on q's device, last dim
    contiguous, 16-byte aligned. ``tile``, ``warps``, ``stages`` and ``kv_splits`` (key-range
    splits inside a CTA, for short problems) pick the compiled kernel; ``tile=None`` takes the
    autotuner's winner for this GPU, head dim, masking and sequence length
    (``flashcore.autotune``; Ada borrows the H100 table, whose configs all fit an L4), or
    (64, 64) where none was tuned.

    ``precision="fp8"`` (sm_89, sm_90) quantises q, k, v to float8_e4m3fn with per-(batch, head)
    scales taken from the data (no finite input overflows) and runs the e4m3 MMA kernel; see
    ``flashcore.ops.fp8`` for the lower-level entry on already-quantised tensors.
    """
    _validate(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"attention: causal must be a bool, got {causal!r}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[3])
    elif not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)):
        raise ValueError(f"attention: softmax_scale must be a finite number, got {softmax_scale!r}")
    config = resolve_config(
        config, tile, warps, stages, kv_splits, arch=arch_of(q.get_device()), head_dim=q.shape[3],
        causal=causal, seqlen_q=q.shape[2], precision=precision,
    )
    if precision == "fp8":
        from .fp8 import attention_via_fp8

        if out is not None:
            _check_out(out, q)
        return attention_via_fp8(
            q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
            config=config, out=out,
        )
    if precision != "fp16":
        raise ValueError(f"attention: precision must be 'fp16' or 'fp8', got {precision!r}")

    B, H, Sq, D = q.shape
    dev = q.get_device()
    kern = _get_kernel(dev, q.dtype, D, config, causal, return_lse)
    # keep any copy prepared() made alive until the launch: freed earlier, its memory could be
    # handed to `out` below while the kernel still reads it
    q, q_arg = prepared(q)
    k, k_arg = prepared(k)
    v, v_arg = prepared(v)
    if out is None:
        out = q.new_empty((B, H, Sq, D))
    else:
        _check_out(out, q)
    if return_lse:
        lse = q.new_empty((B, H, Sq), dtype=torch.float32)
        lse_arg = (lse.data_ptr(), B, H, Sq, H * Sq, Sq)
    else:
        lse = None
        lse_arg = _NO_LSE
    args = (q_arg, k_arg, v_arg, tensor_arg(out), lse_arg, (softmax_scale * LOG2_E,))
    launch(kern, attention_grid(Sq, H, B, kern.artifact.spec.tile_m), args, dev)
    return (out, lse) if return_lse else out
