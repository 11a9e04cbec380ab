"""Use a prebuilt catalog as this process's kernel cache, refusing one this host cannot run."""

from __future__ import annotations

import os
from pathlib import Path

from ..build.cache import CACHE_ENV
from ..build.catalog import verify_catalog
from ..errors import CatalogError
from .device import visible_archs


def load_catalog(path: str | Path) -> Path:
    """Verify a catalog folder and make it this process's kernel cache (FLASHCORE_CACHE_DIR).

    Refuses a catalog that holds no kernel for the arch of some visible CUDA device."""
    root = Path(path).resolve()
    index = verify_catalog(root)
    for device, arch in visible_archs().items():
        if arch not in index["archs"]:
            raise CatalogError(
                f"catalog {root} holds kernels for {index['archs']}, but cuda:{device} needs "
                f"{arch}; build one with: flashcore precompile --arch {arch} --out DIR"
            )
    os.environ[CACHE_ENV] = str(root)
    return root
