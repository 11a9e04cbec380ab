"""The host-time benchmark's table and record (``python -m flashcore.bench --host``), on CPU."""

from __future__ import annotations

import json

from flashcore.tuning import host_bench
from flashcore.tuning.host_bench import CASES, HostResult, host_table, record_host


def test_host_table_and_record_carry_every_case(tmp_path):
    results = [HostResult(c, 20.0 + i, 25.0, 4.0, 5.0) for i, c in enumerate(CASES)]
    lines = host_table(results).splitlines()
    assert len(lines) == len(CASES) + 1
    assert lines[1].startswith(CASES[0].name) and lines[1].endswith("1.25")  # SDPA / ours
    data = json.loads(record_host(results, tmp_path, {"gpu": "none"}).read_text())
    assert [r["name"] for r in data["results"]] == [c.name for c in CASES]
    assert data["results"][1]["flashcore_us"] == 21.0 and data["environment"] == {"gpu": "none"}
    assert all(c.grows for c in CASES if c.name.startswith("decode")) and not CASES[0].grows


def test_each_case_is_reported_as_it_is_measured(monkeypatch):
    """``--host`` prints a case's row once it is measured (a run cut short keeps them)."""
    seen, done = [], []
    monkeypatch.setattr(host_bench, "_calls", lambda case: ([case], None, None))
    monkeypatch.setattr(host_bench, "per_call_us",
                        lambda fn, views: (seen.append(views[0].name), 30.0)[1])
    monkeypatch.setattr(host_bench, "time_queued", lambda fn, views: 5.0)
    results = host_bench.measure_host(CASES[:2], report=lambda r: done.append((r.case.name,
                                                                               len(seen))))
    # each case is reported after its four loops and before the next case's first
    assert done == [(CASES[0].name, 4), (CASES[1].name, 8)]
    assert [r.case for r in results] == list(CASES[:2])


def test_hook_case_calls_both_backends_as_a_layer_does():
    """The transformers case times flashcore's registered attention function and transformers'
    SDPA one on the same views (flashcore's launch stubbed on CPU); both return (B, S, H, D).
    Without transformers the case is left out of the run."""
    import pytest
    import torch

    (case,) = [c for c in CASES if c.hook]
    if not host_bench.runnable(case):
        with pytest.raises(ImportError):
            import transformers.integrations.sdpa_attention  # noqa: F401
        return
    from tests.device_stub import stubbed_device

    launched: list = []
    real_randn = torch.randn
    with stubbed_device(launched), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "randn", lambda *a, device=None, **k: real_randn(*a, **k))
        views, ours, theirs = host_bench._calls(case)
        k, v = views[3]
        assert k.shape == (1, case.heads_kv, case.keys + 3, case.head_dim)
        mine = ours(k, v)
        assert len(launched) >= 1  # flashcore's kernels, not a torch fallback
        ref = theirs(k, v)
    want = (case.batch, case.seqlen_q, case.heads, case.head_dim)
    assert mine.shape == want and ref.shape == want
