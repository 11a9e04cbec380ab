"""Thin checked access to ``cuda.bindings.driver``: every call's CUresult is checked."""

from __future__ import annotations

from typing import Any

from ..errors import DriverError

try:
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - older cuda-python layout
    from cuda import cuda as cu  # type: ignore[no-redef]


def check(result: Any, what: str) -> Any:
    """Unwrap a cuda-python result tuple ``(CUresult, *values)``; raise DriverError on failure."""
    if isinstance(result, tuple):
        err, *values = result
    else:
        err, values = result, []
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        text = cu.cuGetErrorString(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(name)
        text = text.decode() if isinstance(text, bytes) else str(text)
        raise DriverError(f"{what} failed: {name} ({text})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)
