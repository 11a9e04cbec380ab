"""The benchmark's measuring loop on the CPU (the timer and the device are stand-ins): which
implementation runs at which shape, rounds in turn, medians kept, errors recorded."""

from __future__ import annotations

import types

import pytest

from flashcore.tuning import bench
from flashcore.tuning.bench import DECODE, GQA_PREFILL, MISSION, Shape, measure


@pytest.fixture
def fake_device(monkeypatch):
    """time_kernel returns the next scripted figure and logs which implementation ran."""
    log: list[str] = []
    figures = iter([10.0, 50.0, 30.0, 20.0, 40.0, 60.0, 11.0, 70.0, 12.0] * 10)

    def time_kernel(call, sets):
        call(*sets[0])
        return next(figures)

    monkeypatch.setattr(bench, "time_kernel", time_kernel)
    monkeypatch.setattr(bench, "time_eager", lambda call, sets: 99.0)
    monkeypatch.setattr(bench.torch.cuda, "get_device_properties",
                        lambda _: types.SimpleNamespace(L2_cache_size=50 * 2**20))
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(Shape, "inputs", lambda self: (self, None, None))
    return log


def _impl(name, log):
    def run(q, k, v, causal):
        log.append(name)

    return run


def test_rounds_alternate_and_keep_the_median(fake_device):
    log = fake_device
    impls = {"a": _impl("a", log), "b": _impl("b", log)}
    res = measure([Shape(4, 16, 4096, 64)], impls, eager=False, rounds=3)
    # in turn (not each three times running), every other round reversed (ABBA: a drift
    # favours no one)
    assert log == ["a", "b", "b", "a", "a", "b"]
    by = {r.impl: r for r in res}
    assert by["a"].extra["rounds_us"] == [10.0, 20.0, 40.0] and by["a"].kernel_us == 20.0
    assert by["b"].extra["rounds_us"] == [50.0, 30.0, 60.0] and by["b"].kernel_us == 50.0


def test_one_round_is_one_timing_and_eager_only_at_the_mission_shape(fake_device):
    impls = {"a": _impl("a", fake_device)}
    res = measure([MISSION, Shape(4, 16, 4096, 64)], impls, eager=True)
    assert [r.eager_us for r in res] == [99.0, None]
    assert all("rounds_us" not in r.extra and r.kernel_us is not None for r in res)


def test_each_variant_runs_where_it_applies(fake_device):
    names = ["flashcore", "flashcore-fp8kv", "read-floor", "read-floor-fp8kv",
             "flashcore-kv-expanded"]
    impls = {n: _impl(n, fake_device) for n in names}
    shapes = [MISSION, DECODE[1], GQA_PREFILL[0]]
    ran = {(r.shape, r.impl) for r in measure(shapes, impls, eager=False)}
    assert ran == {(MISSION, "flashcore"),
                   *((DECODE[1], n) for n in names[:4]),
                   (GQA_PREFILL[0], "flashcore"), (GQA_PREFILL[0], "flashcore-kv-expanded")}


def test_a_failing_peer_is_recorded_and_not_retried(fake_device):
    calls = []

    def broken(q, k, v, causal):
        calls.append(1)
        raise RuntimeError("no kernel for this shape\nmore text")

    res = measure([Shape(4, 16, 4096, 64)], {"p": broken}, eager=False, rounds=3)
    assert len(calls) == 1
    assert res[0].kernel_us is None and res[0].error == "RuntimeError: no kernel for this shape"
