"""Timing device work: kernel time from CUDA-graph replays, eager time per call with events, and
eager calls' GPU time queued behind a sleep.

Used by the benchmark and the autotuner. ``call(*inputs)`` is timed over rotating input sets,
enough of them that together they exceed the L2 cache (``n_sets``), so repeats do not measure the
cache. Medians, after warm-up; needs torch with CUDA.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch


def n_sets(bytes_per_set: int, l2_bytes: int) -> int:
    """Input sets to rotate so that together they are at least 3x the L2 (2 to 64)."""
    return max(2, min(64, math.ceil(3 * l2_bytes / max(bytes_per_set, 1))))


def time_kernel(call: Callable[..., object], sets: Sequence[tuple], reps: int = 20,
                warmup_ms: float = 100.0, stream: torch.cuda.Stream | None = None) -> float:
    """Median µs per call of a CUDA graph that replays one call per input set, after replaying
    it for ``warmup_ms``: the GPU idles while inputs are made and kernels load, and its clocks
    take tens of ms to come back (without the warm-up, the first implementation timed after a
    pause runs slower than the same kernel timed later in the same run). ``stream``: warm up and
    capture on it (an autograd backward runs on its forward's stream, so a backward is captured
    on the stream its forward ran on)."""
    for inputs in sets:
        call(*inputs)  # compile, load, allocate (and any per-input preparation) first
    torch.cuda.synchronize()
    s = stream or torch.cuda.Stream()
    with torch.cuda.stream(s):
        for inputs in sets[:2]:
            call(*inputs)
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for inputs in sets:
            call(*inputs)
    _keep_busy(g.replay, warmup_ms)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(sets))
    return statistics.median(times)


def _keep_busy(run: Callable[[], object], ms: float) -> None:
    """Run ``run`` back to back until ``ms`` of GPU time have passed (at least once)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    run()
    b.record()
    b.synchronize()
    once = max(a.elapsed_time(b), 1e-3)
    for _ in range(min(1000, math.ceil(ms / once))):
        run()
    torch.cuda.synchronize()


def time_eager(call: Callable[..., object], sets: Sequence[tuple], reps: int = 20,
               calls: int = 50) -> float:
    """Median µs per eager call over runs of back-to-back calls (no graph): the larger of the
    kernel time and the host time of one call (argument checks, allocation, launch)."""
    for inputs in sets:
        call(*inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(calls):
            call(*sets[i % len(sets)])
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def time_queued(call: Callable[..., object], sets: Sequence[tuple], reps: int = 15,
                calls: int = 50) -> float:
    """Median µs per eager call of ``calls`` calls queued behind a GPU sleep that outlasts
    their host time: the GPU then runs what the eager path launches back to back, so the
    events time its kernels (and their launch gaps on the GPU), not the host's work. A graph
    (``time_kernel``) may launch other kernels than an eager call does."""
    loop = [sets[i % len(sets)] for i in range(calls)]
    for inputs in loop:
        call(*inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for inputs in loop:
        call(*inputs)
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    cycles = int(3 * host_s * 2e9) + 100_000  # three times the host's time at 2 GHz
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        a.record()
        for inputs in loop:
            call(*inputs)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def report(name: str, impls: dict, sets: Sequence[tuple], work: float,
           unit: str = "TF/s") -> None:
    """Print one case: each implementation's ``time_kernel`` (None: not installed; one that
    raises: its error), ``work / µs / 1e6`` in ``unit`` and its time over the first one's."""
    cells, base = [], None
    for label, fn in impls.items():
        if fn is None:
            cells.append(f"{label:34s} n/a")
            continue
        try:
            us = time_kernel(fn, sets)
        except Exception as e:  # noqa: BLE001 (a peer that cannot run this case)
            cells.append(f"{label:34s} failed ({type(e).__name__}: {str(e)[:80]})")
            continue
        base = base or us
        cells.append(f"{label:34s} {us:9.1f} us {work / us / 1e6:7.2f} {unit} x{us / base:5.2f}")
    print(f"{name}\n    " + "\n    ".join(cells), flush=True)


def alternating(items: dict, rounds: int):
    """(round, key, value) of ``items`` for each of ``rounds`` rounds, every other round in
    reverse order (ABBA), so drift in clocks or temperature favours no one."""
    for turn in range(rounds):
        order = list(items.items())
        if turn % 2:
            order.reverse()
        for key, value in order:
            yield turn, key, value
