"""The autotuner's tables: the ``TileConfig`` to use per (arch, head dim, masking, length bucket,
precision), read by ``flashcore.ops.attention(..., tile=None)``.

Tables live in ``flashcore/tuned/<arch>.json`` (or ``$FLASHCORE_TUNED``). An arch without a table
of its own borrows one (``BORROWED_TABLES``): there is no Ada GPU to tune on, and every Hopper
candidate of the default kernel family is required to fit an L4. Imports no torch and no DSL.

An entry's winner may be of another kernel family than the arch's default (the Hopper family,
``wgmma_ws``, on sm_90); such an entry also names the default family's best (``fallback``), which
runs the calls the winner's family does not build (masks, serving layouts, split keys, another
arch borrowing the table): ``lookup`` takes the call's spec features and checks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ..specs import AttentionSpec, SpecError, TileConfig, family

TUNED_DIR = Path(__file__).resolve().parent
TABLE_ENV = "FLASHCORE_TUNED"
DEFAULT = TileConfig((64, 64), warps=4)
# Decode (a few query tokens against many keys): one warp per 16 rows, K/V streamed through two
# stages; the keys are split over CTAs (flashcore.ops.plan)
DECODE_DEFAULT = TileConfig((16, 64), warps=1, stages=2)
# An FP8 KV cache (any query length): its e4m3 K/V are converted in registers, so each warp has
# more to do than in a 16-bit decode and the keys are shared by two warp groups per CTA as well
# as across CTAs (flashcore.ops.plan); 81 KB at d128, within an L4's 99 KB. Two stages of
# 64-key blocks beat one stage of 32 keys at every decode shape timed, each at its best share count
FP8KV_DEFAULT = TileConfig((16, 64), warps=1, stages=2, kv_splits=2)
# Head dims with no entries of their own run the entries of a tuned dim above them (d32 those
# of d64; d80 and d96 those of d128: the same tiles hold fewer columns, in fewer registers and
# less shared memory) where the config is a valid spec at their dim, else the defaults.
STAND_IN_DIMS = {32: 64, 80: 128, 96: 128}
# Past 128, keys 32 a step: at d256 one warp's 16 rows of output are 128 fp32 registers, and
# 64-key steps with masks and softcap reach 254 of 255; 32 keys leave ~30 spare. Two stages of
# (64, 32) tiles are 96 KB and decode's (16, 32) 72 KB, within an L4's 99 KB.
WIDE_DEFAULT = TileConfig((64, 32), warps=4, stages=2)
WIDE_DECODE_DEFAULT = TileConfig((16, 32), warps=1, stages=2)
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
    """Table key; ``precision`` is fp16, fp8 (e4m3 operands), fp8khead (e4m3 operands, K
    descaled per head) or fp8kv (an e4m3 KV cache)."""
    return f"d{head_dim}-{'causal' if causal else 'full'}-{bucket}-{precision}"


# a key's precision as spec fields
PRECISION_FIELDS = {"fp16": {"precision": "fp16"}, "fp8": {"precision": "fp8"},
                    "fp8khead": {"precision": "fp8", "k_scale": "head"},
                    "fp8kv": {"precision": "fp16", "kv_fp8": True}}
# a precision without an entry of its own in a bucket takes this one's (the same kernels serve
# K descaled per head: one scale fewer to apply)
BORROWED_PRECISIONS = {"fp8khead": "fp8"}


@dataclass(frozen=True)
class Tuned:
    """One table entry: the winner, and where it is of a non-default family the default family's
    best (None otherwise)."""

    config: TileConfig
    fallback: TileConfig | None = None


def entry_config(entry: dict) -> TileConfig:
    """The config of one table entry (``{"config": {...}}``, or the flat form of older tables)."""
    if "config" in entry:
        return TileConfig.from_dict(entry["config"])
    return TileConfig(tuple(entry["tile"]), warps=entry["warps"],
                      stages=entry.get("stages", 1), kv_splits=entry.get("kv_splits", 1))


def entry_tuned(entry: dict) -> Tuned:
    fallback = entry.get("fallback")
    return Tuned(entry_config(entry), None if fallback is None else entry_config(fallback))


@cache
def entries(arch: str) -> dict[str, Tuned]:
    """arch's table entries by key; {} where it has no (readable) table."""
    path = Path(os.environ.get(TABLE_ENV, TUNED_DIR)) / f"{arch}.json"
    try:
        winners = json.loads(path.read_text())["winners"]
        return {k: entry_tuned(w) for k, w in winners.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SpecError):
        return {}


def table(arch: str) -> dict[str, TileConfig]:
    """arch's winners by key; {} where it has no (readable) table."""
    return {k: t.config for k, t in entries(arch).items()}


