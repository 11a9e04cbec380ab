"""``BackwardSpec``: the kernels of one attention backward pass (FlashAttention-2's algorithm).

Three kernels make one backward pass, each a spec of its own (``op``):

* ``attention_bwd_pre``: per query row D = rowsum(dO ∘ O) and the forward's LSE in log2 units
  (+inf where the row saw no key, or past the sequence end), into row-padded fp32 workspaces; it
  also zeroes the fp32 dQ accumulator.
* ``attention_bwd``: one CTA per (batch, K/V head, block of ``tile_n`` keys), walking every query
  block of every query head that reads the K/V head and sees some key of the block; dK and dV
  stay in registers (written once, deterministic), dQ is added into the fp32 accumulator with
  atomics. Masks as the forward's (``AttentionSpec``): ``mask_align``, ``window`` (sizes at run
  time), ``softcap`` (logits s -> c·tanh(s / c); dS gets the factor 1 − tanh²).
* ``attention_bwd_post``: dQ = accumulator · softmax_scale in the input dtype.

The workspaces have ``ROW_PAD``-aligned rows per (batch, head), so the main kernel's query
blocks never run past them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import SpecError
from .arch import (
    ARCHS,
    BACKWARD_HEAD_DIMS,
    DTYPE_BYTES,
    DTYPE_TAGS,
    DTYPES,
    PDL_ARCHS,
    SMEM_PER_BLOCK,
    arch_tag,
)
from .attention import MASK_ALIGNS
from .serial import SpecData
from .tile import TileConfig, TiledKernel

BACKWARD_OPS = ("attention_bwd", "attention_bwd_pre", "attention_bwd_post")
ROW_PAD = 128  # workspace rows per (batch, head) are a multiple of this (the largest tile_m)
ROW_THREADS = 128  # threads of a pre/post CTA
BACKWARD_KNOBS = {"tile_m": (32, 64, 128), "tile_n": (32, 64, 128), "warps": (4, 8),
                  "stages": (1,), "kv_splits": (1,)}
_SMEM_ALIGN = 1024


def _align(n: int) -> int:
    return (n + _SMEM_ALIGN - 1) // _SMEM_ALIGN * _SMEM_ALIGN


def warp_grid(rows: int, cols: int, warps: int) -> tuple[int, int]:
    """(warps along the rows, warps along the columns) of a tiled MMA over a (rows, cols) tile:
    as many as fit along the rows (16 each), the rest along the columns."""
    along_rows = max(1, min(warps, rows // 16))
    return along_rows, warps // along_rows


@dataclass(frozen=True)
class BackwardSpec(SpecData, TiledKernel):
    """One kernel of the attention backward (``op`` names which). ``config`` and ``causal``
    describe the main kernel (``tile`` = (query rows, keys) per block); the row kernels take
    the defaults."""

    arch: str = "sm_89"
    dtype: str = "float16"
    head_dim: int = 64
    config: TileConfig = field(default_factory=TileConfig)
    causal: bool = False
    op: str = "attention_bwd"
    mask_align: str = "top_left"
    window: bool = False
    softcap: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.config, dict):
            object.__setattr__(self, "config", TileConfig.from_dict(self.config))

        def bad(what: str) -> SpecError:
            return SpecError(f"BackwardSpec: {what}")

        if self.op not in BACKWARD_OPS:
            raise bad(f"op={self.op!r} is not one of {BACKWARD_OPS}")
        if self.arch not in ARCHS:
            raise bad(f"arch={self.arch!r} is not supported; choose one of {ARCHS}")
        if self.dtype not in DTYPES:
            raise bad(f"dtype={self.dtype!r} is not supported; choose one of {DTYPES}")
        if isinstance(self.head_dim, bool) or self.head_dim not in BACKWARD_HEAD_DIMS:
            raise bad(f"head_dim={self.head_dim!r} is not supported by the backward; choose one "
                      f"of {BACKWARD_HEAD_DIMS} (the forward builds more)")
        for name in ("causal", "window", "softcap"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.mask_align not in MASK_ALIGNS:
            raise bad(f"mask_align={self.mask_align!r} is not supported; choose one of "
                      f"{MASK_ALIGNS}")
        if not isinstance(self.config, TileConfig):
            raise bad(f"config must be a TileConfig, got {type(self.config).__name__}")
        if self.op != "attention_bwd":
            if self.config != TileConfig() or self.causal or self.masked:
                raise bad(f"{self.op} takes no config, causal or mask (they shape the main "
                          "kernel)")
            return
        if self.mask_align != "top_left" and not (self.causal or self.window):
            raise bad(f"mask_align={self.mask_align!r} aligns a causal mask or a window; this "
                      "spec has neither")
        c = self.config
        for knob, allowed in BACKWARD_KNOBS.items():
            if getattr(c, knob) not in allowed:
                raise bad(f"{knob}={getattr(c, knob)} is not supported; choose one of {allowed}")
        if c.family not in ("", "mma_sync"):
            raise bad(f"family={c.family!r}: the backward is built in the mma_sync family only")
        for what, rows, cols in (("S = Q·Kᵀ", c.tile_m, c.tile_n),
                                 ("dK, dV", c.tile_n, self.head_dim),
                                 ("dQ", c.tile_m, self.head_dim)):
            wm, wn = warp_grid(rows, cols, c.warps)
            if wm * wn != c.warps or cols % (16 * wn):
                raise bad(f"{c.warps} warps cannot share the {rows}x{cols} tile of {what} "
                          "(16x16 per warp at least)")
        chunks = c.tile_m * self.head_dim * DTYPE_BYTES[self.dtype] // 16
        if chunks % c.threads:
            raise bad(f"a {c.tile_m}-row Q tile is {chunks} 16-byte copies, which "
                      f"{c.threads} threads cannot share evenly")
        if (c.tile_n * self.head_dim * DTYPE_BYTES[self.dtype] // 16) % c.threads:
            raise bad(f"a {c.tile_n}-key K tile cannot be shared evenly by {c.threads} threads")
        budget = SMEM_PER_BLOCK[self.arch]
        if self.smem_bytes > budget:
            raise bad(f"needs {self.smem_bytes} bytes of shared memory, over {self.arch}'s "
                      f"per-block budget of {budget} (tile {c.tile}, head_dim {self.head_dim})")

    # -- derived -------------------------------------------------------------------------------
    @property
    def masked(self) -> bool:
        """Any mask field other than top-left causal."""
        return self.mask_align != "top_left" or self.window or self.softcap

    @property
    def shifted_mask(self) -> bool:
        """The general key bounds (``kernels.common.block_info``): bottom-right or a window."""
        return self.mask_align == "bottom_right" or self.window

    @property
    def threads(self) -> int:
        return self.config.threads if self.op == "attention_bwd" else ROW_THREADS

    @property
    def rows_per_cta(self) -> int:
        """Rows a pre/post CTA handles: each row is head_dim / 8 threads' 16-byte chunks."""
        return ROW_THREADS // (self.head_dim // 8)

    @property
    def programmatic_launch(self) -> bool:
        return self.arch in PDL_ARCHS

    @property
    def smem_bytes(self) -> int:
        """The main kernel's tiles (``kernels/mma_sync_bwd/layouts.py``): Q and dO (tile_m x
        head_dim), K and V (tile_n x head_dim), P and dS (tile_m x tile_n), 1 KB aligned each;
        the row kernels use none."""
        if self.op != "attention_bwd":
            return 0
        c, d, e = self.config, self.head_dim, DTYPE_BYTES[self.dtype]
        return (2 * _align(c.tile_m * d * e * c.stages) + 2 * _align(c.tile_n * d * e)
                + 2 * _align(c.tile_m * c.tile_n * e))

    @property
    def name(self) -> str:
        part = {"attention_bwd": "bwd", "attention_bwd_pre": "bwd_pre",
                "attention_bwd_post": "bwd_post"}[self.op]
        base = f"fc_attn_{part}_{arch_tag(self.arch)}_{DTYPE_TAGS[self.dtype]}_d{self.head_dim}"
        if self.op != "attention_bwd":
            return base
        flags = (("causal", self.causal), ("br", self.mask_align == "bottom_right"),
                 ("window", self.window), ("softcap", self.softcap))
        return base + f"_{self.config.tag}" + "".join(f"_{n}" for n, on in flags if on)

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["config"] = self.config.to_dict()
        return d


def default_backward_config(head_dim: int) -> TileConfig:
    """The main kernel's config: FlashAttention-2's sm_86/sm_89 choices, which fit an L4's
    99 KB (d64: 64 query rows x 128 keys, d128: 64 x 64; 80 KB each), eight warps."""
    return TileConfig((64, 128) if head_dim <= 64 else (64, 64), warps=8)
