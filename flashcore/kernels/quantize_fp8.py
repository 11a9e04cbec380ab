"""Fused fp16/bf16 -> float8_e4m3fn quantisation with scales taken from the data.

Every value is cast as ``x * 448 / amax``, so no finite input saturates (|x| <= amax maps into
[-448, 448]); amax is clamped below at AMAX_FLOOR so an all-zero group still gets a finite scale.

* ``QuantizeFP8`` (per (batch, head), one CTA per head): pass 1 finds amax (16-byte loads, warp then
  CTA reduction), pass 2 casts and writes the same (batch, heads, seq, head_dim) layout. Descale
  amax / 448 to a (batch, heads) tensor.
* ``QuantizeFP8Transposed`` (V: per (batch, head), amax given): a CTA per block of keys writes the
  transpose (batch, heads, head_dim, seq_padded) with keys permuted inside each group of 32 (see
  the FP8 notes in attention_fwd.py), zeros past the keys, in 16-byte stores along the keys.
* ``QuantizeFP8PerToken`` (per (batch, head, token), one pass, a CTA per block of tokens): the
  threads of one row reduce its amax with butterfly shuffles. An outlier token then costs
  precision only to itself. Descale to a (batch, heads, seq) tensor.
"""

import cutlass
import cutlass.cute as cute

from .common.dtypes import DTYPES

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-30  # 448 / 1e-30 is still a finite float32


class QuantizeFP8:
    def __init__(self, dtype: str, head_dim: int, threads: int = 256):
        self.in_dtype = DTYPES[dtype]
        self.head_dim = head_dim
        self.threads = threads
        self.warps = threads // 32

    @cute.jit
    def host(self, mX: cute.Tensor, mOut: cute.Tensor, mDescale: cute.Tensor):
        warps = self.warps

        @cute.struct
        class Scratch:
            partial: cute.struct.MemRange[cutlass.Float32, warps]

        self.smem_size = Scratch.size_in_bytes()  # read back by the build: the launch ABI
        self.kernel(mX, mOut, mDescale, Scratch).launch(
            grid=(cute.size(mX.shape[1]), cute.size(mX.shape[0]), 1),
            block=[self.threads, 1, 1],
            smem=self.smem_size,
        )

    @cute.kernel
    def kernel(
        self, mX: cute.Tensor, mOut: cute.Tensor, mDescale: cute.Tensor, Scratch: cutlass.Constexpr
    ):
        tidx, _, _ = cute.arch.thread_idx()
        head, batch, _ = cute.arch.block_idx()
        # plain arithmetic: cute.arch.warp_idx() is a full-warp shuffle, which must not run in
        # the lane-0 branch below (the other 31 lanes never arrive: the kernel hangs)
        warp = tidx // 32
        lane = tidx % 32
        X = mX[batch, head, None, None]  # (seq, head_dim)
        Y = mOut[batch, head, None, None]
        seqlen = mX.shape[2]
        chunks_per_row = self.head_dim // 8
        n_chunks = seqlen * chunks_per_row

        # ---- pass 1: amax ------------------------------------------------------------------------
        frag = cute.make_rmem_tensor((8,), self.in_dtype)
        amax = cutlass.Float32(0.0)
        for c in range(tidx, n_chunks, self.threads):
            row = c // chunks_per_row
            cute.autovec_copy(cute.local_tile(X[row, None], (8,), (c % chunks_per_row,)), frag)
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
        amax = partial[0]
        for w in cutlass.range_constexpr(1, self.warps):
            amax = cute.arch.fmax(amax, partial[w])
        amax = cute.arch.fmax(amax, AMAX_FLOOR)
        scale = E4M3_MAX / amax
        if tidx == 0:
            mDescale[batch, head] = amax / E4M3_MAX

        # ---- pass 2: cast ------------------------------------------------------------------------
        q8 = cute.make_rmem_tensor((8,), cutlass.Float8E4M3FN)
        for c in range(tidx, n_chunks, self.threads):
            row = c // chunks_per_row
            chunk = c % chunks_per_row
            cute.autovec_copy(cute.local_tile(X[row, None], (8,), (chunk,)), frag)
            q8.store((frag.load().to(cutlass.Float32) * scale).to(cutlass.Float8E4M3FN))
            cute.autovec_copy(q8, cute.local_tile(Y[row, None], (8,), (chunk,)))


def _key_at(p: int) -> int:
    """The key stored at position p of a group of 32 in Vᵀ (flashcore.ops.fp8.key_permutation)."""
    half, q = divmod(p, 16)
    t, i = divmod(q, 4)
    return 16 * half + 8 * (i // 2) + 2 * t + i % 2


class QuantizeFP8Transposed:
    """V -> Vᵀ in e4m3 with a given per-(batch, head) amax. Thread (d, g) of a CTA owns head-dim
    index d of one group of 32 keys: it reads its 32 values (a warp reads whole 2-byte rows,
    coalesced), converts them in the permuted key order and writes 32 contiguous bytes."""

    def __init__(self, dtype: str, head_dim: int, threads: int = 256):
        self.in_dtype = DTYPES[dtype]
        self.head_dim = head_dim
        self.threads = threads
        self.groups = threads // head_dim  # groups of 32 keys per CTA

    @cute.jit
    def host(self, mX: cute.Tensor, mOut: cute.Tensor, mAmax: cute.Tensor, mDescale: cute.Tensor):
        self.smem_size = 0
        keys_per_cta = 32 * self.groups
        self.kernel(mX, mOut, mAmax, mDescale).launch(
            grid=(cute.ceil_div(mOut.shape[3], keys_per_cta), cute.size(mX.shape[1]),
                  cute.size(mX.shape[0])),
            block=[self.threads, 1, 1],
            smem=0,
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mOut: cute.Tensor, mAmax: cute.Tensor, mDescale: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        blk, head, batch = cute.arch.block_idx()
        d = tidx % self.head_dim
        group = blk * self.groups + tidx // self.head_dim
        amax = cute.arch.fmax(mAmax[batch, head], AMAX_FLOOR)
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
    def __init__(self, dtype: str, head_dim: int, threads: int = 256):
        self.in_dtype = DTYPES[dtype]
        self.head_dim = head_dim
        self.threads = threads
        self.tpr = head_dim // 8  # threads per row, 8 elements (16 bytes) each
        self.rows = threads // self.tpr

    @cute.jit
    def host(self, mX: cute.Tensor, mOut: cute.Tensor, mDescale: cute.Tensor):
        self.smem_size = 0
        self.kernel(mX, mOut, mDescale).launch(
            grid=(cute.ceil_div(mX.shape[2], self.rows), cute.size(mX.shape[1]), cute.size(mX.shape[0])),
            block=[self.threads, 1, 1],
            smem=0,
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mOut: cute.Tensor, mDescale: cute.Tensor):
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
