"""The mma_sync family's backward kernel: FlashAttention-2's dK/dV-stationary algorithm, for
sm_80 / sm_89 / sm_90.

One CTA per (batch, K/V head, block of ``tile_n`` keys). K and V are loaded once; the CTA walks
every query block of every query head that reads this K/V head (grouped-query attention: the
group's heads one after another, so dK and dV sum over them in registers, with no atomics and
the same result every run), each step one ``query_block``. Query blocks that see no key of the
block (above a causal diagonal, top-left or bottom-right, or outside a window) are skipped
(``block_info.query_blocks_seeing``). dQ goes to an fp32 accumulator through
``red.global.add`` (``deterministic``: key blocks take turns per query block, ``turns.py``);
the post kernel scales and converts it.

Inputs: Q, K, V, dO (batch, heads, seq, head_dim) 16-bit; the pre kernel's log2 LSE and D
(batch, heads, padded rows) fp32; outputs dK, dV (K's shape). A packed batch (``varlen``): all
of them (1, heads, total rows, ...), each sequence's rows read through its offsets
(``common.sequences``), the batch in the grid's z. ABI:
``flashcore.specs.params.BACKWARD``.
"""


from types import SimpleNamespace

import cutlass
import cutlass.cute as cute

from ...specs import BackwardSpec
from ..common.grid import wait_for_previous_grid
from ..common.sequences import Sequences
from .cta import BackwardCta
from .epilogue import store_key_grads
from .layouts import BackwardLayouts
from .query_block import issue_block, issue_first, query_block


class AttentionBackward:
    layouts = BackwardLayouts  # the family's trace-time data and CTA view (the Hopper one's
    cta = BackwardCta  # subclass names its own)

    def __init__(self, spec: BackwardSpec):
        self.spec = spec
        self.smem_size = 0

    @cute.jit
    def host(self, args):
        """The launch; the runtime repeats this geometry (``abi.backward_grid``). ``args``:
        ``flashcore.specs.params.BACKWARD``'s."""
        lay = self.layouts(self.spec)
        self.smem_size = lay.storage.size_in_bytes()  # read back by the build: the launch ABI
        mK = args.inputs.k
        n_blocks = cute.ceil_div(mK.shape[2], self.spec.tile_n)
        grid = (n_blocks, mK.shape[1] * mK.shape[0], 1)  # chunks of one (batch, head) pair
        if cutlass.const_expr(self.spec.varlen):  # the runtime sizes x by the longest sequence
            grid = (n_blocks * mK.shape[1], 1, args.serving.cu_seqlens_k.shape[0] - 1)
        # a warp-specialised kernel moves registers between its warpgroups (``setmaxnreg``),
        # which ptxas may ignore unless it knows the count at entry: one CTA an SM says so
        # (d96's warpgroups otherwise stayed at 168 registers, spilled and serialised their
        # MMAs; d64's 64-row kernel kept 168 too)
        self.kernel(self.kernel_args(lay, args)).launch(
            grid=grid, block=[self.spec.threads, 1, 1], smem=self.smem_size,
            min_blocks_per_mp=1 if self.spec.warp_specialized else 0)

    def kernel_args(self, lay, args):
        """What the kernel gets of the launch's arguments (the Hopper kernel's TMA atoms)."""
        return args

    def begin(self, args):
        """Trace time, the start both families' kernels share: this CTA (``cta``, over the
        shared storage) and its walk, (cta, first query head, first query block, query
        blocks a head, steps)."""
        inputs, masks = args.inputs, args.masks
        lay = self.layouts(self.spec)
        storage = cutlass.memory.SmemAllocator().allocate(lay.storage)
        # a packed batch's offsets (the forward's reader of them; no paged cache here), read
        # only once the grids before are done: the previous one may still be writing them
        if cutlass.const_expr(self.spec.varlen):
            wait_for_previous_grid(self.spec)
        seqs = Sequences(self.spec, SimpleNamespace(
            cu_seqlens_q=args.serving.cu_seqlens_q, cu_seqlens_k=args.serving.cu_seqlens_k,
            block_table=None, seqlens_k=None))
        cta = self.cta(lay, storage, inputs.q, inputs.k, inputs.v, masks.window_left,
                       masks.window_right, seqs)
        cta.softcap = (masks.softcap_in, masks.softcap_out)
        cta.dq_turns = args.order.dq_turns  # None unless deterministic
        work = args.workspaces
        cta.query_sources(inputs.q, inputs.do, work.lse_log2, work.dpsum,
                          cta.kv_head * cta.q_group)
        if cutlass.const_expr(not self.spec.varlen):
            wait_for_previous_grid(self.spec)  # the pre kernel wrote the workspaces
        lo, hi = cta.query_blocks()
        per_head = cutlass.max(hi - lo, 0)
        steps = per_head * cta.q_group
        return cta, cta.kv_head * cta.q_group, lo, per_head, steps

    @cute.kernel
    def kernel(self, args):
        mdQacc = args.workspaces.dq_accum
        cta, first, lo, per_head, steps = self.begin(args)
        issue_first(cta, first, lo, steps)
        for step in range(steps):
            # the step's blocks have landed, and every warp is done with the last step's P, dS
            # (and, two stages, with the stage the next block goes into)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            after = step + 1
            slot = 0
            if cutlass.const_expr(self.spec.config.stages > 1):
                slot = step % 2
                if after < steps:
                    issue_block(cta, first + after // per_head, lo + after % per_head,
                                1 - slot)
                cute.arch.cp_async_commit_group()
            query_block(cta, mdQacc, first + step // per_head, lo + step % per_head,
                        args.scales.scale_log2, after < steps, first + after // per_head,
                        lo + after % per_head, slot)
        # a CTA whose keys no query sees walked no block: its K/V copies must land before the
        # epilogue reuses their tiles
        cute.arch.cp_async_wait_group(0)
        store_key_grads(cta, args.grads.dk, args.grads.dv, args.scales.scale)
