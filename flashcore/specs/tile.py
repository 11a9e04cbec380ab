"""``TileConfig``: the tuning knobs of one kernel, carried as one value.

The op, the autotuner's tables, the catalog, the CLI and the tests all pass a ``TileConfig``
whole; nothing unpacks it into positional tuples. Defaults live here and nowhere else. Which
values a kernel family accepts is the family's business (``flashcore.specs.families``); this class
checks only that each knob is a positive whole number.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..errors import SpecError

DEFAULT_TILE = (64, 64)
# Family names no longer built, and the family to name instead: refused with that advice rather
# than as unknown names, since saved specs, tables and scripts may still carry them.
RETIRED_FAMILIES: dict[str, str] = {"wgmma": "wgmma_ws"}


def default_warps(tile_m: int) -> int:
    """One warp per 16 query rows, at most 8: the warps an unspecified config gets."""
    return max(1, min(8, tile_m // 16))


def refuse_retired_family(name: str) -> None:
    """Raise ``SpecError`` if ``name`` is a retired family (``RETIRED_FAMILIES``)."""
    if name in RETIRED_FAMILIES:
        raise SpecError(f"kernel family {name!r} is no longer built; use "
                        f"family={RETIRED_FAMILIES[name]!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class TileConfig:
    """How one CTA is shaped.

    ``tile``: (query rows per CTA, keys per step). ``warps``: warps that share one key range
    (``None``: one per 16 rows, at most 8). ``stages``: K/V blocks in flight. ``kv_splits``:
    groups of ``warps`` warps in one CTA, each walking its own share of the keys, merged
    through shared memory at the end. ``family``: the kernel design that runs the tile
    (``flashcore.specs.families``; empty for the arch's default), so a tuned table can pick a
    family per bucket like any other knob.
    """

    tile: tuple[int, int] = field(
        default=DEFAULT_TILE, metadata={"help": "query rows per CTA and keys per step"})
    warps: int | None = field(
        default=None, metadata={"help": "warps sharing one key range (default: tile_m/16, <= 8)"})
    stages: int = field(default=1, metadata={"help": "K/V blocks in flight"})
    kv_splits: int = field(
        default=1, metadata={"help": "warp groups in a CTA, each over its own share of the keys"})
    family: str = field(default="", metadata={
        "help": "kernel family ('': the arch's default)", "cli": False})

    def __post_init__(self) -> None:
        tile = self.tile
        if isinstance(tile, list):
            tile = tuple(tile)
        if not (isinstance(tile, tuple) and len(tile) == 2 and all(_is_int(t) for t in tile)):
            raise SpecError(
                f"TileConfig: tile must be a pair of ints (tile_m, tile_n), got {self.tile!r}")
        object.__setattr__(self, "tile", tile)
        if self.warps is None:
            object.__setattr__(self, "warps", default_warps(tile[0]))
        for name in ("warps", "stages", "kv_splits"):
            v = getattr(self, name)
            if not _is_int(v):
                raise SpecError(f"TileConfig: {name} must be an int, got {v!r}")
            if v < 1:
                raise SpecError(f"TileConfig: {name}={v} must be at least 1")
        if min(tile) < 1:
            raise SpecError(f"TileConfig: tile {tile} must be positive")
        if not isinstance(self.family, str):
            raise SpecError(f"TileConfig: family must be a str, got {self.family!r}")
        refuse_retired_family(self.family)

    @property
    def tile_m(self) -> int:
        return self.tile[0]

    @property
    def tile_n(self) -> int:
        return self.tile[1]

    @property
    def group_threads(self) -> int:
        """Threads that share one key range."""
        return 32 * self.warps  # type: ignore[operator]

    @property
    def threads(self) -> int:
        return self.group_threads * self.kv_splits

    @property
    def tag(self) -> str:
        """The config's part of a kernel name, e.g. ``m64n64_w4_s1`` (``_k2`` with key splits)."""
        s = f"m{self.tile_m}n{self.tile_n}_w{self.warps}_s{self.stages}"
        s += f"_k{self.kv_splits}" if self.kv_splits > 1 else ""
        return s + (f"_{self.family}" if self.family else "")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"tile": list(self.tile), "warps": self.warps,
                             "stages": self.stages, "kv_splits": self.kv_splits}
        if self.family:  # the default family leaves no trace: older keys and names hold
            d["family"] = self.family
        return d

    @classmethod
    def from_dict(cls, d: Any) -> TileConfig:
        if isinstance(d, TileConfig):
            return d
        if not isinstance(d, dict):
            raise SpecError(f"TileConfig: expected an object, got {type(d).__name__}")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise SpecError(f"TileConfig: unknown fields {sorted(unknown)}")
        return cls(**d)

    def replace(self, **changes: Any) -> TileConfig:
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        return self.tag


def tile_config(config: TileConfig | None = None, **knobs: Any) -> TileConfig:
    """A config from a base (default: ``TileConfig()``) and keyword knobs; ``None`` knobs are
    left as the base has them. ``tile`` changes also re-derive an unset warp count."""
    base = config or TileConfig()
    changes = {k: v for k, v in knobs.items() if v is not None}
    if "tile" in changes and "warps" not in changes and config is None:
        changes["warps"] = None
    return base.replace(**changes) if changes else base


class TiledKernel:
    """The tile knobs of a kernel spec whose ``config`` is a TileConfig, read through it (a
    mixin of the attention and backward specs)."""

    config: TileConfig

    @property
    def tile(self) -> tuple[int, int]:
        return self.config.tile

    @property
    def tile_m(self) -> int:
        return self.config.tile_m

    @property
    def tile_n(self) -> int:
        return self.config.tile_n

    @property
    def warps(self) -> int:
        return self.config.warps  # type: ignore[return-value]

    @property
    def stages(self) -> int:
        return self.config.stages

    @property
    def kv_splits(self) -> int:
        return self.config.kv_splits
