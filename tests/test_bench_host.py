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
    monkeypatch.setattr(host_bench, "time_kernel", lambda fn, views: 5.0)
    results = host_bench.measure_host(CASES[:2], report=lambda r: done.append((r.case.name,
                                                                               len(seen))))
    # each case is reported after its four loops and before the next case's first
    assert done == [(CASES[0].name, 4), (CASES[1].name, 8)]
    assert [r.case for r in results] == list(CASES[:2])
