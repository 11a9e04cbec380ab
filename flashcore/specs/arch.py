"""What each target architecture offers, as data: the one place these facts live."""

from __future__ import annotations

import math

ARCHS = ("sm_80", "sm_89", "sm_90")
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (32, 64, 80, 96, 128, 256)  # the forward's (mma_sync family)
BACKWARD_HEAD_DIMS = HEAD_DIMS  # the backward (mma_sync family) builds every forward dim
# what the other kernels build: FP8 operands, an FP8 KV cache and their quantiser; the Hopper
# family (its 128-byte swizzles and tuned schedules assume these)
FP8_HEAD_DIMS = (64, 128)
WGMMA_HEAD_DIMS = (32, 64, 80, 96, 128, 256)
FP8_ARCHS = ("sm_89", "sm_90")  # e4m3 mma.sync and cvt exist from Ada on
PDL_ARCHS = ("sm_90",)  # griddepcontrol (programmatic dependent launch) exists from Hopper on

# Largest dynamic shared memory one block may opt into, in bytes (CUDA programming guide,
# "Technical specifications per compute capability").
SMEM_PER_BLOCK = {"sm_80": 163 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024}
# Shared memory per SM (for occupancy estimates).
SMEM_PER_SM = {"sm_80": 164 * 1024, "sm_89": 100 * 1024, "sm_90": 228 * 1024}

DTYPE_BYTES = {"float16": 2, "bfloat16": 2}
DTYPE_TAGS = {"float16": "f16", "bfloat16": "bf16"}  # short names used in kernel names
E4M3_BYTES = 1


SWIZZLE_LINE_BYTES = 128  # the widest swizzled line: a row of 32 four-byte banks


def swizzle_line_bytes(row_bytes: int) -> int:
    """Bytes of one line of a shared tile's swizzle atom for rows of ``row_bytes``: the largest
    power of two (at most 128) that divides the row, so the atoms tile it (a 96-wide fp16 row,
    192 bytes, is three 64-byte lines; 80 wide, five of 32). Eight lines of any such width,
    XOR-swizzled, still cover all banks for ldmatrix."""
    return math.gcd(row_bytes, SWIZZLE_LINE_BYTES)


def arch_tag(arch: str) -> str:
    """"sm_90" -> "sm90" (kernel names)."""
    return arch.replace("_", "")


def check_target(bad, arch, dtype, head_dim=None) -> None:
    """Raise ``bad(what)`` for an arch or dtype flashcore does not build, and (``head_dim``
    given) a head dim outside the forward's."""
    if arch not in ARCHS:
        raise bad(f"arch={arch!r} is not supported; choose one of {ARCHS}")
    if dtype not in DTYPES:
        raise bad(f"dtype={dtype!r} is not supported; choose one of {DTYPES}")
    if head_dim is not None and head_dim not in HEAD_DIMS:
        raise bad(f"head_dim={head_dim} is not supported; choose one of {HEAD_DIMS}")
