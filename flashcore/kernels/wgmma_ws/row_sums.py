"""The softmax's row sums by the tensor cores: each step's P times a shared tile of ones, an
n8 warpgroup MMA issued in the P·V group (``WgmmaWs.sums_by_mma`` says where).

The sums then leave the softmax's chain of dependent phases: no FADD a score, no quad
reduction at the end, and they are the sums of P as the P·V MMA reads it (e4m3 or 16-bit, the
numerator's own rounding). The ones' accumulator is rescaled with O, 4 registers a thread:
two columns of each of its two rows, both the row's sum (``totals``).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import OperandMajorMode

from ..common.dtypes import E4M3
from ..common.sync import st_shared_b32
from ..hopper.fragments import acc_mn_view
from ..hopper.layouts import ROWS_PER_WARPGROUP, k_major

COLUMNS = 8  # the narrowest wgmma N

# 1.0 in each element of a 32-bit word: e4m3 0x38, fp16 0x3c00, bf16 0x3f80
_ONE_WORDS = {"e4m3": 0x38383838, "fp16": 0x3C003C00, "bf16": 0x3F803F80}


def one_word(dtype) -> int:
    if dtype is E4M3:
        return _ONE_WORDS["e4m3"]
    return _ONE_WORDS["bf16" if dtype is cutlass.BFloat16 else "fp16"]


def sums_view(acc: cute.Tensor) -> cute.Tensor:
    """The sums' accumulator as (rows, columns): an n8 accumulator ((2, 2), M, 1) is the
    wgmma accumulator of one column group (``acc_mn_view``'s ((2, 2, 1), M, 1))."""
    (pair, half), m, n = acc.layout.shape
    return acc_mn_view(cute.make_tensor(acc.iterator, cute.make_layout(((pair, half, 1), m, n))))


@cute.jit
def totals(acc: cute.Tensor) -> cute.Tensor:
    """Each of this thread's rows' sums (its two equal columns: each one is read, so that
    neither accumulator register is dead in a kernel with two walks of the keys, where ptxas
    then serialises every wgmma, warning C7511, and the FP8 kernels run much slower)."""
    view = sums_view(acc)
    rows = cute.size(view, mode=[0])
    out = cute.make_rmem_tensor(rows, cutlass.Float32)
    for r in cutlass.range_constexpr(rows):
        out[r] = (view[r, 0] + view[r, 1]) * 0.5
    return out


def ones_layout(dtype, tile_n: int):
    """The ones tile: the K-major B operand of (keys) x COLUMNS, swizzled as any K-major tile
    (every element is 1, so only its extent matters)."""
    return k_major(dtype, (COLUMNS, tile_n))


def sum_mma(dtype, warpgroups: int, p_in_registers: bool) -> cute.TiledMma:
    """acc (64 rows x COLUMNS a warpgroup) += P · ones: P as the P·V MMA reads it (its A
    operand, from registers or from P's shared tile), the ones K-major from shared memory."""
    source = sm90.OperandSource.RMEM if p_in_registers else sm90.OperandSource.SMEM
    return sm90.make_trivial_tiled_mma(
        dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32,
        (warpgroups, 1, 1), (ROWS_PER_WARPGROUP, COLUMNS), source)


@cute.jit
def fill_ones(sOnes: cute.Tensor, dtype: cutlass.Constexpr, tidx, threads: cutlass.Constexpr):
    """Every thread writes its 32-bit words of the tile, then fences them into the async proxy
    (the wgmma reads it there); the caller's CTA barrier publishes them."""
    words = cute.cosize(sOnes.layout) * dtype.width // 32
    base = sOnes.iterator.toint()
    for i in cutlass.range_constexpr((words + threads - 1) // threads):
        w = tidx + i * threads
        if w < words:
            st_shared_b32(base + 4 * w, cutlass.Int32(one_word(dtype)))
    cute.arch.fence_proxy("async.shared", space="cta")
