"""The fp16/bf16 -> e4m3 quantisers (eager): scales from the data, per token or per (batch, head),
and V's transposed, key-permuted layout for the FP8 attention kernel."""

from __future__ import annotations

import torch

from ..compiler.abi import MAX_GRID_Z
from ..runtime.device import arch_of
from ..runtime.launch import kernel_for, launch
from ..specs import FP8_HEAD_DIMS, QuantizeSpec
from ..specs.quantize import AMAX_SHARES
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
    x: torch.Tensor, *, transpose: bool = False, granularity: str = "head",
    check_finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flashcore.ops.fp8.quantize_fp8``, eager. ``check_finite``: refuse a non-finite input
    (one read of x and one synchronisation; skipped inside a CUDA graph capture)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"quantize_fp8: x must be a 4-d tensor, got {getattr(x, 'shape', x)!r}")
    if x.dtype not in DTYPE_NAMES:
        raise TypeError(f"quantize_fp8: x has dtype {x.dtype}; expected float16 or bfloat16")
    if x.device.type != "cuda":
        raise ValueError(f"quantize_fp8: x is on {x.device}; expected a CUDA tensor")
    B, H, S, D = x.shape
    if D not in FP8_HEAD_DIMS:
        raise ValueError(f"quantize_fp8: head_dim {D} is not supported; e4m3 kernels are built "
                         f"for {FP8_HEAD_DIMS}")
    if x.numel() == 0:
        raise ValueError(f"quantize_fp8: x is empty (shape {tuple(x.shape)})")
    if H > MAX_GRID_Z:
        raise ValueError(f"quantize_fp8: {H} heads is more than the {MAX_GRID_Z} a grid holds")
    if check_finite and not torch.cuda.is_current_stream_capturing():
        check_finite_input(x)
    if granularity == "token":
        out = torch.empty((B, H, S, D), dtype=E4M3, device=x.device)
        descale = torch.empty((B, H, S), dtype=torch.float32, device=x.device)
    elif transpose:
        out = torch.empty((B, H, D, padded_keys(S)), dtype=E4M3, device=x.device)
        descale = torch.empty((B, H), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((B, H, S, D), dtype=E4M3, device=x.device)
        descale = torch.empty((B, H), dtype=torch.float32, device=x.device)
    # the grid's z dimension is the batch: past its limit, slices of the batch in turn
    for b0 in range(0, B, MAX_GRID_Z):
        b1 = min(b0 + MAX_GRID_Z, B)
        _quantize_into(x[b0:b1], out[b0:b1], descale[b0:b1], transpose, granularity)
    return out, descale


def check_finite_input(x: torch.Tensor) -> None:
    """Refuse a tensor with an inf or NaN: one of them would make its whole scale group's codes
    NaN (448 / inf is 0, and 0 · inf is NaN)."""
    finite = torch.isfinite(x)
    if not finite.all():
        where = tuple(int(i) for i in (~finite).nonzero()[0])
        raise ValueError(f"quantize_fp8: x has non-finite values (the first at index {where}): "
                         "its scale group would quantise to NaN; quantise finite values only")


def _quantize_into(x: torch.Tensor, out: torch.Tensor, descale: torch.Tensor, transpose: bool,
                   granularity: str) -> None:
    """Quantise ``x`` (at most MAX_GRID_Z batches) into ``out`` and ``descale``."""
    B, H, S, D = x.shape
    x, x_arg = prepared(x)
    dev = x.get_device()
    kern = _kernel(dev, x.dtype, D, transpose, granularity, "cast")
    rows = kern.artifact.spec.threads // (D // 8)  # a CTA's rows, 16 bytes a thread
    if granularity == "token":
        st = descale.stride()
        args = (x_arg, tensor_arg(out), (descale.data_ptr(), B, H, S, st[0], st[1]))
        launch(kern, (-(-S // rows), H, B), args, dev)
        return
    # per (batch, head): the partial maxima of AMAX_SHARES CTAs each, then the cast by blocks
    # of rows (or of keys for Vᵀ, every padded key written: zeros past S, where P is 0 and V
    # must be finite), each CTA reducing the shares for its scale
    shares = torch.empty(B * H * AMAX_SHARES, dtype=torch.float32, device=x.device)
    partial = (shares.data_ptr(), B, H, AMAX_SHARES, H * AMAX_SHARES, AMAX_SHARES)
    launch(_kernel(dev, x.dtype, D, False, "head", "amax"), (AMAX_SHARES, H, B),
           (x_arg, partial), dev)
    descale_arg = (descale.data_ptr(), B, H, descale.stride(0))
    if transpose:
        keys_per_cta = 32 * (kern.artifact.spec.threads // D)
        launch(kern, (-(-padded_keys(S) // keys_per_cta), H, B),
               (x_arg, transposed_arg(out), partial, descale_arg), dev)
        return
    launch(kern, (-(-S // rows), H, B), (x_arg, tensor_arg(out), partial, descale_arg), dev)


def _kernel(device: int, dtype: torch.dtype, head_dim: int, transpose: bool, granularity: str,
            part: str):
    key = (device, dtype, head_dim, transpose, granularity, part)
    kern = _kernels.get(key)
    if kern is None:  # building and validating a spec costs more than the launch
        spec = QuantizeSpec(arch=arch_of(device), dtype=DTYPE_NAMES[dtype], head_dim=head_dim,
                            transpose=transpose, granularity=granularity, part=part)
        kern = _kernels[key] = kernel_for(spec, device)
    return kern
