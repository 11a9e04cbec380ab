"""Where a value of the fp32 dQ accumulator lies (``specs.backward.DQ_CHUNK_TURNS``): row r's
32-byte chunk c at chunk c ^ (r mod turns). An MMA accumulator fragment's rows (a thread's
values) are one residue mod 8, so one XOR of a thread's byte addresses, computed from its first
value's row, places every value it holds."""

import cutlass
import cutlass.cute as cute

from ...specs.backward import DQ_CHUNK_BYTES, dq_chunk_turns


@cute.jit
def turn_bytes(dst: cute.Tensor, accumulator: cute.Tensor, head_dim: cutlass.Constexpr):
    """The XOR of this thread's byte addresses: ``dst`` is its partition of a block of the
    fp32 ``accumulator`` as plain row-major order would place it; its first value's row (a
    packed sequence starts at any row) decides."""
    turns = dq_chunk_turns(head_dim)
    out = cutlass.Int64(0)
    if cutlass.const_expr(turns > 1):
        first = (dst.iterator + cute.crd2idx(0, dst.layout)).toint()
        row = (first - accumulator.iterator.toint()) // (4 * head_dim)
        out = row % turns * DQ_CHUNK_BYTES
    return out


def turned_chunk(chunk, row, head_dim: int):
    """Chunk ``chunk`` of row ``row`` (each ``DQ_CHUNK_BYTES``), as stored."""
    turns = dq_chunk_turns(head_dim)
    if turns == 1:
        return chunk
    return chunk ^ (row % turns)
