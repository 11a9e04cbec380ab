"""Fused fp16/bf16 -> float8_e4m3fn quantisation with scales taken from the data.

Every value is cast as ``x * 448 / amax``, so no finite input saturates (|x| <= amax maps into
[-448, 448]); amax is clamped below at AMAX_FLOOR so an all-zero group still gets a finite scale.

* ``AmaxPerHead`` (pass 1 of a per-(batch, head) scale): ``AMAX_SHARES`` CTAs a (batch, head),
  each the amax of its share of the rows (16-byte loads, warp then CTA reduction) into
  ``partial[batch, head, share]``; the casts take the max of the shares (one warp's shuffles).
* ``QuantizeFP8`` (pass 2, per (batch, head)): a CTA per block of rows casts them into the same
  (batch, heads, seq, head_dim) layout, 16 bytes a thread. Descale amax / 448 to a (batch,
  heads) tensor.
* ``QuantizeFP8Transposed`` (V: pass 2 per (batch, head)): a CTA per block of keys writes the
  transpose (batch, heads, head_dim, seq_padded) with keys permuted inside each group of 32 (see
  the FP8 notes in attention_fwd.py), zeros past the keys, in 16-byte stores along the keys.
* ``QuantizeFP8PerToken`` (per (batch, head, token), one pass, a CTA per block of tokens): the
  threads of one row reduce its amax with butterfly shuffles. An outlier token then costs
  precision only to itself. Descale to a (batch, heads, seq) tensor.
"""

import cutlass
import cutlass.cute as cute

from ..specs.quantize import AMAX_SHARES, QuantizeSpec  # a warp's lanes: one reads each share
from .common.dtypes import DTYPES

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-30  # 448 / 1e-30 is still a finite float32


@cute.jit
def head_amax(partial: cute.Tensor) -> cutlass.Float32:
    """The (batch, head)'s amax from its ``AMAX_SHARES`` partial maxima (every warp reduces
    them: lane i reads share i), clamped below at ``AMAX_FLOOR``."""
    lane = cute.arch.lane_idx()
    amax = cute.arch.warp_reduction_max(partial[lane])
    return cute.arch.fmax(amax, AMAX_FLOOR)


class AmaxPerHead:
    """Pass 1 of a per-(batch, head) scale: CTA ``share`` of a (batch, head) takes the amax of
    its ``ceil(seq / AMAX_SHARES)`` rows into ``partial[batch, head, share]`` (0 for a share
    past the end)."""

    def __init__(self, spec: QuantizeSpec):
        self.in_dtype = DTYPES[spec.dtype]
        self.head_dim = spec.head_dim
        self.threads = spec.threads
        self.warps = spec.threads // 32

    @cute.jit
    def host(self, args):
        """``args``: ``flashcore.specs.params.QUANTIZE_FP8``'s (x, partial)."""
        warps, mX = self.warps, args.tensors.x

        @cute.struct
        class Scratch:
            partial: cute.struct.MemRange[cutlass.Float32, warps]

        self.smem_size = Scratch.size_in_bytes()  # read back by the build: the launch ABI
        self.kernel(args, Scratch).launch(
            grid=(AMAX_SHARES, cute.size(mX.shape[1]), cute.size(mX.shape[0])),
            block=[self.threads, 1, 1],
            smem=self.smem_size,
        )

    @cute.kernel
    def kernel(self, args, Scratch: cutlass.Constexpr):
        mX, mPartial = args.tensors.x, args.tensors.partial
        tidx, _, _ = cute.arch.thread_idx()
        share, head, batch = cute.arch.block_idx()
        # plain arithmetic: cute.arch.warp_idx() is a full-warp shuffle, which must not run in
        # the lane-0 branch below (the other 31 lanes never arrive: the kernel hangs)
        warp = tidx // 32
        lane = tidx % 32
        X = mX[batch, head, None, None]  # (seq, head_dim)
        seqlen = mX.shape[2]
        per_row = self.head_dim // 8  # 16-byte chunks
        rows = cute.ceil_div(seqlen, AMAX_SHARES)
        first = share * rows
        n_chunks = (cutlass.min(first + rows, seqlen) - first) * per_row  # <= 0: no rows
        frag = cute.make_rmem_tensor((8,), self.in_dtype)
        amax = cutlass.Float32(0.0)
        for c in range(tidx, n_chunks, self.threads):
            row = first + c // per_row
            cute.autovec_copy(cute.local_tile(X[row, None], (8,), (c % per_row,)), frag)
            v = frag.load().to(cutlass.Float32)
            hi = v.reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
            lo = v.reduce(cute.ReductionOp.MIN, cutlass.Float32.inf, 0)
            amax = cute.arch.fmax(amax, cute.arch.fmax(hi, -lo))
        amax = cute.arch.warp_reduction_max(amax)
        smem = cutlass.memory.SmemAllocator()
        partial = smem.allocate(Scratch).partial.get_tensor(cute.make_layout((self.warps,)))
        if lane == 0:
            partial[warp] = amax
        cute.arch.sync_threads()
        if tidx == 0:
            for w in cutlass.range_constexpr(1, self.warps):
                amax = cute.arch.fmax(amax, partial[w])
            mPartial[batch, head, share] = amax


