"""The Hopper kernels' shared layouts and tiled warpgroup MMAs (what ``wgmma_ws`` builds its
trace-time data from; its budget: ``flashcore.specs.families.WgmmaWs``).

Shared tiles are the canonical swizzled K-major wgmma layout (rows of head_dim elements, 8-row
atoms of the widest swizzle a row is a whole number of: ``specs.families.swizzle_span``; 128
bytes, so 64 16-bit elements, for d64, d128 and d256). Q and K are K-major operands of S = Q·Kᵀ as stored; V,
stored the same way (keys x head_dim), read through a transposed (head_dim, keys) view is the
MN-major B operand of O = P·V (the transposed K-major SW128 atom is the MN-major SW128 atom).

The swizzle lives on the shared-memory pointer (``get_tensor(outer, swizzle=inner)``): there the
DSL applies it to byte addresses, as the wgmma descriptors' SW128 mode does. (Composed into the
layout instead it would act on element offsets: for 16-bit data a different permutation.)
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from ...specs.families import swizzle_span

WARPGROUP = 128  # threads of one warpgroup: one wgmma M tile of 64 rows
ROWS_PER_WARPGROUP = 64


_ATOMS = {128: warpgroup.SmemLayoutAtomKind.K_SW128, 64: warpgroup.SmemLayoutAtomKind.K_SW64,
          32: warpgroup.SmemLayoutAtomKind.K_SW32}


def tma_view(t: cute.Tensor) -> cute.Tensor:
    """(batch, heads, seq, d) -> (seq, d, heads, batch): the view a TMA descriptor walks (d
    contiguous; ``runtime.tensor_map``)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))


def swizzle_bytes(dtype, row: int) -> int:
    """The swizzle span of a K-major tile whose rows are ``row`` elements (``swizzle_span``:
    e4m3 rows of 64, 16-bit d96 rows of 192 bytes take 64)."""
    return swizzle_span(row * dtype.width // 8)


def k_major(dtype, shape: tuple):
    """A K-major swizzled layout of ``shape`` (rows, K[, stages]), the widest swizzle a row
    is a whole number of (``swizzle_bytes``)."""
    kind = _ATOMS[swizzle_bytes(dtype, shape[1])]
    atom = warpgroup.make_smem_layout_atom(kind, dtype)
    return cute.tile_to_shape(atom, shape, tuple(range(len(shape))))


def smem_tiles(dtype, tile_m: int, tile_n: int, head_dim: int, stages: int):
    """(Q's (tile_m, d), the K/V ring's (tile_n, d, stages)) K-major swizzled layouts: rows of
    head_dim 16-bit elements fill the 128-byte swizzle (e4m3 rows of 64 a 64-byte one)."""
    return (k_major(dtype, (tile_m, head_dim)), k_major(dtype, (tile_n, head_dim, stages)))


def tiled_mmas(dtype, warpgroups: int, tile_n: int, head_dim: int,
               v_major: OperandMajorMode = OperandMajorMode.MN, p_in_registers: bool = True):
    """(S = Q·Kᵀ: A and B from shared memory, both K-major, 64 rows x tile_n a warpgroup;
    O += P·V: A (P) from registers (or from a K-major shared tile), B (V seen as head_dim x
    keys) MN-major from shared, or K-major for e4m3, whose wgmma reads only K-major operands:
    Vᵀ stored keys-contiguous)."""
    qk = sm90.make_trivial_tiled_mma(
        dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32,
        (warpgroups, 1, 1), (ROWS_PER_WARPGROUP, tile_n))
    p_source = sm90.OperandSource.RMEM if p_in_registers else sm90.OperandSource.SMEM
    pv = sm90.make_trivial_tiled_mma(
        dtype, dtype, OperandMajorMode.K, v_major, cutlass.Float32,
        (warpgroups, 1, 1), (ROWS_PER_WARPGROUP, head_dim), p_source)
    return qk, pv
