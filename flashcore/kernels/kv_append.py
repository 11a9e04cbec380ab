"""New keys and values into a paged KV cache, turned by rotary on the way, and the queries
turned alike (``flashcore.specs.KvAppendSpec``): the work before a ``flash_attn_with_kvcache``
attention, one launch instead of a dozen small torch ones.

A CTA per (token, head, sequence): grid x is the new tokens, then (with rotary) the query
tokens; y the heads (the more of the query and K/V heads); z the sequences. New token t of
sequence b goes to position seqlens[b] + t: row (position % page_size) of page
block_table[b, position // page_size]. Every index is clamped into its tensor (a length or
table the host did not check writes in the wrong place, never outside the cache), and a
position past the rotary tables takes their last row.
"""

import cutlass
import cutlass.cute as cute

from ..specs import KvAppendSpec
from .common.dtypes import DTYPES


class KvAppend:
    def __init__(self, spec: KvAppendSpec):
        self.spec = spec
        self.smem_size = 0
        self.dtype = DTYPES[spec.dtype]
        self.half = spec.rotary_dim // 2

    @cute.jit
    def host(self, args):
        """``args``: ``flashcore.specs.params.KV_APPEND``'s."""
        mK = args.new.k
        tokens, heads = mK.shape[2], mK.shape[1]
        if cutlass.const_expr(self.spec.rotary_dim > 0):
            mQ = args.rotary.q
            tokens, heads = tokens + mQ.shape[2], cutlass.max(heads, mQ.shape[1])
        self.kernel(args).launch(grid=(tokens, heads, mK.shape[0]),
                                 block=[self.spec.threads, 1, 1], smem=0)

    @cute.kernel
    def kernel(self, args):
        x, head, batch = cute.arch.block_idx()
        mK, mV = args.new.k, args.new.v
        c = args.cache
        start = c.seqlens[batch]
        if x < mK.shape[2]:  # noqa: SIM102 - run-time conditions: one branch each
            if head < mK.shape[1]:
                mKc, table = c.k_cache, c.block_table
                page_size = mKc.shape[2]
                pos = cutlass.max(start + x, 0)
                col = cutlass.min(pos // page_size, table.shape[1] - 1)
                page = cutlass.min(cutlass.max(table[batch, col], 0), mKc.shape[0] - 1)
                row = pos % page_size
                self.turn(mK[batch, head, x, None], mKc[page, head, row, None], pos, args)
                self.copy(mV[batch, head, x, None], c.v_cache[page, head, row, None])
        if cutlass.const_expr(self.spec.rotary_dim > 0):
            r = args.rotary
            t = x - mK.shape[2]
            if t >= 0:  # noqa: SIM102
                if head < r.q.shape[1]:
                    self.turn(r.q[batch, head, t, None], r.q_out[batch, head, t, None],
                              start + t * r.q_step, args)

    @cute.jit
    def copy(self, src: cute.Tensor, dst: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        for i in range(tidx, self.spec.head_dim, self.spec.threads):
            dst[i] = src[i]

    @cute.jit
    def turn(self, src: cute.Tensor, dst: cute.Tensor, pos, args):
        """``dst`` = ``src`` (one head's row) turned by rotary at ``pos``; the features past
        rotary_dim copied as they are."""
        if cutlass.const_expr(self.spec.rotary_dim == 0):
            self.copy(src, dst)
        else:
            tidx, _, _ = cute.arch.thread_idx()
            cos, sin = args.rotary.cos, args.rotary.sin
            p = cutlass.min(cutlass.max(pos, 0), cos.shape[0] - 1)
            half, rd = self.half, self.spec.rotary_dim
            for u in range(tidx, half + self.spec.head_dim - rd, self.spec.threads):
                if u < half:
                    i0, i1 = u, u + half
                    if cutlass.const_expr(self.spec.interleaved):
                        i0, i1 = 2 * u, 2 * u + 1
                    cs = cos[p, u].to(cutlass.Float32)
                    sn = sin[p, u].to(cutlass.Float32)
                    a = src[i0].to(cutlass.Float32)
                    b = src[i1].to(cutlass.Float32)
                    dst[i0] = (a * cs - b * sn).to(self.dtype)
                    dst[i1] = (a * sn + b * cs).to(self.dtype)
                else:
                    j = rd + u - half
                    dst[j] = src[j]