class _HeadScaledCast:
    """The launch of both per-(batch, head) casts: a CTA per block (``blocks``) of each
    (batch, head), the shares of the amax pass coming in."""

    def __init__(self, spec: QuantizeSpec):
        self.in_dtype = DTYPES[spec.dtype]
        self.head_dim = spec.head_dim
        self.threads = spec.threads

    @cute.jit
    def host(self, args):
        """``args``: ``flashcore.specs.params.QUANTIZE_FP8``'s (x, out, partial, descale)."""
        self.smem_size = 0
        mX, mOut = args.tensors.x, args.tensors.out
        self.kernel(args).launch(
            grid=(self.blocks(mX, mOut), cute.size(mX.shape[1]), cute.size(mX.shape[0])),
            block=[self.threads, 1, 1],
            smem=0,
        )


class QuantizeFP8(_HeadScaledCast):
    """x -> e4m3 in x's layout with one scale per (batch, head), from the amax pass's shares:
    a CTA per block of rows, 8 values (16 bytes) a thread."""

    def __init__(self, spec: QuantizeSpec):
        super().__init__(spec)
        self.tpr = spec.head_dim // 8  # threads per row
        self.rows = spec.threads // self.tpr

    def blocks(self, mX: cute.Tensor, mOut: cute.Tensor):
        return cute.ceil_div(mX.shape[2], self.rows)

    @cute.kernel
    def kernel(self, args):
        t = args.tensors
        mX, mOut, mPartial, mDescale = t.x, t.out, t.partial, t.descale
        tidx, _, _ = cute.arch.thread_idx()
        blk, head, batch = cute.arch.block_idx()
        amax = head_amax(mPartial[batch, head, None])
        if blk == 0 and tidx == 0:
            mDescale[batch, head] = amax / E4M3_MAX
        row = blk * self.rows + tidx // self.tpr
        chunk = tidx % self.tpr
        if row < mX.shape[2]:
            frag = cute.make_rmem_tensor((8,), self.in_dtype)
            cute.autovec_copy(cute.local_tile(mX[batch, head, row, None], (8,), (chunk,)), frag)
            q8 = cute.make_rmem_tensor((8,), cutlass.Float8E4M3FN)
            q8.store((frag.load().to(cutlass.Float32) * (E4M3_MAX / amax)).to(
                cutlass.Float8E4M3FN))
            cute.autovec_copy(q8, cute.local_tile(mOut[batch, head, row, None], (8,), (chunk,)))


