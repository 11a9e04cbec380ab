"""How one run-time kernel parameter lies in the kernel's parameter buffer (the PTX ``.param``).

The CuTe DSL passes a ``cute.Tensor`` by value as a struct: a 64-bit pointer, then each run-time
(dynamic) shape entry as i32, then each dynamic stride as i64 (8-byte aligned). Static entries
are left out, and so is an optional tensor the spec does not use. ``flashcore.specs.params``
declares which of these each kernel takes; the runtime packs them and the compiler checks them
against the PTX ``.entry`` (``flashcore.compiler.abi``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorParam:
    name: str
    dynamic_shapes: int  # how many i32 shape entries follow the pointer
    dynamic_strides: int  # how many i64 strides follow

    @property
    def size(self) -> int:
        return _align(8 + 4 * self.dynamic_shapes, 8) + 8 * self.dynamic_strides

    @property
    def align(self) -> int:
        return 8

    @property
    def fmt(self) -> str:
        pad = _align(8 + 4 * self.dynamic_shapes, 8) - (8 + 4 * self.dynamic_shapes)
        return "<Q" + "i" * self.dynamic_shapes + "x" * pad + "q" * self.dynamic_strides


@dataclass(frozen=True)
class ScalarParam:
    name: str
    fmt: str  # struct format of one value, e.g. "<f"

    @property
    def size(self) -> int:
        return struct.calcsize(self.fmt)

    @property
    def align(self) -> int:
        return self.size


@dataclass(frozen=True)
class TensorMapParam:
    """A TMA descriptor (``CUtensorMap``, 128 bytes, 64-byte aligned) passed by value, encoded by
    the runtime (``flashcore.runtime.tensor_map``) for a (batch, heads, seq, head_dim) tensor:
    TMA dims (head_dim, seq, heads, batch), box (``box_cols`` elements, ``box_rows`` rows, 1, 1),
    a ``swizzle``-byte swizzle, zero fill past the ends. ``tensor``: which tensor argument it
    describes; ``dtype``: its element type ("": the call's 16-bit dtype); ``transposed``: FP8
    Vᵀ, (batch, heads, head_dim, keys) walked as (keys, head_dim, heads, batch)."""

    name: str
    tensor: str
    box_rows: int
    box_cols: int = 64  # 128 bytes of 16-bit elements: the swizzle span
    dtype: str = ""
    swizzle: int = 128
    transposed: bool = False

    size: int = 128
    align: int = 64
    fmt: str = "<128s"


@dataclass(frozen=True)
class CoordParam:
    """The run-time extents of a TMA coordinate tensor: (seq, heads, batch) as i32 (the DSL
    passes them even where the kernel never reads them)."""

    name: str
    extents: int = 3

    @property
    def size(self) -> int:
        return 4 * self.extents

    @property
    def align(self) -> int:
        return 4

    @property
    def fmt(self) -> str:
        return "<" + "i" * self.extents


Packed = TensorParam | ScalarParam | TensorMapParam | CoordParam
