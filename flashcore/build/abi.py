"""The attention kernel's parameter ABI and launch geometry, as data.

The CuTe DSL passes a ``cute.Tensor`` by value as a struct: a 64-bit pointer, then each run-time
(dynamic) shape entry as i32, then each dynamic stride as i64 (8-byte aligned). Static entries are
left out. The runtime packs arguments from this description, and the compiler checks it against the
``.entry`` it reads from the PTX, so a kernel whose signature drifted is refused, never launched.
This module must not import the DSL: hosts without it launch prebuilt kernels.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

LOG2_E = math.log2(math.e)


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


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# Q, K, V, O: (batch, heads, seq, head_dim) with batch, heads, seq and their strides dynamic.
# LSE: (batch, heads, seq_q) float32, last stride static.
ATTENTION_FWD_PARAMS: tuple[TensorParam | ScalarParam, ...] = (
    TensorParam("q", 3, 3),
    TensorParam("k", 3, 3),
    TensorParam("v", 3, 3),
    TensorParam("o", 3, 3),
    TensorParam("lse", 3, 2),
    ScalarParam("scale_log2", "<f"),
)


# FP8: Q, K (batch, heads, seq, head_dim) e4m3; V transposed (batch, heads, head_dim, seq_k padded
# to a multiple of 128, keys permuted within each 32, see flashcore.ops.fp8); float32 descale
# factors per token for Q (batch, heads, seq_q) and K (batch, heads, seq_k), per head for V.
ATTENTION_FWD_FP8_PARAMS: tuple[TensorParam | ScalarParam, ...] = (
    TensorParam("q", 3, 3),
    TensorParam("k", 3, 3),
    TensorParam("vt", 3, 3),
    TensorParam("o", 3, 3),
    TensorParam("lse", 3, 2),
    TensorParam("q_descale", 3, 2),
    TensorParam("k_descale", 3, 2),
    TensorParam("v_descale", 2, 1),
    ScalarParam("scale_log2", "<f"),
)


# Quantiser: x (batch, heads, seq, head_dim) 16-bit; out e4m3 in x's layout, or Vᵀ
# (batch, heads, head_dim, seq_padded); descale (batch, heads) float32.
QUANTIZE_FP8_PARAMS: tuple[TensorParam | ScalarParam, ...] = (
    TensorParam("x", 3, 3),
    TensorParam("out", 3, 3),
    TensorParam("descale", 2, 1),
)


# V's quantiser (per head, transposed): the amax per (batch, heads) comes in, computed beforehand
# (one torch reduction), so every block of keys can be quantised by its own CTA.
QUANTIZE_FP8_VT_PARAMS: tuple[TensorParam | ScalarParam, ...] = (
    TensorParam("x", 3, 3),
    TensorParam("out", 3, 3),
    TensorParam("amax", 2, 1),
    TensorParam("descale", 2, 1),
)


# Per-token quantiser: the descale is (batch, heads, seq).
QUANTIZE_FP8_TOKEN_PARAMS: tuple[TensorParam | ScalarParam, ...] = (
    TensorParam("x", 3, 3),
    TensorParam("out", 3, 3),
    TensorParam("descale", 3, 2),
)


def params_for(spec) -> tuple[TensorParam | ScalarParam, ...]:
    if spec.op == "quantize_fp8":
        if spec.granularity == "token":
            return QUANTIZE_FP8_TOKEN_PARAMS
        return QUANTIZE_FP8_VT_PARAMS if spec.transpose else QUANTIZE_FP8_PARAMS
    return ATTENTION_FWD_FP8_PARAMS if spec.precision == "fp8" else ATTENTION_FWD_PARAMS


def attention_grid(seqlen_q: int, heads: int, batch: int, tile_m: int) -> tuple[int, int, int]:
    return ((seqlen_q + tile_m - 1) // tile_m, heads, batch)


def check_against_entry(params: tuple, entry_params) -> None:
    """Raise ValueError if the PTX parameter list does not match the ABI description."""
    if len(params) != len(entry_params):
        raise ValueError(
            f"kernel has {len(entry_params)} parameters, the ABI describes {len(params)}"
        )
    for want, got in zip(params, entry_params):
        if want.size != got.size or want.align != got.align:
            raise ValueError(
                f"parameter {want.name!r}: PTX has {got.size} bytes aligned {got.align}, "
                f"the ABI packs {want.size} bytes aligned {want.align}"
            )
