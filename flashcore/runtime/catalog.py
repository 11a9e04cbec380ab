"""Use a prebuilt catalog as this process's kernel cache, refusing one this host cannot run."""

from __future__ import annotations

import os
from pathlib import Path

from ..compiler.cache import CACHE_ENV, use_catalog
from ..compiler.catalog import CATALOG_SHA256_ENV, verify_index
from ..errors import CatalogError
from .device import visible_archs


def load_catalog(path: str | Path, *, sha256: str | None = None) -> Path:
    """Verify a catalog folder and make it this process's kernel cache (FLASHCORE_CACHE_DIR).

    The cache then serves only the kernels the index lists (each re-checked against the index
    when read) and writes nothing into the folder. Refuses a catalog that holds no kernel for the
    arch of some visible CUDA device.

    ``sha256`` (else ``$FLASHCORE_CATALOG_SHA256``): the sha256 its index.json must have. The
    checksums in a catalog prove it is intact, not who built it; a pin does (``flashcore
    catalog-hash DIR`` prints the value)."""
    root = Path(path).resolve()
    pin = sha256 or os.environ.get(CATALOG_SHA256_ENV) or None
    index = verify_index(root, pin)
    archs = index.data["archs"]
    for device, arch in visible_archs().items():
        if arch not in archs:
            raise CatalogError(
                f"catalog {root} holds kernels for {archs}, but cuda:{device} needs "
                f"{arch}; build one with: flashcore precompile --arch {arch} --out DIR"
            )
    use_catalog(root, index.served(), index.sha256)
    os.environ[CACHE_ENV] = str(root)
    return root
