"""Catalogs: the specs flashcore builds ahead of time, and self-contained folders of them.

A catalog folder is a cache root (``v1/...``, usable as ``FLASHCORE_CACHE_DIR``) plus an
``index.json`` naming every kernel with its path and checksums. ``flashcore.load_catalog``
(``flashcore.runtime.catalog``) verifies one and makes it the process's cache, which then serves
only the entries the index lists (re-checking each meta.json against the index when it reads it)
and never writes into the folder.

The checksums sit beside the data they check, so they prove a catalog is intact, not where it
came from: anyone who can write the folder can rewrite them. To accept only the catalog you
built, pin the sha256 of its index.json (``load_catalog(path, sha256=...)`` or
``FLASHCORE_CATALOG_SHA256``; ``flashcore catalog-hash DIR`` prints it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
from pathlib import Path

from ..errors import CacheCorruptionError, CatalogError
from ..specs import HEAD_DIMS, AttentionSpec, TileConfig
from ..version import __version__
from .artifact import META, KernelArtifact
from .cache import KernelCache
from .catalog_index import (  # noqa: F401 - re-exported: the catalog API in one place
    CATALOG_FORMAT,
    CATALOG_SHA256_ENV,
    INDEX,
    CatalogIndex,
    catalog_sha256,
    read_index,
    verify_index,
)
from .layout import FAILED_SUFFIX, LAYOUT, LOCK_SUFFIX, entry_name, spec_dir_name
from .safe_read import JSON_MAX, read_regular

# Configs shipped per head dim: the default tile and a larger-tile option; the untuned dims
# (after them) the planner's default only (``tuned.table.default_config``, a layer above).
CATALOG_CONFIGS = {d: [TileConfig((64, 64), warps=4), TileConfig((128, 64), warps=8)]
                   for d in (64, 128)}
CATALOG_CONFIGS.update({d: [TileConfig((64, 32), warps=4, stages=2) if d > 128
                            else TileConfig((64, 64), warps=4)]
                        for d in HEAD_DIMS if d not in CATALOG_CONFIGS})


def catalog_specs(archs: tuple[str, ...] = ("sm_80", "sm_89", "sm_90")) -> list[AttentionSpec]:
    specs = []
    for arch, dtype, d, causal, lse in itertools.product(
        archs, ("float16", "bfloat16"), CATALOG_CONFIGS, (False, True), (False, True)
    ):
        for config in CATALOG_CONFIGS[d]:
            specs.append(AttentionSpec(arch=arch, dtype=dtype, head_dim=d, config=config,
                                       causal=causal, return_lse=lse))
    return specs


def write_catalog(root: Path, artifacts: list) -> Path:
    """Write ``root/index.json`` naming every artifact (spec, arch, path, checksums).

    ``root`` is a cache root (the artifacts were put there by a KernelCache(root)), so the folder
    works as it is as ``FLASHCORE_CACHE_DIR`` and through ``load_catalog``. The cache's lock
    files and failure markers in it are removed: a catalog holds kernels and their index only.
    """
    root = Path(root)
    kernels = []
    for art in artifacts:
        rel = Path(LAYOUT) / spec_dir_name(art.spec) / entry_name(
            art.source_hash, art.toolchain.get("nvidia-cutlass-dsl")
        )
        meta = read_regular(root / rel / META, JSON_MAX)
        kernels.append(
            {
                "name": art.spec.name,
                "arch": art.spec.arch,
                "spec": art.spec.to_dict(),
                "path": rel.as_posix(),
                "cubin_sha256": hashlib.sha256(art.cubin).hexdigest(),
                "meta_sha256": hashlib.sha256(meta).hexdigest(),
            }
        )
    strip_cache_litter(root)
    index = {
        "format": CATALOG_FORMAT,
        "flashcore": __version__,
        "archs": sorted({k["arch"] for k in kernels}),
        "kernels": sorted(kernels, key=lambda k: k["name"]),
    }
    path = root / INDEX
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def strip_cache_litter(root: Path) -> None:
    """Remove the lock files and failure markers a KernelCache leaves beside its entries."""
    base = Path(root) / LAYOUT
    if not base.is_dir():
        return
    for sdir in base.iterdir():
        if sdir.is_dir() and not sdir.is_symlink():
            for f in sdir.iterdir():
                if f.name.endswith((LOCK_SUFFIX, FAILED_SUFFIX)) and f.is_file():
                    f.unlink(missing_ok=True)


def verify_catalog(root: str | Path, *, sha256: str | None = None) -> dict:
    """Check a catalog folder against its index; raise CatalogError naming the first problem.

    This proves the folder is intact and self-consistent, not who built it: pin ``sha256`` (of
    index.json, see ``catalog_sha256``) to accept only the catalog you built."""
    return verify_index(Path(root), sha256).data


def copy_catalog(src: str | Path, dst: str | Path, *, keep_ir: bool = False) -> Path:
    """Copy a catalog folder, by default without the IR (GPU hosts need only cubins); every entry
    is verified on the way and re-saved with fresh checksums."""
    src, dst = Path(src), Path(dst)
    index = verify_index(src, None)
    cache = KernelCache(dst)
    arts = []
    for k in index.kernels:
        try:
            art = KernelArtifact.load(src / k["path"], meta_sha256=k["meta_sha256"])
        except CacheCorruptionError as e:  # changed since it was verified
            raise CatalogError(f"catalog entry {k['name']} is damaged: {e}") from None
        if not keep_ir:
            art = dataclasses.replace(art, ir="")
        cache.put(art)
        arts.append(art)
    return write_catalog(dst, arts)
