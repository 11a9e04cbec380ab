"""Kernel specs: a kernel described by data.

A spec is frozen, hashable and JSON-serialisable. Its ``name`` is readable and stable; its
``content_hash`` keys the on-disk cache (together with the kernel source hash and DSL version).
Validation happens on construction, so an object that exists can be compiled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from .errors import SpecError

ARCHS = ("sm_80", "sm_89", "sm_90")
DTYPES = ("float16", "bfloat16")
PRECISIONS = ("fp16", "fp8")  # MMA operand precision: the input dtype, or float8_e4m3fn
FP8_ARCHS = ("sm_89", "sm_90")  # e4m3 mma.sync exists from Ada on
PDL_ARCHS = ("sm_90",)  # griddepcontrol (programmatic dependent launch) exists from Hopper on
HEAD_DIMS = (64, 128)
TILE_M = (16, 32, 64, 128)
TILE_N = (32, 64, 128)
WARPS = (1, 2, 4, 8)
STAGES = (1, 2, 3)
KV_SPLITS = (1, 2, 4)
MAX_THREADS = 512  # 128 registers per thread still fit the 64K register file

# Largest dynamic shared memory one block may opt into, in bytes (CUDA programming guide,
# "Technical specifications per compute capability").
SMEM_PER_BLOCK = {"sm_80": 163 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024}
# Shared memory per SM (for occupancy estimates).
SMEM_PER_SM = {"sm_80": 164 * 1024, "sm_89": 100 * 1024, "sm_90": 228 * 1024}

_DTYPE_BYTES = {"float16": 2, "bfloat16": 2}
_PRECISION_BYTES = {"fp8": 1}
_SMEM_ALIGN = 1024  # every shared buffer is 1024-byte aligned (swizzle atoms repeat at 1 KB)

SPEC_VERSION = 1


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class AttentionSpec:
    """One FlashAttention-2-style forward kernel.

    ``tile`` is (tile_m, tile_n): query rows per CTA and keys per inner iteration. Each warp owns
    ``tile_m / warps`` query rows, which must be a multiple of 16 (the MMA's M).
    ``kv_splits`` > 1 gives the CTA that many groups of ``warps`` warps, each walking its own share
    of the keys, combined through shared memory at the end: more parallelism for short problems
    (split-KV inside one CTA: no workspace, no second launch).
    ``dtype`` is the output (and, for ``precision="fp16"``, the input) dtype; ``precision="fp8"``
    multiplies float8_e4m3fn operands (m16n8k32) that ``flashcore.ops.quantize_fp8`` produced.
    """

    arch: str = "sm_89"
    dtype: str = "float16"
    head_dim: int = 64
    tile: tuple[int, int] = (64, 64)
    warps: int = 4
    stages: int = 1
    causal: bool = False
    return_lse: bool = False
    precision: str = "fp16"
    kv_splits: int = 1
    op: str = field(default="attention_fwd")

    def __post_init__(self) -> None:
        # Accept lists (from JSON) for the tile, store a tuple so the spec stays hashable.
        if isinstance(self.tile, list):
            object.__setattr__(self, "tile", tuple(self.tile))
        self._validate()

    # -- validation ---------------------------------------------------------------------------
    def _validate(self) -> None:
        def bad(what: str) -> SpecError:
            return SpecError(f"AttentionSpec: {what}")

        if self.op != "attention_fwd":
            raise bad(f"op={self.op!r} is not supported (only 'attention_fwd')")
        if self.arch not in ARCHS:
            raise bad(f"arch={self.arch!r} is not supported; choose one of {ARCHS}")
        if self.dtype not in DTYPES:
            raise bad(f"dtype={self.dtype!r} is not supported; choose one of {DTYPES}")
        if self.precision not in PRECISIONS:
            raise bad(f"precision={self.precision!r} is not supported; choose one of {PRECISIONS}")
        if self.precision == "fp8" and self.arch not in FP8_ARCHS:
            raise bad(
                f"precision='fp8' needs FP8 tensor cores (mma.sync e4m3), which {self.arch} does "
                f"not have; use arch in {FP8_ARCHS} or precision='fp16'"
            )
        for name in ("head_dim", "warps", "stages", "kv_splits"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(f"{name} must be an int, got {v!r}")
        if self.head_dim not in HEAD_DIMS:
            raise bad(f"head_dim={self.head_dim} is not supported; choose one of {HEAD_DIMS}")
        if (
            not isinstance(self.tile, tuple)
            or len(self.tile) != 2
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in self.tile)
        ):
            raise bad(f"tile must be a pair of ints (tile_m, tile_n), got {self.tile!r}")
        tm, tn = self.tile
        if tm not in TILE_M:
            raise bad(f"tile_m={tm} is not supported; choose one of {TILE_M}")
        if tn not in TILE_N:
            raise bad(f"tile_n={tn} is not supported; choose one of {TILE_N}")
        if self.warps not in WARPS:
            raise bad(f"warps={self.warps} is not supported; choose one of {WARPS}")
        if tm % (16 * self.warps) != 0:
            raise bad(
                f"tile_m={tm} must be a multiple of 16 * warps = {16 * self.warps} "
                "(each warp owns whole 16-row MMA tiles)"
            )
        if self.kv_splits not in KV_SPLITS:
            raise bad(f"kv_splits={self.kv_splits} is not supported; choose one of {KV_SPLITS}")
        if self.threads > MAX_THREADS:
            raise bad(
                f"warps * kv_splits = {self.warps * self.kv_splits} warps is {self.threads} threads, "
                f"over {MAX_THREADS} (the register file could not hold them)"
            )
        if self.stages not in STAGES:
            raise bad(f"stages={self.stages} is not supported; choose one of {STAGES}")
        if not isinstance(self.causal, bool):
            raise bad(f"causal must be a bool, got {self.causal!r}")
        if not isinstance(self.return_lse, bool):
            raise bad(f"return_lse must be a bool, got {self.return_lse!r}")
        # Each thread of a group copies 16-byte chunks; a tile must hold one chunk per thread.
        chunks_per_row = self.head_dim * self.elem_bytes // 16
        vt_chunks = self.head_dim * tn * self.elem_bytes // 16  # fp8 V is stored transposed
        if (
            (tn * chunks_per_row) % self.group_threads
            or (tm * chunks_per_row) % self.group_threads
            or vt_chunks % self.group_threads
        ):
            raise bad(
                f"tile {self.tile} with head_dim={self.head_dim} cannot be split evenly over "
                f"{self.group_threads} threads in 16-byte copies"
            )
        budget = SMEM_PER_BLOCK[self.arch]
        if self.smem_bytes > budget:
            raise bad(
                f"needs {self.smem_bytes} bytes of shared memory, over {self.arch}'s per-block "
                f"budget of {budget} bytes; use a smaller tile or fewer stages"
            )

    # -- derived -------------------------------------------------------------------------------
    @property
    def tile_m(self) -> int:
        return self.tile[0]

    @property
    def tile_n(self) -> int:
        return self.tile[1]

    @property
    def group_threads(self) -> int:
        """Threads that share one key range (all of them unless kv_splits > 1)."""
        return 32 * self.warps

    @property
    def threads(self) -> int:
        return self.group_threads * self.kv_splits

    @property
    def programmatic_launch(self) -> bool:
        """Hopper kernels take part in programmatic dependent launch: they wait for the grid
        before them (``griddepcontrol.wait``) before touching global memory, so the runtime may
        start them while that grid drains. Ada and Ampere have no such instruction."""
        return self.arch in PDL_ARCHS

    @property
    def elem_bytes(self) -> int:
        """Bytes per operand element in shared memory."""
        return _PRECISION_BYTES.get(self.precision, _DTYPE_BYTES[self.dtype])

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory the kernel allocates: Q tile, then K and V tiles per stage and
        key split, for fp8 a separate 16-bit output tile (the e4m3 Q buffer is too small to stage
        it), and with kv_splits > 1 each split's row max and sum and all but one split's fp32
        output, for the combine."""
        q = _align(self.tile_m * self.head_dim * self.elem_bytes, _SMEM_ALIGN)
        kv = _align(self.tile_n * self.head_dim * self.elem_bytes * self.kv_splits, _SMEM_ALIGN)
        o = 0
        if self.precision == "fp8":
            o = _align(self.tile_m * self.head_dim * _DTYPE_BYTES[self.dtype], _SMEM_ALIGN)
        combine = 0
        if self.kv_splits > 1:
            combine = _align(self.kv_splits * 2 * self.tile_m * 4, _SMEM_ALIGN) + _align(
                (self.kv_splits - 1) * self.tile_m * self.head_dim * 4, _SMEM_ALIGN
            )
        return q + 2 * self.stages * kv + o + combine

    @property
    def name(self) -> str:
        """Readable, stable and unique among valid specs (every field appears)."""
        dt = {"float16": "f16", "bfloat16": "bf16"}[self.dtype]
        parts = [
            "fc_attn_fwd",
            self.arch.replace("_", ""),
            dt,
            f"d{self.head_dim}",
            f"m{self.tile_m}n{self.tile_n}",
            f"w{self.warps}",
            f"s{self.stages}",
        ]
        if self.kv_splits > 1:
            parts.append(f"k{self.kv_splits}")
        if self.causal:
            parts.append("causal")
        if self.return_lse:
            parts.append("lse")
        if self.precision != "fp16":
            parts.append(self.precision)
        return "_".join(parts)

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tile"] = list(self.tile)
        d["spec_version"] = SPEC_VERSION
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AttentionSpec:
        d = dict(d)
        version = d.pop("spec_version", SPEC_VERSION)
        if version != SPEC_VERSION:
            raise SpecError(f"AttentionSpec: spec_version {version} is not {SPEC_VERSION}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise SpecError(f"AttentionSpec: unknown fields {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> AttentionSpec:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(f"AttentionSpec: not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise SpecError("AttentionSpec: JSON must be an object")
        return cls.from_dict(d)

    @property
    def content_hash(self) -> str:
        """sha256 of the canonical JSON, first 16 hex digits."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def replace(self, **changes: Any) -> AttentionSpec:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class QuantizeSpec:
    """The fp16/bf16 -> e4m3 quantiser of one tensor (per-(batch, head) scale).

    ``transpose`` writes V's layout for the FP8 attention kernel: (batch, heads, head_dim, seq
    padded to a multiple of 128) with keys permuted within each 32.
    """

    arch: str = "sm_89"
    dtype: str = "float16"
    head_dim: int = 64
    transpose: bool = False
    threads: int = 256
    granularity: str = "head"  # one scale per (batch, head), or per (batch, head, token)
    op: str = field(default="quantize_fp8")

    def __post_init__(self) -> None:
        def bad(what: str) -> SpecError:
            return SpecError(f"QuantizeSpec: {what}")

        if self.op != "quantize_fp8":
            raise bad(f"op={self.op!r} is not 'quantize_fp8'")
        if self.arch not in FP8_ARCHS:
            raise bad(f"arch={self.arch!r}: e4m3 needs one of {FP8_ARCHS}")
        if self.dtype not in DTYPES:
            raise bad(f"dtype={self.dtype!r} is not supported; choose one of {DTYPES}")
        if self.head_dim not in HEAD_DIMS:
            raise bad(f"head_dim={self.head_dim} is not supported; choose one of {HEAD_DIMS}")
        if not isinstance(self.transpose, bool):
            raise bad(f"transpose must be a bool, got {self.transpose!r}")
        if self.threads not in (128, 256, 512):
            raise bad(f"threads={self.threads} is not one of (128, 256, 512)")
        if self.granularity not in ("head", "token"):
            raise bad(f"granularity={self.granularity!r} is not 'head' or 'token'")
        if self.granularity == "token" and self.transpose:
            raise bad("per-token scales are for Q and K; V (transpose=True) is scaled per head")

    @property
    def name(self) -> str:
        dt = {"float16": "f16", "bfloat16": "bf16"}[self.dtype]
        t = "_vt" if self.transpose else ""
        g = "_tok" if self.granularity == "token" else ""
        return (f"fc_quant_e4m3_{self.arch.replace('_', '')}_{dt}_d{self.head_dim}"
                f"_t{self.threads}{t}{g}")

    @property
    def smem_bytes(self) -> int:
        # per head: one float per warp for the amax reduction; per token, and Vᵀ (amax given):
        # none
        return 4 * (self.threads // 32) if self.granularity == "head" and not self.transpose else 0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["spec_version"] = SPEC_VERSION
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @property
    def content_hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


KernelSpec = AttentionSpec | QuantizeSpec
_SPEC_CLASSES = {"attention_fwd": AttentionSpec, "quantize_fp8": QuantizeSpec}


def spec_from_dict(d: dict[str, Any]) -> KernelSpec:
    """Rebuild any kernel spec from its ``to_dict`` form (dispatching on ``op``)."""
    if not isinstance(d, dict):
        raise SpecError(f"a spec must be a JSON object, got {type(d).__name__}")
    op = d.get("op", "attention_fwd")
    cls = _SPEC_CLASSES.get(op)
    if cls is None:
        raise SpecError(f"unknown kernel op {op!r}; known: {sorted(_SPEC_CLASSES)}")
    if cls is AttentionSpec:
        return AttentionSpec.from_dict(d)
    d = dict(d)
    version = d.pop("spec_version", SPEC_VERSION)
    if version != SPEC_VERSION:
        raise SpecError(f"{cls.__name__}: spec_version {version} is not {SPEC_VERSION}")
    known = {f.name for f in dataclasses.fields(cls)}
    if set(d) - known:
        raise SpecError(f"{cls.__name__}: unknown fields {sorted(set(d) - known)}")
    return cls(**d)
