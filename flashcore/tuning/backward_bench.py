"""The benchmark's backward section (``python -m flashcore.bench --backward``): one training step
(forward + backward) and the backward alone, flashcore against its peers in one run, with the
peak memory of a step.

Times are medians over CUDA-graph replays (``timing.time_kernel``; the backward alone replays
``autograd.grad`` of a forward made once per input set, captured on that forward's stream),
or over CUDA events per call where an implementation cannot be captured
(``extra["timer"] == "events"``). TFLOP/s are counted as the forward's peers count them: the
forward's 4·B·H·S_q·S_k·D (halved when causal), the backward 2.5x that, a step 3.5x. Peak
memory: ``torch.cuda.max_memory_allocated`` over one step, less what was allocated before it
(the inputs and the output gradient).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .peers import Impl, _fa4, _flashcore, _flex, _sdpa
from .records import result_row, write_record
from .shape import Shape
from .timing import alternating, n_sets, time_eager, time_kernel

BACKWARD_FLOPS = 2.5  # the backward's FLOPs over the forward's: five products against two
STEP_FLOPS = 1.0 + BACKWARD_FLOPS

# GQA 32/8 beside the same call with K/V expanded to 32 heads (its baseline: GQA's backward
# must not be slower than attention over the pre-expanded K/V)
_GQA = [Shape(4, 32, 4096, 128, True, kv_heads=8), Shape(4, 32, 4096, 128, True)]
BACKWARD_SHAPES = [Shape(4, 16, 4096, d, causal) for d in (64, 128) for causal in (False, True)]
BACKWARD_SHAPES += [Shape(4, 16, 4096, d, causal) for d in (96, 256) for causal in (False, True)]
BACKWARD_SHAPES += [Shape(2, 16, 8192, 128), *_GQA]
BACKWARD_SHAPES += [Shape(1, 32, 32768, 128, True)]  # a long sequence: the step's peak memory
QUICK = [Shape(4, 16, 4096, 128), Shape(4, 16, 4096, 128, True), *_GQA]


def backward_suite(quick: bool) -> list[Shape]:
    return list(QUICK if quick else BACKWARD_SHAPES)


@dataclass
class BackwardResult:
    shape: Shape
    impl: str
    step_us: float | None = None  # forward + backward
    backward_us: float | None = None
    peak_bytes: int | None = None  # over what was allocated before the step
    error: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def step_tflops(self) -> float | None:
        if self.step_us is None:
            return None
        return STEP_FLOPS * self.shape.flops() / self.step_us / 1e6

    @property
    def backward_tflops(self) -> float | None:
        if self.backward_us is None:
            return None
        return BACKWARD_FLOPS * self.shape.flops() / self.backward_us / 1e6


def backward_implementations() -> dict[str, Impl]:
    """Differentiable (q, k, v, causal) -> out: ours (and ours with ``deterministic=True``: the
    cost of dQ's ordered adds), SDPA forced to each backend, FlashAttention-4 where
    ``flash_attn.cute`` imports, FlexAttention compiled."""
    import torch._functorch.config as functorch_config
    from torch.nn.attention import SDPBackend

    # the backward alone is timed by replaying autograd.grad of one forward (retain_graph),
    # which a compiled backward refuses while it donates its saved buffers (FlexAttention's)
    functorch_config.donated_buffer = False
    impls: dict[str, Impl | None] = {
        "flashcore": _flashcore(),
        "flashcore-det": _flashcore(deterministic=True),
        "sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "fa4": _fa4(),
        "flex": _flex(),
    }
    return {name: fn for name, fn in impls.items() if fn is not None}


def variant_implementation(text: str) -> Impl:
    """Ours with the backward's main kernel chosen by ``text`` (``spec.backward.
    parse_backward_choices``, e.g. ``128:64x128w8s2a242``): an A/B of its variants in one
    run. At a head dim that ``text`` names no kernel for it refuses (a ``ValueError``, the
    table's "n/a"), rather than time the default under the variant's name."""
    from ..ops.backward import backward_choices_override
    from ..specs.backward import parse_backward_choices

    ours = _flashcore()
    dims = parse_backward_choices(text)

    def run(q, k, v, causal):
        if None not in dims and q.shape[-1] not in dims:
            raise ValueError(f"backward variant {text!r} names no kernel for head_dim "
                             f"{q.shape[-1]}")
        return ours(q, k, v, causal)

    run.context = lambda: backward_choices_override(text)  # type: ignore[attr-defined]
    return run


def _inputs(shape: Shape) -> tuple[torch.Tensor, ...]:
    """q, k, v requiring grad, and an output gradient."""
    q, k, v = (t.requires_grad_() for t in shape.inputs())
    return q, k, v, torch.randn_like(q)


def _step(fn: Impl, causal: bool) -> Callable:
    def call(q, k, v, dout):
        return torch.autograd.grad(fn(q, k, v, causal), (q, k, v), dout)

    return call


def _backward(out, q, k, v, dout):
    return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def _timed(call: Callable, sets: list, stream: torch.cuda.Stream | None, extra: dict) -> float:
    """Graph time of ``call`` over ``sets``, else (a capture that fails) events."""
    try:
        return time_kernel(call, sets, stream=stream)
    except Exception as e:  # noqa: BLE001 (an implementation a graph cannot capture)
        torch.cuda.synchronize()
        extra["timer"] = "events"
        extra["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        return time_eager(call, sets)


def time_step(fn: Impl, sets: list, causal: bool, extra: dict) -> float:
    return _timed(_step(fn, causal), sets, None, extra)


def time_backward(fn: Impl, sets: list, causal: bool, extra: dict) -> float:
    """The backward alone: each set's forward runs once on a side stream, whose autograd graph
    the timed calls walk again (``retain_graph``)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ready = [(fn(q, k, v, causal), q, k, v, dout) for q, k, v, dout in sets]
        us = _timed(_backward, ready, s, extra)
    torch.cuda.current_stream().wait_stream(s)
    return us


def step_peak_bytes(fn: Impl, inputs: tuple, causal: bool) -> int:
    """Peak bytes one step allocates on top of what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = _step(fn, causal)(*inputs)
    torch.cuda.synchronize()
    del grads
    return torch.cuda.max_memory_allocated() - before


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def measure_backward(shapes: list[Shape], impls: dict[str, Impl],
                     rounds: int = 1) -> list[BackwardResult]:
    """Each shape's implementations in turn, ``rounds`` times over (every other round
    reversed, ABBA; medians kept, each round's figures in ``extra``); an implementation that
    fails is recorded and not tried again at that shape."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results = []
    for shape in shapes:
        sets = [_inputs(shape) for _ in range(n_sets(int(shape.min_bytes()), l2))]
        mine = {name: BackwardResult(shape, name) for name in impls}
        steps: dict[str, list[float]] = {name: [] for name in mine}
        backs: dict[str, list[float]] = {name: [] for name in mine}
        for turn, name, r in alternating(mine, rounds):
            if r.error:
                continue
            fn = impls[name]
            try:
                with getattr(fn, "context", contextlib.nullcontext)():
                    if turn == 0:
                        r.peak_bytes = step_peak_bytes(fn, sets[0], shape.causal)
                    steps[name].append(time_step(fn, sets, shape.causal, r.extra))
                    backs[name].append(time_backward(fn, sets, shape.causal, r.extra))
            except Exception as e:  # noqa: BLE001 (a peer without this shape: record it)
                r.error = _error(e)
        for name, r in mine.items():
            if steps[name] and backs[name] and not r.error:
                r.step_us = statistics.median(steps[name])
                r.backward_us = statistics.median(backs[name])
                if rounds > 1:
                    r.extra["rounds_step_us"] = steps[name]
                    r.extra["rounds_backward_us"] = backs[name]
            results.append(r)
        print(f"{shape}: " + ", ".join(  # progress: a long run killed early still reports
            f"{name} {r.backward_us:.0f}" if r.backward_us else f"{name} -"
            for name, r in mine.items()), file=sys.stderr, flush=True)
        del sets
        torch.cuda.empty_cache()
    return results


# -- reporting ---------------------------------------------------------------------------------
def _cell(r: BackwardResult | None, what: str, base: BackwardResult | None) -> str:
    if r is None:
        return "-"
    if r.error:
        return "n/a"
    if what == "peak":
        return "-" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.0f}MiB"
    us = r.step_us if what == "step" else r.backward_us
    tf = r.step_tflops if what == "step" else r.backward_tflops
    cell = f"{us:.0f}us {tf:.0f}TF"
    theirs = None if base is None else (base.step_us if what == "step" else base.backward_us)
    if r is not base and theirs:
        cell += f" x{us / theirs:.2f}"
    return cell


