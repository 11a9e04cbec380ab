"""Tensors to kernel arguments: dtype names, and the (pointer, extents, strides) of each tensor
parameter in the order ``flashcore.build.abi`` describes."""

from __future__ import annotations

import torch

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
E4M3 = torch.float8_e4m3fn


def tensor_arg(t: torch.Tensor) -> tuple:
    """(pointer, extents..., strides...) of a (batch, heads, seq, head_dim) tensor for a
    TensorParam(3, 3): the dynamic extents are batch, heads, seq; the strides those of modes 0-2."""
    b, h, s, _ = t.shape
    sb, sh, ss, _ = t.stride()
    return (t.data_ptr(), b, h, s, sb, sh, ss)


def rows_arg(t: torch.Tensor) -> tuple:
    """The same for a (batch, heads, seq) float32 tensor with a unit last stride
    (TensorParam(3, 2): LSE, per-token descales)."""
    b, h, s = t.shape
    sb, sh, _ = t.stride()
    return (t.data_ptr(), b, h, s, sb, sh)


def prepared(t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """(t, tensor_arg(t)) for a (batch, heads, seq, head_dim) input: the kernels need a contiguous
    last dim and a 16-byte aligned base and strides; anything else is copied first. Strides and
    pointer are read once (every attention call goes through here)."""
    sb, sh, ss, sd = t.stride()
    ptr = t.data_ptr()
    align = 16 // t.element_size()
    if sd != 1 or ptr % 16 or sb % align or sh % align or ss % align:
        t = t.contiguous()
        sb, sh, ss, _ = t.stride()
        ptr = t.data_ptr()
    b, h, s, _ = t.shape
    return t, (ptr, b, h, s, sb, sh, ss)


def transposed_arg(t: torch.Tensor) -> tuple:
    """The same for a (batch, heads, head_dim, seq) tensor (FP8 Vᵀ): head_dim (mode 2) is the
    static extent, so the dynamic extents are batch, heads, seq and the strides those of 0-2."""
    b, h, _, s = t.shape
    sb, sh, sd, _ = t.stride()
    return (t.data_ptr(), b, h, s, sb, sh, sd)
