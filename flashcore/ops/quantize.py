"""The fp16/bf16 -> e4m3 quantisers (eager): scales from the data, per token or per (batch, head),
and V's transposed, key-permuted layout for the FP8 attention kernel."""

from __future__ import annotations

import math

import torch

from ..runtime.device import arch_of
from ..runtime.launch import kernel_for, launch
from ..spec import HEAD_DIMS, QuantizeSpec
from .inputs import DTYPE_NAMES, E4M3, prepared, tensor_arg, transposed_arg

VT_PAD = 128  # Vᵀ's key extent is padded to this (the largest tile_n): its tiles are never ragged
_kernels: dict[tuple, object] = {}  # call-site key -> loaded quantiser (no spec work per call)


def key_permutation() -> list[int]:
    """perm[p] = the key stored at position p of each group of 32 in Vᵀ."""
    perm = []
    for p in range(32):
        half, q = divmod(p, 16)
        t, i = divmod(q, 4)
        perm.append(16 * half + 8 * (i // 2) + 2 * t + i % 2)
    return perm


def padded_keys(seqlen_k: int) -> int:
    return -(-seqlen_k // VT_PAD) * VT_PAD


def run_quantize(
    x: torch.Tensor, *, transpose: bool = False, granularity: str = "head"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flashcore.ops.fp8.quantize_fp8``, eager."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"quantize_fp8: x must be a 4-d tensor, got {getattr(x, 'shape', x)!r}")
    if x.dtype not in DTYPE_NAMES:
        raise TypeError(f"quantize_fp8: x has dtype {x.dtype}; expected float16 or bfloat16")
    if x.device.type != "cuda":
        raise ValueError(f"quantize_fp8: x is on {x.device}; expected a CUDA tensor")
    B, H, S, D = x.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"quantize_fp8: head_dim {D} is not supported; supported are {HEAD_DIMS}")
    if x.numel() == 0:
        raise ValueError(f"quantize_fp8: x is empty (shape {tuple(x.shape)})")
    x, x_arg = prepared(x)
    key = (x.get_device(), x.dtype, D, transpose, granularity)
    kern = _kernels.get(key)
    if kern is None:  # building and validating a spec costs more than the launch
        spec = QuantizeSpec(arch=arch_of(x.get_device()), dtype=DTYPE_NAMES[x.dtype], head_dim=D,
                            transpose=transpose, granularity=granularity)
        kern = _kernels[key] = kernel_for(spec, x.get_device())
    if transpose:
        # the kernel writes every padded key (zeros past S: P is 0 there and V must be finite),
        # a CTA per 32 * threads / D keys, with the amax of each (batch, head) given: one
        # reduction here, so the cast is not one CTA per head
        out = torch.empty((B, H, D, padded_keys(S)), dtype=E4M3, device=x.device)
        amax = torch.linalg.vector_norm(x, ord=math.inf, dim=(2, 3), dtype=torch.float32)
        descale = torch.empty((B, H), dtype=torch.float32, device=x.device)
        args = (x_arg, transposed_arg(out), (amax.data_ptr(), B, H, H),
                (descale.data_ptr(), B, H, H))
        keys_per_cta = 32 * (kern.artifact.spec.threads // D)
        launch(kern, (-(-padded_keys(S) // keys_per_cta), H, B), args, x.get_device())
        return out, descale
    out = torch.empty((B, H, S, D), dtype=E4M3, device=x.device)
    out_arg = tensor_arg(out)
    if granularity == "token":
        descale = torch.empty((B, H, S), dtype=torch.float32, device=x.device)
        args = (x_arg, out_arg, (descale.data_ptr(), B, H, S, H * S, S))
        rows = kern.artifact.spec.threads // (D // 8)
        launch(kern, (-(-S // rows), H, B), args, x.get_device())
    else:
        descale = torch.empty((B, H), dtype=torch.float32, device=x.device)
        args = (x_arg, out_arg, (descale.data_ptr(), B, H, H))
        launch(kern, (H, B, 1), args, x.get_device())
    return out, descale