def _key_at(p: int) -> int:
    """The key stored at position p of a group of 32 in Vᵀ (flashcore.ops.fp8.key_permutation)."""
    half, q = divmod(p, 16)
    t, i = divmod(q, 4)
    return 16 * half + 8 * (i // 2) + 2 * t + i % 2


class QuantizeFP8Transposed(_HeadScaledCast):
    """V -> Vᵀ in e4m3 with one scale per (batch, head), from the amax pass's shares. Thread
    (d, g) of a CTA owns head-dim index d of one group of 32 keys: it reads its 32 values (a
    warp reads whole 2-byte rows, coalesced), converts them in the permuted key order and
    writes 32 contiguous bytes."""

    def __init__(self, spec: QuantizeSpec):
        super().__init__(spec)
        self.groups = spec.threads // spec.head_dim  # groups of 32 keys per CTA

    def blocks(self, mX: cute.Tensor, mOut: cute.Tensor):
        return cute.ceil_div(mOut.shape[3], 32 * self.groups)

    @cute.kernel
    def kernel(self, args):
        t = args.tensors
        mX, mOut, mPartial, mDescale = t.x, t.out, t.partial, t.descale
        tidx, _, _ = cute.arch.thread_idx()
        blk, head, batch = cute.arch.block_idx()
        d = tidx % self.head_dim
        group = blk * self.groups + tidx // self.head_dim
        amax = head_amax(mPartial[batch, head, None])
        scale = E4M3_MAX / amax
        if blk == 0 and tidx == 0:
            mDescale[batch, head] = amax / E4M3_MAX
        X = mX[batch, head, None, None]  # (seq, head_dim)
        Y = mOut[batch, head, None, None]  # (head_dim, seq_padded)
        seqlen = mX.shape[2]
        if group * 32 < mOut.shape[3]:
            vals = cute.make_rmem_tensor((32,), cutlass.Float32)
            for p in cutlass.range_constexpr(32):
                key = group * 32 + _key_at(p)
                vals[p] = cutlass.Float32(0.0)  # keys past the end: zeros (P is 0 there)
                if key < seqlen:
                    vals[p] = X[key, d].to(cutlass.Float32) * scale
            q8 = cute.make_rmem_tensor((32,), cutlass.Float8E4M3FN)
            q8.store(vals.load().to(cutlass.Float8E4M3FN))
            cute.autovec_copy(q8, cute.local_tile(Y[d, None], (32,), (group,)))


class QuantizeFP8PerToken:
    def __init__(self, spec: QuantizeSpec):
        self.in_dtype = DTYPES[spec.dtype]
        self.head_dim = spec.head_dim
        self.threads = spec.threads
        self.tpr = spec.head_dim // 8  # threads per row, 8 elements (16 bytes) each
        self.rows = spec.threads // self.tpr

    @cute.jit
    def host(self, args):
        """``args``: ``flashcore.specs.params.QUANTIZE_FP8``'s (x, out, descale)."""
        self.smem_size = 0
        mX = args.tensors.x
        self.kernel(args).launch(
            grid=(cute.ceil_div(mX.shape[2], self.rows), cute.size(mX.shape[1]), cute.size(mX.shape[0])),
            block=[self.threads, 1, 1],
            smem=0,
        )

    @cute.kernel
    def kernel(self, args):
        mX, mOut, mDescale = args.tensors.x, args.tensors.out, args.tensors.descale
        tidx, _, _ = cute.arch.thread_idx()
        blk, head, batch = cute.arch.block_idx()
        row = blk * self.rows + tidx // self.tpr
        chunk = tidx % self.tpr
        valid = row < mX.shape[2]
        frag = cute.make_rmem_tensor((8,), self.in_dtype)
        frag.fill(0.0)
        if valid:
            cute.autovec_copy(cute.local_tile(mX[batch, head, row, None], (8,), (chunk,)), frag)
        v = frag.load().to(cutlass.Float32)
        amax = cute.arch.fmax(
            v.reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0),
            -v.reduce(cute.ReductionOp.MIN, cutlass.Float32.inf, 0),
        )
        # every lane takes part in the shuffles (rows of a warp are aligned groups of tpr lanes)
        amax = cute.arch.warp_reduction_max(amax, threads_in_group=self.tpr)
        amax = cute.arch.fmax(amax, AMAX_FLOOR)
        q8 = cute.make_rmem_tensor((8,), cutlass.Float8E4M3FN)
        q8.store((v * (E4M3_MAX / amax)).to(cutlass.Float8E4M3FN))
        if valid:
            cute.autovec_copy(q8, cute.local_tile(mOut[batch, head, row, None], (8,), (chunk,)))
            if chunk == 0:
                mDescale[batch, head, row] = amax / E4M3_MAX
