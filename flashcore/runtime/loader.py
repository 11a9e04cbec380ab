"""One loaded module per (kernel, device), with argument buffers prepared once.

``cuModuleLoadData`` loads into the calling thread's current context; we make torch's primary
context of the target device current first (a torch device guard), so torch and flashcore share it.
Launching packs arguments into preallocated ctypes buffers and calls ``cuLaunchKernel`` on the
stream given (torch's current stream): no allocation and no per-call Python objects beyond that.
Hopper kernels go through ``cuLaunchKernelEx`` with programmatic stream serialisation (PDL): their
launch overlaps the tail of the grid before them, which they wait for on the device.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import threading
from dataclasses import dataclass

from ..compiler.abi import ScalarParam, TensorMapParam, TensorParam, check_against_entry, params_for
from ..compiler.artifact import KernelArtifact
from ..errors import LaunchError
from .device import capability, native_arch, runs_from_ptx
from .driver import check, cu

_DEFAULT_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in
_SUCCESS = cu.CUresult.CUDA_SUCCESS
_NO_CONTEXT = (cu.CUresult.CUDA_ERROR_INVALID_CONTEXT, cu.CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED)


@dataclass
class LoadedKernel:
    artifact: KernelArtifact
    device: int
    module: object
    function: object
    params: tuple

    def __post_init__(self) -> None:
        # One buffer holds every parameter at its aligned offset, packed by one Struct: a launch
        # is one pack_into and one cuLaunchKernel.
        fmt, offsets, pos = "<", [], 0
        for p in self.params:
            pad = -pos % p.align
            fmt += "x" * pad + p.fmt.lstrip("<")
            pos += pad
            offsets.append(pos)
            pos += p.size
        self._struct = struct.Struct(fmt)
        if self._struct.size != pos:
            raise LaunchError(f"{self.artifact.entry}: packed {self._struct.size} B, expected {pos}")
        self._buf = ctypes.create_string_buffer(max(pos, 1))
        base = ctypes.addressof(self._buf)
        self._argv = (ctypes.c_void_p * len(offsets))(*[base + o for o in offsets])
        self._argv_addr = ctypes.addressof(self._argv)
        self._lock = threading.Lock()  # the buffer is shared; cuLaunchKernel copies it
        self._block = self.artifact.block
        self._smem = self.artifact.smem_dynamic
        self.programmatic = getattr(self.artifact.spec, "programmatic_launch", False)
        # TMA kernels: the descriptors the launcher encodes, in parameter order
        self.tensor_maps = tuple(p for p in self.params if isinstance(p, TensorMapParam))
        self.tma_args_memo: dict[tuple, tuple] = {}  # the launcher's, per call arguments
        self._configs: dict[tuple, object] = {}  # (grid, stream) -> CUlaunchConfig

    def launch(self, grid: tuple[int, int, int], values: tuple, stream: int) -> None:
        """``values``: every parameter's fields, flattened in ABI order (see flashcore.abi)."""
        result, call = self._launch(grid, values, stream)
        if result[0] in _NO_CONTEXT:
            # a thread whose first CUDA work is this launch may have no current context (torch
            # sets one lazily): make the device's primary context (torch's) current, then again
            make_primary_context_current(self.device)
            result, call = self._launch(grid, values, stream)
        if result[0] != _SUCCESS:  # the message is built only on failure (every call gets here)
            check(result, f"{call}({self.artifact.entry}, grid={grid})")

    def _launch(self, grid: tuple[int, int, int], values: tuple, stream: int):
        with self._lock:
            self._struct.pack_into(self._buf, 0, *values)
            if self.programmatic and _pdl_enabled[0]:
                call = "cuLaunchKernelEx"
                result = cu.cuLaunchKernelEx(
                    self._config(grid, stream), self.function, self._argv_addr, 0
                )
            else:
                call = "cuLaunchKernel"
                bx, by, bz = self._block
                result = cu.cuLaunchKernel(
                    self.function, grid[0], grid[1], grid[2], bx, by, bz, self._smem,
                    stream, self._argv_addr, 0,
                )
        return result, call

    def _config(self, grid: tuple[int, int, int], stream: int):
        """The launch configuration with programmatic stream serialisation allowed: the grid may
        start while the previous one in the stream drains (the kernel waits for it with
        ``griddepcontrol.wait`` before touching memory). Built once per grid and stream."""
        key = (grid, stream)
        cfg = self._configs.get(key)
        if cfg is None:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg = cu.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self._block
            cfg.sharedMemBytes = self._smem
            cfg.hStream = stream
            cfg.attrs = [attr]
            cfg.numAttrs = 1
            if len(self._configs) >= 64:  # shapes vary without bound in some programs
                self._configs.clear()
            self._configs[key] = cfg
        return cfg


