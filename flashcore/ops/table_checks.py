"""Checks of serving tables read back from the device (``check_lengths``): each builds
(message, bad?) pairs in 64-bit arithmetic on the GPU, and one read-back raises the first that
holds. Skipped inside a CUDA graph capture, which cannot read device values (said once per
op)."""

from __future__ import annotations

import warnings

import torch

from .validate import op_error


def cu_seqlens_faults(name: str, cu: torch.Tensor, total: int, max_len: int) -> list:
    """Device-side tests of one offsets vector: (message, bad?) pairs (read back together). In
    64 bits: an int32 difference of wrapped offsets could pass."""
    cu = cu.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    return [(f"{name}[0] must be 0", cu[0] != 0),
            (f"{name} must not decrease", (lens < 0).any()),
            (f"{name}[-1] is past the packed tensor's {total} rows", cu[-1] > total),
            (f"a sequence in {name} is longer than its max_seqlen ({max_len})",
             (lens > max_len).any())]


def table_faults(lens: torch.Tensor, table: torch.Tensor, pages: int, page_size: int,
                 name: str = "seqlens_k") -> list:
    """Device-side tests of a paged cache's key lengths (``name``) and block table, as
    ``cu_seqlens_faults`` (64-bit): only the entries a sequence's length reaches are read."""
    max_pages = table.shape[1]
    lens = lens.to(torch.int64)
    reach = (lens.clamp(min=0) + page_size - 1) // page_size  # pages each sequence uses
    used = torch.arange(max_pages, device=table.device)[None, :] < reach[:, None]
    return [(f"{name} must be >= 0", (lens < 0).any()),
            (f"{name} is over the block table's {max_pages} pages x {page_size}",
             (lens > max_pages * page_size).any()),
            (f"a block_table entry a sequence uses is outside 0..{pages - 1}",
             (used & ((table < 0) | (table >= pages))).any())]


_warned_capture: set[str] = set()


def checking(op: str, check_lengths: bool) -> bool:
    """Whether to run the device-side checks: asked for, and not inside a graph capture (which
    cannot read device values back; its small kernels would also join the graph). A capture
    that skips asked-for checks says so once per op."""
    if not check_lengths:
        return False
    if not torch.cuda.is_current_stream_capturing():
        return True
    if op not in _warned_capture:
        _warned_capture.add(op)
        warnings.warn(
            f"{op}: inside a CUDA graph capture the length tables cannot be checked, so they are "
            "trusted: the kernels stay inside every tensor whatever the tables say and rows no "
            "sequence computes read 0, but a wrong table gives wrong results. Check the tables "
            "before capturing; check_lengths=False says they are trusted and silences this",
            RuntimeWarning, stacklevel=4)
    return False


def raise_faults(op: str, faults: list) -> None:
    """Raise the first fault whose flag is set: (message, a one-element bool tensor) pairs,
    read back from the device in one synchronisation."""
    if not faults:
        return
    flags = torch.stack([torch.as_tensor(bad).reshape(()) for _, bad in faults]).tolist()
    for (message, _), bad in zip(faults, flags):
        if bad:
            raise op_error(op, message + " (check_lengths=False skips these checks)")


__all__ = ["checking", "cu_seqlens_faults", "raise_faults", "table_faults"]
