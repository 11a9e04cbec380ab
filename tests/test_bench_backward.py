"""The benchmark's backward section on the CPU (timers and device are stand-ins): its cases,
its FLOP counting, rounds in turn with medians kept, failures recorded, the events fallback."""

from __future__ import annotations

import types

import pytest

from flashcore.tuning import backward_bench as bb
from flashcore.tuning.backward_bench import (
    BACKWARD_SHAPES,
    BackwardResult,
    backward_suite,
    backward_table,
    measure_backward,
)
from flashcore.tuning.bench import _parse_shape
from flashcore.tuning.shape import Shape


def test_the_cases_are_the_ones_asked_for():
    labels = [s.label for s in backward_suite(quick=False)]
    assert labels == ["4,16,4096,64", "4,16,4096,64 causal", "4,16,4096,128",
                      "4,16,4096,128 causal", "4,16,4096,96", "4,16,4096,96 causal",
                      "4,16,4096,256", "4,16,4096,256 causal", "2,16,8192,128", "4,32/8,4096,128 causal",
                      "4,32,4096,128 causal",  # the GQA call and its K/V expanded
                      "1,32,32768,128 causal"]
    quick = backward_suite(quick=True)
    assert quick and set(quick) < set(BACKWARD_SHAPES)
    assert any(s.hkv != s.heads for s in quick) and any(s.causal for s in quick)
    assert all(s.dtype == "float16" and s.sq == s.seq for s in BACKWARD_SHAPES)
    assert _parse_shape("4,32/8,4096,128,causal") == BACKWARD_SHAPES[-3]
    gqa, expanded = BACKWARD_SHAPES[-3:-1]
    assert (gqa.hkv, expanded.hkv) == (8, 32) and gqa.heads == expanded.heads == 32


def test_flops_are_counted_as_the_peers_count_them():
    s = Shape(4, 16, 4096, 64)
    fwd = 4.0 * 4 * 16 * 4096 * 4096 * 64
    r = BackwardResult(s, "x", step_us=1e6, backward_us=1e6)
    assert r.backward_tflops == pytest.approx(2.5 * fwd / 1e12)
    assert r.step_tflops == pytest.approx(3.5 * fwd / 1e12)
    causal = BackwardResult(Shape(4, 16, 4096, 64, True), "x", step_us=1e6, backward_us=1e6)
    assert causal.backward_tflops == pytest.approx(r.backward_tflops / 2)
    # GQA counts the query heads: K/V heads change bytes, not FLOPs
    gqa = BackwardResult(Shape(4, 32, 4096, 128, True, kv_heads=8), "x", backward_us=1e6)
    assert gqa.backward_tflops == pytest.approx(2.5 * 4.0 * 4 * 32 * 4096**2 * 128 / 2 / 1e12)
    assert BackwardResult(s, "x").step_tflops is None


@pytest.fixture
def fake_device(monkeypatch):
    """Each step and backward timing returns the next scripted figure; logs who ran."""
    log: list[str] = []
    figures = iter([10.0, 5.0, 30.0, 15.0, 20.0, 8.0, 40.0, 21.0, 12.0, 6.0, 35.0, 16.0] * 5)

    def timer(kind):
        def run(fn, sets, causal, extra):
            fn(*sets[0][:3], causal)
            log.append(kind)
            return next(figures)

        return run

    monkeypatch.setattr(bb, "time_step", timer("step"))
    monkeypatch.setattr(bb, "time_backward", timer("backward"))
    monkeypatch.setattr(bb, "step_peak_bytes", lambda fn, inputs, causal: 3 * 2**20)
    monkeypatch.setattr(bb, "_inputs", lambda shape: (shape, None, None, None))
    monkeypatch.setattr(bb.torch.cuda, "get_device_properties",
                        lambda _: types.SimpleNamespace(L2_cache_size=50 * 2**20))
    monkeypatch.setattr(bb.torch.cuda, "empty_cache", lambda: None)
    return log


def _impl(name, log):
    def run(q, k, v, causal):
        log.append(name)

    return run


def test_rounds_alternate_and_keep_the_medians(fake_device):
    log = fake_device
    impls = {"a": _impl("a", log), "b": _impl("b", log)}
    res = measure_backward([Shape(4, 16, 4096, 64)], impls, rounds=3)
    ran = [x for x in log if x in ("a", "b")]
    assert ran == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]  # ABBA
    by = {r.impl: r for r in res}
    assert by["a"].extra["rounds_step_us"] == [10.0, 40.0, 12.0] and by["a"].step_us == 12.0
    assert by["a"].extra["rounds_backward_us"] == [5.0, 21.0, 6.0] and by["a"].backward_us == 6.0
    assert by["b"].step_us == 30.0 and by["b"].backward_us == 15.0
    assert all(r.peak_bytes == 3 * 2**20 for r in res)
    text = backward_table(res, ours="a")
    assert "forward + backward" in text and "backward alone" in text and "3MiB" in text
    assert "x2.50" in text  # b's step over a's: 30 / 12


def test_a_failing_peer_is_recorded_and_not_retried(fake_device):
    calls = []

    def broken(q, k, v, causal):
        calls.append(1)
        raise RuntimeError("no backward for this shape\nmore text")

    res = measure_backward([Shape(4, 16, 4096, 64)], {"p": broken}, rounds=3)
    assert len(calls) == 1
    assert res[0].step_us is None and res[0].error == "RuntimeError: no backward for this shape"
    assert "n/a" in backward_table(res, ours="p")


def test_an_implementation_a_graph_cannot_capture_is_timed_with_events(monkeypatch):
    def no_graph(call, sets, stream=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(bb, "time_kernel", no_graph)
    monkeypatch.setattr(bb, "time_eager", lambda call, sets: 42.0)
    monkeypatch.setattr(bb.torch.cuda, "synchronize", lambda: None)
    extra: dict = {}
    assert bb._timed(lambda: None, [()], None, extra) == 42.0
    assert extra["timer"] == "events" and "capturing" in extra["graph_error"]


def test_a_variant_refuses_head_dims_it_names_no_kernel_for(monkeypatch):
    """``--bwd-variants "64:..."`` at d128 would time the default under the variant's name."""
    import torch

    ran = []
    monkeypatch.setattr(bb, "_flashcore", lambda: lambda q, k, v, causal: ran.append(q.shape))
    d64 = bb.variant_implementation("64:64x128w8s2-hopper")
    q64, q128 = torch.empty(1, 1, 8, 64), torch.empty(1, 1, 8, 128)
    d64(q64, q64, q64, False)
    with pytest.raises(ValueError, match="names no kernel for head_dim 128"):
        d64(q128, q128, q128, False)
    every = bb.variant_implementation("64x128w8s2-hopper")  # every head dim
    every(q128, q128, q128, False)
    assert ran == [q64.shape, q128.shape]
