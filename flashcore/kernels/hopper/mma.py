"""Warpgroup MMA (``wgmma.mma_async``) groups as the Hopper kernels issue them, and the guard
on the attention ABI's optional arguments that a kernel does not build."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


def refuse_extras(family: str, extras: tuple) -> None:
    """Trace time: a Hopper kernel takes every optional argument of the attention ABI (FP8
    descales, serving tables, ...) but builds only some; those in ``extras`` must be None (the
    spec refuses such specs first; this guards a direct call)."""
    if any(x is not None for x in extras):
        raise ValueError(f"{family} attention: optional arguments this kernel does not build "
                         "(serving tables, FP8 descales of 16-bit operands) must be None")


@cute.jit
def wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
          zero_init: cutlass.Constexpr, wait: cutlass.Constexpr = 0):
    """acc (+)= A·B over the K steps of the fragments, as one wgmma group; then, unless
    ``wait`` is None, wait until at most ``wait`` groups are in flight (``wgmmas``)."""
    wgmmas([(tiled_mma, acc, a, b)], zero_init, wait)


def wgmmas(products: list, zero_init: bool, wait: int | None = 0) -> None:
    """Each (tiled_mma, acc, a, b) of ``products``: acc (+)= A·B over the K steps of the
    fragments, all of them one wgmma group; then, unless ``wait`` is None, wait until at most
    ``wait`` groups are in flight.

    ``wgmma.fence`` first: it orders this thread's earlier register writes (the accumulators'
    rescaling, P's conversion) before the asynchronous MMAs read those registers. The first
    step overwrites the accumulator when ``zero_init`` (no fill needed). A fresh atom per
    product: its accumulate flag is mutated, which must not leak into other calls' IR."""
    warpgroup.fence()
    for tiled_mma, acc, a, b in products:  # (trace time: a Python loop, unrolled)
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in range(cute.size(a, mode=[2])):
            cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if wait is not None:
        warpgroup.wait_group(wait)
