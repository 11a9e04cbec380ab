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
  ``varlen``: a packed batch (FlashAttention's ``cu_seqlens``), Q, K, V, dO, dK, dV viewed as
  (1, heads, total rows, head_dim) with the batch in the grid's z; the row kernels see the
  packed rows as one sequence.
  ``deterministic``: the key blocks add into each query block's dQ rows one after another,
  the highest first (a counter per (batch, head, query block)), so dQ's sums are the same every
  run. Two families build it: ``mma_sync`` (``kernels/mma_sync_bwd``, every arch and head dim)
  and, on sm_90 at d64, d96 and d128, ``hopper`` (``kernels/wgmma_bwd``: warpgroup MMAs; the same
  walk, ABI and row kernels).
* ``attention_bwd_post``: dQ = accumulator · softmax_scale in the input dtype.

The dQ accumulator's rows hold their 32-byte chunks in an order turned by the row
(``DQ_CHUNK_TURNS``), which the main kernels write and the post kernel reads.

The workspaces have ``ROW_PAD``-aligned rows per (batch, head), so the main kernel's query
blocks never run past them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import SpecError
from .arch import (
    BACKWARD_HEAD_DIMS,
    DTYPE_BYTES,
    DTYPE_TAGS,
    PDL_ARCHS,
    SMEM_PER_BLOCK,
    arch_tag,
    check_target,
)
from .attention import MASK_ALIGNS
from .families import tensor_map_params
from .packing import Packed
from .serial import SpecData
from .tile import TileConfig, TiledKernel

BACKWARD_OPS = ("attention_bwd", "attention_bwd_pre", "attention_bwd_post")
ROW_PAD = 128  # workspace rows per (batch, head) are a multiple of this (the largest tile_m)
ROW_THREADS = 128  # threads of a pre/post CTA
PRODUCER_THREADS = 128  # a warp-specialised main kernel's producer warpgroup
# ``stages``: query blocks (Q, dO and their LSE and D rows) in flight: 2 prefetches the next
# block while this one computes
BACKWARD_KNOBS = {"tile_m": (32, 64, 128), "tile_n": (32, 64, 128), "warps": (4, 8),
                  "stages": (1, 2), "kv_splits": (1,)}
# The Hopper backward (``kernels/wgmma_bwd``): warpgroup MMAs on sm_90, two warpgroups of 64
# keys, two stages of Q and dO; query blocks of 128 rows at d64, 64 at d96 and d128 (each head
# dim's first tile is its default; 128 rows spill at d96 and d128). d64 also builds 64 rows.
HOPPER_BWD = "hopper"
HOPPER_BWD_HEAD_DIMS = (64, 96, 128)
HOPPER_BWD_TILES = {64: ((128, 128), (64, 128)), 96: ((64, 128),), 128: ((64, 128),)}
BACKWARD_FAMILIES = ("", "mma_sync", HOPPER_BWD)
_SMEM_ALIGN = 1024


# The dQ accumulator's rows are row-major in chunks of 32 bytes (8 floats), chunk c of row r
# stored at chunk c ^ (r mod DQ_CHUNK_TURNS) where a row has a multiple of that many chunks
# (``dq_chunk_turns``): a warp's accumulator fragment (8 rows of 32 bytes at one column) is
# staged in shared memory over every bank instead of one bank window (8-way conflicts), and the
# block still reaches global memory as one linear bulk reduction. Every kernel that reads or
# adds into the accumulator uses this layout.
DQ_CHUNK_BYTES = 32
DQ_CHUNK_TURNS = 4


def dq_chunk_turns(head_dim: int) -> int:
    """Rows over which the dQ accumulator's chunks turn at ``head_dim``: ``DQ_CHUNK_TURNS``, or
    1 (plain row-major) where a row is no multiple of that many chunks (d80)."""
    chunks = head_dim * 4 // DQ_CHUNK_BYTES
    return DQ_CHUNK_TURNS if chunks % DQ_CHUNK_TURNS == 0 else 1


def _align(n: int) -> int:
    return (n + _SMEM_ALIGN - 1) // _SMEM_ALIGN * _SMEM_ALIGN


def row_lanes(head_dim: int) -> int:
    """Lanes of one row in the row kernels: a 16-byte chunk each, rounded up to a power of two
    (the butterfly sum's width); lanes past the row's chunks idle."""
    return 1 << (head_dim // 8 - 1).bit_length()


def warp_grid(rows: int, cols: int, warps: int, along_rows: int = 0) -> tuple[int, int]:
    """(warps along the rows, warps along the columns) of a tiled MMA over a (rows, cols) tile:
    ``along_rows`` along the rows if given, else as many as fit (16 rows each), the rest along
    the columns."""
    if not along_rows:
        along_rows = max(1, min(warps, rows // 16))
    return along_rows, warps // along_rows


def squarest_grid(rows: int, cols: int, warps: int) -> int:
    """Warps along the rows that make each warp's tile of a (rows, cols) product the squarest
    that divides it in 16-wide steps: the least shared-memory traffic per MMA (a warp tile of
    m x n reads m + n operand rows for m · n products); ties go to more warps along the rows
    (FlashAttention-2's choices)."""
    best, score = 0, None
    for wm in (w for w in (1, 2, 4, 8) if w <= warps and warps % w == 0):
        wn = warps // wm
        if rows % (16 * wm) or cols % (16 * wn):
            continue
        s = wm / rows + wn / cols
        if score is None or s <= score:
            best, score = wm, s
    return best


def default_warps_m(head_dim: int, config: TileConfig) -> tuple[int, ...]:
    """``BackwardSpec.warps_m`` of a config: the squarest warp tiles of S/dP, dK/dV and dQ (the
    Hopper family places its warpgroups itself: ())."""
    c = config
    if c.family == HOPPER_BWD:
        return ()
    return (squarest_grid(c.tile_m, c.tile_n, c.warps),
            squarest_grid(c.tile_n, head_dim, c.warps),
            squarest_grid(c.tile_m, head_dim, c.warps))


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
    # dQ adds in key-block order (``kernels/mma_sync_bwd/turns.py``): bit-identical runs
    deterministic: bool = False
    # a packed batch: sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1] of Q and of K
    varlen: bool = False
    # warps along the rows of the S/dP (query rows), dK/dV (keys) and dQ (query rows) products;
    # () spreads each over 16-row strips first (``warp_grid``)
    warps_m: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.config, dict):
            object.__setattr__(self, "config", TileConfig.from_dict(self.config))
        if isinstance(self.warps_m, list):
            object.__setattr__(self, "warps_m", tuple(self.warps_m))

        def bad(what: str) -> SpecError:
            return SpecError(f"BackwardSpec: {what}")

        if self.op not in BACKWARD_OPS:
            raise bad(f"op={self.op!r} is not one of {BACKWARD_OPS}")
        check_target(bad, self.arch, self.dtype)
        if isinstance(self.head_dim, bool) or self.head_dim not in BACKWARD_HEAD_DIMS:
            raise bad(f"head_dim={self.head_dim!r} is not supported by the backward; choose one "
                      f"of {BACKWARD_HEAD_DIMS} (the forward builds more)")
        for name in ("causal", "window", "softcap", "deterministic", "varlen"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.mask_align not in MASK_ALIGNS:
            raise bad(f"mask_align={self.mask_align!r} is not supported; choose one of "
                      f"{MASK_ALIGNS}")
        if not isinstance(self.config, TileConfig):
            raise bad(f"config must be a TileConfig, got {type(self.config).__name__}")
        if self.op != "attention_bwd":
            if (self.config != TileConfig() or self.causal or self.masked or self.warps_m
                    or self.deterministic or self.varlen):
                raise bad(f"{self.op} takes no config, causal, mask, deterministic or varlen "
                          "(they shape the main kernel)")
            return
        if self.mask_align != "top_left" and not (self.causal or self.window):
            raise bad(f"mask_align={self.mask_align!r} aligns a causal mask or a window; this "
                      "spec has neither")
        c = self.config
        for knob, allowed in BACKWARD_KNOBS.items():
            if getattr(c, knob) not in allowed:
                raise bad(f"{knob}={getattr(c, knob)} is not supported; choose one of {allowed}")
        if c.family not in BACKWARD_FAMILIES:
            raise bad(f"family={c.family!r}: the backward is built in the families "
                      f"{BACKWARD_FAMILIES[1:]}")
        if c.family == HOPPER_BWD:
            self._check_hopper(bad)
        else:
            self._check_warp_grids(bad)
        budget = SMEM_PER_BLOCK[self.arch]
        if self.smem_bytes > budget:
            raise bad(f"needs {self.smem_bytes} bytes of shared memory, over {self.arch}'s "
                      f"per-block budget of {budget} (tile {c.tile}, head_dim {self.head_dim})")

    def _check_hopper(self, bad) -> None:
        c = self.config
        if self.arch != "sm_90":
            raise bad(f"family={HOPPER_BWD!r} runs warpgroup MMAs: sm_90 only, not {self.arch}")
        if self.head_dim not in HOPPER_BWD_HEAD_DIMS:
            raise bad(f"family={HOPPER_BWD!r} is built for head_dim in {HOPPER_BWD_HEAD_DIMS}, "
                      f"not head_dim={self.head_dim} (family 'mma_sync' builds it)")
        tiles = HOPPER_BWD_TILES[self.head_dim]
        if c.tile not in tiles or c.warps != 8:
            raise bad(f"family={HOPPER_BWD!r} is built at head_dim={self.head_dim} for tiles "
                      f"{tiles} (query rows, keys) with warps=8 (two warpgroups of 64 keys), not "
                      f"tile={c.tile} warps={c.warps}")
        if c.stages != 2:
            raise bad(f"family={HOPPER_BWD!r} keeps two query blocks in flight: stages=2, got "
                      f"stages={c.stages}")
        if self.warps_m:
            raise bad(f"family={HOPPER_BWD!r} places its warps itself: warps_m must be (), got "
                      f"{self.warps_m!r}")

    def _check_warp_grids(self, bad) -> None:
        c = self.config
        wms = self.warps_m or (0, 0, 0)
        if (not isinstance(self.warps_m, tuple) or len(wms) != 3
                or any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in wms)):
            raise bad(f"warps_m={self.warps_m!r} must be () or three warp counts (S/dP, dK/dV, "
                      "dQ)")
        for what, rows, cols, along in (("S = Q·Kᵀ", c.tile_m, c.tile_n, wms[0]),
                                        ("dK, dV", c.tile_n, self.head_dim, wms[1]),
                                        ("dQ", c.tile_m, self.head_dim, wms[2])):
            wm, wn = warp_grid(rows, cols, c.warps, along)
            if wm * wn != c.warps or cols % (16 * wn) or rows % (16 * wm):
                raise bad(f"{c.warps} warps cannot share the {rows}x{cols} tile of {what} "
                          "(16x16 per warp at least)")

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
    def paged_kv(self) -> bool:
        """The backward reads no paged cache (``kernels.common.sequences`` asks)."""
        return False

    @property
    def threads(self) -> int:
        """A row kernel's ``ROW_THREADS``; the main kernel's ``config.threads``, and a
        producer warpgroup more where it is warp-specialised."""
        if self.op != "attention_bwd":
            return ROW_THREADS
        return self.config.threads + (PRODUCER_THREADS if self.warp_specialized else 0)

    @property
    def warp_specialized(self) -> bool:
        """The Hopper kernel over a dense batch with bulk dQ: a producer warpgroup whose first
        warp copies every tile by TMA and whose second adds each block's dQ, the MMA
        warpgroups meeting at named barriers only (``kernels/wgmma_bwd/warp_specialized.py``).
        d64 at 128 or 64 query rows, d96 and d128 at 64."""
        return (self.loads_by_tma and self.bulk_dq
                and (self.config.tile_m, self.head_dim) in ((64, 64), (128, 64), (64, 96),
                                                            (64, 128)))

    @property
    def rows_per_cta(self) -> int:
        """Rows a pre/post CTA handles: ``row_lanes`` threads a row."""
        return ROW_THREADS // row_lanes(self.head_dim)

    @property
    def programmatic_launch(self) -> bool:
        return self.arch in PDL_ARCHS

    @property
    def hopper(self) -> bool:
        """Built by the Hopper backward (``kernels/wgmma_bwd``)."""
        return self.config.family == HOPPER_BWD

    @property
    def bulk_dq(self) -> bool:
        """dQ's adds as one bulk reduction a query block (``kernels/wgmma_bwd/dq_bulk.py``);
        the deterministic kernel keeps its turns' per-thread adds."""
        return self.hopper and not self.deterministic

    @property
    def loads_by_tma(self) -> bool:
        """The main kernel takes Q, K, V and dO as TMA descriptors (``tensor_map_params``) and
        one warp copies each tile (the Hopper kernel over dense batches); a packed batch's
        rows are copied by every thread (cp.async, rows past a sequence zero-filled)."""
        return self.op == "attention_bwd" and self.hopper and not self.varlen

    def tensor_map_params(self, arg) -> tuple[Packed, ...]:
        """Q's, K's, V's or dO's descriptor (``runtime.tensor_map``) and its coordinate
        tensor's (seq, heads, batch): a box of a query block's rows (Q, dO) or the key block's
        (K, V), each row the kernel's swizzle span (``families.swizzle_span``) wide."""
        rows = self.config.tile_m if arg.name in ("q", "do") else self.config.tile_n
        return tensor_map_params(arg.abi_name, rows, self.head_dim, DTYPE_BYTES[self.dtype])

    @property
    def dsl_target(self) -> str:
        """What the DSL compiles for (``families.dsl_arch``): wgmma needs sm_90a."""
        return "sm_90a" if self.hopper else self.arch

    @property
    def prefetch_rows(self) -> bool:
        """The main kernel copies each query block's LSE and D rows into shared memory with its
        Q and dO (two stages), rather than reading them from global memory when it starts it."""
        return self.config.stages > 1

    @property
    def smem_bytes(self) -> int:
        """The main kernel's tiles (``kernels/mma_sync_bwd/layouts.py``): Q and dO (tile_m x
        head_dim per stage), K and V (tile_n x head_dim), P and dS (tile_m x tile_n), 1 KB
        aligned each, and with ``prefetch_rows`` the LSE and D rows (fp32, tile_m per stage,
        128-byte aligned), the whole rounded up to 1 KB; the row kernels use none."""
        if self.op != "attention_bwd":
            return 0
        c, d, e = self.config, self.head_dim, DTYPE_BYTES[self.dtype]
        if self.hopper:  # Q, dO staged; K, V; dS (keys x query rows); LSE and D rows staged;
            # two fp32 dQ blocks for the bulk reductions; the TMA copies' barriers (8-byte
            # aligned: they may sit in the last member's padding)
            ds = 2 if self.warp_specialized else 1  # dSᵀ in two stages
            n = (2 * _align(c.tile_m * d * e * c.stages) + 2 * _align(c.tile_n * d * e)
                 + _align(c.tile_n * c.tile_m * e * ds) + _align(c.tile_m * 4 * c.stages))
            n += c.tile_m * 4 * c.stages  # D's rows, the last 1 KB-aligned member but one
            if self.bulk_dq:
                n = _align(n) + 2 * c.tile_m * d * 4
            if self.loads_by_tma:  # a full barrier a stage and the key block's; empty ones
                n = -(-n // 8) * 8 + 8 * (c.stages + 1 + (c.stages if ds == 2 else 0))
            return _align(n)
        n = (2 * _align(c.tile_m * d * e * c.stages) + 2 * _align(c.tile_n * d * e)
             + 2 * _align(c.tile_m * c.tile_n * e))
        if self.prefetch_rows:  # the struct's size rounds up to its 1 KB member alignment
            n = _align(n + 2 * (-(-c.tile_m * 4 * c.stages // 128) * 128))
        return n

    @property
    def name(self) -> str:
        part = {"attention_bwd": "bwd", "attention_bwd_pre": "bwd_pre",
                "attention_bwd_post": "bwd_post"}[self.op]
        base = f"fc_attn_{part}_{arch_tag(self.arch)}_{DTYPE_TAGS[self.dtype]}_d{self.head_dim}"
        if self.op != "attention_bwd":
            return base
        flags = (("causal", self.causal), ("br", self.mask_align == "bottom_right"),
                 ("window", self.window), ("softcap", self.softcap),
                 ("det", self.deterministic), ("varlen", self.varlen))
        layout = "_a" + "".join(map(str, self.warps_m)) if self.warps_m else ""
        return (base + f"_{self.config.tag}" + layout
                + "".join(f"_{n}" for n, on in flags if on))

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["config"] = self.config.to_dict()
        if self.warps_m:
            d["warps_m"] = list(self.warps_m)
        else:  # the default leaves no trace: older keys and names hold
            d.pop("warps_m", None)
        for name in ("deterministic", "varlen"):
            if not getattr(self, name):
                d.pop(name, None)
        return d


def default_backward_config(head_dim: int, arch: str | None = None) -> TileConfig:
    """The main kernel's config. sm_90 at d64, d96 and d128: the Hopper backward, 128 keys and
    128 query rows at d64 (FlashAttention-4's tile), 64 at d96 and d128. Else the
    mma_sync backward: eight warps, 64 query rows x 128 keys, two query blocks in
    flight where they fit (98 KB at d64: an L4's 99 KB hold it). Wider rows on an L4 (or no
    ``arch``) take 64 keys: d96 two blocks in flight (89 KB), d128 one (80 KB); sm_80 and
    sm_90 hold 64 x 128 up to d128 (FlashAttention-2's A100/H100 tile): twice the keys per CTA,
    half the Q/dO traffic and dQ atomics per FLOP. d80 rows (five 32-byte lines) copy 64 rows a
    pass with four warps. d256 keeps dK and dV (128 registers a thread at 64 keys and eight
    warps) beside 64 x 64 scores; an L4's 99 KB hold 32 x 32 tiles of four warps. (d64 at
    128 x 128, FlashAttention-2's H100 choice, runs at 255 registers with a few spilled: a
    variant to time, not the default.)"""
    if arch == "sm_90" and head_dim in HOPPER_BWD_HEAD_DIMS:
        return TileConfig(HOPPER_BWD_TILES[head_dim][0], warps=8, stages=2, family=HOPPER_BWD)
    big = arch is not None and SMEM_PER_BLOCK[arch] >= 160 * 1024
    if head_dim == 80:
        return TileConfig((64, 64), warps=4, stages=2)
    if head_dim == 256:
        return TileConfig((64, 64), warps=8) if big else TileConfig((32, 32), warps=4)
    if head_dim <= 64 or big:
        return TileConfig((64, 128), warps=8, stages=2)
    if head_dim <= 96:
        return TileConfig((64, 64), warps=8, stages=2)
    return TileConfig((64, 64), warps=8)


_CHOICE = re.compile(r"^(?:(\d+):)?(\d+)x(\d+)w(\d+)s(\d+)(?:a(\d{3}|-))?(?:-(\w+))?$")


def parse_backward_choices(text: str) -> dict[int | None, tuple[TileConfig, tuple[int, ...]
                                                                | None]]:
    """Main-kernel choices written as ``[D:]MxNwWsS[aXYZ|a-][-FAMILY]`` separated by ``;``:
    for head dim D (every head dim without ``D:``) tiles of M query rows x N keys, W warps, S
    stages, warps along the rows of S/dP, dK/dV and dQ (``aXYZ``; ``a-``: 16-row strips first;
    none: ``default_warps_m``) and the kernel family (none: mma_sync). E.g.
    ``128:64x128w8s2a242;64:128x128w8s2`` or ``64x128w8s2-hopper``. Returns {D or None:
    (config, warps_m or None)}."""
    out: dict[int | None, tuple[TileConfig, tuple[int, ...] | None]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        m = _CHOICE.match(part)
        if m is None:
            raise SpecError(f"backward choice {part!r} is not [D:]MxNwWsS[aXYZ|a-][-FAMILY] "
                            "(e.g. 128:64x128w8s2a242 or 64x128w8s2-hopper)")
        d, tm, tn, w, st, a, family = m.groups()
        if family is not None and family not in BACKWARD_FAMILIES:
            raise SpecError(f"backward choice {part!r}: family {family!r} is not one of "
                            f"{BACKWARD_FAMILIES[1:]}")
        config = TileConfig((int(tm), int(tn)), warps=int(w), stages=int(st),
                            family="" if family in (None, "mma_sync") else family)
        warps_m = None if a is None else (() if a == "-" else tuple(int(x) for x in a))
        out[None if d is None else int(d)] = (config, warps_m)
    return out
