"""The backward's row kernels, a thread per 8 elements of a row (one 16-byte access; a row's
lanes are a power of two, ``specs.backward.row_lanes``).

* ``BackwardPreprocess``: per query row D = Σ dO ∘ O (fp32) and the forward's LSE times log2 e,
  +inf for a row that saw no key (LSE -inf) and for the padding rows past the sequence, so the
  main kernel's exp2(S · scale · log2 e − LSE · log2 e) is 0 there, never NaN; zeroes the row's
  fp32 dQ accumulator.
* ``BackwardPostprocess``: dQ = accumulator · softmax_scale in the input dtype (its chunks read
  where ``dq_layout`` places them).
"""


import cutlass
import cutlass.cute as cute

from ...specs import BackwardSpec
from ...specs.backward import DQ_CHUNK_BYTES, ROW_THREADS, row_lanes
from ..common.dtypes import DTYPES
from ..common.grid import wait_for_previous_grid
from ..common.softmax import LOG2_E
from .dq_layout import turned_chunk

VEC = 8  # 16-bit elements of one 16-byte access
assert VEC * 4 == DQ_CHUNK_BYTES  # the post kernel reads dQ's accumulator a chunk at a time


class _RowKernel:
    def __init__(self, spec: BackwardSpec):
        self.spec = spec
        self.smem_size = 0
        self.chunks = spec.head_dim // VEC  # 16-byte chunks of a row
        self.per_row = row_lanes(spec.head_dim)  # its lanes, consecutive (the last may idle)
        self.rows = spec.rows_per_cta
        # butterfly offsets over a row's lanes: per_row / 2, ..., 1
        self.offsets = tuple(self.per_row >> i for i in range(1, self.per_row.bit_length()))

    @cute.jit
    def coords(self, heads, padded_rows):
        """(batch, head, row, chunk) of this thread."""
        tidx, _, _ = cute.arch.thread_idx()
        lin, _, _ = cute.arch.block_idx()
        per_head = cute.ceil_div(padded_rows, self.rows)
        bh = lin // per_head
        row = lin % per_head * self.rows + tidx // self.per_row
        return bh // heads, bh % heads, row, tidx % self.per_row


class BackwardPreprocess(_RowKernel):
    @cute.jit
    def host(self, args):
        """``args``: ``flashcore.specs.params.BACKWARD_PRE``'s."""
        mO, mLSE2 = args.inputs.o, args.workspaces.lse_log2
        blocks = cute.ceil_div(mLSE2.shape[2], self.rows) * mO.shape[1] * mO.shape[0]
        self.kernel(args).launch(
            grid=(blocks, 1, 1), block=[ROW_THREADS, 1, 1], smem=0)

    @cute.kernel
    def kernel(self, args):
        mO, mdO, mLSE = args.inputs.o, args.inputs.do, args.inputs.lse
        work = args.workspaces
        mLSE2, mD, mdQacc = work.lse_log2, work.dpsum, work.dq_accum
        batch, head, row, chunk = self.coords(mO.shape[1], mLSE2.shape[2])
        wait_for_previous_grid(self.spec)
        dt = DTYPES[self.spec.dtype]
        total = cutlass.Float32(0.0)
        if row < mO.shape[2]:  # noqa: SIM102 - run-time conditions: one branch each
            if chunk < self.chunks:
                o = cute.make_rmem_tensor((VEC,), dt)
                do = cute.make_rmem_tensor((VEC,), dt)
                cute.autovec_copy(cute.local_tile(mO[batch, head, row, None], (VEC,), (chunk,)),
                                  o)
                cute.autovec_copy(cute.local_tile(mdO[batch, head, row, None], (VEC,),
                                                  (chunk,)), do)
                total = (o.load().to(cutlass.Float32) * do.load().to(cutlass.Float32)).reduce(
                    cute.ReductionOp.ADD, 0.0, 0)
        for i in cutlass.range_constexpr(len(self.offsets)):
            total = total + cute.arch.shuffle_sync_bfly(total, offset=self.offsets[i])
        if chunk < self.chunks:
            zeros = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            zeros.fill(0.0)
            cute.autovec_copy(zeros, cute.local_tile(mdQacc[batch, head, row, None], (VEC,),
                                                     (chunk,)))
        if chunk == 0:
            lse2 = cutlass.Float32(cutlass.Float32.inf)
            if row < mO.shape[2]:
                lse = mLSE[batch, head, row]
                if lse != -cutlass.Float32.inf:
                    lse2 = lse * LOG2_E
            mD[batch, head, row] = total
            mLSE2[batch, head, row] = lse2


class BackwardPostprocess(_RowKernel):
    @cute.jit
    def host(self, args):
        """``args``: ``flashcore.specs.params.BACKWARD_POST``'s."""
        mdQ = args.outputs.dq
        blocks = cute.ceil_div(mdQ.shape[2], self.rows) * mdQ.shape[1] * mdQ.shape[0]
        self.kernel(args).launch(grid=(blocks, 1, 1), block=[ROW_THREADS, 1, 1], smem=0)

    @cute.kernel
    def kernel(self, args):
        mdQacc, mdQ, scale = args.inputs.dq_accum, args.outputs.dq, args.scales.scale
        batch, head, row, chunk = self.coords(mdQ.shape[1], mdQ.shape[2])
        wait_for_previous_grid(self.spec)
        dt = DTYPES[self.spec.dtype]
        if row < mdQ.shape[2]:  # noqa: SIM102 - run-time conditions: one branch each
            if chunk < self.chunks:
                acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)  # VEC floats: one chunk
                cute.autovec_copy(cute.local_tile(mdQacc[batch, head, row, None], (VEC,),
                                                  (turned_chunk(chunk, row, self.spec.head_dim),)),
                                  acc)
                out = cute.make_rmem_tensor((VEC,), dt)
                out.store((acc.load() * scale).to(dt))
                cute.autovec_copy(out, cute.local_tile(mdQ[batch, head, row, None], (VEC,),
                                                       (chunk,)))
