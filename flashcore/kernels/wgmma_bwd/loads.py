"""The Hopper backward's TMA copies over dense batches (``BackwardSpec.loads_by_tma``): warp 0
copies the key block's K and V once and each query block's Q and dO tiles into their stage
(one elected lane issues them; the whole warp runs the code, as ``elect.sync`` needs), an
mbarrier a stage counting the bytes and the key block's its own. Every thread would otherwise
spend a hundred instructions a query block on its cp.async copies' addresses. The LSE and D
rows stay per-thread cp.async copies (``mma_sync_bwd.query_block``). A packed batch keeps
cp.async throughout: its rows past a sequence must be zero-filled.

A stage's barrier completes once a use: query block i of the walk lands in stage i % 2 with
phase (i // 2) % 2. The warp-specialised kernel copies the LSE and D rows too, as 1-D bulk
copies on the same barrier (``bulk_copy_g2s``)."""

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op

from ..hopper.layouts import tma_view


def tma_inputs(spec, lay, inputs):
    """Host side: Q, K, V and dO as (TMA atom, coordinate tensor) pairs over the kernel's
    swizzled tiles (the runtime encodes the descriptors: ``BackwardSpec.tensor_map_params``)."""
    c, d = spec.config, spec.head_dim
    op = cpasync.CopyBulkTensorTileG2SOp()
    block = cute.select(lay.sQ, mode=[0, 1])  # one stage

    def atom(t, smem, tile):
        return cpasync.make_tiled_tma_atom(op, tma_view(t), smem, tile)

    return inputs._replace(q=atom(inputs.q, block, (c.tile_m, d)),
                           k=atom(inputs.k, lay.sK, (c.tile_n, d)),
                           v=atom(inputs.v, lay.sK, (c.tile_n, d)),
                           do=atom(inputs.do, block, (c.tile_m, d)))


class TensorShape:
    """A TMA coordinate tensor's extents as its tensor's (batch, heads, seq, head_dim) shape:
    what the CTA's placement reads of Q and K."""

    def __init__(self, tma: cute.Tensor):
        seq, d, heads, batch = (tma.shape[i] for i in range(4))
        self.shape = (batch, heads, seq, d)


@cute.jit
def init_barriers(mbar, stages: cutlass.Constexpr, tidx, empties: cutlass.Constexpr) -> None:
    """Thread 0: a barrier a stage and the key block's, one arrival each (the copying
    thread's, with the bytes it expects), and with ``empties`` (the MMA warps' count) an empty
    barrier a stage after them, an arrival from each MMA warp; then every thread sees them
    initialised."""
    if tidx == 0:
        for s in cutlass.range_constexpr(stages + 1):
            cute.arch.mbarrier_init(mbar + s, 1)
        if cutlass.const_expr(empties > 0):
            for s in cutlass.range_constexpr(stages):
                cute.arch.mbarrier_init(mbar + stages + 1 + s, empties)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()


def _tiles(atom, tma_rows: cute.Tensor, smem: cute.Tensor, tile, block) -> tuple:
    """(the shared tile's TMA view, block ``block``'s TMA view) of ``tma_rows``."""
    gX = cute.local_tile(tma_rows, tile, (block, 0))
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2),
                                 cute.group_modes(gX, 0, 2))


@cute.jit
def copy_pair(atoms, smems, head, batch, tile: cutlass.Constexpr, block, mbar,
              bytes_: cutlass.Constexpr, stage=None):
    """Warp 0: block ``block`` of two tensors' (``atoms``: (TMA atom, coordinate tensor)
    pairs) rows of (``head``, ``batch``) into ``smems`` (stage ``stage`` of them, where
    staged), both on ``mbar``, which expects ``bytes_`` (rows past a tensor are zero-filled by
    TMA)."""
    if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, bytes_)
        for (atom, tma), smem in zip(atoms, smems):
            s_t, g_t = _tiles(atom, tma[None, None, head, batch], smem, tile, block)
            if cutlass.const_expr(stage is not None):
                s_t = s_t[None, stage]
            cute.copy(atom, g_t, s_t, tma_bar_ptr=mbar)


@dsl_user_op
def bulk_copy_g2s(saddr, gaddr, size: int, mbar, *, loc=None, ip=None) -> None:
    """``cp.async.bulk`` (1-D): ``size`` bytes from global ``gaddr`` to shared ``saddr`` (both
    16-byte aligned), completing on the mbarrier at shared address ``mbar``."""
    llvm.inline_asm(None, [cutlass.Int32(saddr).ir_value(loc=loc, ip=ip),
                           cutlass.Int64(gaddr).ir_value(loc=loc, ip=ip),
                           cutlass.Int32(mbar).ir_value(loc=loc, ip=ip)],
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                    f"[$0], [$1], {size}, [$2];", "r,l,r", has_side_effects=True, loc=loc, ip=ip)
