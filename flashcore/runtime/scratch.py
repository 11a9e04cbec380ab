"""Float32 scratch memory for the partial results of split-KV calls, reused call after call, and
the int32 arrival counters of the kernels whose last share merges (``AttentionSpec``'s
``merge_shares``), zero before each launch: such a kernel sets every counter it raised back to 0.

An eager decode call is host-bound and a fresh ``torch.empty`` costs microseconds of it, so each
(device, stream, thread) keeps one buffer of each and grows it when a call needs more (a grown
counter buffer starts at zero). Reuse is safe because a call's kernels and the next call's run
in the order of one stream, and a thread's calls do not interleave with another's on the
buffers. While a CUDA graph is being captured, and inside the registered ops
(``fresh_scratch``), the buffers are always fresh: a replay must not share memory with eager
calls, and torch.compile's CUDA graphs run an op first outside any capture but in the graph's
memory pool, where a kept buffer would be memory the graph does not own."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_buffers: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
_fresh = threading.local()
_MAX_BUFFERS = 64  # threads and streams come and go in some programs: then start again
_MIN_NUMEL = 1 << 16  # 256 KB: the partials of a usual decode call fit from the start
_MIN_COUNTERS = 1 << 10  # a usual decode grid's query tiles


def scratch(like: torch.Tensor, numel: int, counters: int = 0):
    """At least ``numel`` float32 elements on ``like``'s device, for its current stream; with
    ``counters`` > 0, the pair of them and at least that many zero int32 counters."""
    device = like.get_device()
    if (not like.is_cuda or torch._C._cuda_getDevice() != device
            or torch._C._cuda_isCurrentStreamCapturing() or getattr(_fresh, "depth", 0)):
        buf = torch.empty(numel, dtype=torch.float32, device=like.device)
        if not counters:
            return buf
        return buf, torch.zeros(counters, dtype=torch.int32, device=like.device)
    key = (device, torch._C._cuda_getCurrentRawStream(device), threading.get_ident())
    buf, arrivals = _buffers.get(key, (None, None))
    if buf is None or buf.numel() < numel:
        if len(_buffers) >= _MAX_BUFFERS:
            _buffers.clear()
        buf = torch.empty(max(numel, _MIN_NUMEL), dtype=torch.float32,
                          device=torch.device("cuda", device))
        _buffers[key] = (buf, arrivals)
    if not counters:
        return buf
    if arrivals is None or arrivals.numel() < counters:
        arrivals = torch.zeros(max(counters, _MIN_COUNTERS), dtype=torch.int32,
                               device=torch.device("cuda", device))
        _buffers[key] = (buf, arrivals)
    return buf, arrivals


@contextlib.contextmanager
def fresh_scratch() -> Iterator[None]:
    """Within the block, this thread's calls get fresh scratch tensors, kept by no one after."""
    _fresh.depth = getattr(_fresh, "depth", 0) + 1
    try:
        yield
    finally:
        _fresh.depth -= 1
