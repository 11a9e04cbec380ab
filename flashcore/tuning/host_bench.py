"""Host time of eager calls, as generation makes them (``python -m flashcore.bench --host``).

Each case runs the same loop for flashcore and for torch SDPA (default backend, ``enable_gqa``
where K/V have fewer heads): back-to-back calls whose key length grows by one each call (views of
a preallocated cache, made before the loop), one synchronisation at the end. The kernels take a
few microseconds, less than the host's work, so the loop measures the host: the median µs per
call over several runs of it. Each case also gets both calls' GPU time, eager calls queued
behind a sleep (``timing.time_queued``: what the loop launches, run back to back): where it is
longer than the host's work the loop measures the GPU, not the host.
The output-layout case writes (batch, seq, heads, head_dim), as a
transformers attention hook returns it (flashcore with ``out=``; SDPA then transposes and copies).
The hook case calls the attention functions themselves, flashcore's transformers backend
(``integrations.transformers.attention_forward``) against transformers' SDPA one, as a decoder
layer does each step (it is left out where transformers is not installed).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..ops import attention
from .timing import time_queued

CALLS = 400  # a run of back-to-back calls (the keys grow by one each call)
RUNS = 15


@dataclass(frozen=True)
class HostCase:
    name: str
    batch: int
    heads: int
    heads_kv: int
    seqlen_q: int
    keys: int  # the key length of the first call
    head_dim: int
    causal: bool = False
    bshd_out: bool = False  # write (batch, seq, heads, head_dim), as transformers wants it
    grows: bool = True  # the keys grow by one each call
    hook: bool = False  # through transformers' attention functions (query (B, H, 1, D) in)


CASES = (
    HostCase("mission shape 1,8,512,64 (keys fixed)", 1, 8, 8, 512, 512, 64, grows=False),
    HostCase("decode 1,32/8,1xS,128, S from 4096", 1, 32, 8, 1, 4096, 128),
    HostCase("decode 1,32/8,1xS,64, S from 512", 1, 32, 8, 1, 512, 64),
    HostCase("decode 8,28/4,1xS,128, S from 1024", 8, 28, 4, 1, 1024, 128),
    HostCase("decode 1,32/8,1xS,128 into (B, S, H, D)", 1, 32, 8, 1, 4096, 128, bshd_out=True),
    # a transformers layer's prefill: the prompt against itself, written as the hook returns it
    HostCase("prefill 1,16/4,512,128 causal into (B, S, H, D)", 1, 16, 4, 512, 512, 128,
             causal=True, bshd_out=True, grows=False),
    # a decoder layer's decode step through the registered backends (examples/generate_*)
    HostCase("transformers hook 1,16/4,1xS,128, S from 600", 1, 16, 4, 1, 600, 128,
             causal=True, hook=True),
)


def runnable(case: HostCase) -> bool:
    """Whether this host can run ``case`` (the hook case needs transformers)."""
    if not case.hook:
        return True
    try:
        import transformers.integrations.sdpa_attention  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class HostResult:
    case: HostCase
    flashcore_us: float
    sdpa_us: float
    flashcore_kernel_us: float
    sdpa_kernel_us: float

    @property
    def ratio(self) -> float:
        """SDPA's host time over flashcore's (> 1: flashcore cheaper)."""
        return self.sdpa_us / self.flashcore_us


def _calls(case: HostCase, dtype=torch.float16) -> tuple[list, Callable, Callable]:
    """The loop's inputs (q, and K/V views growing by one key) and the two calls."""
    dev = "cuda"
    grow = CALLS if case.grows else 0
    q = torch.randn(case.batch, case.heads, case.seqlen_q, case.head_dim, device=dev, dtype=dtype)
    cache = [torch.randn(case.batch, case.heads_kv, case.keys + grow, case.head_dim, device=dev,
                         dtype=dtype) for _ in range(2)]
    views = [(cache[0][:, :, :case.keys + i], cache[1][:, :, :case.keys + i])
             for i in range(max(grow, 1))]
    gqa = case.heads != case.heads_kv
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if case.hook:
        return views, *_hooks(case, q)
    if case.bshd_out:
        out = torch.empty(case.batch, case.seqlen_q, case.heads, case.head_dim, device=dev,
                          dtype=dtype).transpose(1, 2)

        def ours(k, v):
            return attention(q, k, v, causal=case.causal, out=out)

        def theirs(k, v):
            return sdpa(q, k, v, is_causal=case.causal, enable_gqa=gqa).transpose(1, 2) \
                .contiguous()
    else:
        def ours(k, v):
            return attention(q, k, v, causal=case.causal)

        def theirs(k, v):
            return sdpa(q, k, v, is_causal=case.causal, enable_gqa=gqa)
    return views, ours, theirs


