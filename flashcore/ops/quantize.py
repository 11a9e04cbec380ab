"""The fp16/bf16 -> e4m3 quantisers (eager): scales from the data, per token or per (batch, head),
and V's transposed, key-permuted layout for the FP8 attention kernel."""

from __future__ import annotations

import torch

from ..runtime.device import arch_of
from ..runtime.launch import kernel_for, launch
from ..spec import HEAD_DIMS, QuantizeSpec
from ..spec.quantize import AMAX_SHARES
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
    dev = x.get_device()
    kern = _kernel(dev, x.dtype, D, transpose, granularity, "cast")
    rows = kern.artifact.spec.threads // (D // 8)  # a CTA's rows, 16 bytes a thread
    if granularity == "token":
        out = torch.empty((B, H, S, D), dtype=E4M3, device=x.device)
        descale = torch.empty((B, H, S), dtype=torch.float32, device=x.device)
        args = (x_arg, tensor_arg(out), (descale.data_ptr(), B, H, S, H * S, S))
        launch(kern, (-(-S // rows), H, B), args, dev)
        return out, descale
    # per (batch, head): the partial maxima of AMAX_SHARES CTAs each, then the cast by blocks
    # of rows (or of keys for Vᵀ, every padded key written: zeros past S, where P is 0 and V
    # must be finite), each CTA reducing the shares for its scale
    shares = torch.empty(B * H * AMAX_SHARES, dtype=torch.float32, device=x.device)
    partial = (shares.data_ptr(), B, H, AMAX_SHARES, H * AMAX_SHARES, AMAX_SHARES)
    descale = torch.empty((B, H), dtype=torch.float32, device=x.device)  # its own storage
    launch(_kernel(dev, x.dtype, D, False, "head", "amax"), (AMAX_SHARES, H, B),
           (x_arg, partial), dev)
    descale_arg = (descale.data_ptr(), B, H, H)
    if transpose:
        out = torch.empty((B, H, D, padded_keys(S)), dtype=E4M3, device=x.device)
        keys_per_cta = 32 * (kern.artifact.spec.threads // D)
        launch(kern, (-(-padded_keys(S) // keys_per_cta), H, B),
               (x_arg, transposed_arg(out), partial, descale_arg), dev)
        return out, descale
    out = torch.empty((B, H, S, D), dtype=E4M3, device=x.device)
    launch(kern, (-(-S // rows), H, B), (x_arg, tensor_arg(out), partial, descale_arg), dev)
    return out, descale


def _kernel(device: int, dtype: torch.dtype, head_dim: int, transpose: bool, granularity: str,
            part: str):
    key = (device, dtype, head_dim, transpose, granularity, part)
    kern = _kernels.get(key)
    if kern is None:  # building and validating a spec costs more than the launch
        spec = QuantizeSpec(arch=arch_of(device), dtype=DTYPE_NAMES[dtype], head_dim=head_dim,
                            transpose=transpose, granularity=granularity, part=part)
        kern = _kernels[key] = kernel_for(spec, device)
    return kern