def make_primary_context_current(device: int) -> None:
    """Make CUDA device ``device``'s primary context (the one torch uses) current here."""
    dev = check(cu.cuDeviceGet(device), f"cuDeviceGet({device})")
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain({device})")
    check(cu.cuCtxSetCurrent(ctx), f"cuCtxSetCurrent(cuda:{device})")
    check(cu.cuDevicePrimaryCtxRelease(dev), f"cuDevicePrimaryCtxRelease({device})")


# ``FLASHCORE_PDL=0`` launches Hopper kernels the plain way (debugging); see plain_launches()
_pdl_enabled = [os.environ.get("FLASHCORE_PDL", "1") != "0"]


def programmatic_launch_enabled() -> bool:
    return _pdl_enabled[0]


@contextlib.contextmanager
def plain_launches():
    """Launch without programmatic serialisation inside this block (the benchmark's A/B; not
    thread-safe: it flips a process-wide switch)."""
    old = _pdl_enabled[0]
    _pdl_enabled[0] = False
    try:
        yield
    finally:
        _pdl_enabled[0] = old


_loaded: dict[tuple[str, str, int], LoadedKernel] = {}
_load_lock = threading.Lock()


def load_kernel(artifact: KernelArtifact, device: int) -> LoadedKernel:
    """Load ``artifact`` on CUDA device ``device`` (once; later calls hit a table)."""
    key = (artifact.entry, artifact.spec.content_hash + artifact.source_hash, device)
    hit = _loaded.get(key)
    if hit is not None:
        return hit
    import torch

    with _load_lock:
        hit = _loaded.get(key)
        if hit is not None:
            return hit
        params = params_for(artifact.spec)
        try:
            check_against_entry(params, artifact.params)
        except ValueError as e:
            raise LaunchError(f"{artifact.entry}: {e}") from e
        _check_arch(artifact, device)
        # another (older) arch's kernel runs from its PTX, compiled by the driver for this GPU
        image = artifact.cubin if artifact.spec.arch == native_arch(device) else (
            artifact.ptx.encode() + b"\0")
        with torch.cuda.device(device):
            torch.cuda.current_stream(device)  # makes torch's primary context current
            module = check(cu.cuModuleLoadData(image), f"cuModuleLoadData({artifact.entry})")
            function = check(
                cu.cuModuleGetFunction(module, artifact.entry.encode()),
                f"cuModuleGetFunction({artifact.entry})",
            )
            if artifact.smem_dynamic > _DEFAULT_SMEM_LIMIT:
                check(
                    cu.cuFuncSetAttribute(
                        function,
                        cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        artifact.smem_dynamic,
                    ),
                    f"cuFuncSetAttribute({artifact.entry}, max dynamic smem)",
                )
        lk = LoadedKernel(artifact, device, module, function, params)
        _loaded[key] = lk
        return lk


def _check_arch(artifact: KernelArtifact, device: int) -> None:
    arch = artifact.spec.arch
    if arch == native_arch(device):
        return
    # Another arch's kernel runs from its PTX when that PTX targets an older GPU.
    if not runs_from_ptx(arch, capability(device)):
        major, minor = capability(device)
        raise LaunchError(
            f"{artifact.entry} was built for {arch}; cuda:{device} is sm_{major}{minor}"
        )


__all__ = ["LoadedKernel", "ScalarParam", "TensorParam", "load_kernel"]
