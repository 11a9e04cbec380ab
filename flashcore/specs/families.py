"""Kernel families: which kernel design a spec is compiled with, and what that design accepts.

A family names one kernel design (its source under ``flashcore/kernels/<family>/``). It says on
which archs it runs, which values of each ``TileConfig`` knob it accepts, and how much shared
memory a spec needs, so an invalid spec is refused when it is made, naming the knob. The spec
names its family or takes its arch's default. ``mma_sync`` (FlashAttention-2 style, warp-level
``mma.sync`` on sm_80/sm_89/sm_90) is the default, ``wgmma_ws`` (Hopper warpgroup MMA, warp
specialised) the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ..errors import SpecError
from .arch import (
    DTYPE_BYTES,
    E4M3_BYTES,
    SMEM_PER_BLOCK,
    WGMMA_HEAD_DIMS,
    swizzle_line_bytes,
)
from .packing import CoordParam, Packed, TensorMapParam
from .tile import TileConfig, refuse_retired_family


class FamilySpec(Protocol):
    """What a family reads of an ``attention.AttentionSpec`` (which imports the families to
    validate itself, so the families name its fields here instead of importing it)."""

    arch: str
    dtype: str
    head_dim: int
    config: TileConfig
    causal: bool
    precision: str
    kv_fp8: bool
    mask_align: str
    window: bool
    softcap: bool
    page_size: int

    @property
    def elem_bytes(self) -> int: ...

_SMEM_ALIGN = 1024  # every shared buffer is 1024-byte aligned (swizzle atoms repeat at 1 KB)


def _align(n: int, a: int = _SMEM_ALIGN) -> int:
    return (n + a - 1) // a * a


SWIZZLE_SPANS = (128, 64, 32)  # bytes; each has a TMA swizzle mode (runtime.tensor_map)
# the fewest rows of a paged cache's TMA box in the Hopper family: whole 8-row swizzle atoms,
# and at most tile_n / 16 boxes a block an operand for the producer warps to issue
MIN_PAGE_BOX_ROWS = 16


def swizzle_span(row_bytes: int) -> int:
    """Bytes of the swizzle a K-major wgmma tile of ``row_bytes`` rows takes, and of its TMA
    box's rows: the widest of ``SWIZZLE_SPANS`` that divides a row (16-bit d96: 64; d80: 32)."""
    for span in SWIZZLE_SPANS:
        if row_bytes % span == 0:
            return span
    raise SpecError(f"a row of {row_bytes} bytes is no whole number of 32-byte swizzle units")


