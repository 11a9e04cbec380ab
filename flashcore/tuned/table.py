"""The autotuner's tables: the ``TileConfig`` to use per (arch, head dim, masking, length bucket,
precision), read by ``flashcore.ops.attention(..., tile=None)``.

Tables live in ``flashcore/tuned/<arch>.json`` (or ``$FLASHCORE_TUNED``). An arch without a table
of its own borrows one (``BORROWED_TABLES``): there is no Ada GPU to tune on, and every Hopper
candidate is required to fit an L4. Imports no torch and no DSL.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

from ..spec import AttentionSpec, SpecError, TileConfig

TUNED_DIR = Path(__file__).resolve().parent
TABLE_ENV = "FLASHCORE_TUNED"
DEFAULT = TileConfig((64, 64), warps=4)
# Decode (a few query tokens against many keys): one warp per 16 rows, K/V streamed through two
# stages; the keys are split over CTAs (flashcore.ops.plan)
DECODE_DEFAULT = TileConfig((16, 64), warps=1, stages=2)
# An FP8 KV cache (any query length): its e4m3 K/V are converted in shared memory by the CTA's
# own warps, so it wants small, many CTAs; 16x32 fits an L4 with the converted tiles
# (H100 sweep, 2026-11-23: 74 µs against 84-95 for 16x64 at 16,32/8,4096)
FP8KV_DEFAULT = TileConfig((16, 32), warps=1, stages=1)
# (name, upper bound of seq_q, the shape timed for it: batch, query heads, key/value heads,
# query tokens, keys)
BUCKETS = [
    ("decode", 16, (1, 32, 8, 1, 8192)),
    ("short", 1024, (1, 8, 8, 512, 512)),
    ("mid", 2048, (4, 16, 16, 2048, 2048)),
    ("long", None, (4, 16, 16, 4096, 4096)),
]
BORROWED_TABLES = {"sm_89": "sm_90"}


def bucket_of(seqlen: int) -> str:
    for name, bound, _ in BUCKETS:
        if bound is None or seqlen <= bound:
            return name
    raise AssertionError("the last bucket has no bound")


def key(head_dim: int, causal: bool, bucket: str, precision: str = "fp16") -> str:
    """Table key; ``precision`` is fp16, fp8 (e4m3 operands) or fp8kv (an e4m3 KV cache)."""
    return f"d{head_dim}-{'causal' if causal else 'full'}-{bucket}-{precision}"


def entry_config(entry: dict) -> TileConfig:
    """The config of one table entry (``{"config": {...}}``, or the flat form of older tables)."""
    if "config" in entry:
        return TileConfig.from_dict(entry["config"])
    return TileConfig(tuple(entry["tile"]), warps=entry["warps"],
                      stages=entry.get("stages", 1), kv_splits=entry.get("kv_splits", 1))


@cache
def table(arch: str) -> dict[str, TileConfig]:
    """arch's winners by key; {} where it has no (readable) table."""
    path = Path(os.environ.get(TABLE_ENV, TUNED_DIR)) / f"{arch}.json"
    try:
        winners = json.loads(path.read_text())["winners"]
        return {k: entry_config(w) for k, w in winners.items()}
    except (OSError, ValueError, KeyError, TypeError, SpecError):
        return {}


def table_arch(arch: str) -> str:
    """The arch whose table ``tile=None`` reads on ``arch``: its own if it has one."""
    if table(arch) or arch not in BORROWED_TABLES:
        return arch
    return BORROWED_TABLES[arch]


@cache
def lookup(arch: str, head_dim: int, causal: bool, bucket: str,
           precision: str = "fp16") -> TileConfig:
    """The tuned config for ``tile=None`` (from a borrowed table where ``arch`` has none), else
    ``DEFAULT`` (``DECODE_DEFAULT`` for decode)."""
    fallback = (FP8KV_DEFAULT if precision == "fp8kv" else
                DECODE_DEFAULT if bucket == "decode" else DEFAULT)
    return table(table_arch(arch)).get(key(head_dim, causal, bucket, precision), fallback)


def winner_specs(arch: str, build_arch: str | None = None,
                 precisions=("fp16", "fp8")) -> dict[str, AttentionSpec]:
    """The tuned winners of ``arch``'s table as specs for ``build_arch`` (default ``arch``), by
    table key: what ``tile=None`` runs, or its twin on another arch."""
    out = {}
    for name, config in sorted(table(arch).items()):
        d, mask, _, prec = name.split("-")
        if prec in precisions:
            out[name] = AttentionSpec(arch=build_arch or arch, head_dim=int(d[1:]), config=config,
                                      causal=mask == "causal", precision=prec)
    return out


def clear() -> None:
    """Forget the tables read (after writing one, or changing $FLASHCORE_TUNED)."""
    table.cache_clear()
    lookup.cache_clear()
