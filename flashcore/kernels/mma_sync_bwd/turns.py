"""The deterministic backward's order of dQ adds: an int32 counter per (batch, query head,
query block) of the key blocks that have added into its dQ rows, the highest key block first.
Key block n waits until the counter reaches its turn (``block_info.dq_turn``), adds, and counts
itself. Every CTA it waits for holds a higher key block, which the grid launches first
(``cta.key_block_coords``), so was scheduled before it: the wait always ends.

The counter is read with acquire and raised with release at GPU scope, around a CTA barrier
(CUTLASS's generic barrier does the same): the adds of one CTA happen before the next one's."""


import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def load_acquire(address, *, loc=None, ip=None) -> cutlass.Int32:
    """``ld.acquire.gpu`` of the int32 at global ``address`` (an Int64)."""
    value = llvm.inline_asm(cutlass.Int32.mlir_type,
                            [cutlass.Int64(address).ir_value(loc=loc, ip=ip)],
                            "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l",
                            has_side_effects=True, loc=loc, ip=ip)
    return cutlass.Int32(value)


@dsl_user_op
def add_release(address, value, *, loc=None, ip=None) -> None:
    """``red.release.gpu``: add ``value`` to the int32 at global ``address``; this thread's
    earlier writes (and, after a CTA barrier, its CTA's) are visible before the sum is."""
    llvm.inline_asm(None, [cutlass.Int64(address).ir_value(loc=loc, ip=ip),
                           cutlass.Int32(value).ir_value(loc=loc, ip=ip)],
                    "red.release.gpu.global.add.s32 [$0], $1;", "l,r", has_side_effects=True,
                    loc=loc, ip=ip)


@cute.jit
def wait_turn(counters: cute.Tensor, index, turn, tidx):
    """Until counter ``index`` holds ``turn``: one thread spins, the CTA waits for it."""
    if tidx == 0:
        address = (counters.iterator + index).toint()
        seen = load_acquire(address)
        while seen != turn:
            seen = load_acquire(address)
    cute.arch.sync_threads()


@cute.jit
def pass_turn(counters: cute.Tensor, index, tidx):
    """After every thread's adds: the next key block's turn at counter ``index``."""
    cute.arch.sync_threads()
    if tidx == 0:
        add_release((counters.iterator + index).toint(), 1)
