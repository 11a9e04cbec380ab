"""The mma_sync family's trace-time data: element types, shared-memory layouts and struct, copy
atoms and the tiled MMA of one spec. Python data at trace time (no instructions); built the same
way by the host function (for the launch's shared-memory size) and by the kernel."""


import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from ...specs import AttentionSpec
from ...specs.arch import swizzle_line_bytes
from ..common.copies import g2s_copy, swizzled_row_atom
from ..common.dtypes import DTYPES, E4M3


class KernelLayouts:
    """Everything shaped by the spec. Shared tiles of K and V have modes (keys, head_dim, stage,
    key split); for fp8 operands V arrives transposed, (head_dim, keys, stage, split)."""

    def __init__(self, spec: AttentionSpec):
        c = spec.config
        d, tm, tn = spec.head_dim, c.tile_m, c.tile_n
        self.spec = spec
        self.fp8 = spec.precision == "fp8"
        self.kv_fp8 = spec.kv_fp8
        self.out_dtype = DTYPES[spec.dtype]
        self.q_dtype = E4M3 if self.fp8 else self.out_dtype  # Q as loaded
        # what the MMAs multiply. An FP8 KV cache's codes become fp16 in one instruction a
        # pair (bf16 took three: e4m3 -> f16 -> f32 -> bf16), so its kernels multiply in fp16
        # for either output dtype: a bf16 Q is scaled into fp16's range once (``e4m3_operands
        # .query_to_fp16``), and P in fp16 is finer than in bf16
        self.op_dtype = (E4M3 if self.fp8 else cutlass.Float16 if self.kv_fp8
                         else self.out_dtype)
        self.q_rescaled = self.q_dtype != self.op_dtype and not self.fp8
        self.ring_dtype = E4M3 if (self.fp8 or self.kv_fp8) else self.out_dtype  # K/V as loaded
        gt = c.group_threads

        def atom(dtype):  # lines of up to 128 bytes that tile a row (96 wide: three of 64)
            return swizzled_row_atom(dtype.width, line_elems(d, dtype.width))

        staged = (c.stages, c.kv_splits)
        self.sQ = cute.tile_to_shape(atom(self.q_dtype), (tm, d), (0, 1))
        ring_atom = atom(self.ring_dtype)
        self.sK_ring = cute.tile_to_shape(ring_atom, (tn, d, *staged), (0, 1, 2, 3))
        if self.fp8:  # Vᵀ tile: head_dim rows of tile_n keys
            self.sV_ring = cute.tile_to_shape(swizzled_row_atom(8, min(tn, 128)),
                                              (d, tn, *staged), (0, 1, 2, 3))
        else:
            self.sV_ring = self.sK_ring
        # an FP8 KV cache's ring again, as 16-bit elements of two codes each (the same bytes
        # under the same swizzle): what ldmatrix reads (``e4m3_operands.py``)
        self.sK_codes = (cute.tile_to_shape(
            swizzled_row_atom(16, cute.size(ring_atom.outer.shape[1]) // 2),
            (tn, d // 2, *staged), (0, 1, 2, 3)) if self.kv_fp8 else None)
        self.sO = cute.tile_to_shape(atom(self.out_dtype), (tm, d), (0, 1))
        self.g2s_q = g2s_copy(self.q_dtype, cute.size(atom(self.q_dtype).outer.shape[1]), gt)
        self.g2s_k = g2s_copy(self.ring_dtype, cute.size(ring_atom.outer.shape[1]), gt)
        self.g2s_v = (g2s_copy(E4M3, cute.size(self.sV_ring.outer.shape[1]), gt) if self.fp8
                      else self.g2s_k)
        # per-key descales: one 4-byte cp.async each (a row of them need not be 16-byte aligned)
        self.scale_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), cutlass.Float32,
            num_bits_per_copy=32) if self.kv_fp8 else None
        o_tpr = line_elems(d, self.out_dtype.width) * self.out_dtype.width // 128  # 16 B each
        self.r2g_o = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype,
                                num_bits_per_copy=128),
            cute.make_layout((gt // o_tpr, o_tpr), stride=(o_tpr, 1)),
            cute.make_layout((1, 128 // self.out_dtype.width)),
        )
        if self.fp8:
            mma_op, perm_k = warp.MmaFP8Op(E4M3, cutlass.Float32, (16, 8, 32)), 32
        else:
            mma_op, perm_k = warp.MmaF16BF16Op(self.op_dtype, cutlass.Float32, (16, 8, 16)), 16
        self.tiled_mma = cute.make_tiled_mma(mma_op, (c.warps, 1, 1),
                                             permutation_mnk=(c.warps * 16, 16, perm_k))
        self.storage = self._shared_storage()

    def ldmatrix_ops(self):
        """(A and K operand, V operand) ldmatrix ops: 8-bit, or 16-bit with V transposed."""
        if self.fp8:
            op = warp.LdMatrix8x16x8bOp(num_matrices=4)
            return op, op
        return (warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4))

    def _shared_storage(self):
        spec, c = self.spec, self.spec.config
        q, ring, out = self.q_dtype, self.ring_dtype, self.out_dtype
        fp8, kv_fp8, splits = self.fp8, self.kv_fp8, c.kv_splits
        n_q, n_k, n_v = (cute.cosize(x) for x in (self.sQ, self.sK_ring, self.sV_ring))
        n_o = cute.cosize(self.sO)
        n_scale = c.tile_n * c.stages * splits
        n_ml = splits * 2 * c.tile_m  # per split: row max and row sum
        n_acc = (splits - 1) * c.tile_m * spec.head_dim  # all splits but the first: fp32 O
        Align, Mem = cute.struct.Align, cute.struct.MemRange

        @cute.struct
        class SharedStorage:
            sQ: Align[Mem[q, n_q], 1024]
            sK: Align[Mem[ring, n_k], 1024]
            sV: Align[Mem[ring, n_v], 1024]
            if kv_fp8:  # per-key descales of each stage
                sKd: Align[Mem[cutlass.Float32, n_scale], 1024]
                sVd: Align[Mem[cutlass.Float32, n_scale], 1024]
            if fp8:  # e4m3 Q cannot hold the 16-bit output tile: O gets its own buffer
                sO: Align[Mem[out, n_o], 1024]
            if splits > 1:
                sML: Align[Mem[cutlass.Float32, n_ml], 1024]
                sAcc: Align[Mem[cutlass.Float32, n_acc], 1024]

        return SharedStorage


def line_elems(head_dim: int, elem_bits: int) -> int:
    """Elements of one swizzle line of a ``head_dim``-wide row (``arch.swizzle_line_bytes``)."""
    return swizzle_line_bytes(head_dim * elem_bits // 8) * 8 // elem_bits
