"""``CombineSpec``: the kernel that merges split-KV partial results (flash-decoding)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SpecError
from .arch import DTYPE_TAGS, PDL_ARCHS, arch_tag, check_target
from .serial import SpecData

MAX_SPLITS = 256  # key shares a split-KV call may have: the combine keeps a weight for each
IN_FLIGHT = 4  # shares a combine thread loads before it adds them up


@dataclass(frozen=True)
class CombineSpec(SpecData):
    """Merge ``num_splits`` (at most ``MAX_SPLITS``) fp32 partial outputs and log-sum-exps of
    each query row into the output (``dtype``) and, with ``return_lse``, the row's
    log-sum-exp. A CTA per row, its ``warps`` sharing the row's shares."""

    arch: str = "sm_89"
    dtype: str = "float16"
    head_dim: int = 64
    return_lse: bool = False
    warps: int = 4
    op: str = field(default="attention_combine")

    def __post_init__(self) -> None:
        def bad(what: str) -> SpecError:
            return SpecError(f"CombineSpec: {what}")

        if self.op != "attention_combine":
            raise bad(f"op={self.op!r} is not 'attention_combine'")
        check_target(bad, self.arch, self.dtype, self.head_dim)
        if not isinstance(self.return_lse, bool):
            raise bad(f"return_lse must be a bool, got {self.return_lse!r}")
        if self.warps not in (1, 2, 4, 8):
            raise bad(f"warps={self.warps} is not one of (1, 2, 4, 8)")
        if self.threads < self.head_dim // 4:
            raise bad(f"warps={self.warps} is {self.threads} threads, fewer than the "
                      f"{self.head_dim // 4} 16-byte loads of one head_dim={self.head_dim} row")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def slots(self) -> int:
        """Shares read at once: a share's row is ``head_dim / 4`` threads' 16-byte loads."""
        return self.threads // (self.head_dim // 4)

    @property
    def idle_threads(self) -> bool:
        """Whether some threads hold no slot (``head_dim / 4`` does not divide the threads, as
        at head_dim 96): they help reduce the LSEs but add no share."""
        return self.threads % (self.head_dim // 4) != 0

    @property
    def smem_bytes(self) -> int:
        """Each share's weight (and zeros for a pass of loads that runs past the last share),
        each slot's partial row, each warp's reduction value."""
        return 4 * (MAX_SPLITS + IN_FLIGHT * self.slots + self.slots * self.head_dim
                    + self.warps)

    @property
    def programmatic_launch(self) -> bool:
        return self.arch in PDL_ARCHS

    @property
    def name(self) -> str:
        lse = "_lse" if self.return_lse else ""
        return (f"fc_attn_combine_{arch_tag(self.arch)}_{DTYPE_TAGS[self.dtype]}"
                f"_d{self.head_dim}_w{self.warps}{lse}")
