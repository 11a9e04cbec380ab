"""Exceptions raised by flashcore. Every one names the thing that is wrong."""

from __future__ import annotations


class FlashcoreError(Exception):
    """Base class of every flashcore error."""


class SpecError(FlashcoreError, ValueError):
    """A kernel spec asks for something the compiler cannot build."""


class CompileError(FlashcoreError, RuntimeError):
    """The CuTe DSL failed to build a kernel for a (valid) spec."""


class CacheCorruptionError(FlashcoreError, RuntimeError):
    """An on-disk artifact failed its checksum or could not be parsed."""


class KernelNotAvailableError(FlashcoreError, RuntimeError):
    """A kernel is not in the cache and this host cannot compile it."""


class CatalogError(FlashcoreError, ValueError):
    """A prebuilt kernel catalog is malformed, tampered with, or for another arch."""


class DriverError(FlashcoreError, RuntimeError):
    """A CUDA driver call returned an error."""


class LaunchError(FlashcoreError, ValueError):
    """Arguments do not match the compiled kernel's parameter list."""
