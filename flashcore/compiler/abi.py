"""The attention kernel's parameter ABI and launch geometry, as data.

The CuTe DSL passes a ``cute.Tensor`` by value as a struct: a 64-bit pointer, then each run-time
(dynamic) shape entry as i32, then each dynamic stride as i64 (8-byte aligned). Static entries are
left out, and so is an optional tensor the spec does not use. The runtime packs arguments from this description, and the compiler checks it against the
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


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def fp8_descale_params(spec) -> list:
    """FP8 operands' float32 descales: Q per token (batch, heads, seq), K per token or (with
    ``k_scale="head"``) per (batch, heads), V per (batch, heads)."""
    per_token_k = getattr(spec, "k_scale", "token") == "token"
    return [TensorParam("q_descale", 3, 2),
            TensorParam("k_descale", 3, 2) if per_token_k else TensorParam("k_descale", 2, 1),
            TensorParam("v_descale", 2, 1)]


def tma_attention_params(spec) -> tuple:
    """The warp-specialised Hopper kernel's parameters (``flashcore.kernels.wgmma_ws``): Q, K and
    V as TMA descriptors, each followed by its coordinate tensor's (seq, heads, batch); then O,
    LSE if asked, FP8's descales, the exp2 softmax scale and ``q_group``, and the masks'
    run-time sizes as in ``attention_params`` (no ``num_splits``: the family splits no keys).

    Each box row fills the kernel's swizzle span, at most 128 bytes (e4m3 rows of 64 elements:
    64 bytes); FP8 Vᵀ's box is head_dim rows of tile_n keys."""
    c, d = spec.config, spec.head_dim
    fp8 = spec.precision == "fp8"
    dtype, esize = ("float8_e4m3fn", 1) if fp8 else ("", 2)

    def tma(name: str, rows: int, inner: int, transposed: bool = False):
        span = min(inner * esize, 128)
        return [TensorMapParam(f"{name}_tma", name, rows, span // esize, dtype, span, transposed),
                CoordParam(f"{name}_extents")]

    params = tma("q", c.tile_m, d) + tma("k", c.tile_n, d)
    params += tma("vt", d, c.tile_n, transposed=True) if fp8 else tma("v", c.tile_n, d)
    params.append(TensorParam("o", 3, 3))
    if spec.return_lse:
        params.append(TensorParam("lse", 3, 2))
    if fp8:
        params += fp8_descale_params(spec)
    params += [ScalarParam("scale_log2", "<f"), ScalarParam("q_group", "<i")]
    return (*params, *mask_params(spec))


def mask_params(spec) -> list:
    """A window's left and right sizes (``flashcore.kernels.common.block_info.UNBOUNDED`` for
    a side without one), soft-capping's scale / cap and cap / scale."""
    params = []
    if getattr(spec, "window", False):  # keys a token sees: [t - left, t + right], block_info
        params += [ScalarParam("window_left", "<i"), ScalarParam("window_right", "<i")]
    if getattr(spec, "softcap", False):  # S -> out * tanh(S * in): in = scale / cap
        params += [ScalarParam("softcap_in", "<f"), ScalarParam("softcap_out", "<f")]
    return params


def attention_params(spec) -> tuple[TensorParam | ScalarParam, ...]:
    """The attention kernel's parameters, as ``flashcore.kernels.mma_sync`` declares them.

    Q, K, V, O: (batch, heads, seq, head_dim), batch, heads, seq and their strides dynamic; K and
    V may have fewer heads than Q (grouped-query attention). FP8 operands: V transposed (batch,
    heads, head_dim, seq_k padded to a multiple of 128, keys permuted within each 32, see
    ``flashcore.ops.fp8``). With ``split_kv``, O and LSE are fp32 workspaces of
    num_splits · batch rows of batches. LSE and the descales: (batch, heads, seq) float32 with a
    unit last stride, or (batch, heads) for FP8 V (and K with ``k_scale="head"``). Then the
    exp2 softmax scale, the query rows per token (``q_group``: > 1 when a K/V head's query
    heads are packed into rows) and the number of key shares (split-KV across CTAs; 1
    otherwise); with a window its left and right sizes
    (``flashcore.kernels.common.block_info.UNBOUNDED`` for a side without one), with
    soft-capping scale / cap and cap / scale.

    Serving layouts: with ``varlen`` Q and O (and K and V unless paged) are packed batches viewed
    as (1, heads, total rows, head_dim), then come the int32 offsets ``cu_seqlens_q`` (and
    ``cu_seqlens_k``), batch + 1 each; the grid's z is the batch. With ``paged_kv`` K and V are
    the cache's pages viewed as (pages, heads, page_size, head_dim), then the int32 block table
    (batch, max_pages) and ``seqlens_k`` (batch); an e4m3 paged cache's per-key descales are
    viewed the same way, (pages, heads, page_size) with every stride dynamic (the user's
    (pages, page_size, heads) tensor permuted, or broadcast with stride 0).
    """
    params = [TensorParam("q", 3, 3), TensorParam("k", 3, 3),
              TensorParam("vt" if spec.precision == "fp8" else "v", 3, 3), TensorParam("o", 3, 3)]
    if spec.return_lse or spec.split_kv:
        params.append(TensorParam("lse", 3, 2))
    if spec.precision == "fp8":
        params += fp8_descale_params(spec)
    elif spec.kv_fp8 and getattr(spec, "paged_kv", False):  # (pages, heads, page_size), any strides
        params += [TensorParam("k_descale", 3, 3), TensorParam("v_descale", 3, 3)]
    elif spec.kv_fp8:
        params += [TensorParam("k_descale", 3, 2), TensorParam("v_descale", 3, 2)]
    params += [ScalarParam("scale_log2", "<f"), ScalarParam("q_group", "<i"),
               ScalarParam("num_splits", "<i"), *mask_params(spec)]
    if getattr(spec, "varlen", False):  # int32 (batch + 1) offsets of each sequence's rows
        params.append(TensorParam("cu_seqlens_q", 1, 0))
        if not spec.paged_kv:
            params.append(TensorParam("cu_seqlens_k", 1, 0))
    if getattr(spec, "paged_kv", False):  # int32 (batch, max_pages) and (batch,)
        params += [TensorParam("block_table", 2, 1), TensorParam("seqlens_k", 1, 0)]
    return tuple(params)


# Split-KV combine: partial O (num_splits · batch, heads, rows, head_dim) and LSE fp32, the
# output O (batch, query heads, seq, head_dim) and optionally its LSE, the query heads packed
# into a partial's rows a token (q_group) and the number of shares.
def combine_params(spec) -> tuple[TensorParam | ScalarParam, ...]:
    params = [TensorParam("o_partial", 3, 3), TensorParam("lse_partial", 3, 2),
              TensorParam("o", 3, 3)]
    if spec.return_lse:
        params.append(TensorParam("lse", 3, 2))
    return (*params, ScalarParam("q_group", "<i"), ScalarParam("num_splits", "<i"))


# Per-(batch, head) scale, pass 1: x (batch, heads, seq, head_dim) 16-bit; partial
# (batch, heads, AMAX_SHARES) float32 maxima.
QUANTIZE_FP8_AMAX_PARAMS: tuple[TensorParam | ScalarParam, ...] = (
    TensorParam("x", 3, 3),
    TensorParam("partial", 3, 2),
)


# Pass 2: out e4m3 in x's layout, or Vᵀ (batch, heads, head_dim, seq_padded), from pass 1's
# partial maxima (so every block of rows or keys is cast by its own CTA); descale (batch,
# heads) float32.
QUANTIZE_FP8_PARAMS: tuple[TensorParam | ScalarParam, ...] = (
    TensorParam("x", 3, 3),
    TensorParam("out", 3, 3),
    TensorParam("partial", 3, 2),
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
        return QUANTIZE_FP8_AMAX_PARAMS if spec.part == "amax" else QUANTIZE_FP8_PARAMS
    if spec.op == "attention_combine":
        return combine_params(spec)
    if getattr(spec, "family", "") == "wgmma_ws":
        return tma_attention_params(spec)
    return attention_params(spec)


MAX_GRID_X = 2**31 - 1
MAX_GRID_Z = 65535


def attention_grid(rows: int, heads: int, batch: int, tile_m: int,
                   num_splits: int = 1) -> tuple[int, int, int]:
    """x: every (batch, head, query tile), the tile fastest; y: the key shares."""
    x = (rows + tile_m - 1) // tile_m * heads * batch
    if x > MAX_GRID_X:
        raise ValueError(f"{batch} batches x {heads} heads x {rows} rows is {x} CTAs, over "
                         f"the grid's {MAX_GRID_X}")
    return (x, num_splits, 1)


def varlen_grid(max_rows: int, heads: int, batch: int, tile_m: int) -> tuple[int, int, int]:
    """Packed batches: x walks (head, query tile) up to the longest sequence, z the batch."""
    x = (max_rows + tile_m - 1) // tile_m * heads
    if x > MAX_GRID_X or batch > MAX_GRID_Z:
        raise ValueError(f"{batch} sequences of up to {max_rows} rows x {heads} heads do not fit "
                         f"the grid (x {MAX_GRID_X}, z {MAX_GRID_Z})")
    return (x, 1, batch)


def combine_grid(rows: int, heads: int, batch: int) -> tuple[int, int, int]:
    """A CTA per (batch, head, row)."""
    x = batch * heads * rows
    if x > MAX_GRID_X:
        raise ValueError(f"{batch} batches x {heads} heads x {rows} rows is {x} CTAs, over "
                         f"the grid's {MAX_GRID_X}")
    return (x, 1, 1)


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


# -- the attention backward (``flashcore.specs.backward``) ----------------------------------------
BACKWARD_OPS = ("attention_bwd", "attention_bwd_pre", "attention_bwd_post")


def backward_params(spec) -> tuple[TensorParam | ScalarParam, ...]:
    """The backward kernels' parameters (``flashcore.kernels.mma_sync_bwd``).

    pre: O and dO (batch, heads, seq_q, head_dim), the forward's LSE (batch, heads, seq_q),
    then the fp32 workspaces: LSE in log2 units and D = rowsum(dO ∘ O) (batch, heads, rows)
    and the dQ accumulator (batch, heads, rows, head_dim), rows = seq_q rounded up to
    ``spec.backward.ROW_PAD``. main: Q, K, V, dO, the two row workspaces, the dQ accumulator,
    dK and dV (K's shape), the exp2 softmax scale and the softmax scale, then as the forward's
    (``attention_params``) a window's left and right sizes and soft-capping's scale / cap and
    cap / scale. post: the dQ accumulator, dQ (Q's shape) and the softmax scale."""
    if spec.op == "attention_bwd_pre":
        return (TensorParam("o", 3, 3), TensorParam("do", 3, 3), TensorParam("lse", 3, 2),
                TensorParam("lse_log2", 3, 2), TensorParam("dpsum", 3, 2),
                TensorParam("dq_accum", 3, 3))
    if spec.op == "attention_bwd_post":
        return (TensorParam("dq_accum", 3, 3), TensorParam("dq", 3, 3),
                ScalarParam("scale", "<f"))
    params = (TensorParam("q", 3, 3), TensorParam("k", 3, 3), TensorParam("v", 3, 3),
              TensorParam("do", 3, 3), TensorParam("lse_log2", 3, 2), TensorParam("dpsum", 3, 2),
              TensorParam("dq_accum", 3, 3), TensorParam("dk", 3, 3), TensorParam("dv", 3, 3),
              ScalarParam("scale_log2", "<f"), ScalarParam("scale", "<f"))
    if spec.window:
        params += (ScalarParam("window_left", "<i"), ScalarParam("window_right", "<i"))
    if spec.softcap:
        params += (ScalarParam("softcap_in", "<f"), ScalarParam("softcap_out", "<f"))
    return params


def backward_rows_grid(padded_rows: int, heads: int, batch: int,
                       rows_per_cta: int) -> tuple[int, int, int]:
    """pre and post: a CTA per ``rows_per_cta`` rows of each (batch, head); ``padded_rows``
    (pre: the workspace's rows) or the sequence's (post: rounded up)."""
    x = (padded_rows + rows_per_cta - 1) // rows_per_cta * heads * batch
    if x > MAX_GRID_X:
        raise ValueError(f"{batch} batches x {heads} heads x {padded_rows} rows is {x} CTAs, "
                         f"over the grid's {MAX_GRID_X}")
    return (x, 1, 1)


def backward_grid(seqlen_k: int, heads_kv: int, batch: int, tile_n: int) -> tuple[int, int, int]:
    """main: a CTA per (batch, K/V head, key block), the key block fastest."""
    x = (seqlen_k + tile_n - 1) // tile_n * heads_kv * batch
    if x > MAX_GRID_X:
        raise ValueError(f"{batch} batches x {heads_kv} heads x {seqlen_k} keys is {x} CTAs, "
                         f"over the grid's {MAX_GRID_X}")
    return (x, 1, 1)


# Dispatches the backward ops before the forward's dispatch (which knows the others).
_params_for_forward_ops = params_for


def params_for(spec) -> tuple:
    if spec.op in BACKWARD_OPS:
        return backward_params(spec)
    return _params_for_forward_ops(spec)