def _hooks(case: HostCase, q) -> tuple[Callable, Callable]:
    """flashcore's and SDPA's transformers attention functions, called as a decoder layer
    calls them (both return (batch, seq, heads, head_dim))."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ..integrations.transformers import attention_forward

    layer = torch.nn.Module().eval()  # what the functions read of the attention module
    layer.is_causal = case.causal
    layer.num_key_value_groups = case.heads // case.heads_kv
    scaling = case.head_dim ** -0.5

    def ours(k, v):
        return attention_forward(layer, q, k, v, None, scaling=scaling, dropout=0.0)[0]

    def theirs(k, v):
        return sdpa_attention_forward(layer, q, k, v, None, scaling=scaling, dropout=0.0)[0]
    return ours, theirs


def per_call_us(fn: Callable, views: list, runs: int = RUNS) -> float:
    """Median µs per call of ``len(views)``-call loops (at least ``CALLS`` calls a run)."""
    loop = views * max(1, CALLS // len(views))
    for k, v in loop[:50]:  # warm-up: kernels loaded, plans made
        fn(k, v)
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for k, v in loop:
            fn(k, v)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / len(loop) * 1e6)
    return statistics.median(times)


def measure_host(cases=CASES, report: Callable[[HostResult], None] | None = None
                 ) -> list[HostResult]:
    """Each case's result; ``report`` gets each as it is measured (a run cut short still
    shows the cases it finished)."""
    results = []
    for case in filter(runnable, cases):
        views, ours, theirs = _calls(case)
        # in turn, twice (ABBA): the host's clock and caches drift over a run
        a1, b1 = per_call_us(ours, views), per_call_us(theirs, views)
        b2, a2 = per_call_us(theirs, views), per_call_us(ours, views)
        results.append(HostResult(case, (a1 + a2) / 2, (b1 + b2) / 2,
                                  time_queued(ours, views), time_queued(theirs, views)))
        if report is not None:
            report(results[-1])
    return results


HOST_HEADER = (f"{'eager µs a call (kernel µs)':46s} {'flashcore':>16s} {'SDPA':>16s} "
               f"{'SDPA/ours':>10s}")


def host_row(r: HostResult) -> str:
    return (f"{r.case.name:46s} {r.flashcore_us:7.2f} ({r.flashcore_kernel_us:6.1f}) "
            f"{r.sdpa_us:7.2f} ({r.sdpa_kernel_us:6.1f}) {r.ratio:10.2f}")


def host_table(results: list[HostResult]) -> str:
    return "\n".join([HOST_HEADER, *map(host_row, results)])


def record_host(results: list[HostResult], out: Path, environment: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    path = out / f"host-{stamp}.json"
    path.write_text(json.dumps({"environment": environment, "results": [
        {**asdict(r.case), "flashcore_us": r.flashcore_us, "sdpa_us": r.sdpa_us,
         "flashcore_kernel_us": r.flashcore_kernel_us, "sdpa_kernel_us": r.sdpa_kernel_us}
        for r in results]}, indent=1))
    return path
