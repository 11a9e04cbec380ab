"""How the cache and catalogs lay kernels out on disk: the names both use."""

from __future__ import annotations

import re

from ..specs import KernelSpec

LAYOUT = "v1"
QUARANTINE = "quarantine"
CATALOG_INDEX = "index.json"
LOCK_SUFFIX = ".lock"
FAILED_SUFFIX = ".failed"
SPEC_DIR = re.compile(r"[A-Za-z0-9_.]+-[0-9a-f]{16}")
ENTRY_DIR = re.compile(r"[0-9a-f]{16}-dsl[A-Za-z0-9._+-]*")


def spec_dir_name(spec: KernelSpec) -> str:
    return f"{spec.name}-{spec.content_hash}"


def entry_name(source: str, dsl: str | None) -> str:
    """``<source hash>-dsl<DSL fingerprint>``: one build of one spec."""
    return f"{source}-dsl{dsl}"
