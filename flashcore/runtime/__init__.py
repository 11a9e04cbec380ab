"""Load cubins and launch them with cuda-python's driver API on torch's current stream."""

from .loader import LoadedKernel, load_kernel

__all__ = ["LoadedKernel", "load_kernel"]
