"""The mma_sync family's forward kernel: FlashAttention-2 style, for sm_80 / sm_89 / sm_90.

One CTA computes ``tile_m`` query rows of one (batch, head) over its share of the keys
(``cta.py``). It walks the key blocks from the last to the first, so the blocks that need masking
(the ragged end of the keys; the diagonal when causal) come first and initialise the running row
max (``block.py``, ``pipeline.py`` for the loads). With ``kv_splits`` > 1 the CTA holds that many
groups of ``warps`` warps, each over its own share of the keys, merged through shared memory at
the end (``epilogue.py``).

* global->shared: 128-bit ``cp.async``; rows past a sequence end are zero-filled in shared memory.
* shared->registers: ``ldmatrix`` (transposed for 16-bit V, which is stored keys × head_dim).
* MMA: warp-level m16n8k16 (fp16/bf16) or m16n8k32 (e4m3), fp32 accumulate; each warp owns
  ``tile_m / warps`` query rows. Online softmax in ``common/softmax.py``.
* P is converted in registers and re-viewed as the A operand of P·V (no trip through memory).

Variants, all compile-time choices of the spec: ``precision="fp8"`` (Q, K and Vᵀ in e4m3 with
descales per token for Q and K and per (batch, head) for V; each key's descale multiplies its
column of scores, each query's folds into its row's exp2 scale; P comes out of its exp2 times
``P_SCALE`` for its e4m3 conversion, the row sums with it, so O / sum needs only V's descale;
Vᵀ's keys are stored permuted within each 32 so P's registers serve as the A operand as they
are), ``kv_fp8`` (an e4m3 KV cache whose codes ldmatrix reads and the
MMAs' fragments convert in registers to fp16, for either output dtype, ``e4m3_operands.py``), ``split_kv`` (fp32 partial
results per share of the keys, for the combine kernel, or merged by the last share's CTA with
``merge_shares``: ``common/merge.py``), causal (top-left, torch's
``is_causal``), LSE.

ABI: ``flashcore.compiler.abi`` (grid and parameters).
"""

import math

import cutlass
import cutlass.cute as cute

from ...specs import AttentionSpec
from ..common.block_info import masked_steps
from ..common.fp8 import P_SCALE, fold_query_descales
from ..common.fragments import mn_view
from ..common.grid import kv_head_of, tile_coords, wait_for_previous_grid
from ..common.merge import last_share_merges
from ..common.sequences import Sequences
from ..common.softmax import OnlineSoftmax
from .block import key_block
from .cta import Cta
from .epilogue import merge_groups, store_output, store_partials
from .layouts import KernelLayouts
from .pipeline import prologue


