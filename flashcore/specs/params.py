"""Every kernel's run-time parameters, declared once.

A kernel's parameters are named groups (``Group``) of named parameters (``Param``), in the
order the kernel takes them (``Signature``). A parameter has a kind (``Kind``: a tensor's
layout, which fixes what the DSL passes for it, or a scalar's type), an element type, and the
specs that have it (``when``); a spec without it passes nothing there. From the one
declaration come

* the packing (``Signature.packing``): what the runtime packs and the compiler checks against
  the PTX ``.entry`` (``flashcore.compiler.abi``);
* the kernel's argument: ``Signature.Args``, a named tuple of the groups' named tuples (an
  absent parameter is None), which the ``@cute.jit`` host takes and hands the ``@cute.kernel``
  whole; the kernel reads ``args.<group>.<param>``;
* the fake arguments the build traces with (``flashcore.kernels.build``: a fake per kind).

Adding a run-time argument: declare it here, use it in the device code, pass its value from the
op that launches the kernel. Pure data: no DSL.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .families import family
from .packing import Packed, ScalarParam, TensorParam

E4M3 = "float8_e4m3fn"
F32 = "float32"
I32 = "int32"


@dataclass(frozen=True)
class Kind:
    """What a parameter holds: a tensor of ``shapes`` run-time i32 extents and ``strides``
    run-time i64 strides (the other entries static), or a scalar of struct format ``fmt``;
    ``dtype``: its element type unless the parameter says ("": the spec's 16-bit dtype)."""

    name: str
    shapes: int = 0
    strides: int = 0
    fmt: str = ""
    dtype: str = ""

    def packed(self, name: str) -> Packed:
        if self.fmt:
            return ScalarParam(name, self.fmt)
        return TensorParam(name, self.shapes, self.strides)


# (batch, heads, seq, head_dim): head_dim static and contiguous, strides multiples of 16 bytes
BHSD = Kind("bhsd", 3, 3)
# (batch, heads, head_dim, seq): FP8 Vᵀ (seq padded to a multiple of 128, contiguous)
BHDS = Kind("bhds", 3, 3)
# (batch, heads, seq) float32, unit last stride: LSE, per-token descales, row workspaces
ROWS = Kind("rows", 3, 2, dtype=F32)
PER_HEAD = Kind("per_head", 2, 1, dtype=F32)  # (batch, heads) float32
# (pages, heads, page_size) float32, every stride run-time: a paged cache's per-key descales,
# the user's (pages, page_size, heads) tensor permuted (or broadcast with stride 0)
PAGE_SCALES = Kind("page_scales", 3, 3, dtype=F32)
INT_VECTOR = Kind("int_vector", 1, 0, dtype=I32)  # (n,) int32
INT_MATRIX = Kind("int_matrix", 2, 1, dtype=I32)  # (rows, cols) int32, unit last stride
FLOAT = Kind("float", fmt="<f", dtype=F32)
INT = Kind("int", fmt="<i", dtype=I32)


class Arg(NamedTuple):
    """A parameter as one spec has it."""

    name: str  # its field in the group
    abi_name: str  # its name in the packing
    kind: Kind
    dtype: str  # element type: a spec dtype name, E4M3, F32 or I32


@dataclass(frozen=True)
class Param:
    """``kind`` and ``dtype`` may be functions of the spec; ``when``: the specs that have it
    (None: every one); ``abi_name``: its name in the packing where that differs."""

    name: str
    kind: Kind | Callable[[Any], Kind]
    dtype: str | Callable[[Any], str] = ""
    when: Callable[[Any], bool] | None = None
    abi_name: Callable[[Any], str] | None = None

    def resolve(self, spec) -> Arg | None:
        if self.when is not None and not self.when(spec):
            return None
        kind = self.kind if isinstance(self.kind, Kind) else self.kind(spec)
        dtype = self.dtype if isinstance(self.dtype, str) else self.dtype(spec)
        name = self.name if self.abi_name is None else self.abi_name(spec)
        return Arg(self.name, name, kind, dtype or kind.dtype or spec.dtype)


@dataclass(frozen=True)
class Group:
    """``tma``: a family that loads by TMA passes these as descriptors and coordinate extents
    (``KernelFamily.tensor_map_params``)."""

    name: str
    params: tuple[Param, ...]
    tma: bool = False
    Fields: type = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "Fields", namedtuple(self.name, [p.name for p in self.params]))


