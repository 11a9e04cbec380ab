"""After the query loop: dK (times the softmax scale) and dV in the input dtype, through the
K and V tiles' shared memory to 16-byte stores of the block's keys that exist."""


import cutlass
import cutlass.cute as cute

from ..common.sync import named_barrier
from .cta import BackwardCta

EPILOGUE_BARRIER = 1  # a warp-specialised kernel's: its MMA warps meet alone


@cute.jit
def sync_workers(cta: BackwardCta):
    """Every computing thread here: the whole CTA, or a warp-specialised kernel's MMA warps
    (a named barrier: its producer warps do not come)."""
    if cutlass.const_expr(cta.spec.warp_specialized):  # (d96: two copies of the loop)
        named_barrier(EPILOGUE_BARRIER, cta.config.threads, aligned=not cta.lay.dq_single)
    else:
        cute.arch.sync_threads()


@cute.jit
def store_key_grads(cta: BackwardCta, mdK, mdV, scale):
    cta.acc_dK.store(cta.acc_dK.load() * scale)
    sync_workers(cta)  # every warp is done reading sK and sV
    store_tile(cta, cta.acc_dK, cta.sK, mdK)
    store_tile(cta, cta.acc_dV, cta.sV, mdV)


@cute.jit
def store_tile(cta: BackwardCta, acc, smem, mOut):
    lay, c, d = cta.lay, cta.config, cta.spec.head_dim
    r = cute.make_rmem_tensor(acc.layout, lay.dtype)
    r.store(acc.load().to(lay.dtype))
    r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), lay.dtype),
                                 lay.mma_dkv)
    r2s_thr = r2s.get_slice(cta.tidx)
    cute.copy(r2s, r2s_thr.retile(r), r2s_thr.partition_D(smem))
    sync_workers(cta)
    gOut = cute.local_tile(cta.key_rows(mOut), (c.tile_n, d), (cta.n_block, 0))
    cOut = cute.local_tile(cute.make_identity_tensor((cta.seqlen_k, d)), (c.tile_n, d),
                           (cta.n_block, 0))
    r2g = lay.r2g.get_slice(cta.tidx)
    tS, tG, tC = r2g.partition_S(smem), r2g.partition_D(gOut), r2g.partition_D(cOut)
    tR = cute.make_rmem_tensor_like(tG, lay.dtype)
    cute.autovec_copy(tS, tR)
    for m in cutlass.range_constexpr(cute.size(tR, mode=[1])):
        if cute.elem_less(tC[0, m, 0][0], cta.seqlen_k):
            cute.copy(lay.r2g, tR[None, m, None], tG[None, m, None])
