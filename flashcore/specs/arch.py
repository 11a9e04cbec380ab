"""What each target architecture offers, as data: the one place these facts live."""

from __future__ import annotations

ARCHS = ("sm_80", "sm_89", "sm_90")
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128)
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


def arch_tag(arch: str) -> str:
    """"sm_90" -> "sm90" (kernel names)."""
    return arch.replace("_", "")
