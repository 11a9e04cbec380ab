"""Catalogs: the specs flashcore builds ahead of time, and self-contained folders of them.

A catalog folder is a cache root (``v1/...``, usable as ``FLASHCORE_CACHE_DIR``) plus an
``index.json`` naming every kernel with its path and checksums. ``flashcore.load_catalog``
(``flashcore.runtime.catalog``) verifies one and makes it the process's cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
from pathlib import Path

from .. import __version__
from ..errors import CacheCorruptionError, CatalogError
from ..spec import AttentionSpec, TileConfig
from .artifact import KernelArtifact
from .cache import KernelCache, entry_name, spec_dir_name

# Configs shipped per head dim: the default tile and a larger-tile option.
CATALOG_CONFIGS = {d: [TileConfig((64, 64), warps=4), TileConfig((128, 64), warps=8)]
                   for d in (64, 128)}


def catalog_specs(archs: tuple[str, ...] = ("sm_80", "sm_89", "sm_90")) -> list[AttentionSpec]:
    specs = []
    for arch, dtype, d, causal, lse in itertools.product(
        archs, ("float16", "bfloat16"), (64, 128), (False, True), (False, True)
    ):
        for config in CATALOG_CONFIGS[d]:
            specs.append(AttentionSpec(arch=arch, dtype=dtype, head_dim=d, config=config,
                                       causal=causal, return_lse=lse))
    return specs


# -- catalogs on disk ----------------------------------------------------------------------------
INDEX = "index.json"
CATALOG_FORMAT = 2  # 2: specs carry a TileConfig; the kernel sources moved (rebuild format 1)


def write_catalog(root: Path, artifacts: list) -> Path:
    """Write ``root/index.json`` naming every artifact (spec, arch, path, checksums).

    ``root`` is a cache root (the artifacts were put there by a KernelCache(root)), so the folder
    works as it is as ``FLASHCORE_CACHE_DIR`` and through ``load_catalog``.
    """
    kernels = []
    for art in artifacts:
        rel = Path("v1") / spec_dir_name(art.spec) / entry_name(
            art.source_hash, art.toolchain.get("nvidia-cutlass-dsl")
        )
        meta = (root / rel / "meta.json").read_bytes()
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


def verify_catalog(root: Path) -> dict:
    """Check a catalog folder against its index; raise CatalogError naming the first problem."""
    root = Path(root)
    try:
        index = json.loads((root / INDEX).read_text())
    except FileNotFoundError:
        raise CatalogError(f"{root} is not a flashcore catalog: no {INDEX}") from None
    except (OSError, ValueError) as e:
        raise CatalogError(f"{root / INDEX} is unreadable: {e}") from None
    if not isinstance(index, dict):
        raise CatalogError(f"{root / INDEX}: not a catalog index")
    if index.get("format") != CATALOG_FORMAT:
        raise CatalogError(
            f"{root / INDEX}: catalog format {index.get('format')!r}, this flashcore reads "
            f"{CATALOG_FORMAT}; rebuild it with: flashcore precompile --arch ... --out {root}"
        )
    for k in index.get("kernels", []):
        where = root / k["path"]
        try:
            meta = (where / "meta.json").read_bytes()
        except OSError:
            raise CatalogError(f"catalog entry {k['name']} is missing ({where})") from None
        if hashlib.sha256(meta).hexdigest() != k["meta_sha256"]:
            raise CatalogError(f"catalog entry {k['name']} was modified: {where}/meta.json")
        try:
            art = KernelArtifact.load(where)
        except CacheCorruptionError as e:
            raise CatalogError(f"catalog entry {k['name']} is damaged: {e}") from None
        if hashlib.sha256(art.cubin).hexdigest() != k["cubin_sha256"]:
            raise CatalogError(f"catalog entry {k['name']}: cubin differs from the index")
    return index


def copy_catalog(src: str | Path, dst: str | Path, *, keep_ir: bool = False) -> Path:
    """Copy a catalog folder, by default without the IR (GPU hosts need only cubins); every entry
    is verified on the way and re-saved with fresh checksums."""
    src, dst = Path(src), Path(dst)
    index = verify_catalog(src)
    cache = KernelCache(dst)
    arts = []
    for k in index["kernels"]:
        art = KernelArtifact.load(src / k["path"])
        if not keep_ir:
            art = dataclasses.replace(art, ir="")
        cache.put(art)
        arts.append(art)
    return write_catalog(dst, arts)
