"""Helpers shared by the GPU tests (importable without CUDA)."""

from __future__ import annotations

import torch

requires_cuda = None
try:
    import pytest

    requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
except ImportError:  # pragma: no cover
    pass


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN so any element the kernel fails to write shows up."""
    return t.fill_(float("nan"))


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()
