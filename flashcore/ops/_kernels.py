"""spec + device -> a loaded, launchable kernel (compiled or taken from the cache once)."""

from __future__ import annotations

from typing import Any

import torch

from ..spec import KernelSpec

_loaded: dict[tuple[Any, int], Any] = {}


def arch_of(device: torch.device) -> str:
    """The cubin arch to run on ``device``: sm_90 on Hopper, sm_89 on Ada, sm_80 on other Ampere."""
    arch = _archs.get(device.index)
    if arch is None:  # asking the driver costs tens of µs: once per device
        arch = _archs[device.index] = _arch_of(device)
    return arch


_archs: dict[int | None, str] = {}


def _arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    if major == 9 and minor == 0:
        return "sm_90"
    if major == 8:
        return "sm_89" if minor >= 9 else "sm_80"
    raise ValueError(
        f"flashcore: {device} is sm_{major}{minor}; supported are sm_80, sm_86/87 "
        "(sm_80 kernels), sm_89 and sm_90"
    )


def kernel_for(spec: KernelSpec, device: torch.device):
    key = (spec, device.index)
    k = _loaded.get(key)
    if k is None:
        from ..compiler import compile_kernel
        from ..runtime import load_kernel

        k = load_kernel(compile_kernel(spec), device.index)
        _loaded[key] = k
    return k


def launch(kernel, grid: tuple[int, int, int], args: tuple, device: int) -> None:
    """Launch on CUDA device ``device``'s (an index) current torch stream, with that device's
    context current.

    ``args``: one tuple per parameter; flattened here for the loader's single pack."""
    values = sum(args, ())  # C-level concatenation: cheaper per call than a generator
    # the raw handle: torch.cuda.current_stream() builds a Stream object (~6 µs)
    if torch._C._cuda_getDevice() == device:
        kernel.launch(grid, values, torch._C._cuda_getCurrentRawStream(device))
    else:
        with torch.cuda.device(device):
            kernel.launch(grid, values, torch._C._cuda_getCurrentRawStream(device))


def tensor_arg(t: torch.Tensor) -> tuple:
    """(pointer, extents..., strides...) of a (batch, heads, seq, head_dim) tensor for a
    TensorParam(3, 3): the dynamic extents are batch, heads, seq; the strides those of modes 0-2."""
    b, h, s, _ = t.shape
    sb, sh, ss, _ = t.stride()
    return (t.data_ptr(), b, h, s, sb, sh, ss)


def prepared(t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """(t, tensor_arg(t)) for a (batch, heads, seq, head_dim) input: the kernels need a contiguous
    last dim and a 16-byte aligned base and strides; anything else is copied first. Strides and
    pointer are read once (every attention call goes through here)."""
    sb, sh, ss, sd = t.stride()
    ptr = t.data_ptr()
    if sd != 1 or ptr % 16 or sb % 8 or sh % 8 or ss % 8:
        t = t.contiguous()
        sb, sh, ss, _ = t.stride()
        ptr = t.data_ptr()
    b, h, s, _ = t.shape
    return t, (ptr, b, h, s, sb, sh, ss)


def transposed_arg(t: torch.Tensor) -> tuple:
    """The same for a (batch, heads, head_dim, seq) tensor (FP8 Vᵀ): head_dim (mode 2) is the
    static extent, so the dynamic extents are batch, heads, seq and the strides those of 0-2."""
    b, h, _, s = t.shape
    sb, sh, sd, _ = t.stride()
    return (t.data_ptr(), b, h, s, sb, sh, sd)