@dataclass(frozen=True)
class Signature:
    """A kernel's parameters; ``kernel``: the class traced for a spec, "module:Class" under
    ``flashcore.kernels`` (it takes the spec; its ``host`` and ``kernel`` take ``Args``)."""

    name: str
    groups: tuple[Group, ...]
    kernel: Callable[[Any], str]
    Args: type = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "Args", namedtuple(self.name, [g.name for g in self.groups]))

    def resolve(self, spec) -> tuple[tuple[Group, tuple[Arg | None, ...]], ...]:
        return tuple((g, tuple(p.resolve(spec) for p in g.params)) for g in self.groups)

    def args(self, spec, make: Callable[[Arg], Any]) -> tuple:
        """``Args`` of ``make(arg)`` for each parameter ``spec`` has, None for the others."""
        return self.Args(*(g.Fields(*(None if a is None else make(a) for a in args))
                           for g, args in self.resolve(spec)))

    def packing(self, spec) -> tuple[Packed, ...]:
        maps = _tensor_maps(spec)
        out: list[Packed] = []
        for g, args in self.resolve(spec):
            for a in args:
                if a is None:
                    continue
                if g.tma and maps is not None:
                    out += maps(a)
                else:
                    out.append(a.kind.packed(a.abi_name))
        return tuple(out)


def _tensor_maps(spec) -> Callable[[Arg], tuple[Packed, ...]] | None:
    """How a spec that loads by TMA passes a ``tma`` group's tensors (its family's
    ``tensor_map_params``, or the spec's own: the backward), None where it does not."""
    if getattr(spec, "loads_by_tma", False):
        return spec.tensor_map_params
    fam = family(spec.family) if getattr(spec, "family", "") else None
    if fam is not None and fam.loads_by_tma:
        return lambda arg: fam.tensor_map_params(spec, arg)
    return None


def _fixed(text: str) -> Callable[[Any], str]:
    return lambda spec: text


def _fp8(s) -> bool:  # e4m3 operands
    return s.precision == "fp8"


def _e4m3_kv(s) -> bool:  # e4m3 K and V: FP8 operands or an FP8 KV cache
    return s.precision == "fp8" or s.kv_fp8


def _kv_dtype(s) -> str:
    return E4M3 if _e4m3_kv(s) else ""


def _k_descale(s) -> Kind:
    """FP8 operands: per token, or per (batch, head) with ``k_scale="head"``; an FP8 KV cache:
    per key, or per key of each page."""
    if _fp8(s):
        return ROWS if s.k_scale == "token" else PER_HEAD
    return PAGE_SCALES if s.paged_kv else ROWS


def _v_descale(s) -> Kind:
    if _fp8(s):
        return PER_HEAD
    return PAGE_SCALES if s.paged_kv else ROWS


# Window sizes (``flashcore.kernels.common.block_info.UNBOUNDED`` for a side without one: keys
# a token sees are [t - left, t + right]) and soft-capping's scale / cap and cap / scale
# (S -> out * tanh(S * in)): the forward's and the backward's.
MASKS = Group("masks", (
    Param("window_left", INT, when=lambda s: s.window),
    Param("window_right", INT, when=lambda s: s.window),
    Param("softcap_in", FLOAT, when=lambda s: s.softcap),
    Param("softcap_out", FLOAT, when=lambda s: s.softcap),
))