def table_arch(arch: str) -> str:
    """The arch whose table ``tile=None`` reads on ``arch``: its own if it has one."""
    if entries(arch) or arch not in BORROWED_TABLES:
        return arch
    return BORROWED_TABLES[arch]


def lookup(arch: str, head_dim: int, causal: bool, bucket: str,
           precision: str = "fp16", features: tuple = ()) -> TileConfig:
    """The tuned config for ``tile=None`` (from a borrowed table where ``arch`` has none; for
    an untuned head dim, a tuned dim's that fits: ``STAND_IN_DIMS``), else ``default_config``
    (``DEFAULT``, ``DECODE_DEFAULT`` for decode, ``FP8KV_DEFAULT`` for an FP8 KV cache; the
    ``WIDE_`` ones past head_dim 128).

    ``features``: the call's other spec fields as (name, value) pairs (masks, serving layouts,
    ``split_kv``): where the winner's family does not build them on ``arch`` (its spec is
    refused), the entry's fallback runs. Every eager call comes here: both steps are memoised,
    and an entry without a fallback never looks at the features."""
    tuned = _entry(arch, head_dim, causal, bucket, precision)
    if tuned.fallback is None or _builds(arch, head_dim, causal, precision, tuned.config,
                                         features):
        return tuned.config
    return tuned.fallback


@cache
def _entry(arch: str, head_dim: int, causal: bool, bucket: str, precision: str) -> Tuned:
    default = default_config(head_dim, bucket, precision)
    table = entries(table_arch(arch))
    tuned = _table_entry(table, head_dim, causal, bucket, precision)
    if tuned is not None:
        return tuned
    stand_in = STAND_IN_DIMS.get(head_dim)
    tuned = stand_in and _table_entry(table, stand_in, causal, bucket, precision)
    if not tuned:
        return Tuned(default)
    # the winner, or the default family's best; a Hopper (wgmma_ws) tile is timed at its own
    # head dim only: its registers and pipes at one dim say nothing of another's
    for config in (tuned.config, tuned.fallback):
        if (config is not None and config.family in ("", "mma_sync")
                and _builds(arch, head_dim, causal, precision, config, ())):
            return Tuned(config)
    return Tuned(default)


def default_config(head_dim: int, bucket: str, precision: str = "fp16") -> TileConfig:
    """The config of a call the table has no entry for."""
    if precision == "fp8kv":
        return FP8KV_DEFAULT
    if head_dim > 128:
        return WIDE_DECODE_DEFAULT if bucket == "decode" else WIDE_DEFAULT
    return DECODE_DEFAULT if bucket == "decode" else DEFAULT


def _table_entry(table: dict[str, Tuned], head_dim: int, causal: bool, bucket: str,
                 precision: str) -> Tuned | None:
    borrowed = BORROWED_PRECISIONS.get(precision)
    if borrowed and key(head_dim, causal, bucket, precision) not in table:
        precision = borrowed
    return table.get(key(head_dim, causal, bucket, precision))


@cache
def _builds(arch: str, head_dim: int, causal: bool, precision: str, config: TileConfig,
            features: tuple) -> bool:
    fields = {**dict(features), **PRECISION_FIELDS[precision]}
    try:
        AttentionSpec(arch=arch, head_dim=head_dim, causal=causal, config=config, **fields)
    except SpecError:
        return False
    return True


def winner_specs(arch: str, build_arch: str | None = None,
                 precisions=("fp16", "fp8")) -> dict[str, AttentionSpec]:
    """The tuned winners of ``arch``'s table, and their fallbacks (key ``<key>:fallback``), as
    specs for ``build_arch`` (default ``arch``), by table key: what ``tile=None`` runs, or its
    twin on another arch (a config whose family does not build there is left out)."""
    out = {}
    for name, tuned in sorted(entries(arch).items()):
        d, mask, _, prec = name.split("-")
        if prec not in precisions:
            continue
        target = build_arch or arch
        for suffix, config in (("", tuned.config), (":fallback", tuned.fallback)):
            if config is None or (config.family and target not in family(config.family).archs):
                continue
            out[name + suffix] = AttentionSpec(arch=target, head_dim=int(d[1:]), config=config,
                                               causal=mask == "causal", **PRECISION_FIELDS[prec])
    return out


# how many times the tables were forgotten: what memoises a config read from them keys on it
generation = 0


def clear() -> None:
    """Forget the tables read (after writing one, or changing $FLASHCORE_TUNED)."""
    global generation
    entries.cache_clear()
    _entry.cache_clear()
    _builds.cache_clear()
    generation += 1
