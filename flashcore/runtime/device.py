"""Which kernels a CUDA device runs: its arch, or the arch named in ``FLASHCORE_ARCH``.

``FLASHCORE_ARCH=sm_89`` on an H100 runs the sm_89 kernels there: the loader hands their PTX to
the driver, which compiles it for the device (PTX of an older target runs on newer GPUs). That
checks the exact code an L4 gets, for correctness and races, on a GPU we have; its timings are not
an L4's. The named arch must be one the device can run from PTX (no newer than the device).
"""

from __future__ import annotations

import os

from ..errors import FlashcoreError
from ..specs import ARCHS

ARCH_ENV = "FLASHCORE_ARCH"

_archs: dict[int, str] = {}
_native: dict[int, str] = {}


class UnsupportedDeviceError(FlashcoreError, ValueError):
    """The GPU is of an architecture flashcore has no kernels for."""


def capability(device: int) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(device)


def native_arch(device: int) -> str:
    """The cubin arch of CUDA device ``device`` (an index): sm_90 on Hopper, sm_89 on Ada,
    sm_80 on other Ampere."""
    arch = _native.get(device)
    if arch is None:  # asking the driver costs tens of µs: once per device
        major, minor = capability(device)
        if (major, minor) == (9, 0):
            arch = "sm_90"
        elif major == 8:
            arch = "sm_89" if minor >= 9 else "sm_80"
        else:
            raise UnsupportedDeviceError(
                f"flashcore: cuda:{device} is sm_{major}{minor}; supported are sm_80, sm_86/87 "
                "(sm_80 kernels), sm_89 and sm_90"
            )
        _native[device] = arch
    return arch


def arch_of(device: int) -> str:
    """The arch whose kernels run on ``device``: ``FLASHCORE_ARCH`` if set, else its own."""
    arch = _archs.get(device)
    if arch is None:
        arch = _archs[device] = _chosen_arch(device)
    return arch


def _chosen_arch(device: int) -> str:
    native = native_arch(device)
    wanted = os.environ.get(ARCH_ENV)
    if not wanted or wanted == native:
        return native
    if wanted not in ARCHS:
        raise UnsupportedDeviceError(f"{ARCH_ENV}={wanted!r} is not one of {ARCHS}")
    if not runs_from_ptx(wanted, capability(device)):
        raise UnsupportedDeviceError(
            f"{ARCH_ENV}={wanted}: cuda:{device} ({native}) cannot run {wanted} PTX (only "
            "older targets' PTX runs on a newer GPU)"
        )
    return wanted


def runs_from_ptx(arch: str, cap: tuple[int, int]) -> bool:
    """PTX for ``arch`` can be JIT-compiled for a device of compute capability ``cap``."""
    return (int(arch[3]), int(arch[4:])) <= cap


def visible_archs() -> dict[int, str]:
    """{device index: arch} for every visible CUDA device (empty without CUDA)."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    return {i: arch_of(i) for i in range(torch.cuda.device_count())}


def forget() -> None:
    """Drop the per-device memo (tests that change FLASHCORE_ARCH)."""
    _archs.clear()
    _native.clear()
