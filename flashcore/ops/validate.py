"""Checking what the user passes to the attention ops: every error names the argument and the
problem. The common case is one pass over a few attributes (every call pays for it); the named
errors are worked out only when that pass fails."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..specs import FP8_HEAD_DIMS, HEAD_DIMS
from .inputs import DTYPE_NAMES, E4M3, readable, readable_copy
from .plan import MAX_SPLITS
from .quantize import padded_keys

INT32_MAX = 2**31 - 1


def head_dim_problem(head_dim: int) -> str | None:
    """Why the ops refuse ``head_dim`` (None: they run it)."""
    if head_dim in HEAD_DIMS:
        return None
    return f"head_dim {head_dim} is not supported; supported are {HEAD_DIMS}"


def check_qkv(q, k, v) -> None:
    """q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D) on one CUDA device, fp16/bf16 (k and v may be
    an e4m3 KV cache), D in HEAD_DIMS, Hq a multiple of Hkv."""
    try:
        qs, ks, vs, dt = q.shape, k.shape, v.shape, q.dtype
        if (
            len(qs) == 4 and len(ks) == 4 and ks == vs
            and dt in DTYPE_NAMES and k.dtype == v.dtype and (k.dtype == dt or k.dtype == E4M3)
            and qs[3] in HEAD_DIMS and ks[3] == qs[3] and ks[0] == qs[0]
            and ks[1] and qs[1] % ks[1] == 0
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
    if q.dtype not in DTYPE_NAMES:
        raise TypeError(f"attention: q has dtype {q.dtype}; supported are float16 and bfloat16")
    for name, t in (("k", k), ("v", v)):
        if t.dtype not in (q.dtype, E4M3):
            raise TypeError(
                f"attention: dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype} (k and v "
                "take q's dtype, or float8_e4m3fn for an FP8 KV cache)"
            )
    if k.dtype != v.dtype:
        raise TypeError(f"attention: k and v dtypes differ ({k.dtype} vs {v.dtype})")
    B, Hq, _, D = q.shape
    problem = head_dim_problem(D)
    if problem is not None:
        raise ValueError(f"attention: {problem}")
    if k.shape != v.shape:
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(
            f"attention: k has shape {tuple(k.shape)}, expected ({B}, heads_kv, seq_k, {D}) to "
            f"match q {tuple(q.shape)}"
        )
    if k.shape[1] == 0 or Hq % k.shape[1]:
        raise ValueError(
            f"attention: q has {Hq} heads and k/v {k.shape[1]}: the query heads must be a whole "
            "multiple of the key/value heads (grouped-query attention)"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_cuda:
            raise ValueError(f"attention: {name} is on {t.device}; flashcore runs on CUDA tensors")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention: devices differ: q {q.device}, k {k.device}, v {v.device}")


def check_kv_descales(k, k_descale, v_descale, op: str = "attention",
                      paged: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 KV cache needs float32 per-token descales for k and v, shaped like k without
    head_dim: (B, Hkv, Sk), or (pages, page_size, Hkv) for a paged cache; 16-bit k/v take none.
    Returns them with a unit last stride (dense; a paged cache's are read with any strides)."""
    if k.dtype != E4M3:
        if k_descale is not None or v_descale is not None:
            raise ValueError(f"{op}: k_descale/v_descale are for float8_e4m3fn k and v")
        return None, None
    if k.shape[-1] not in FP8_HEAD_DIMS:
        raise ValueError(f"{op}: an FP8 KV cache is built for head_dim in {FP8_HEAD_DIMS}, "
                         f"not {k.shape[-1]}; keep k and v in q's dtype")
    want = tuple(k.shape[:3])
    how = ("flashcore.ops.fp8.quantize_paged_cache(cache)" if paged else
           "flashcore.ops.fp8.quantize_fp8(x, granularity='token')")
    for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
        if t is None:
            raise ValueError(f"{op}: float8_e4m3fn k and v need {name} (float32, shape "
                             f"{want}: {how})")
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32
                or tuple(t.shape) != want or t.device != k.device):
            raise ValueError(f"{op}: {name} must be float32 of shape {want} on {k.device}, "
                             f"got {getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}")
    if paged:
        return k_descale, v_descale
    return (k_descale if k_descale.stride(2) == 1 else k_descale.contiguous(),
            v_descale if v_descale.stride(2) == 1 else v_descale.contiguous())


