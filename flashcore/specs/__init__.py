"""Kernel specs: a kernel described by data (frozen, hashable, JSON-serialisable).

Pure data: importing this package needs neither torch nor the CuTe DSL.
"""

from __future__ import annotations

from typing import Any

from ..errors import SpecError
from .arch import (
    ARCHS,
    BACKWARD_HEAD_DIMS,
    DTYPES,
    FP8_ARCHS,
    FP8_HEAD_DIMS,
    HEAD_DIMS,
    PDL_ARCHS,
    SMEM_PER_BLOCK,
    SMEM_PER_SM,
)
from .attention import PRECISIONS, AttentionSpec
from .backward import BACKWARD_OPS, BackwardSpec
from .combine import MAX_SPLITS, CombineSpec
from .families import DEFAULT_FAMILY, FAMILIES, dsl_arch, family
from .kv_append import KvAppendSpec
from .quantize import QuantizeSpec
from .serial import SPEC_VERSION
from .tile import TileConfig, default_warps, tile_config

KernelSpec = AttentionSpec | QuantizeSpec | CombineSpec | BackwardSpec | KvAppendSpec
_SPEC_CLASSES = {"attention_fwd": AttentionSpec, "quantize_fp8": QuantizeSpec,
                 "attention_combine": CombineSpec, "kv_append": KvAppendSpec,
                 **{op: BackwardSpec for op in BACKWARD_OPS}}


def spec_from_dict(d: Any) -> KernelSpec:
    """Rebuild any kernel spec from its ``to_dict`` form (dispatching on ``op``)."""
    if not isinstance(d, dict):
        raise SpecError(f"a spec must be a JSON object, got {type(d).__name__}")
    op = d.get("op", "attention_fwd")
    cls = _SPEC_CLASSES.get(op)
    if cls is None:
        raise SpecError(f"unknown kernel op {op!r}; known: {sorted(_SPEC_CLASSES)}")
    return cls.from_dict(d)


__all__ = [
    "ARCHS",
    "BACKWARD_HEAD_DIMS",
    "BACKWARD_OPS",
    "DEFAULT_FAMILY",
    "DTYPES",
    "FAMILIES",
    "FP8_ARCHS",
    "FP8_HEAD_DIMS",
    "HEAD_DIMS",
    "MAX_SPLITS",
    "PDL_ARCHS",
    "PRECISIONS",
    "SMEM_PER_BLOCK",
    "SMEM_PER_SM",
    "SPEC_VERSION",
    "AttentionSpec",
    "BackwardSpec",
    "CombineSpec",
    "KernelSpec",
    "KvAppendSpec",
    "QuantizeSpec",
    "SpecError",
    "TileConfig",
    "default_warps",
    "dsl_arch",
    "family",
    "spec_from_dict",
    "tile_config",
]
