"""One launch that only reads a buffer: what streaming a KV cache costs on this GPU.

The benchmark's decode rows set our decode beside it. A Triton kernel (imported only when
called; the GPU host has Triton, a build host need not): 16-byte loads, ``unroll`` blocks in flight
a program, a grid of ``per_sm`` programs a SM walking the buffer; it XORs every word so none is
optimised away. The defaults are the best of ``scripts/decode_floor.py``'s sweep of configs on
the H100, where the read's time fits a fixed launch cost plus bytes over a bandwidth close to the
HBM's peak; torch's sum reads slower than that, so as a floor it would flatter our decode.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
        pid = tl.program_id(0)
        stride = tl.num_programs(0) * BLOCK * UNROLL
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid * BLOCK * UNROLL, n, stride):
            for u in tl.static_range(UNROLL):
                off = start + u * BLOCK + tl.arange(0, BLOCK)
                acc ^= tl.load(x_ptr + off, mask=off < n, other=0, cache_modifier=".cg")
        tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))

    return read


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def streaming_read(warps: int = 8, vecs: int = 1, unroll: int = 4, per_sm: int = 8):
    """``run(x)`` -> one int32 per program, the XOR of the words it read (``x``: a contiguous
    int32 tensor on the GPU). ``vecs`` 16-byte loads a thread per block."""
    block = warps * 32 * 4 * vecs
    cache: dict = {}

    def run(x: torch.Tensor) -> torch.Tensor:
        dev = x.device.index or 0
        if dev not in cache:
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            cache[dev] = torch.empty(per_sm * sms, dtype=torch.int32, device=x.device)
        out = cache[dev]
        _kernel()[(out.numel(),)](x, out, x.numel(), BLOCK=block, UNROLL=unroll,
                                  num_warps=warps)
        return out

    return run
