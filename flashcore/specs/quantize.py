"""``QuantizeSpec``: the fp16/bf16 -> e4m3 quantiser of one tensor."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SpecError
from .arch import DTYPE_TAGS, DTYPES, FP8_ARCHS, FP8_HEAD_DIMS, arch_tag
from .serial import SpecData

AMAX_SHARES = 32  # partial maxima per (batch, head): the amax pass's CTAs for each


@dataclass(frozen=True)
class QuantizeSpec(SpecData):
    """Per-(batch, head) or per-token e4m3 quantisation with scales from the data.

    ``transpose`` writes V's layout for the FP8 attention kernel: (batch, heads, head_dim, seq
    padded to a multiple of 128) with keys permuted within each 32. A per-(batch, head) scale
    takes two kernels: ``part="amax"`` (``AMAX_SHARES`` partial maxima of each (batch, head),
    a CTA each), then ``part="cast"`` (the quantised tensor, a CTA per block of rows or keys).
    """

    arch: str = "sm_89"
    dtype: str = "float16"
    head_dim: int = 64
    transpose: bool = False
    threads: int = 256
    granularity: str = "head"  # one scale per (batch, head), or per (batch, head, token)
    part: str = "cast"  # per (batch, head): "amax" (pass 1), then "cast"
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
        if self.head_dim not in FP8_HEAD_DIMS:
            raise bad(f"head_dim={self.head_dim} is not supported; e4m3 kernels are built for "
                      f"{FP8_HEAD_DIMS}")
        if not isinstance(self.transpose, bool):
            raise bad(f"transpose must be a bool, got {self.transpose!r}")
        if self.threads not in (128, 256, 512):
            raise bad(f"threads={self.threads} is not one of (128, 256, 512)")
        if self.granularity not in ("head", "token"):
            raise bad(f"granularity={self.granularity!r} is not 'head' or 'token'")
        if self.granularity == "token" and self.transpose:
            raise bad("per-token scales are for Q and K; V (transpose=True) is scaled per head")
        if self.part not in ("cast", "amax"):
            raise bad(f"part={self.part!r} is not 'cast' or 'amax'")
        if self.part == "amax" and (self.granularity != "head" or self.transpose):
            raise bad("part='amax' is the per-(batch, head) scale's first pass: granularity "
                      "'head', transpose=False")

    @property
    def name(self) -> str:
        t = "_vt" if self.transpose else ""
        g = "_tok" if self.granularity == "token" else ""
        a = "_amax" if self.part == "amax" else ""
        return (f"fc_quant_e4m3_{arch_tag(self.arch)}_{DTYPE_TAGS[self.dtype]}_d{self.head_dim}"
                f"_t{self.threads}{t}{g}{a}")

    @property
    def smem_bytes(self) -> int:
        # the amax pass: one float per warp for its CTA's reduction; the casts: none
        return 4 * (self.threads // 32) if self.part == "amax" else 0
