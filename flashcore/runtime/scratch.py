"""Float32 scratch memory for the partial results of split-KV calls, reused call after call.

An eager decode call is host-bound and a fresh ``torch.empty`` costs microseconds of it, so each
(device, stream, thread) keeps one buffer and grows it when a call needs more. Reuse is safe
because a call's kernels and the next call's run in the order of one stream, and a thread's calls
do not interleave with another's on the buffer. While a CUDA graph is being captured, and inside
the registered ops (``fresh_scratch``), the buffer is always fresh: a replay must not share
memory with eager calls, and torch.compile's CUDA graphs run an op first outside any capture but
in the graph's memory pool, where a kept buffer would be memory the graph does not own."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_buffers: dict[tuple[int, int, int], torch.Tensor] = {}
_fresh = threading.local()
_MAX_BUFFERS = 64  # threads and streams come and go in some programs: then start again
_MIN_NUMEL = 1 << 16  # 256 KB: the partials of a usual decode call fit from the start


def scratch(like: torch.Tensor, numel: int) -> torch.Tensor:
    """At least ``numel`` float32 elements on ``like``'s device, for its current stream."""
    device = like.get_device()
    if (not like.is_cuda or torch._C._cuda_getDevice() != device
            or torch._C._cuda_isCurrentStreamCapturing() or getattr(_fresh, "depth", 0)):
        return torch.empty(numel, dtype=torch.float32, device=like.device)
    key = (device, torch._C._cuda_getCurrentRawStream(device), threading.get_ident())
    buf = _buffers.get(key)
    if buf is None or buf.numel() < numel:
        if len(_buffers) >= _MAX_BUFFERS:
            _buffers.clear()
        buf = _buffers[key] = torch.empty(max(numel, _MIN_NUMEL), dtype=torch.float32,
                                          device=torch.device("cuda", device))
    return buf


@contextlib.contextmanager
def fresh_scratch() -> Iterator[None]:
    """Within the block, this thread's calls get fresh scratch tensors, kept by no one after."""
    _fresh.depth = getattr(_fresh, "depth", 0) + 1
    try:
        yield
    finally:
        _fresh.depth -= 1
