"""The kernels' parameter ABI and launch geometry, as data.

Each kernel's parameters are declared once, in ``flashcore.specs.params``; ``params_for``
gives their packing (``flashcore.specs.packing``: a tensor is a pointer, then its run-time
shape entries as i32, then its run-time strides as i64; a TMA operand a descriptor and its
coordinate extents). The runtime packs arguments from it, and the compiler checks it against
the ``.entry`` it reads from the PTX, so a kernel whose signature drifted is refused, never
launched. This module must not import the DSL: hosts without it launch prebuilt kernels.
"""

from __future__ import annotations

import math

from ..specs.packing import CoordParam, Packed, ScalarParam, TensorMapParam, TensorParam
from ..specs.params import params_of

LOG2_E = math.log2(math.e)


def params_for(spec) -> tuple[Packed, ...]:
    """The packing of ``spec``'s kernel, in ``.entry`` order (``flashcore.specs.params``)."""
    return params_of(spec)


MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = MAX_GRID_Z = 65535


def attention_grid(rows: int, heads: int, batch: int, tile_m: int,
                   num_splits: int = 1) -> tuple[int, int, int]:
    """x: every (batch, head, query tile), the tile fastest; y: the key shares."""
    x = (rows + tile_m - 1) // tile_m * heads * batch
    if x > MAX_GRID_X:
        raise ValueError(f"{batch} batches x {heads} heads x {rows} rows is {x} CTAs, over "
                         f"the grid's {MAX_GRID_X}")
    return (x, num_splits, 1)


def varlen_grid(max_rows: int, heads: int, batch: int, tile_m: int) -> tuple[int, int, int]:
    """Packed batches: x walks (head, query tile) up to the longest sequence, z the batch."""
    x = (max_rows + tile_m - 1) // tile_m * heads
    if x > MAX_GRID_X or batch > MAX_GRID_Z:
        raise ValueError(f"{batch} sequences of up to {max_rows} rows x {heads} heads do not fit "
                         f"the grid (x {MAX_GRID_X}, z {MAX_GRID_Z})")
    return (x, 1, batch)


def combine_grid(rows: int, heads: int, batch: int) -> tuple[int, int, int]:
    """A CTA per (batch, head, row)."""
    x = batch * heads * rows
    if x > MAX_GRID_X:
        raise ValueError(f"{batch} batches x {heads} heads x {rows} rows is {x} CTAs, over "
                         f"the grid's {MAX_GRID_X}")
    return (x, 1, 1)


def check_against_entry(params: tuple, entry_params) -> None:
    """Raise ValueError if the PTX parameter list does not match the ABI description."""
    if len(params) != len(entry_params):
        raise ValueError(
            f"kernel has {len(entry_params)} parameters, the ABI describes {len(params)}"
        )
    for want, got in zip(params, entry_params):
        if want.size != got.size or want.align != got.align:
            raise ValueError(
                f"parameter {want.name!r}: PTX has {got.size} bytes aligned {got.align}, "
                f"the ABI packs {want.size} bytes aligned {want.align}"
            )


def backward_rows_grid(padded_rows: int, heads: int, batch: int,
                       rows_per_cta: int) -> tuple[int, int, int]:
    """pre and post: a CTA per ``rows_per_cta`` rows of each (batch, head); ``padded_rows``
    (pre: the workspace's rows) or the sequence's (post: rounded up)."""
    x = (padded_rows + rows_per_cta - 1) // rows_per_cta * heads * batch
    if x > MAX_GRID_X:
        raise ValueError(f"{batch} batches x {heads} heads x {padded_rows} rows is {x} CTAs, "
                         f"over the grid's {MAX_GRID_X}")
    return (x, 1, 1)


def backward_grid(seqlen_k: int, heads_kv: int, batch: int, tile_n: int,
                  chunk: int = 1) -> tuple[int, int, int]:
    """main: a CTA per (batch, K/V head, key block). y walks chunks of ``chunk`` (batch, K/V
    head) pairs (``backward_chunk``), x a chunk's CTAs key block by key block, its pairs
    fastest: a causal grid's longest walks (the first key blocks) of a chunk start together."""
    pairs = heads_kv * batch
    if chunk < 1 or pairs % chunk:
        raise ValueError(f"chunk={chunk} does not divide the {pairs} (batch, K/V head) pairs")
    x = (seqlen_k + tile_n - 1) // tile_n * chunk
    y = pairs // chunk
    if x > MAX_GRID_X or y > MAX_GRID_Y:
        raise ValueError(f"{batch} batches x {heads_kv} heads x {seqlen_k} keys in chunks of "
                         f"{chunk} is a ({x}, {y}) grid, over ({MAX_GRID_X}, {MAX_GRID_Y})")
    return (x, y, 1)


def backward_chunk(seqlen_k: int, heads_kv: int, batch: int, tile_n: int, sms: int) -> int:
    """(batch, K/V head) pairs a chunk of the main grid holds: the most whose key blocks fit
    one wave of ``sms`` CTAs (at least one, and enough that the chunks fit the grid's y), a
    divisor of the pairs. In a chunk the key block is the slow index, so its heaviest CTAs
    (causal: the first key blocks, which every later query block sees) start first; a GQA
    CTA walks all of its group's query heads, and one started last would run alone."""
    pairs = heads_kv * batch
    blocks = (seqlen_k + tile_n - 1) // tile_n
    least = -(-pairs // MAX_GRID_Y)
    fit = max(least, sms // max(blocks, 1))
    divisors = [c for c in range(1, min(fit, pairs) + 1) if pairs % c == 0 and c >= least]
    return max(divisors) if divisors else next(c for c in range(least, pairs + 1)
                                               if pairs % c == 0)



def varlen_backward_grid(max_seqlen_k: int, heads_kv: int, batch: int,
                         tile_n: int) -> tuple[int, int, int]:
    """main, packed batch: x walks (K/V head, key block) up to the longest sequence's keys, z
    the batch."""
    x = (max_seqlen_k + tile_n - 1) // tile_n * heads_kv
    if x > MAX_GRID_X or batch > MAX_GRID_Z:
        raise ValueError(f"{batch} sequences of up to {max_seqlen_k} keys x {heads_kv} heads do "
                         f"not fit the grid (x {MAX_GRID_X}, z {MAX_GRID_Z})")
    return (max(x, 1), 1, batch)


__all__ = ["LOG2_E", "MAX_GRID_X", "MAX_GRID_Y", "MAX_GRID_Z", "CoordParam", "ScalarParam",
           "TensorMapParam", "TensorParam", "attention_grid", "backward_chunk", "backward_grid",
           "backward_rows_grid",
           "check_against_entry", "combine_grid", "params_for", "varlen_backward_grid",
           "varlen_grid"]
