"""Split-KV combine (flash-decoding's second step): merge each query row's partial results.

Input: ``num_splits`` shares of the keys per row, as normalised fp32 outputs
(num_splits · batch, heads, rows, head_dim) and their natural-log LSEs (num_splits · batch, heads,
rows), written by ``AttentionSpec(split_kv=True)`` kernels; with ``q_group`` > 1 their heads are
K/V heads whose rows pack ``q_group`` query heads a token, token-major (the output's head h,
token t is partial head h // q_group, row t * q_group + h % q_group). Output: O = Σ_s exp(lse_s - lse) O_s
with lse = log Σ_s exp(lse_s), in the output dtype, and optionally lse. A share that saw no key
has lse_s = -inf and weight 0; a row no share saw gets 0 and lse -inf.

A CTA per row. The partials were just written and sit in L2, so the time is load latency: the
CTA's threads read ``slots`` shares at once (a share's row is head_dim / 4 threads' 16-byte
loads), each thread ``IN_FLIGHT`` shares before it adds them up (the first of these passes
while the LSEs are reduced), and the slots' sums meet in shared memory. (A warp walking the
shares one after another pays one L2 round trip per share: its time grows with the share count.)
"""


import cutlass
import cutlass.cute as cute

from ..specs import MAX_SPLITS, CombineSpec
from ..specs.combine import IN_FLIGHT
from .common.dtypes import DTYPES
from .common.softmax import LN_2, LOG2_E

VEC = 4  # fp32 columns per thread: one 16-byte load