def check_fp8_operand(name: str, t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """An ``attention_fp8`` operand: e4m3 of ``shape``; returned as the kernels can read it
    (``inputs.readable_copy``)."""
    if not isinstance(t, torch.Tensor) or t.dtype != E4M3:
        raise TypeError(f"attention_fp8: {name} must be a float8_e4m3fn tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != shape:
        raise ValueError(f"attention_fp8: {name} has shape {tuple(t.shape)}, expected {shape}")
    return readable_copy(t)


def check_fp8_descale(name: str, t: torch.Tensor, shape: tuple, device,
                      per_head: tuple | None = None) -> torch.Tensor:
    """An ``attention_fp8`` descale: float32 of ``shape`` (or of ``per_head``, where one per
    (batch, head) is taken too) on ``device``; returned contiguous."""
    shapes = (shape,) if per_head is None else (shape, per_head)
    if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32
            or tuple(t.shape) not in shapes or t.device != device):
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(f"attention_fp8: {name} must be float32 of shape {want} on {device}, "
                         f"got {getattr(t, 'dtype', None)} {tuple(getattr(t, 'shape', ()))}")
    return t.contiguous()


def softmax_scale_of(softmax_scale, head_dim: int) -> float:
    """The softmax scale of a call: 1 / sqrt(head_dim) unless given (a finite number)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)):
        raise ValueError(f"attention: softmax_scale must be a finite number, got {softmax_scale!r}")
    return softmax_scale


def signed_query(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """(q, scale) as the kernels take them, scale >= 0. A kernel subtracts each row's running
    max of q·k before exp2, which bounds the scaled logits only when the scale is not negative
    (with a negative one p overflows: inf in 16-bit P, saturated e4m3). A negative scale runs
    as -q with |scale|: the same logits, for one negated copy of q."""
    if scale >= 0:
        return q, scale
    if q.dtype == E4M3:  # flip the sign bit: exact, and NaN stays NaN
        return (q.view(torch.uint8) ^ 0x80).view(E4M3), -scale
    return torch.neg(q), -scale


def check_num_splits(op: str, num_splits) -> None:
    """``num_splits``: None (planned) or an int in 1..MAX_SPLITS."""
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"{op}: num_splits must be an int in 1..{MAX_SPLITS}, got {num_splits!r}")


def check_grad(q, k, v, why: str | None = None) -> None:
    """Refuse inputs that would silently lose their gradients in a call without a backward
    (``why``: what the call has that the backward lacks)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        names = [n for n, t in (("q", q), ("k", k), ("v", v)) if t.requires_grad]
        what = "yet" if why is None else f"for {why} yet"
        raise RuntimeError(
            f"flashcore.ops.attention has no backward {what}, and {', '.join(names)} require "
            "grad: the output would carry no gradient to them. Call it under torch.no_grad() or "
            "torch.inference_mode(), pass detached tensors, or pass allow_no_grad=True to get a "
            "result that is not differentiable"
        )


def check_extents(*tensors: torch.Tensor) -> None:
    """Kernels take batch, heads and sequence extents as 32-bit integers."""
    for t in tensors:
        if t.numel() > INT32_MAX and max(t.shape[:-1], default=0) > INT32_MAX:
            raise ValueError(f"attention: a dimension of {tuple(t.shape)} is over 2**31 - 1, "
                             "more than flashcore's kernels index")


def check_out(out, shape: tuple, dtype: torch.dtype, device: torch.device, inputs: dict,
              op: str = "attention", aligned: bool = True) -> None:
    """A caller's ``out=``: a tensor of exactly ``shape``, ``dtype`` and ``device``, whose
    elements are distinct and share no memory with any of ``inputs`` ({name: tensor}); with
    ``aligned``, one the kernels can store into as it is (an op that stores through a scratch
    tensor otherwise passes False)."""
    check_out_meta(out, shape, dtype, device, op)
    if _self_overlapping(out):
        raise ValueError(f"{op}: out overlaps itself (strides {out.stride()} for shape "
                         f"{tuple(out.shape)}): elements would be written twice")
    if aligned and not readable(out):
        align = 16 // out.element_size()
        raise ValueError(
            f"{op}: out needs a contiguous last dim, a 16-byte aligned base and strides that "
            f"are multiples of {align} elements; got strides {out.stride()}")
    for name, t in inputs.items():
        if t is not None and _ranges_overlap(out, t):
            raise ValueError(f"{op}: out shares memory with {name}; the kernel would "
                             "overwrite inputs that other blocks still read")


def alibi_arg(slopes, batch: int, heads: int, q: Tensor, op: str = "attention") -> tuple:
    """ALiBi's slopes: float32 (heads,) or (batch, heads) on q's device (batch: sequences of a
    packed batch), as (the tensor the kernel reads, its argument: pointer, batch, heads, batch
    stride; 0 for one slope a head)."""
    if (not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32
            or slopes.device != q.device or tuple(slopes.shape) not in ((heads,), (batch, heads))):
        raise ValueError(f"{op}: alibi_slopes must be float32 of shape ({heads},) or "
                         f"({batch}, {heads}) on {q.device}, got "
                         f"{getattr(slopes, 'dtype', type(slopes).__name__)} "
                         f"{tuple(getattr(slopes, 'shape', ()))}")
    if slopes.stride(-1) != 1:
        slopes = slopes.contiguous()
    return slopes, (slopes.data_ptr(), batch, heads, slopes.stride(0) if slopes.dim() == 2 else 0)


def exact_ints(tile, num_splits) -> bool:
    """Whether the knobs a memoised call is keyed on are None or ints: a key matches equal
    values (2.0 == 2), which the checks would refuse."""
    return ((num_splits is None or type(num_splits) is int)
            and (tile is None or (type(tile) is tuple and len(tile) == 2
                                  and type(tile[0]) is int and type(tile[1]) is int)))


def out_apart(out, inputs: tuple) -> bool:
    """The part of ``check_out`` that depends on addresses: a 16-byte aligned base and no
    memory shared with any of ``inputs`` (for a call whose shapes and strides passed it)."""
    return out.data_ptr() % 16 == 0 and not any(_ranges_overlap(out, t) for t in inputs)


def check_out_meta(out, shape: tuple, dtype: torch.dtype, device: torch.device,
                   op: str = "attention") -> None:
    """The part of ``check_out`` that needs no memory addresses (also run while tracing)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"{op}: out is {tuple(out.shape)} {out.dtype} on {out.device}; expected "
            f"{tuple(shape)} {dtype} on {device}"
        )


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (0, 0)
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1)
    start = t.data_ptr()
    return start, start + (span + 1) * t.element_size()


def _ranges_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    return a0 < b1 and b0 < a1


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two indices of ``t`` address one element (e.g. a stride-0 expand)."""
    extent = 1
    for n, s in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n > 1),
                       key=lambda x: x[1]):
        if s < extent:
            return True
        extent = s * n
    return False


