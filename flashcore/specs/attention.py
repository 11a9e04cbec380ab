"""``AttentionSpec``: one attention forward kernel, described by data.

A spec is frozen, hashable and JSON-serialisable. Its ``name`` is readable and unique among
valid specs; its ``content_hash`` keys the on-disk cache (with the build's fingerprint).
Validation happens on construction, so an object that exists can be compiled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..errors import SpecError
from .arch import (
    ARCHS,
    DTYPE_BYTES,
    DTYPE_TAGS,
    DTYPES,
    E4M3_BYTES,
    FP8_ARCHS,
    FP8_HEAD_DIMS,
    HEAD_DIMS,
    PDL_ARCHS,
    arch_tag,
    check_target,
)
from .families import DEFAULT_FAMILY, family
from .serial import SpecData
from .tile import TileConfig, TiledKernel

PRECISIONS = ("fp16", "fp8")  # MMA operand precision: the input dtype, or float8_e4m3fn
# where the causal diagonal (and a window's edges) sit when S_q != S_k: top-left (torch's
# is_causal: query i sees keys <= i) or bottom-right (the last query sees the last key)
MASK_ALIGNS = ("top_left", "bottom_right")
# FP8 operands: K's descale per key (an outlier token costs precision only to itself) or one per
# (batch, K/V head), which folds into each row's exp2 scale (no per-score multiply or load)
K_SCALES = ("token", "head")
WINDOW_UNBOUNDED = 1 << 30  # a window side without a limit, as the kernel takes it (int32-safe)


@dataclass(frozen=True)
class AttentionSpec(SpecData, TiledKernel):
    """One forward attention kernel.

    ``dtype`` is the query and output dtype. ``precision="fp8"`` multiplies float8_e4m3fn Q, K
    and Vᵀ (m16n8k32) that ``flashcore.ops.fp8.quantize_fp8`` produced, K descaled per token
    or (``k_scale="head"``) per (batch, head). ``kv_fp8`` reads K and
    V as an e4m3 KV cache (dense or paged) with per-key descales and multiplies in ``dtype`` (dequantised in
    shared memory). ``split_kv`` writes fp32 partial outputs of one share of the keys per CTA
    (flash-decoding); a combine kernel (``CombineSpec``) merges them, or with ``merge_shares``
    the last CTA of each query tile's shares does. Every kernel serves
    grouped-query attention (K/V with fewer heads than Q) and any batch, head count and length.
    ``mask_align``, ``window`` and ``softcap`` are the masks as data: where the causal diagonal
    sits, a sliding window (key blocks outside it are skipped) and logit soft-capping; the
    window's sizes and the cap are run-time arguments, so one kernel serves every value.
    ``varlen`` and ``paged_kv`` are the serving layouts: a packed batch of sequences of different
    lengths (cumulative offsets, FlashAttention's ``varlen`` convention), and K/V read from a
    paged cache through a block table (vLLM's); lengths and tables are run-time arguments. A
    ``page_size`` compiled in lets a key block be copied in whole pages (the family says which
    sizes it can); 0 serves any page size, gathering the keys one row at a time.
    ``packed_tokens``: grouped-query decode of a few tokens, each K/V head's (token, query
    head) pairs the rows of its tiles, token-major (row t * q_group + h is query head
    kv * q_group + h's token t), gathered from Q and scattered to O and LSE as they are.
    """

    arch: str = field(default="sm_89", metadata={"help": "target architecture", "choices": ARCHS})
    dtype: str = field(default="float16", metadata={"help": "query/output dtype",
                                                    "choices": DTYPES})
    head_dim: int = field(default=64, metadata={"help": "head dimension", "choices": HEAD_DIMS})
    config: TileConfig = field(default_factory=TileConfig,
                               metadata={"help": "tile, warps, stages, kv_splits"})
    causal: bool = field(default=False, metadata={"help": "causal mask (top-left unless mask_align)"})
    return_lse: bool = field(default=False, metadata={"help": "also write the log-sum-exp"})
    precision: str = field(default="fp16", metadata={"help": "MMA operand precision",
                                                     "choices": PRECISIONS})
    kv_fp8: bool = field(default=False, metadata={"help": "K/V are an e4m3 cache with per-token scales"})
    k_scale: str = field(default="token", metadata={
        "help": "precision='fp8': K's descale per token or per (batch, head)",
        "choices": K_SCALES})
    split_kv: bool = field(default=False, metadata={"help": "write per-CTA partials for a combine"})
    merge_shares: bool = field(default=False, metadata={
        "help": "split_kv: the last CTA of each query tile's shares merges them into the output "
                "(one launch, no combine kernel; int32 arrival counters, zero before the launch)"})
    mask_align: str = field(default="top_left", metadata={
        "help": "causal/window diagonal: top_left (torch's is_causal) or bottom_right",
        "choices": MASK_ALIGNS})
    window: bool = field(default=False, metadata={
        "help": "sliding-window attention (the window's sizes are run-time arguments)"})
    softcap: bool = field(default=False, metadata={
        "help": "soft-cap logits, cap * tanh(s / cap) (the cap is a run-time argument)"})
    alibi: bool = field(default=False, metadata={
        "help": "ALiBi: add -slope * |i + offset - j| to each logit, a float32 slope per "
                "(batch, head) at run time (offset as the causal diagonal's)"})
    varlen: bool = field(default=False, metadata={
        "help": "packed variable-length batch: Q/O (and K/V unless paged) as (total, heads, d) "
                "with cumulative sequence offsets"})
    paged_kv: bool = field(default=False, metadata={
        "help": "K/V in a paged cache (pages, page_size, heads, d) read through a block table"})
    page_size: int = field(default=0, metadata={
        "help": "a paged cache's page size, compiled in: key blocks are copied a page at a time "
                "(0: any page size, keys gathered a row at a time)"})
    packed_tokens: bool = field(default=False, metadata={
        "help": "GQA decode of a few tokens: each K/V head's (token, query head) pairs are its "
                "tiles' rows, token-major, read from and written to (batch, heads, seq, d)"})
    family: str = field(default="", metadata={"help": "kernel family (default: the arch's)"})
    op: str = field(default="attention_fwd", metadata={"cli": False})

    def __post_init__(self) -> None:
        if isinstance(self.config, dict):
            object.__setattr__(self, "config", TileConfig.from_dict(self.config))
        self._resolve_family()
        self._validate()

    def _resolve_family(self) -> None:
        """One family, named by the spec or its config (or the arch's default): the spec's
        ``family`` always holds it, the config's only when it is not the default (so a default
        config keeps the names and keys it always had)."""
        named = {f for f in (self.family, getattr(self.config, "family", "")) if f}
        if len(named) > 1:
            raise SpecError(f"AttentionSpec: family={self.family!r} and config.family="
                            f"{self.config.family!r} disagree")
        default = DEFAULT_FAMILY.get(self.arch, "")
        chosen = named.pop() if named else default
        object.__setattr__(self, "family", chosen)
        if isinstance(self.config, TileConfig):
            object.__setattr__(self, "config", self.config.replace(
                family="" if chosen == default else chosen))

    # -- validation ---------------------------------------------------------------------------
    def _validate(self) -> None:
        def bad(what: str) -> SpecError:
            return SpecError(f"AttentionSpec: {what}")

        if self.op != "attention_fwd":
            raise bad(f"op={self.op!r} is not supported (only 'attention_fwd')")
        check_target(bad, self.arch, self.dtype)
        if self.precision not in PRECISIONS:
            raise bad(f"precision={self.precision!r} is not supported; choose one of {PRECISIONS}")
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int):
            raise bad(f"head_dim must be an int, got {self.head_dim!r}")
        if self.head_dim not in HEAD_DIMS:
            raise bad(f"head_dim={self.head_dim} is not supported; choose one of {HEAD_DIMS}")
        if not isinstance(self.config, TileConfig):
            raise bad(f"config must be a TileConfig, got {type(self.config).__name__}")
        for name in ("causal", "return_lse", "kv_fp8", "split_kv", "merge_shares", "window",
                     "softcap", "alibi", "varlen", "paged_kv", "packed_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a bool, got {getattr(self, name)!r}")
        if (self.precision == "fp8" or self.kv_fp8) and self.head_dim not in FP8_HEAD_DIMS:
            what = "precision='fp8'" if self.precision == "fp8" else "kv_fp8=True"
            raise bad(f"{what} is built for head_dim in {FP8_HEAD_DIMS}, not head_dim="
                      f"{self.head_dim} (its e4m3 tiles and permutations assume 64-byte "
                      "multiples); use 16-bit operands")
        if (self.precision == "fp8" or self.kv_fp8) and self.arch not in FP8_ARCHS:
            what = "precision='fp8'" if self.precision == "fp8" else "kv_fp8=True"
            raise bad(
                f"{what} needs e4m3 support (mma.sync / cvt e4m3), which {self.arch} does not "
                f"have; use arch in {FP8_ARCHS}"
            )
        if self.mask_align not in MASK_ALIGNS:
            raise bad(f"mask_align={self.mask_align!r} is not supported; choose one of {MASK_ALIGNS}")
        if self.mask_align != "top_left" and not (self.causal or self.window or self.alibi):
            raise bad(f"mask_align={self.mask_align!r} aligns a causal mask, a window or ALiBi; "
                      "this spec has none (leave it 'top_left')")
        if self.alibi and (self.precision == "fp8" or self.kv_fp8 or self.packed_tokens):
            raise bad("alibi=True is built for 16-bit operands, a row per (head, token) (one "
                      "slope a CTA): not with FP8 or packed_tokens")
        if self.softcap and self.precision == "fp8":
            raise bad("softcap=True needs the true logits, which the FP8 kernel never forms "
                      "(its query descales fold into the exp2 scale); use precision='fp16'")
        if self.k_scale not in K_SCALES:
            raise bad(f"k_scale={self.k_scale!r} is not supported; choose one of {K_SCALES}")
        if self.k_scale != "token" and self.precision != "fp8":
            raise bad(f"k_scale={self.k_scale!r} is for precision='fp8' (K's e4m3 descales); "
                      "leave it 'token'")
        if self.precision == "fp8" and self.kv_fp8:
            raise bad("kv_fp8=True is for 16-bit operands; precision='fp8' already reads e4m3 K/V")
        if (self.varlen or self.paged_kv) and self.precision == "fp8":
            raise bad("varlen/paged_kv read 16-bit operands; precision='fp8' is for dense tensors")
        if self.varlen and self.kv_fp8 and not self.paged_kv:
            raise bad("an e4m3 KV cache (kv_fp8=True) is read from dense (batch, heads, seq, d) "
                      "tensors or a paged cache; packed varlen K/V with kv_fp8 are not built")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int):
            raise bad(f"page_size must be an int, got {self.page_size!r}")
        if self.page_size < 0 or (self.page_size and not self.paged_kv):
            raise bad(f"page_size={self.page_size} needs paged_kv=True and is >= 1 "
                      "(0 leaves the page size to run time)")
        if self.packed_tokens and (self.varlen or self.precision == "fp8"):
            raise bad("packed_tokens=True packs a dense or paged decode's 16-bit queries; "
                      "varlen batches and precision='fp8' keep a row per (head, token)")
        if self.merge_shares and not self.split_kv:
            raise bad("merge_shares=True merges the shares of a split_kv kernel; set "
                      "split_kv=True (or leave merge_shares False)")
        if self.varlen and self.split_kv:
            raise bad("varlen=True is the prefill layout and splits no keys across CTAs; "
                      "decode a paged cache (paged_kv=True) for split-KV")
        fam = family(self.family)
        if self.arch not in fam.archs:
            raise bad(f"family {fam.name!r} does not run on {self.arch}; it runs on {fam.archs}")
        fam.validate(self)

    # -- derived -------------------------------------------------------------------------------
    @property
    def group_threads(self) -> int:
        """Threads that share one key range (all of them unless kv_splits > 1)."""
        return self.config.group_threads

    @property
    def threads(self) -> int:
        """The CTA's threads: the config's, and the family's producer warps if it has any."""
        return self.config.threads + family(self.family).producer_threads

    @property
    def shifted_mask(self) -> bool:
        """The general key bounds: bottom-right alignment or a window (else the fixed top-left
        diagonal, or no mask but the sequence end)."""
        return self.mask_align == "bottom_right" or self.window

    @property
    def programmatic_launch(self) -> bool:
        """Hopper kernels take part in programmatic dependent launch: they wait for the grid
        before them (``griddepcontrol.wait``) before touching global memory, so the runtime may
        start them while that grid drains. Ada and Ampere have no such instruction."""
        return self.arch in PDL_ARCHS

    @property
    def elem_bytes(self) -> int:
        """Bytes per MMA operand element in shared memory."""
        return E4M3_BYTES if self.precision == "fp8" else DTYPE_BYTES[self.dtype]

    @property
    def smem_bytes(self) -> int:
        return family(self.family).smem_bytes(self)

    @property
    def name(self) -> str:
        """Readable, stable and unique among valid specs (every field appears)."""
        parts = ["fc_attn_fwd", arch_tag(self.arch), DTYPE_TAGS[self.dtype],
                 f"d{self.head_dim}", self.config.tag]
        flags = [("causal", self.causal), ("lse", self.return_lse),
                 (self.precision, self.precision != "fp16"), ("khead", self.k_scale == "head"),
                 ("kvfp8", self.kv_fp8),
                 ("split", self.split_kv), ("merge", self.merge_shares),
                 ("br", self.mask_align == "bottom_right"),
                 ("window", self.window), ("softcap", self.softcap),
                 ("alibi", self.alibi), ("varlen", self.varlen),
                 (f"paged{self.page_size or ''}", self.paged_kv),
                 ("ptok", self.packed_tokens)]  # config.tag: family
        return "_".join(parts + [tag for tag, on in flags if on])

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["config"] = self.config.to_dict()
        for name in ("alibi", "merge_shares"):  # off: the JSON (and cache keys) specs had before
            if not d[name]:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AttentionSpec:
        d = cls._checked_fields(d, legacy=_LEGACY_CONFIG_FIELDS)
        legacy = {k: d.pop(k) for k in _LEGACY_CONFIG_FIELDS if k in d}
        if legacy:  # specs written before TileConfig carried the knobs at the top level
            if "config" in d:
                raise SpecError(f"AttentionSpec: both 'config' and {sorted(legacy)} given")
            d["config"] = TileConfig(**legacy)
        return cls(**d)

    def replace(self, **changes: Any) -> AttentionSpec:
        """A copy with fields changed; TileConfig knobs (tile, warps, ...) may be given
        directly and change the config."""
        knobs = {k: changes.pop(k) for k in _LEGACY_CONFIG_FIELDS if k in changes}
        if knobs:
            changes["config"] = changes.get("config", self.config).replace(**knobs)
        return dataclasses.replace(self, **changes)


_LEGACY_CONFIG_FIELDS = ("tile", "warps", "stages", "kv_splits")
