"""One key block: S = Q·Kᵀ, mask, online softmax, O += P·V, around the block's loads."""


import cutlass
import cutlass.cute as cute

from ..common.fp8 import key_descales, scale_columns
from ..common.fragments import acc_as_fp8_operand_a, acc_as_operand_a, mn_view
from ..common.mask import alibi_bias, mask_scores, soft_cap
from ..common.mma import gemm_rs, gemm_ss
from ..common.softmax import OnlineSoftmax
from .cta import Cta
from .e4m3_operands import gemm_codes
from .pipeline import after_block, after_scores, before_scores


@cute.jit
def key_block(cta: Cta, softmax: OnlineSoftmax, n_block, slot, masked: cutlass.Constexpr,
              first: cutlass.Constexpr):
    c = cta.config
    acc_S = cute.make_rmem_tensor(cta.thr_mma.partition_shape_C((c.tile_m, c.tile_n)),
                                  cutlass.Float32)
    acc_S.fill(0.0)
    k_descale = None
    if cutlass.const_expr(cta.lay.fp8 and cta.spec.k_scale == "token"):
        # issued before the MMAs so their global-load latency hides behind them
        k_descale = key_descales(cta.score_coords(n_block), cta.gKd, cta.seqlen_k)

    kv_scales = before_scores(cta, n_block, slot, first)
    if cutlass.const_expr(cta.lay.kv_fp8):
        gemm_codes(cta.lay.tiled_mma, acc_S, cta.q_frag, cta.k, cta.k.stage(slot))
    else:
        gemm_ss(cta.lay.tiled_mma, acc_S, cta.q, cta.q.smem, cta.k, cta.k.stage(slot))
    after_scores(cta, n_block)

    S = mn_view(acc_S)
    if cutlass.const_expr(k_descale is not None):  # each key's descale scales its column
        scale_columns(S, k_descale)
    if cutlass.const_expr(cta.lay.kv_fp8):  # the FP8 KV cache's per-key descales of K and V
        scale_columns(S, kv_scales[0])
    if cutlass.const_expr(cta.spec.softcap):
        soft_cap(S, *cta.softcap)
    if cutlass.const_expr(cta.spec.alibi):  # after the cap, as FlashAttention adds it
        alibi_bias(S, cta.score_coords(n_block), cta.alibi, cta.bounds.offset, cta.q_group)
    if cutlass.const_expr(masked):
        mask_scores(S, cta.score_coords(n_block), cta.seqlen_k, cta.bounds, cta.q_group)
    if cutlass.const_expr(cta.lay.kv_fp8):
        softmax.update(S, mn_view(cta.acc_O), kv_scales[2])  # the output's unit moves too
        scale_columns(S, kv_scales[1])  # P·(v8 · v_descale) = (P · v_descale)·v8, per key
    else:
        softmax.update(S, mn_view(cta.acc_O))

    p_frag = probabilities_as_operand(cta, acc_S)
    if cutlass.const_expr(cta.lay.kv_fp8):
        gemm_codes(cta.lay.tiled_mma, cta.acc_O, p_frag, cta.vt, cta.vt.stage(slot))
    else:
        gemm_rs(cta.lay.tiled_mma, cta.acc_O, p_frag, cta.vt, cta.vt.stage(slot))
    after_block(cta, n_block, slot)


@cute.jit
def probabilities_as_operand(cta: Cta, acc_S: cute.Tensor):
    """P in the operand precision, re-viewed as the A operand of P·V (no trip through memory)."""
    op = cta.lay.op_dtype
    if cutlass.const_expr(cta.lay.fp8):
        # Gather in the A operand's value order on the fp32 accumulator (4-byte elements: any
        # stride is fine), then convert into a compact fragment: the MMA takes each 32-bit
        # register as 4 consecutive bytes of the fragment's storage.
        acc_as_a = cute.make_tensor(acc_S.iterator, acc_as_fp8_operand_a(acc_S.layout))
        tOrP = cute.make_rmem_tensor(acc_as_a.shape, op)
        tOrP.store(acc_as_a.load().to(op))  # P_SCALE is in p already (softmax p_log2)
        return tOrP
    rP = cute.make_rmem_tensor(acc_S.layout, op)
    rP.store(acc_S.load().to(op))
    return cute.make_tensor(rP.iterator, acc_as_operand_a(rP.layout))