# The attention forward (``flashcore.kernels.mma_sync``, ``flashcore.kernels.wgmma_ws``).
# Q, K, V, O: (batch, heads, seq, head_dim); K and V may have fewer heads than Q (grouped-query
# attention). FP8 operands: Vᵀ, keys permuted within each 32 (``flashcore.ops.fp8``). With
# ``split_kv`` O and LSE are fp32 workspaces of num_splits · batch rows of batches. Then the
# descales, the exp2 softmax scale, the query rows per token (``q_group``: > 1 where a K/V
# head's query heads are packed into rows) and the key shares (split-KV across CTAs; a family
# that splits no keys takes none), the masks' sizes, ALiBi's slopes. Serving layouts: with ``varlen`` Q and O
# (and K and V unless paged) are packed batches viewed as (1, heads, total rows, head_dim) and
# int32 offsets (batch + 1) of each sequence's rows follow; the grid's z is the batch. With
# ``paged_kv`` K and V are the cache's pages viewed as (pages, heads, page_size, head_dim), then
# the int32 block table (batch, max_pages) and ``seqlens_k`` (batch). With ``merge_shares`` the
# last share's CTA of each query tile writes the output (batch, query heads, seq, head_dim), its
# LSE (with ``return_lse``; the partials' LSE is always there) and resets its int32 arrival
# counter (one per CTA of the grid's x, zero before the launch).
ATTENTION = Signature("attention", (
    Group("operands", (
        Param("q", BHSD, dtype=lambda s: E4M3 if _fp8(s) else ""),
        Param("k", BHSD, dtype=_kv_dtype),
        Param("v", lambda s: BHDS if _fp8(s) else BHSD, dtype=_kv_dtype,
              abi_name=lambda s: "vt" if _fp8(s) else "v"),
    ), tma=True),
    Group("outputs", (
        Param("o", BHSD, dtype=lambda s: F32 if s.split_kv else ""),
        Param("lse", ROWS, when=lambda s: s.return_lse or s.split_kv),
    )),
    Group("descales", (
        Param("q_descale", ROWS, when=_fp8),
        Param("k_descale", _k_descale, when=_e4m3_kv),
        Param("v_descale", _v_descale, when=_e4m3_kv),
    )),
    Group("softmax", (
        Param("scale_log2", FLOAT),
        Param("q_group", INT),
        Param("num_splits", INT, when=lambda s: family(s.family).splits_keys),
    )),
    MASKS,
    # ALiBi's slopes: float32 (batch, heads), a batch stride of 0 for one slope per head
    Group("bias", (Param("alibi_slopes", PER_HEAD, when=lambda s: s.alibi),)),
    Group("serving", (
        Param("cu_seqlens_q", INT_VECTOR, when=lambda s: s.varlen),
        Param("cu_seqlens_k", INT_VECTOR, when=lambda s: s.varlen and not s.paged_kv),
        Param("block_table", INT_MATRIX, when=lambda s: s.paged_kv),
        Param("seqlens_k", INT_VECTOR, when=lambda s: s.paged_kv),
    )),
    Group("merge", (
        Param("out", BHSD, when=lambda s: s.merge_shares),
        Param("out_lse", ROWS, when=lambda s: s.merge_shares and s.return_lse),
        Param("arrivals", INT_VECTOR, when=lambda s: s.merge_shares),
    )),
), kernel=lambda s: family(s.family).kernel_class)

# Split-KV combine: partial O (num_splits · batch, heads, rows, head_dim) and LSE fp32, the
# output O (batch, query heads, seq, head_dim) and optionally its LSE, the query heads packed
# into a partial's rows a token (q_group) and the number of shares.
COMBINE = Signature("combine", (
    Group("partials", (Param("o_partial", BHSD, dtype=F32), Param("lse_partial", ROWS))),
    Group("outputs", (Param("o", BHSD), Param("lse", ROWS, when=lambda s: s.return_lse))),
    Group("shares", (Param("q_group", INT), Param("num_splits", INT))),
), kernel=_fixed("combine:CombineSplits"))


def _quantize_kernel(s) -> str:
    if s.granularity == "token":
        return "quantize_fp8:QuantizeFP8PerToken"
    if s.part == "amax":
        return "quantize_fp8:AmaxPerHead"
    return "quantize_fp8:QuantizeFP8Transposed" if s.transpose else "quantize_fp8:QuantizeFP8"


# The e4m3 quantiser: x (batch, heads, seq, head_dim) 16-bit. Per (batch, head), pass 1 (amax):
# the partial maxima (batch, heads, AMAX_SHARES); pass 2: out e4m3 in x's layout, or Vᵀ (batch,
# heads, head_dim, seq padded), from pass 1's partial maxima, and the descale (batch, heads).
# Per token: out and the descale (batch, heads, seq).
QUANTIZE_FP8 = Signature("quantize", (
    Group("tensors", (
        Param("x", BHSD),
        Param("out", lambda s: BHDS if s.transpose else BHSD, dtype=E4M3,
              when=lambda s: s.part != "amax"),
        Param("partial", ROWS, when=lambda s: s.granularity == "head"),
        Param("descale", lambda s: ROWS if s.granularity == "token" else PER_HEAD,
              when=lambda s: s.part != "amax"),
    )),
), kernel=_quantize_kernel)

