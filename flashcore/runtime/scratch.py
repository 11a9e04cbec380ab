"""Float32 scratch memory for the partial results of split-KV calls, reused call after call.

An eager decode call is host-bound and a fresh ``torch.empty`` costs microseconds of it, so each
(device, stream, thread) keeps one buffer and grows it when a call needs more. Reuse is safe
because a call's kernels and the next call's run in the order of one stream, and a thread's calls
do not interleave with another's on the buffer. While a CUDA graph is being captured the buffer
is always fresh, from the graph's own memory pool: a replay must not share memory with eager
calls."""

from __future__ import annotations

import threading

import torch

_buffers: dict[tuple[int, int, int], torch.Tensor] = {}
_MAX_BUFFERS = 64  # threads and streams come and go in some programs: then start again
_MIN_NUMEL = 1 << 16  # 256 KB: the partials of a usual decode call fit from the start


def scratch(like: torch.Tensor, numel: int) -> torch.Tensor:
    """At least ``numel`` float32 elements on ``like``'s device, for its current stream."""
    device = like.get_device()
    if (not like.is_cuda or torch._C._cuda_getDevice() != device
            or torch._C._cuda_isCurrentStreamCapturing()):
        return torch.empty(numel, dtype=torch.float32, device=like.device)
    key = (device, torch._C._cuda_getCurrentRawStream(device), threading.get_ident())
    buf = _buffers.get(key)
    if buf is None or buf.numel() < numel:
        if len(_buffers) >= _MAX_BUFFERS:
            _buffers.clear()
        buf = _buffers[key] = torch.empty(max(numel, _MIN_NUMEL), dtype=torch.float32,
                                          device=torch.device("cuda", device))
    return buf