class AttentionForward:
    """Trace-time configuration of one kernel: the spec is Python data (constexpr)."""

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.smem_size = 0
        # whether some CTA may have no key block to walk (a plain top-left kernel always has one)
        self.may_walk_no_block = (spec.split_kv or spec.shifted_mask or spec.varlen
                                  or spec.paged_kv)

    @cute.jit
    def host(self, args):
        """The launch; flashcore keeps only the kernel's cubin and its runtime repeats this
        geometry (``flashcore.compiler.abi.attention_grid``). ``args``:
        ``flashcore.specs.params.ATTENTION``'s."""
        lay = KernelLayouts(self.spec)
        self.smem_size = lay.storage.size_in_bytes()  # read back by the build: the launch ABI
        mQ, mK = args.operands.q, args.operands.k
        q_group, num_splits = args.softmax.q_group, args.softmax.num_splits
        cu_seqlens_q = args.serving.cu_seqlens_q
        rows, heads = mQ.shape[2], mQ.shape[1]
        if cutlass.const_expr(self.spec.packed_tokens):  # a K/V head's tokens of its queries
            rows, heads = rows * q_group, mK.shape[1]
        m_blocks = cute.ceil_div(rows, self.spec.tile_m)
        batches = 1 if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
        self.kernel(args).launch(
            grid=(m_blocks * heads * mQ.shape[0], num_splits, batches),
            block=[self.spec.threads, 1, 1], smem=self.smem_size,
            # a decode tile's CTAs (one warp row, or a K/V head's packed token rows) run about
            # one a SM: without a bound ptxas budgets registers for a dozen such CTAs (168 for
            # one or two warps, 128 for four) and spilled in the key loop (bf16 16x64 s2 split:
            # 24 B, five local accesses a block; with it 183 registers, none)
            min_blocks_per_mp=1 if self.spec.tile_m == 16 or self.spec.packed_tokens else 0,
        )

    @cute.kernel
    def kernel(self, args):
        mQ, mK, mV = args.operands.q, args.operands.k, args.operands.v
        mO, mLSE = args.outputs.o, args.outputs.lse
        mQd, mKd, mVd = args.descales.q_descale, args.descales.k_descale, args.descales.v_descale
        scale_log2, q_group = args.softmax.scale_log2, args.softmax.q_group
        masks = args.masks
        # the CTA's coordinates, key range and addresses are arithmetic on kernel parameters
        # (~200 instructions, four integer divisions): worked out while the previous grid
        # finishes, unless a serving table (read from global memory) decides them
        reads_tables = self.spec.varlen or self.spec.paged_kv
        if cutlass.const_expr(reads_tables):
            wait_for_previous_grid(self.spec)
        lay = KernelLayouts(self.spec)
        storage = cutlass.memory.SmemAllocator().allocate(lay.storage)
        seqs = Sequences(self.spec, args.serving)
        cta = Cta(lay, storage, mQ, mK, mV, mKd, mVd, q_group, args.softmax.num_splits,
                  masks.window_left, masks.window_right, seqs)
        if cutlass.const_expr(not reads_tables):  # noqa: SIM102 - trace time, then run time
            # true in every CTA; as a branch on the computed head it keeps ptxas from hoisting
            # the wait above the arithmetic (it does for a wait that merely comes later)
            if cta.kv_head < mK.shape[1]:
                wait_for_previous_grid(self.spec)
        cta.softcap = (masks.softcap_in, masks.softcap_out)
        cta.alibi = None
        if cutlass.const_expr(self.spec.alibi):  # the head's slope in S's units: / scale
            _, head, batch, _ = tile_coords(mQ, self.spec)
            cta.alibi = args.bias.alibi_slopes[batch, head] * (math.log2(math.e) / scale_log2)
        # FP8: p comes out times P_SCALE (in its exp2's FMA), the row sums with it
        softmax = OnlineSoftmax(cute.size(mn_view(cta.acc_O), mode=[0]), scale_log2,
                                form="exact" if lay.fp8 else "offset",
                                p_log2=math.log2(P_SCALE) if lay.fp8 else 0.0)
        o_scale = cutlass.Float32(1.0)
        if cutlass.const_expr(lay.fp8):
            # each row's exp2 scale carries its query's descale; O = (P8 · v8) / sum *
            # v_descale, loaded early to hide its latency
            _, head, batch, _ = tile_coords(mQ, self.spec)
            kv_head = kv_head_of(head, mQ, mK)
            k_descale = None  # per token: in key_block; per head: in the rows' exp2 scales
            if cutlass.const_expr(self.spec.k_scale == "head"):
                k_descale = mKd[batch, kv_head]
            fold_query_descales(cta, softmax, mQd[batch, head, None], scale_log2, k_descale)
            o_scale = mVd[batch, kv_head]
        q_unit = prologue(cta)
        if cutlass.const_expr(lay.q_rescaled):  # a bf16 Q scaled into fp16: its scores too
            softmax.row_scale.store(softmax.row_scale.load() * q_unit)
        self.walk_keys(cta, softmax)
        if cutlass.const_expr(lay.kv_fp8):  # the output in its own units
            cta.acc_O.store(cta.acc_O.load() * cta.v_unit[0])
        if cutlass.const_expr(self.may_walk_no_block):
            # a CTA that walked no key block (an empty share, a tile outside its window or past
            # its sequence's keys) never waited for its Q copy: it must land before the
            # epilogue reuses Q's buffer, and before the CTA exits
            cute.arch.cp_async_wait_group(0)
        softmax.finish()
        if cutlass.const_expr(self.spec.kv_splits > 1):
            merge_groups(cta, softmax, storage)
        if cta.group == 0:
            if cutlass.const_expr(self.spec.split_kv):
                store_partials(cta, softmax, mQ, mO, mLSE, o_scale)
            else:
                store_output(cta, softmax, mQ, mO, mLSE, o_scale)
        if cutlass.const_expr(self.spec.merge_shares):
            # the K ring is free (every copy landed above): a word of it says who merges
            flag = storage.sK.get_tensor(cute.make_layout((1,)), dtype=cutlass.Int32)
            m_block, head, batch, _ = tile_coords(mQ, self.spec, q_group)
            last_share_merges(self.spec, args.merge, mO, mLSE, flag, (m_block, head, batch),
                              cute.arch.thread_idx()[0], args.softmax.num_splits, q_group)

    @cute.jit
    def walk_keys(self, cta: Cta, softmax: OnlineSoftmax):
        """Key blocks n_hi - 1 down to n_lo; the first ``masked_steps`` of them masked (unrolled),
        the rest in a loop, and with a window the blocks below ``n_lo_unmasked`` (its lower
        edge) masked again. The i-th block walked uses ring stage i % stages."""
        spec = self.spec
        steps = masked_steps(spec.tile_m, spec.tile_n, cta.bounds)
        for step in cutlass.range_constexpr(steps):
            n_block = cta.n_hi - 1 - step
            if n_block >= cta.n_lo:
                key_block(cta, softmax, n_block, step % spec.stages, masked=True,
                          first=step == 0)
        lowest = cta.n_lo
        if cutlass.const_expr(spec.window):
            lowest = cutlass.max(cta.n_lo, cta.n_lo_unmasked)
        for n_block in range(cta.n_hi - 1 - steps, lowest - 1, -1):
            key_block(cta, softmax, n_block, (cta.n_hi - 1 - n_block) % spec.stages,
                      masked=False, first=False)
        if cutlass.const_expr(spec.window):
            for n_block in range(cutlass.min(cta.n_hi - 1 - steps, lowest - 1), cta.n_lo - 1, -1):
                key_block(cta, softmax, n_block, (cta.n_hi - 1 - n_block) % spec.stages,
                          masked=True, first=False)
