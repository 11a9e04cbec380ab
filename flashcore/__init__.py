"""flashcore: attention kernels described by data, compiled with the CuTe DSL, launched with cuda-python."""

from __future__ import annotations

from .errors import (
    CacheCorruptionError,
    CatalogError,
    CompileError,
    DriverError,
    FlashcoreError,
    KernelNotAvailableError,
    LaunchError,
    SpecError,
)
from .specs import AttentionSpec, TileConfig
from .version import __version__


def __getattr__(name: str):
    # Lazy: importing flashcore stays cheap and works without torch's CUDA or the DSL.
    if name in ("compile_kernel", "compile_many", "can_compile"):
        from .compiler import compiler

        return getattr(compiler, name)
    if name == "load_catalog":
        from .runtime.catalog import load_catalog

        return load_catalog
    if name == "KernelArtifact":
        from .compiler.artifact import KernelArtifact

        return KernelArtifact
    if name == "ops":
        import importlib

        return importlib.import_module(".ops", __name__)
    raise AttributeError(f"module 'flashcore' has no attribute {name!r}")


__all__ = [
    "AttentionSpec",
    "CacheCorruptionError",
    "CatalogError",
    "CompileError",
    "DriverError",
    "FlashcoreError",
    "KernelNotAvailableError",
    "LaunchError",
    "SpecError",
    "TileConfig",
    "__version__",
    "can_compile",
    "compile_kernel",
    "compile_many",
    "load_catalog",
]