# -- the serving layouts' arguments (flashcore.ops.serving) --
def op_error(op: str, what: str) -> ValueError:
    return ValueError(f"{op}: {what}")


def check_tensor(op: str, name: str, t, dims: int, dtypes, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise op_error(op, f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected one of {tuple(dtypes)}")
    if not t.is_cuda:
        raise op_error(op, f"{name} is on {t.device}; flashcore runs on CUDA tensors")
    if device is not None and t.device != device:
        raise op_error(op, f"{name} is on {t.device}, q on {device}")


def check_heads(op: str, q_heads: int, kv_heads: int, head_dim: int, kv_dim: int) -> None:
    problem = head_dim_problem(head_dim)
    if problem is not None:
        raise op_error(op, problem)
    if kv_dim != head_dim:
        raise op_error(op, f"q has head_dim {head_dim}, k/v {kv_dim}")
    if kv_heads == 0 or q_heads % kv_heads:
        raise op_error(op, f"q has {q_heads} heads and k/v {kv_heads}: the query heads must be a "
                        "whole multiple of the key/value heads (grouped-query attention)")


def check_int32(op: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT32_MAX:
        raise op_error(op, f"{name} must be an int in 0..2**31-1, got {value!r}")
    return value


def int32_vector(op: str, name: str, t, device, length: int | None = None) -> torch.Tensor:
    check_tensor(op, name, t, 1, (torch.int32,), device)
    if length is not None and t.shape[0] != length:
        raise op_error(op, f"{name} has {t.shape[0]} entries, expected {length}")
    return t.contiguous()


# -- the backward's arguments (flashcore.ops.backward) --
def check_like(name: str, t: Any, q: Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"attention_backward: {name} must be a torch.Tensor, got "
                        f"{type(t).__name__}")
    if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
        raise ValueError(f"attention_backward: {name} is {tuple(t.shape)} {t.dtype} on "
                         f"{t.device}; expected q's {tuple(q.shape)} {q.dtype} on {q.device}")


def check_rows(name: str, t: Any, q: Tensor) -> Tensor:
    """A float32 (B, H, S_q) row tensor (the LSE, its gradient), returned with a unit last
    stride."""
    want = tuple(q.shape[:3])
    if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != want
            or t.device != q.device):
        raise ValueError(f"attention_backward: {name} must be float32 of shape {want} on "
                         f"{q.device}, got {getattr(t, 'dtype', type(t).__name__)} "
                         f"{tuple(getattr(t, 'shape', ()))}")
    return t if t.stride(2) == 1 else t.contiguous()


def grad_buffer(name: str, t: Tensor | None, like: Tensor) -> Tensor:
    """A gradient's output: ``t`` (contiguous, of ``like``'s shape, dtype and device) or a new
    tensor."""
    if t is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if (not isinstance(t, torch.Tensor) or t.shape != like.shape or t.dtype != like.dtype
            or t.device != like.device or not t.is_contiguous()):
        raise ValueError(f"attention_backward: {name} must be a contiguous {like.dtype} tensor "
                         f"of shape {tuple(like.shape)} on {like.device}")
    return t


# -- FP8 (flashcore.ops.eager) --
def check_precision(precision: str, softcap: bool, head_dim: int, kv_dtype) -> None:
    """``attention``'s ``precision`` other than "fp16": "fp8", without a soft-cap, at an FP8
    head dim, over 16-bit k and v."""
    if precision != "fp8":
        raise ValueError(f"attention: precision must be 'fp16' or 'fp8', got {precision!r}")
    if softcap:
        raise ValueError("attention: softcap needs precision='fp16' (the FP8 kernel never forms "
                         "the true logits: its query descales fold into the exp2 scale)")
    if head_dim not in FP8_HEAD_DIMS:
        raise ValueError(f"attention: precision='fp8' is built for head_dim in {FP8_HEAD_DIMS}, "
                         f"not {head_dim}; use precision='fp16'")
    if kv_dtype == E4M3:
        raise ValueError("attention: precision='fp8' quantises 16-bit k and v itself; an FP8 KV "
                         "cache runs with precision='fp16' (16-bit arithmetic)")


def check_fp8_call(q8, k8, vt8, q_descale, k_descale, v_descale, out_dtype) -> tuple:
    """``attention_fp8``'s operands and descales, each checked by name: (q8, k8, vt8, q, k
    and v descales) as the kernel reads them."""
    if q8.dim() != 4 or k8.dim() != 4:
        raise ValueError("attention_fp8: q8 and k8 must be (batch, heads, seq, head_dim)")
    B, H, Sq, D = q8.shape
    Hkv, Sk = k8.shape[1], k8.shape[2]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"attention_fp8: q8 has {H} heads and k8 {Hkv}: the query heads must be "
                         "a whole multiple of the key/value heads")
    q8 = check_fp8_operand("q8", q8, (B, H, Sq, D))
    k8 = check_fp8_operand("k8", k8, (B, Hkv, Sk, D))
    vt8 = check_fp8_operand("vt8", vt8, (B, Hkv, D, padded_keys(Sk)))
    if not (q8.device == k8.device == vt8.device) or q8.device.type != "cuda":
        raise ValueError("attention_fp8: q8, k8 and vt8 must be on one CUDA device")
    if D not in FP8_HEAD_DIMS or min(B, H, Sq, Sk) == 0:
        raise ValueError(f"attention_fp8: unsupported or empty shape {tuple(q8.shape)}")
    if out_dtype not in DTYPE_NAMES:
        raise TypeError(f"attention_fp8: out_dtype must be float16 or bfloat16, got {out_dtype}")
    qd = check_fp8_descale("q_descale", q_descale, (B, H, Sq), q8.device)
    kd = check_fp8_descale("k_descale", k_descale, (B, Hkv, Sk), q8.device, (B, Hkv))
    vd = check_fp8_descale("v_descale", v_descale, (B, Hkv), q8.device)
    return q8, k8, vt8, qd, kd, vd
