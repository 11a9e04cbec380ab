"""spec + device -> a loaded, launchable kernel (compiled or taken from the cache once), and the
launch on torch's current stream."""

from __future__ import annotations

import torch

from ..compiler.compiler import compile_kernel
from ..specs import KernelSpec
from .loader import LoadedKernel, load_kernel

_loaded: dict[tuple[KernelSpec, int], LoadedKernel] = {}


def kernel_for(spec: KernelSpec, device: int) -> LoadedKernel:
    """The loaded kernel of ``spec`` on CUDA device index ``device`` (built or read once)."""
    key = (spec, device)
    k = _loaded.get(key)
    if k is None:
        k = _loaded[key] = load_kernel(compile_kernel(spec), device)
    return k


def launch(kernel: LoadedKernel, grid: tuple[int, int, int], args: tuple, device: int) -> None:
    """Launch on CUDA device ``device``'s current torch stream, with that device's context
    current.

    ``args``: one tuple per parameter; flattened here for the loader's single pack."""
    values = sum(args, ())  # C-level concatenation: cheaper per call than a generator
    # the raw handle: torch.cuda.current_stream() builds a Stream object, microseconds a call
    if torch._C._cuda_getDevice() == device:
        kernel.launch(grid, values, torch._C._cuda_getCurrentRawStream(device))
    else:
        with torch.cuda.device(device):
            kernel.launch(grid, values, torch._C._cuda_getCurrentRawStream(device))
