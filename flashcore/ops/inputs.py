"""Tensors to kernel arguments: dtype names, and the (pointer, extents, strides) of each tensor
parameter in the order ``flashcore.compiler.abi`` describes."""

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


def vector_arg(t: torch.Tensor) -> tuple:
    """(pointer, length) of a (n,) tensor with a unit stride (TensorParam(1, 0): offsets,
    lengths)."""
    return (t.data_ptr(), t.shape[0])


def matrix_arg(t: torch.Tensor) -> tuple:
    """(pointer, rows, columns, row stride) of a (rows, cols) tensor with a unit last stride
    (TensorParam(2, 1): block tables, rotary tables)."""
    return (t.data_ptr(), t.shape[0], t.shape[1], t.stride(0))


def readable(t: torch.Tensor) -> bool:
    """Whether the kernels can read or write ``t`` as it is: a contiguous last dim, a 16-byte
    aligned base and strides that are whole multiples of 16 bytes (the compiled kernels assume
    all three: ``flashcore.kernels.build``), and no broadcast (``broadcast``)."""
    st = t.stride()
    align = 16 // t.element_size()
    return (st[-1] == 1 and t.data_ptr() % 16 == 0 and all(s % align == 0 for s in st[:-1])
            and (0 not in st or not broadcast(t)))


def broadcast(t: torch.Tensor) -> bool:
    """Whether a dim of more than one element has stride 0 (an ``expand``): a TMA descriptor
    cannot step by 0 (``runtime.tensor_map``), so such a tensor is copied first."""
    return any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride()))


def readable_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a fresh compact copy of it where the kernels cannot read it as it is. A fresh
    allocation, never ``contiguous()``: that returns a contiguous view at a misaligned base
    unchanged."""
    return t if readable(t) else _fresh_copy(t)


def _fresh_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def prepared(t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """(t, tensor_arg(t)) for a (batch, heads, seq, head_dim) input the kernels read, copied
    first where they could not read it (``readable``). Strides and pointer are read once on the
    common path (every attention call goes through here)."""
    sb, sh, ss, sd = t.stride()
    ptr = t.data_ptr()
    align = 16 // t.element_size()
    if (sd != 1 or ptr % 16 or sb % align or sh % align or ss % align
            or 0 in (sb, sh, ss) and broadcast(t)):
        t = _fresh_copy(t)
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
