"""The JSON records the benchmarks write: one file per run, named for what ran, where and when."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path


def result_row(result, **derived) -> dict:
    """A result dataclass with a ``shape`` field as a JSON row, with ``derived`` values added
    (rates worked out from its times)."""
    row = asdict(result)
    row["shape"] = asdict(result.shape)
    row.update(derived)
    return row


def write_record(out: Path, tag: str, env: dict, rows: list[dict]) -> Path:
    """``out/<tag>-<sm>-<date>.json`` holding the environment and the rows."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = env["date"].replace(":", "").replace("-", "")[:15]
    path = out / f"{tag}-{env['sm']}-{stamp}.json"
    path.write_text(json.dumps({"environment": env, "results": rows}, indent=1) + "\n")
    return path