# The backward (``flashcore.kernels.mma_sync_bwd``). pre: O and dO (batch, heads, seq_q,
# head_dim), the forward's LSE (batch, heads, seq_q), then the fp32 workspaces: LSE in log2
# units and D = rowsum(dO ∘ O) (batch, heads, rows) and the dQ accumulator (batch, heads,
# rows, head_dim), rows = seq_q rounded up to ``spec.backward.ROW_PAD``. main: Q, K, V, dO,
# the workspaces, dK and dV (K's shape), the exp2 softmax scale and the softmax scale, the
# masks' sizes, (``varlen``) the packed batch's int32 offsets (batch + 1) of Q's rows and of
# K's, and (``deterministic``) the int32 counters of key blocks done, (batch, heads, query
# blocks) flat and contiguous, zeroed by the caller. post: the dQ accumulator, dQ (Q's shape) and the softmax
# scale.
_WORKSPACES = Group("workspaces", (Param("lse_log2", ROWS), Param("dpsum", ROWS),
                                   Param("dq_accum", BHSD, dtype=F32)))
BACKWARD_PRE = Signature("backward_pre", (
    Group("inputs", (Param("o", BHSD), Param("do", BHSD), Param("lse", ROWS))),
    _WORKSPACES,
), kernel=_fixed("mma_sync_bwd.rows:BackwardPreprocess"))
BACKWARD = Signature("backward", (
    Group("inputs", (Param("q", BHSD), Param("k", BHSD), Param("v", BHSD), Param("do", BHSD)),
          tma=True),
    _WORKSPACES,
    Group("grads", (Param("dk", BHSD), Param("dv", BHSD))),
    Group("scales", (Param("scale_log2", FLOAT), Param("scale", FLOAT))),
    MASKS,
    Group("serving", (Param("cu_seqlens_q", INT_VECTOR, when=lambda s: s.varlen),
                      Param("cu_seqlens_k", INT_VECTOR, when=lambda s: s.varlen))),
    Group("order", (Param("dq_turns", INT_VECTOR, when=lambda s: s.deterministic),)),
), kernel=lambda s: ("wgmma_bwd.warp_specialized:WarpSpecializedBackward"
                     if s.warp_specialized else "wgmma_bwd.attention_bwd:HopperBackward"
                     if s.hopper else "mma_sync_bwd.attention_bwd:AttentionBackward"))
BACKWARD_POST = Signature("backward_post", (
    Group("inputs", (Param("dq_accum", BHSD, dtype=F32),)),
    Group("outputs", (Param("dq", BHSD),)),
    Group("scales", (Param("scale", FLOAT),)),
), kernel=_fixed("mma_sync_bwd.rows:BackwardPostprocess"))

# Appending to a KV cache (``flashcore.kernels.kv_append``): the new keys and values (batch,
# heads_kv, new tokens, head_dim), the cache's pages viewed as (pages, heads_kv, page_size,
# head_dim) with the block table (batch, max_pages) and each sequence's length before the new
# tokens (where they go: their positions). With rotary: q (batch, heads, seq_q, head_dim) and
# the turned copy the attention reads, the cos and sin tables (positions, rotary_dim / 2), and
# the queries' position step (1: token t at length + t; 0: every token at length).
_ROTARY_TABLE = Kind("rotary_table", 2, 1)  # (positions, rotary_dim / 2), unit last stride


def _rotates(s) -> bool:
    return s.rotary_dim > 0


def _table_dtype(s) -> str:
    return F32 if s.table_dtype == "float32" else s.table_dtype


KV_APPEND = Signature("kv_append", (
    Group("new", (Param("k", BHSD), Param("v", BHSD))),
    Group("cache", (Param("k_cache", BHSD), Param("v_cache", BHSD),
                    Param("block_table", INT_MATRIX), Param("seqlens", INT_VECTOR))),
    Group("rotary", (
        Param("q", BHSD, when=_rotates),
        Param("q_out", BHSD, when=_rotates),
        Param("cos", _ROTARY_TABLE, dtype=_table_dtype, when=_rotates),
        Param("sin", _ROTARY_TABLE, dtype=_table_dtype, when=_rotates),
        Param("q_step", INT, when=_rotates),
    )),
), kernel=_fixed("kv_append:KvAppend"))

SIGNATURES: dict[str, Signature] = {
    "attention_fwd": ATTENTION, "attention_combine": COMBINE, "quantize_fp8": QUANTIZE_FP8,
    "attention_bwd_pre": BACKWARD_PRE, "attention_bwd": BACKWARD,
    "attention_bwd_post": BACKWARD_POST, "kv_append": KV_APPEND,
}


def signature(spec) -> Signature:
    return SIGNATURES[spec.op]


def params_of(spec) -> tuple[Packed, ...]:
    """The packing of ``spec``'s kernel: one entry per parameter of its PTX ``.entry``."""
    return signature(spec).packing(spec)
