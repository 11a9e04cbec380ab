"""Ping-pong between consumer warpgroups: they take turns to issue their warpgroup MMAs, so one
warpgroup's softmax runs while the next one's MMAs hold the tensor cores (FlashAttention-3's
inter-warpgroup schedule).

Warpgroup w waits on named barrier ``TURN_BARRIER + w`` (its 128 threads and one arrival of
the 128 threads of the warpgroup before it, in a ring), issues, and passes the turn on by
arriving at the next one's barrier. Every arrival is matched: the last warpgroup hands the
first its opening turn, and the first waits once more at the end for the last one's final
hand-over.
"""

import cutlass
import cutlass.cute as cute

from ..hopper.layouts import WARPGROUP

TURN_BARRIER = 4  # named barriers 4..6 (the epilogue's are 1..3, the CTA's 0)


def takes_turns(consumers: int, tile_n: int) -> bool:
    """Ping-pong pays where each turn's MMAs are long: 128-key blocks. With 64-key blocks the
    turn barriers cost more than the overlap gains (on the H100, 128x128 tiles are faster with
    turns, 128x64 tiles slower)."""
    return consumers > 1 and tile_n >= 128


class Turns:
    """Trace-time: one consumer warpgroup's place in the ring (no-ops unless ``takes_turns``)."""

    def __init__(self, wg, consumers: int, tile_n: int):
        self.wg, self.consumers = wg, consumers
        self.on = takes_turns(consumers, tile_n)

    def _bar(self, w):
        return TURN_BARRIER + w

    @cute.jit
    def open(self):
        """The last warpgroup hands the first its opening turn."""
        if cutlass.const_expr(self.on):  # noqa: SIM102 - trace time, then run time
            if self.wg == self.consumers - 1:
                cute.arch.barrier_arrive(barrier_id=self._bar(0),
                                         number_of_threads=2 * WARPGROUP)

    @cute.jit
    def wait(self):
        if cutlass.const_expr(self.on):
            cute.arch.barrier(barrier_id=self._bar(self.wg), number_of_threads=2 * WARPGROUP)

    @cute.jit
    def pass_on(self):
        if cutlass.const_expr(self.on):
            nxt = self.wg + 1
            if nxt == self.consumers:
                nxt = 0
            cute.arch.barrier_arrive(barrier_id=self._bar(nxt), number_of_threads=2 * WARPGROUP)

    @cute.jit
    def close(self):
        """The first warpgroup takes the last hand-over (so no arrival is left pending)."""
        if cutlass.const_expr(self.on):  # noqa: SIM102 - trace time, then run time
            if self.wg == 0:
                cute.arch.barrier(barrier_id=self._bar(0), number_of_threads=2 * WARPGROUP)
