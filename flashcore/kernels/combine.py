"""Split-KV combine (flash-decoding's second step): merge each query row's partial results.

Input: ``num_splits`` shares of the keys per row, as normalised fp32 outputs
(num_splits · batch, heads, rows, head_dim) and their natural-log LSEs (num_splits · batch, heads,
rows), written by ``AttentionSpec(split_kv=True)`` kernels. Output: O = Σ_s exp(lse_s - lse) O_s
with lse = log Σ_s exp(lse_s), in the output dtype, and optionally lse. A share that saw no key
has lse_s = -inf and weight 0; a row no share saw gets 0 and lse -inf.

One warp per row (``rows_per_cta`` warps per CTA, rows linear over (batch, head, row)); each
lane owns head_dim / 32 consecutive columns, read as one vector.
"""


import cutlass
import cutlass.cute as cute

from ..spec import CombineSpec
from .common.dtypes import DTYPES
from .common.softmax import LN_2, LOG2_E


class CombineSplits:
    def __init__(self, spec: CombineSpec):
        self.spec = spec
        self.smem_size = 0
        self.cols = spec.head_dim // 32  # columns per lane

    @cute.jit
    def host(self, mOp: cute.Tensor, mLSEp: cute.Tensor, mO: cute.Tensor,
             mLSE: cute.Tensor | None, num_splits: cutlass.Int32):
        rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        self.kernel(mOp, mLSEp, mO, mLSE, num_splits).launch(
            grid=(cute.ceil_div(rows, self.spec.rows_per_cta), 1, 1),
            block=[self.spec.threads, 1, 1], smem=0,
        )

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLSEp: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor | None, num_splits: cutlass.Int32):
        if cutlass.const_expr(self.spec.programmatic_launch):
            cute.arch.griddepcontrol_wait()  # the partials come from the grid before this one
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        batch_size, heads, rows = mO.shape[0], mO.shape[1], mO.shape[2]
        lin = cta * self.spec.rows_per_cta + tidx // 32
        if lin < batch_size * heads * rows:
            row = lin % rows
            head = (lin // rows) % heads
            batch = lin // rows // heads
            lse = self.total_lse(mLSEp, num_splits, batch_size, batch, head, row, lane)
            acc = cute.make_rmem_tensor((self.cols,), cutlass.Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor((self.cols,), cutlass.Float32)
            for s in range(num_splits):
                at = s * batch_size + batch
                weight = cutlass.Float32(0.0)
                if lse != -cutlass.Float32.inf:
                    weight = cute.math.exp2((mLSEp[at, head, row] - lse) * LOG2_E, fastmath=True)
                cute.autovec_copy(cute.local_tile(mOp[at, head, row, None], (self.cols,),
                                                  (lane,)), part)
                acc.store(acc.load() + part.load() * weight)
            out = cute.make_rmem_tensor((self.cols,), DTYPES[self.spec.dtype])
            out.store(acc.load().to(DTYPES[self.spec.dtype]))
            cute.autovec_copy(out, cute.local_tile(mO[batch, head, row, None], (self.cols,),
                                                   (lane,)))
            if cutlass.const_expr(mLSE is not None):  # noqa: SIM102 - compile time, then run time
                if lane == 0:
                    mLSE[batch, head, row] = lse

    @cute.jit
    def total_lse(self, mLSEp, num_splits, batch_size, batch, head, row, lane):
        """log Σ_s exp(lse_s) over the shares (lanes take shares lane, lane + 32, ...)."""
        top = -cutlass.Float32.inf
        for s in range(lane, num_splits, 32):
            top = cute.arch.fmax(top, mLSEp[s * batch_size + batch, head, row])
        top = cute.arch.warp_reduction_max(top)
        safe = 0.0 if top == -cutlass.Float32.inf else top
        total = cutlass.Float32(0.0)
        for s in range(lane, num_splits, 32):
            total += cute.math.exp2((mLSEp[s * batch_size + batch, head, row] - safe) * LOG2_E,
                                    fastmath=True)
        total = cute.arch.warp_reduction_sum(total)
        lse = safe + cute.math.log2(total, fastmath=False) * LN_2
        return -cutlass.Float32.inf if total == 0.0 else lse
