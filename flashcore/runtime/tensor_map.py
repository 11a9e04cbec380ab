"""TMA descriptors (``CUtensorMap``) for the kernels that load with TMA, encoded by the driver
(``cuTensorMapEncodeTiled``) from a tensor argument and its ``compiler.abi.TensorMapParam``.

A (batch, heads, seq, head_dim) tensor is a rank-4 map walked innermost first: dims
(head_dim, seq, heads, batch), byte strides of seq, heads, batch; the box is
(``box_cols``, ``box_rows``, 1, 1) with the swizzle of the kernels' shared tiles (128, 64 or 32
bytes: ``specs.families.swizzle_span``), L2 promotion of 128 bytes and zero fill outside the tensor (the kernel masks those keys). A
descriptor embeds the pointer, so it is encoded per distinct (pointer, extents, strides) and
kept in a small cache: a training or serving loop that reuses its buffers encodes once.

A loop that allocates fresh tensors each call (a model's layers in eager mode) would pay the
driver's encoding (about 15 µs a descriptor through cuda-python) every call. So the encodings of
one geometry (everything but the pointer) are compared: where two of them, at two pointers,
differ only in their first 8 bytes and those bytes are each one's pointer, later pointers of
that geometry are written into that descriptor instead of encoding again; where they differ in
anything else, every pointer is encoded by the driver.
"""

from __future__ import annotations

import struct
from collections import OrderedDict

from ..errors import LaunchError
from ..specs.families import SWIZZLE_SPANS
from .driver import check, cu

_CACHE_SIZE = 256
_cache: OrderedDict = OrderedDict()
# geometry -> (pointer, descriptor): one encoding, to compare with the next; a descriptor: its
# first word is the pointer and nothing else depends on it; None: the driver encodes each one
_layouts: dict[tuple, tuple | bytes | None] = {}
_DTYPES = {"float16": (2, "CU_TENSOR_MAP_DATA_TYPE_FLOAT16"),
           "bfloat16": (2, "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16"),
           "float8_e4m3fn": (1, "CU_TENSOR_MAP_DATA_TYPE_UINT8")}  # TMA moves e4m3 as bytes
_SWIZZLES = {span: f"CU_TENSOR_MAP_SWIZZLE_{span}B" for span in SWIZZLE_SPANS}
_SMALL = 128 * 1024  # see _fix_oob_mode
_driver_version: list[int] = []


def encode(arg: tuple, dtype: str, head_dim: int, box_rows: int, box_cols: int = 64,
           swizzle: int = 128) -> bytes:
    """The 128-byte descriptor of the tensor whose ``ops.inputs.tensor_arg`` is ``arg``
    (pointer, batch, heads, seq, batch stride, heads stride, seq stride; head_dim contiguous;
    for FP8 Vᵀ: seq = head_dim rows, ``head_dim`` = the contiguous keys)."""
    key = (arg, dtype, head_dim, box_rows, box_cols, swizzle)
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit
    geometry = key[1:] + (arg[1:],)
    layout = _layouts.get(geometry)
    if type(layout) is bytes:
        ptr = arg[0]
        if ptr % 16:
            raise LaunchError(f"TMA needs a 16-byte aligned base: pointer {ptr:#x}")
        desc = ptr.to_bytes(8, "little") + layout[8:]
    else:
        desc = _encode(arg, dtype, head_dim, box_rows, box_cols, swizzle)
        _learn(geometry, layout, arg[0], desc)
    _cache[key] = desc
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return desc


def _learn(geometry: tuple, seen, ptr: int, desc: bytes) -> None:
    """Compare a geometry's second encoding with its first (``_layouts``)."""
    if geometry not in _layouts:
        if len(_layouts) >= _CACHE_SIZE:
            _layouts.clear()
        _layouts[geometry] = (ptr, desc)
    elif type(seen) is tuple and seen[0] != ptr:
        first_ptr, first = seen
        plain = (first[8:] == desc[8:] and int.from_bytes(first[:8], "little") == first_ptr
                 and int.from_bytes(desc[:8], "little") == ptr)
        _layouts[geometry] = desc if plain else None


def tma_geometry(arg: tuple, head_dim: int, esize: int) -> tuple[list, list]:
    """(dims innermost first, byte strides of dims 1..3) of a tensor_arg, with the checks TMA
    makes: 16-byte aligned base and strides below 2**40. A dim of extent 1 is never stepped
    over, so its stride is replaced by a legal one (torch reports any stride there)."""
    ptr, b, h, s, sb, sh, ss = arg
    dims = [head_dim, s, h, b]
    strides = [ss * esize, sh * esize, sb * esize]
    span = head_dim * esize
    for i, n in enumerate(dims[1:]):
        if n == 1:
            strides[i] = (span + 15) // 16 * 16
        span = max(span, strides[i] * n)
    if ptr % 16 or any(st % 16 or not 0 < st < 2**40 for st in strides):
        raise LaunchError(f"TMA needs a 16-byte aligned base and strides: pointer {ptr:#x}, "
                          f"byte strides {strides} (seq, heads, batch)")
    return dims, strides


def _encode(arg: tuple, dtype: str, head_dim: int, box_rows: int, box_cols: int,
            swizzle: int) -> bytes:
    esize, name = _DTYPES[dtype]
    dims, strides = tma_geometry(arg, head_dim, esize)
    tmap = check(cu.cuTensorMapEncodeTiled(
        getattr(cu.CUtensorMapDataType, name), cu.cuuint32_t(4), arg[0],
        [cu.cuuint64_t(n) for n in dims], [cu.cuuint64_t(n) for n in strides],
        [cu.cuuint32_t(n) for n in (box_cols, box_rows, 1, 1)], [cu.cuuint32_t(1)] * 4,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(cu.CUtensorMapSwizzle, _SWIZZLES[swizzle]),
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    words = [int(w) for w in tmap.opaque]
    _fix_oob_mode(words, dims, strides, esize)
    return struct.pack("<16Q", *words)


def _fix_oob_mode(words: list, dims: list, strides: list, esize: int) -> None:
    """Drivers up to 13.1 set the descriptor's out-of-bounds address mode (bit 21 of word 1) for
    tensors spanning less than 128 KiB, where CUTLASS (and the CuTe DSL's own encoder) clear it
    (CUTLASS 4.3.4: such descriptors fault on some GPUs). Do as they do."""
    if not _driver_version:
        _driver_version.append(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
    span = dims[0] * esize + sum((n - 1) * st for n, st in zip(dims[1:], strides))
    if _driver_version[0] <= 13010 and span < _SMALL:
        words[1] &= ~(1 << 21)


def clear() -> None:
    """Forget the encoded descriptors and the geometries' layouts. The launcher's per-kernel
    argument memos (``ops.launcher.tma_args``) keep theirs: a descriptor depends only on what
    keys it."""
    _cache.clear()
    _layouts.clear()
