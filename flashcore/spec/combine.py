"""``CombineSpec``: the kernel that merges split-KV partial results (flash-decoding)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SpecError
from .arch import ARCHS, DTYPE_TAGS, DTYPES, HEAD_DIMS, PDL_ARCHS, arch_tag
from .serial import SpecData


@dataclass(frozen=True)
class CombineSpec(SpecData):
    """Merge ``num_splits`` fp32 partial outputs and log-sum-exps of each query row into the
    output (``dtype``) and, with ``return_lse``, the row's log-sum-exp. A warp per row."""

    arch: str = "sm_89"
    dtype: str = "float16"
    head_dim: int = 64
    return_lse: bool = False
    rows_per_cta: int = 4  # one warp per row
    op: str = field(default="attention_combine")

    def __post_init__(self) -> None:
        def bad(what: str) -> SpecError:
            return SpecError(f"CombineSpec: {what}")

        if self.op != "attention_combine":
            raise bad(f"op={self.op!r} is not 'attention_combine'")
        if self.arch not in ARCHS:
            raise bad(f"arch={self.arch!r} is not supported; choose one of {ARCHS}")
        if self.dtype not in DTYPES:
            raise bad(f"dtype={self.dtype!r} is not supported; choose one of {DTYPES}")
        if self.head_dim not in HEAD_DIMS:
            raise bad(f"head_dim={self.head_dim} is not supported; choose one of {HEAD_DIMS}")
        if not isinstance(self.return_lse, bool):
            raise bad(f"return_lse must be a bool, got {self.return_lse!r}")
        if self.rows_per_cta not in (1, 2, 4, 8):
            raise bad(f"rows_per_cta={self.rows_per_cta} is not one of (1, 2, 4, 8)")

    @property
    def threads(self) -> int:
        return 32 * self.rows_per_cta

    @property
    def smem_bytes(self) -> int:
        return 0

    @property
    def programmatic_launch(self) -> bool:
        return self.arch in PDL_ARCHS

    @property
    def name(self) -> str:
        lse = "_lse" if self.return_lse else ""
        return (f"fc_attn_combine_{arch_tag(self.arch)}_{DTYPE_TAGS[self.dtype]}"
                f"_d{self.head_dim}_r{self.rows_per_cta}{lse}")
