"""``KvAppendSpec``: new keys and values written into a KV cache in place, with rotary."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SpecError
from .arch import DTYPE_TAGS, DTYPES, arch_tag, check_target
from .serial import SpecData

TABLE_DTYPES = ("float32", *DTYPES)  # the rotary cos/sin tables' element type


@dataclass(frozen=True)
class KvAppendSpec(SpecData):
    """Append each sequence's new tokens to a paged cache (a dense cache is one page a row) at
    its length, and with ``rotary_dim`` > 0 turn the first ``rotary_dim`` features of the new
    keys and of the queries by their positions (cos/sin tables of ``table_dtype``, the math in
    float32): features (2i, 2i + 1) with ``interleaved`` (GPT-J), else (i, i + rotary_dim / 2)
    (GPT-NeoX). FlashAttention's ``flash_attn_with_kvcache`` step before attention, in one
    launch: a CTA per (token, head, sequence)."""

    arch: str = "sm_89"
    dtype: str = "float16"
    head_dim: int = 128
    rotary_dim: int = 0
    interleaved: bool = False
    table_dtype: str = "float32"
    op: str = field(default="kv_append")

    def __post_init__(self) -> None:
        def bad(what: str) -> SpecError:
            return SpecError(f"KvAppendSpec: {what}")

        if self.op != "kv_append":
            raise bad(f"op={self.op!r} is not 'kv_append'")
        check_target(bad, self.arch, self.dtype, self.head_dim)
        if (isinstance(self.rotary_dim, bool) or not isinstance(self.rotary_dim, int)
                or self.rotary_dim < 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim):
            raise bad(f"rotary_dim={self.rotary_dim!r} must be an even int in 0..{self.head_dim}")
        if not isinstance(self.interleaved, bool):
            raise bad(f"interleaved must be a bool, got {self.interleaved!r}")
        if self.table_dtype not in TABLE_DTYPES:
            raise bad(f"table_dtype={self.table_dtype!r} is not one of {TABLE_DTYPES}")
        if not self.rotary_dim and (self.interleaved or self.table_dtype != "float32"):
            raise bad("interleaved and table_dtype describe the rotary; rotary_dim=0 has none "
                      "(leave them False and 'float32')")

    @property
    def threads(self) -> int:
        return 128

    @property
    def smem_bytes(self) -> int:
        return 0

    @property
    def name(self) -> str:
        rot = ""
        if self.rotary_dim:
            order = "i" if self.interleaved else "h"
            rot = f"_r{self.rotary_dim}{order}_{DTYPE_TAGS.get(self.table_dtype, 'f32')}"
        return (f"fc_kv_append_{arch_tag(self.arch)}_{DTYPE_TAGS[self.dtype]}_d{self.head_dim}"
                f"{rot}")