def tensor_map_params(name: str, rows: int, inner: int, esize: int, dtype: str = "",
                      transposed: bool = False) -> tuple[Packed, ...]:
    """A TMA operand's descriptor (boxes of ``rows`` rows, each the swizzle span of a row of
    ``inner`` elements of ``esize`` bytes wide, at most 128 bytes) and its coordinate tensor's
    (seq, heads, batch)."""
    span = swizzle_span(inner * esize)
    return (TensorMapParam(f"{name}_tma", name, rows, span // esize, dtype, span, transposed),
            CoordParam(f"{name}_extents"))


def _copy_pass_rows(threads: int, row_bytes: int) -> int:
    """Rows one pass of ``threads`` threads' 16-byte copies covers, a thread per 16 bytes of
    a swizzle line (``kernels/common/copies.g2s_copy``)."""
    return threads * 16 // swizzle_line_bytes(row_bytes)


class KernelFamily(Protocol):
    name: str
    archs: tuple[str, ...]
    knobs: Mapping[str, tuple[int, ...]]  # every value a spec may take
    splits_keys: bool  # builds split_kv kernels (flash-decoding's partials)
    packs_tokens: bool  # builds packed_tokens kernels (multi-token GQA decode)
    producer_threads: int  # threads a CTA has beyond config.threads (a producer warpgroup)
    kernel_class: str  # the kernel traced: "module:Class" under flashcore.kernels
    loads_by_tma: bool  # takes its operands as TMA descriptors (``tensor_map_params``)
    e4m3_mma_archs: tuple[str, ...]  # archs whose e4m3 MMAs are instructions, not emulated

    def dsl_arch(self, arch: str) -> str: ...

    def search_grid(self, head_dim: int) -> Mapping[str, tuple[int, ...]]:
        """The knob values the autotuner times at ``head_dim`` (a subset of ``knobs``)."""
        ...

    def validate(self, spec: FamilySpec) -> None: ...

    def copies_whole_pages(self, spec: FamilySpec, page_size: int) -> bool: ...

    def smem_bytes(self, spec: FamilySpec) -> int: ...

    def tensor_map_params(self, spec: FamilySpec, arg) -> tuple[Packed, ...]: ...


@dataclass(frozen=True)
class MmaSync:
    """FlashAttention-2 style: warp-level mma.sync, cp.async loads, K/V in a ring of stages."""

    name: str = "mma_sync"
    archs: tuple[str, ...] = ("sm_80", "sm_89", "sm_90")
    max_threads: int = 512  # 128 registers per thread still fit the 64K register file
    splits_keys: bool = True
    packs_tokens: bool = True
    producer_threads: int = 0
    kernel_class: str = "mma_sync.attention_fwd:AttentionForward"
    loads_by_tma: bool = False
    e4m3_mma_archs: tuple[str, ...] = ("sm_89",)  # Hopper has no e4m3 mma.sync: ptxas emulates

    def dsl_arch(self, arch: str) -> str:
        return arch

    @property
    def knobs(self) -> Mapping[str, tuple[int, ...]]:
        return {
            "tile_m": (16, 32, 64, 128),
            "tile_n": (32, 64, 128),
            "warps": (1, 2, 4, 8),
            "stages": (1, 2, 3),
            "kv_splits": (1, 2, 4),
        }

    def search_grid(self, head_dim: int) -> Mapping[str, tuple[int, ...]]:
        return self.knobs

    def validate(self, spec: FamilySpec) -> None:
        c = spec.config

        def bad(what: str) -> SpecError:
            return SpecError(f"AttentionSpec ({self.name}): {what}")

        for knob, allowed in self.knobs.items():
            v = getattr(c, knob)
            if v not in allowed:
                raise bad(f"{knob}={v} is not supported; choose one of {allowed}")
        if c.tile_m % (16 * c.warps) != 0:
            raise bad(
                f"tile_m={c.tile_m} must be a multiple of 16 * warps = {16 * c.warps} "
                "(each warp owns whole 16-row MMA tiles)"
            )
        if c.threads > self.max_threads:
            raise bad(
                f"warps * kv_splits = {c.warps * c.kv_splits} warps is {c.threads} threads, "
                f"over {self.max_threads} (the register file could not hold them)"
            )
        # Each thread of a group copies 16-byte chunks; a tile must hold one chunk per thread.
        load_bytes = E4M3_BYTES if (spec.precision == "fp8" or spec.kv_fp8) else spec.elem_bytes
        chunks = {
            "Q": c.tile_m * spec.head_dim * spec.elem_bytes // 16,
            "K/V": c.tile_n * spec.head_dim * load_bytes // 16,
        }
        for what, n in chunks.items():
            if n % c.group_threads:
                raise bad(
                    f"a {what} tile of {c.tile} at head_dim={spec.head_dim} is {n} 16-byte "
                    f"copies, which {c.group_threads} threads cannot share evenly"
                )
        q_passes = _copy_pass_rows(c.group_threads, spec.head_dim * spec.elem_bytes)
        for what, rows, passes in (("Q", c.tile_m, q_passes),
                                   ("K/V", c.tile_n, self.copy_rows(spec))):
            if rows % passes:
                raise bad(
                    f"a {what} tile of {rows} rows at head_dim={spec.head_dim} is not whole "
                    f"copy passes of {passes} rows ({c.group_threads} threads, 16 bytes each)"
                )
        if spec.page_size and not self.copies_whole_pages(spec, spec.page_size):
            raise bad(
                f"page_size={spec.page_size} cannot be copied a page at a time with tile_n="
                f"{c.tile_n} and {self.copy_rows(spec)} rows per copy pass: it must be a "
                "multiple of the rows per pass and divide or be a multiple of tile_n "
                "(page_size=0 serves any page size)"
            )
        budget = SMEM_PER_BLOCK[spec.arch]
        need = self.smem_bytes(spec)
        if need > budget:
            raise bad(
                f"needs {need} bytes of shared memory, over {spec.arch}'s per-block budget of "
                f"{budget} bytes (tile {c.tile}, stages={c.stages}, kv_splits={c.kv_splits}); "
                "use a smaller tile, fewer stages or fewer kv_splits"
            )

    @staticmethod
    def copy_rows(spec: FamilySpec) -> int:
        """Rows of a K/V tile one pass of a warp group's 16-byte copies covers: each row of a
        swizzle atom (at most 128 bytes) takes a thread per 16 bytes
        (``kernels/common/copies.g2s_copy``). An FP8 KV cache is copied as e4m3 bytes."""
        ring_bytes = E4M3_BYTES if spec.kv_fp8 else spec.elem_bytes
        return _copy_pass_rows(spec.config.group_threads, spec.head_dim * ring_bytes)

    def copies_whole_pages(self, spec: FamilySpec, page_size: int) -> bool:
        """Whether a paged cache of ``page_size`` keys a page can be copied a page at a time:
        every copy pass of a thread stays in one page (the page a multiple of the rows per
        pass) and a key block is a whole number of pages or lies inside one."""
        tn = spec.config.tile_n
        return (page_size % self.copy_rows(spec) == 0
                and (tn % page_size == 0 or page_size % tn == 0))

    def smem_bytes(self, spec: FamilySpec) -> int:
        """Dynamic shared memory the kernel allocates (``flashcore/kernels/mma_sync/layouts.py``
        lays it out; the build checks the two agree): the Q tile; K and V tiles per stage and
        key split; for fp8 operands a separate 16-bit output tile (the e4m3 Q buffer is too
        small to stage it); for an FP8 KV cache the ring's per-key descales (its codes are
        converted in registers); with kv_splits > 1 each split's row max and sum and all but
        one split's fp32 output, for the combine."""
        c, d = spec.config, spec.head_dim
        out_bytes = DTYPE_BYTES[spec.dtype]
        ring_bytes = E4M3_BYTES if spec.kv_fp8 else spec.elem_bytes
        q = _align(c.tile_m * d * spec.elem_bytes)
        kv = _align(c.tile_n * d * ring_bytes * c.kv_splits)
        total = q + 2 * c.stages * kv
        if spec.precision == "fp8":
            total += _align(c.tile_m * d * out_bytes)
        if spec.kv_fp8:  # each stage's per-key descales of K and V
            total += 2 * _align(c.tile_n * 4 * c.stages * c.kv_splits)
        if c.kv_splits > 1:
            total += _align(c.kv_splits * 2 * c.tile_m * 4)
            total += _align((c.kv_splits - 1) * c.tile_m * d * 4)
        return total

    def tensor_map_params(self, spec: FamilySpec, arg) -> tuple[Packed, ...]:
        raise NotImplementedError(f"the {self.name} family loads no operand by TMA")


@dataclass(frozen=True)
class WgmmaWs:
    """Hopper, warp-specialised: warpgroup MMA (``wgmma.mma_async``, sm_90a) fed by TMA
    (``cp.async.bulk.tensor``) from a producer warpgroup through mbarrier pipelines into
    128-byte-swizzled tiles; consumers of 64 query rows each with 240 registers
    (``setmaxnreg``), no CTA barrier in the key loop, softmax overlapped with the previous
    block's P·V (``flashcore/kernels/wgmma_ws``); fp16/bf16 and FP8 e4m3 operands (e4m3
    wgmma). Masks as data: bottom-right alignment and sliding windows (key blocks outside
    skipped), and soft-capping (16-bit only, as every family); LSE, GQA; dense tensors, packed
    batches and paged caches (``copies_whole_pages``); no split-KV.
    ``warps`` counts the consumer warps; the CTA has ``producer_threads`` more. The runtime
    encodes the TMA descriptors (``flashcore.runtime.tensor_map``)."""

    name: str = "wgmma_ws"
    archs: tuple[str, ...] = ("sm_90",)
    precisions: tuple[str, ...] = ("fp16", "fp8")  # fp8: e4m3 wgmma (SASS QGMMA)
    splits_keys: bool = False
    packs_tokens: bool = False
    rows_per_warpgroup: int = 64
    producer_threads: int = 128
    kernel_class: str = "wgmma_ws.attention_fwd:WgmmaWsAttentionForward"
    loads_by_tma: bool = True
    e4m3_mma_archs: tuple[str, ...] = ("sm_90",)

    def dsl_arch(self, arch: str) -> str:
        return "sm_90a"  # wgmma and setmaxnreg are sm_90a instructions

    @property
    def knobs(self) -> Mapping[str, tuple[int, ...]]:
        # key blocks of any 16 keys from 64 to 192 (wgmma's N, and P·V's k16 steps): 128x80
        # fills shared memory at d256 with two stages, 128x176 at d128
        return {"tile_m": (64, 128, 192), "tile_n": tuple(range(64, 193, 16)),
                "warps": (4, 8, 12), "stages": (2, 3, 4), "kv_splits": (1,)}

    def search_grid(self, head_dim: int) -> Mapping[str, tuple[int, ...]]:
        """64- and 128-key blocks, and the widest that still fits beside them at this head dim
        (FlashAttention-3's choice: 192 at d64, 144 at d96, 176 at d128, 80 past d128)."""
        widest = 192 if head_dim <= 64 else 144 if head_dim <= 96 else (
            176 if head_dim <= 128 else 80)
        return {**self.knobs, "tile_n": (64, 128, widest)}

    def validate(self, spec: FamilySpec) -> None:
        c = spec.config

        def bad(what: str) -> SpecError:
            return SpecError(f"AttentionSpec ({self.name}): {what}")

        unsupported = [f for f in ("kv_fp8", "split_kv", "packed_tokens", "alibi")
                       if getattr(spec, f, False)]
        if spec.precision not in self.precisions:
            unsupported.append(f"precision={spec.precision!r}")
        if unsupported:
            raise bad(f"not built yet: {', '.join(unsupported)} (the mma_sync family has them)")
        paged = getattr(spec, "paged_kv", False)
        if paged and not self.copies_whole_pages(spec, spec.page_size):
            raise bad(f"a paged cache needs its page size compiled in, a multiple of tile_n="
                      f"{c.tile_n} or a multiple of {MIN_PAGE_BOX_ROWS} that divides "
                      f"it (each key block one TMA box a page), got page_size="
                      f"{spec.page_size}; the mma_sync family reads any page size")
        if spec.head_dim not in WGMMA_HEAD_DIMS:
            raise bad(f"head_dim={spec.head_dim} is not built (only {WGMMA_HEAD_DIMS}); the "
                      "mma_sync family builds it")
        if spec.precision == "fp8" and spec.head_dim not in (64, 128):
            raise bad(f"FP8 operands at head_dim={spec.head_dim} are not built (64 and 128)")
        if spec.precision == "fp8" and c.tile_n not in (64, 128):
            raise bad(f"FP8 operands take key blocks of 64 or 128 (Vᵀ's rows of keys are one "
                      f"64- or 128-byte swizzle), not tile_n={c.tile_n}")
        for knob, allowed in self.knobs.items():
            v = getattr(c, knob)
            if v not in allowed:
                raise bad(f"{knob}={v} is not supported; choose one of {allowed}")
        if c.tile_m != self.rows_per_warpgroup * c.warps // 4:
            raise bad(f"tile_m={c.tile_m} must be 64 rows per warpgroup of 4 warps: "
                      f"{self.rows_per_warpgroup * c.warps // 4} for warps={c.warps}")
        budget = SMEM_PER_BLOCK[spec.arch]
        need = self.smem_bytes(spec)
        if need > budget:
            raise bad(f"needs {need} bytes of shared memory, over {spec.arch}'s {budget}")
        if spec.softcap and (spec.causal or spec.window) and self.p_in_shared(spec):
            raise bad(f"softcap=True beside a causal mask or a window is not built for tile "
                      f"{c.tile} at head_dim={spec.head_dim} (P through shared memory): its "
                      "consumers' 160 "
                      "registers a thread spill in the key loop; use tile (128, 128) with "
                      "warps=8 or (192, 64) with warps=12")

    def copies_whole_pages(self, spec: FamilySpec, page_size: int) -> bool:
        """A key block is one TMA box of a page's rows (pages of whole blocks) or one box from
        each page it spans (``key_box_rows``): pages that divide tile_n, whole 8-row swizzle
        atoms of at least 16 rows (at most tile_n / 16 boxes an operand a block). (A paged
        cache is 16-bit: ``AttentionSpec`` refuses FP8 operands there.)"""
        tn = spec.config.tile_n
        if page_size <= 0 or page_size % tn == 0:
            return page_size > 0
        return tn % page_size == 0 and page_size % MIN_PAGE_BOX_ROWS == 0

    @staticmethod
    def key_box_rows(spec: FamilySpec) -> int:
        """Rows of a K (or V) TMA box: a key block's, or a page's where pages are smaller."""
        tn = spec.config.tile_n
        return spec.page_size if 0 < spec.page_size < tn else tn

    def tensor_map_params(self, spec: FamilySpec, arg) -> tuple[Packed, ...]:
        """An operand's TMA descriptor and its coordinate tensor's (seq, heads, batch)
        (``flashcore.specs.params.Arg``: q, k, v or FP8 Vᵀ). Each box row fills the kernel's
        swizzle span, at most 128 bytes (e4m3 rows of 64 elements: 64 bytes); a box is a
        query tile's rows or a key tile's, FP8 Vᵀ's head_dim rows of tile_n keys."""
        c, d = spec.config, spec.head_dim
        fp8 = spec.precision == "fp8"
        dtype, esize = ("float8_e4m3fn", 1) if fp8 else ("", 2)
        transposed = arg.kind.name == "bhds"
        rows, inner = (d, c.tile_n) if transposed else (
            c.tile_m if arg.name == "q" else self.key_box_rows(spec), d)
        return tensor_map_params(arg.abi_name, rows, inner, esize, dtype, transposed)

    @staticmethod
    def p_in_shared(spec: FamilySpec) -> bool:
        """Whether P reaches the P·V wgmma through shared memory (its SS form) rather than in
        registers: with three consumer warpgroups (160 registers a thread) where a thread's S
        (tile_n / 2 fp32), O (head_dim / 2) and 16-bit P (tile_n / 4) come to more than 128
        registers: d80-d128 at 128-key steps (d128 FP8: 288 bytes of spills with P in
        registers, d96 144), d64 past 128 keys, d96 at 144. Head dims above 128 have no room
        for three consumers' tiles."""
        c = spec.config
        return (c.warps == 12 and spec.head_dim <= 128
                and 3 * c.tile_n // 4 + spec.head_dim // 2 > 128)

    @staticmethod
    def sums_by_mma(spec: FamilySpec) -> bool:
        """Whether the softmax's row sums come from the tensor cores (P times a tile of ones,
        ``flashcore/kernels/wgmma_ws/row_sums.py``) rather than one FADD a score: with FP8
        operands, whose key step waits on its chain of dependent phases rather than on the
        tensor pipe; not at head_dim 64 without a causal mask, whose P·V is four n64 MMAs a
        step (the n8 sums add four more) and whose softmax chain has no masking. 16-bit steps
        are tensor-bound at d128, where the n8 MMAs cost more than the FADDs they replace
        (docs/tried-and-dropped.md)."""
        return spec.precision == "fp8" and (spec.head_dim >= 128 or spec.causal)

    def smem_bytes(self, spec: FamilySpec) -> int:
        """The wgmma tiles, after 1 KB holding the pipelines' mbarriers; for fp8 operands a
        16-bit output tile of its own (the e4m3 Q buffer is half its size), P's tile where
        it goes through shared memory, and the row sums' tile of ones."""
        out, c = 0, spec.config
        if spec.precision == "fp8":
            out = _align(c.tile_m * spec.head_dim * DTYPE_BYTES[spec.dtype])
        if self.p_in_shared(spec):
            out += _align(c.tile_m * c.tile_n * spec.elem_bytes)
        if self.sums_by_mma(spec):  # 8 columns of ones (the narrowest wgmma N) a key
            out += _align(8 * c.tile_n * spec.elem_bytes)
        # Q (reused for the 16-bit output tile) and ``stages`` K and V tiles, 1 KB aligned
        tiles = (_align(c.tile_m * spec.head_dim * spec.elem_bytes)
                 + 2 * _align(c.tile_n * spec.head_dim * c.stages * spec.elem_bytes))
        return _SMEM_ALIGN + tiles + out


FAMILIES: dict[str, KernelFamily] = {"mma_sync": MmaSync(), "wgmma_ws": WgmmaWs()}
# The family a spec gets when it names none.
DEFAULT_FAMILY = {"sm_80": "mma_sync", "sm_89": "mma_sync", "sm_90": "mma_sync"}


def dsl_arch(spec) -> str:
    """The target the DSL compiles ``spec`` for (CUTE_DSL_ARCH): the arch, or the family's
    variant of it (wgmma needs sm_90a)."""
    own = getattr(spec, "dsl_target", None)  # a spec that names its own (the backward's)
    if own is not None:
        return own
    fam = getattr(spec, "family", "")
    return family(fam).dsl_arch(spec.arch) if fam else spec.arch


def family(name: str) -> KernelFamily:
    refuse_retired_family(name)
    try:
        return FAMILIES[name]
    except KeyError:
        raise SpecError(f"unknown kernel family {name!r}; known: {sorted(FAMILIES)}") from None