class CombineSplits:
    def __init__(self, spec: CombineSpec):
        self.spec = spec
        self.smem_size = 0
        self.chunks = spec.head_dim // VEC  # threads per share's row
        self.slots = spec.slots

    @cute.jit
    def host(self, args):
        """``args``: ``flashcore.specs.params.COMBINE``'s."""
        warps, slots, d = self.spec.warps, self.slots, self.spec.head_dim

        @cute.struct
        class Scratch:
            weight: cute.struct.MemRange[cutlass.Float32, MAX_SPLITS + IN_FLIGHT * slots]
            rows: cute.struct.MemRange[cutlass.Float32, slots * d]
            reduce: cute.struct.MemRange[cutlass.Float32, warps]

        self.smem_size = Scratch.size_in_bytes()  # read back by the build: the launch ABI
        mO = args.outputs.o
        rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        self.kernel(args, Scratch).launch(
            grid=(rows, 1, 1), block=[self.spec.threads, 1, 1], smem=self.smem_size)

    @cute.kernel
    def kernel(self, args, Scratch: cutlass.Constexpr):
        mOp, mLSEp = args.partials.o_partial, args.partials.lse_partial
        mO, mLSE = args.outputs.o, args.outputs.lse
        q_group, num_splits = args.shares.q_group, args.shares.num_splits
        if cutlass.const_expr(self.spec.programmatic_launch):
            cute.arch.griddepcontrol_wait()  # the partials come from the grid before this one
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        lin, _, _ = cute.arch.block_idx()
        batch_size, heads, rows = mO.shape[0], mO.shape[1], mO.shape[2]
        row = lin % rows
        head = (lin // rows) % heads
        batch = lin // rows // heads
        # the partials' (head, row): a K/V head's packed query rows, token-major, when the
        # attention kernel packed them (q_group > 1: its heads' one token, or packed tokens)
        p_head, p_row = head // q_group, row * q_group + head % q_group
        scratch = cutlass.memory.SmemAllocator().allocate(Scratch)
        n_weights = MAX_SPLITS + IN_FLIGHT * self.slots
        weight = scratch.weight.get_tensor(cute.make_layout((n_weights,)))
        red = scratch.reduce.get_tensor(cute.make_layout((self.spec.warps,)))
        sums = scratch.rows.get_tensor(cute.make_layout((self.spec.head_dim, self.slots)))

        # the first pass of partial rows is loaded before the LSEs are reduced: its round trip
        # to L2 overlaps theirs
        chunk, slot = tidx % self.chunks, tidx // self.chunks
        parts = cute.make_rmem_tensor((VEC, IN_FLIGHT), cutlass.Float32)
        self.load_pass(mOp, parts, slot, num_splits, batch_size, batch, p_head, p_row, chunk)
        lse = self.total_lse(mLSEp, num_splits, batch_size, batch, p_head, p_row, tidx, weight,
                             red)
        # share s's weight, exp(lse_s - lse); 0 for every share of a row no share saw, and
        # past the last share (the loads below run over in whole rounds)
        for s in cutlass.range_constexpr(0, n_weights, self.spec.threads):
            if s + tidx < n_weights:
                w = cutlass.Float32(0.0)
                if s + tidx < num_splits and lse != -cutlass.Float32.inf:
                    w = cute.math.exp2((weight[s + tidx] - lse) * LOG2_E, fastmath=True)
                weight[s + tidx] = w
        cute.arch.sync_threads()

        acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        acc.fill(0.0)
        if cutlass.const_expr(self.spec.idle_threads):
            if slot < self.slots:  # a thread past the last slot has no row of sums
                self.add_shares(mOp, parts, acc, weight, sums, slot, chunk, num_splits,
                                batch_size, batch, p_head, p_row)
        else:
            self.add_shares(mOp, parts, acc, weight, sums, slot, chunk, num_splits, batch_size,
                            batch, p_head, p_row)
        cute.arch.sync_threads()
        if slot == 0:
            for j in cutlass.range_constexpr(1, self.slots):
                cute.autovec_copy(cute.local_tile(sums[None, j], (VEC,), (chunk,)),
                                  parts[None, 0])
                acc.store(acc.load() + parts[None, 0].load())
            out = cute.make_rmem_tensor((VEC,), DTYPES[self.spec.dtype])
            out.store(acc.load().to(DTYPES[self.spec.dtype]))
            cute.autovec_copy(out, cute.local_tile(mO[batch, head, row, None], (VEC,),
                                                   (chunk,)))
        if cutlass.const_expr(mLSE is not None):  # noqa: SIM102 - compile time, then run time
            if tidx == 0:
                mLSE[batch, head, row] = lse

    @cute.jit
    def add_shares(self, mOp, parts, acc, weight, sums, slot, chunk, num_splits, batch_size,
                   batch, head, row):
        """This thread's ``chunk`` of its slot's shares (slot, slot + slots, ...), weighted,
        into ``acc`` and its slot's row of ``sums``; ``parts`` holds the first pass."""
        step = self.slots * IN_FLIGHT
        for s0 in range(slot, num_splits, step):
            for u in cutlass.range_constexpr(IN_FLIGHT):
                acc.store(acc.load() + parts[None, u].load() * weight[s0 + u * self.slots])
            if s0 + step < num_splits:
                self.load_pass(mOp, parts, s0 + step, num_splits, batch_size, batch, head,
                               row, chunk)
        cute.autovec_copy(acc, cute.local_tile(sums[None, slot], (VEC,), (chunk,)))

    @cute.jit
    def load_pass(self, mOp, parts, s0, num_splits, batch_size, batch, head, row, chunk):
        """``chunk`` of the partial rows of shares s0, s0 + slots, ... (``IN_FLIGHT`` of them,
        all loads issued before any is used; a share past the last reads the last again, and
        its weight is 0)."""
        for u in cutlass.range_constexpr(IN_FLIGHT):
            s = cutlass.min(s0 + u * self.slots, num_splits - 1)
            cute.autovec_copy(cute.local_tile(mOp[s * batch_size + batch, head, row, None],
                                              (VEC,), (chunk,)), parts[None, u])

    @cute.jit
    def total_lse(self, mLSEp, num_splits, batch_size, batch, head, row, tidx, weight, red):
        """log Σ_s exp(lse_s) over the shares (threads take shares tidx, tidx + threads, ...),
        leaving each share's lse_s in ``weight``."""
        top = -cutlass.Float32.inf
        for s in range(tidx, num_splits, self.spec.threads):
            v = mLSEp[s * batch_size + batch, head, row]
            weight[s] = v
            top = cute.arch.fmax(top, v)
        top = self.block_reduce(top, red, tidx, max=True)
        safe = 0.0 if top == -cutlass.Float32.inf else top
        total = cutlass.Float32(0.0)
        for s in range(tidx, num_splits, self.spec.threads):
            total += cute.math.exp2((weight[s] - safe) * LOG2_E, fastmath=True)
        total = self.block_reduce(total, red, tidx, max=False)
        lse = safe + cute.math.log2(total, fastmath=False) * LN_2
        return -cutlass.Float32.inf if total == 0.0 else lse

    @cute.jit
    def block_reduce(self, value, red, tidx, max: cutlass.Constexpr):
        """The CTA's max (or sum) of ``value``, in every thread (a barrier before and after:
        ``red`` is reused)."""
        if cutlass.const_expr(max):
            value = cute.arch.warp_reduction_max(value)
        else:
            value = cute.arch.warp_reduction_sum(value)
        if tidx % 32 == 0:
            red[tidx // 32] = value
        cute.arch.sync_threads()
        value = red[0]
        for w in cutlass.range_constexpr(1, self.spec.warps):
            value = cute.arch.fmax(value, red[w]) if cutlass.const_expr(max) else value + red[w]
        cute.arch.sync_threads()
        return value