def backward_table(results: list[BackwardResult], ours: str = "flashcore") -> str:
    impls = list(dict.fromkeys(r.impl for r in results))
    shapes = list(dict.fromkeys(r.shape for r in results))
    by = {(r.shape, r.impl): r for r in results}
    lines = []
    for what, title in (("step", "forward + backward"), ("backward", "backward alone"),
                        ("peak", "peak memory of one step")):
        head = f"{title:28s}" + "".join(f"{i:>22s}" for i in impls)
        lines += [head, "-" * len(head)]
        for s in shapes:
            base = by.get((s, ours))
            base = base if base is not None and not base.error else None
            lines.append(f"{s.label:28s}" + "".join(
                f"{_cell(by.get((s, i)), what, base):>22s}" for i in impls))
        lines.append("")
    lines.append(f"TF: TFLOP/s (backward 2.5x the forward's FLOPs, a step 3.5x; causal halves); "
                 f"xN = peer time / {ours} time (>1: {ours} faster); MiB over the inputs")
    return "\n".join(lines)


def record_backward(results: list[BackwardResult], out: Path, env: dict) -> Path:
    """A JSON record beside the forward's (``env``: ``bench.environment()``)."""
    return write_record(out, "backward", env, [
        result_row(r, step_tflops=r.step_tflops, backward_tflops=r.backward_tflops)
        for r in results])
