"""Everything a compiled kernel depends on besides its spec, as strings that key the cache.

- ``source_hash()``: every source file the compile worker can import (``BUILD_SOURCES``: the
  package's ``__init__``, ``errors``, ``version``, the specs and the kernels). The compiler
  checks after each build that the worker imported nothing else from flashcore, so the key
  cannot miss a file.
- ``dsl_fingerprint()``: the versions of every installed ``nvidia-cutlass-dsl*`` distribution,
  including which toolkit flavour of its libraries (``-libs-cu12`` and ``-libs-cu13`` emit
  different PTX ISA versions).
- The environment: the worker starts with every ``CUTE_*`` and ``CUTLASS_*`` variable
  removed and sets the few it needs (``worker_env``), so nothing else in the environment can
  change what is built; the DSL's own file caches live in the build's temporary folder.

Files are read, never imported: hosts without the DSL compute the same key.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent  # the flashcore package folder
# What the compile worker imports (relative to PACKAGE): files, or folders taken whole.
BUILD_SOURCES = ("__init__.py", "errors.py", "version.py", "specs", "kernels")
# Environment variables the DSL reads at import or compile time: never inherited by a worker.
# (``CUTE_`` covers both of its DSL instances, ``CUTE_DSL_*`` and ``CUTE_EXPERIMENTAL_DSL_*``.)
CODEGEN_ENV_PREFIXES = ("CUTE_", "CUTLASS_")
DSL_DIST = "nvidia-cutlass-dsl"


def build_source_files() -> list[Path]:
    """Every file behind ``BUILD_SOURCES``, sorted by path relative to the package."""
    files: list[Path] = []
    for rel in BUILD_SOURCES:
        p = PACKAGE / rel
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return sorted(files, key=lambda f: f.relative_to(PACKAGE).as_posix())


def hash_files(files: list[Path]) -> str:
    """sha256 (16 hex) of ``files`` (inside the package), by relative path and content."""
    h = hashlib.sha256()
    for path in files:
        rel = path.relative_to(PACKAGE).as_posix().encode()
        data = path.read_bytes()
        # length-prefixed, so no two different trees hash the same byte stream
        h.update(len(rel).to_bytes(8, "little") + rel + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:16]


@functools.cache
def source_hash() -> str:
    """sha256 (16 hex) of the build's sources, by relative path and content (once a process)."""
    return hash_files(build_source_files())


def fresh_source_hash() -> str:
    """The same, read again now (the compiler compares it after a build: sources edited while a
    kernel compiled must not be filed under the old key)."""
    return hash_files(build_source_files())


def dsl_version() -> str | None:
    """Installed nvidia-cutlass-dsl version, or None (then this host cannot compile).

    Looks, never imports: both the distribution and an importable ``cutlass`` must be there.
    """
    try:
        if importlib.util.find_spec("cutlass") is None:
            return None
    except (ImportError, ValueError):  # e.g. sys.modules["cutlass"] = None: import blocked
        return None
    try:
        return importlib.metadata.version(DSL_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _dsl_distributions() -> tuple[tuple[str, str], ...]:
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower().replace("_", "-")
        if name.startswith(DSL_DIST):
            found[name] = dist.version
    return tuple(sorted(found.items()))


def dsl_fingerprint() -> str | None:
    """E.g. ``4.8.1-cu12``: the DSL's version and its library flavour(s); any library of
    another version than the DSL is named with it. None when this host cannot compile."""
    version = dsl_version()
    if version is None:
        return None
    parts = []
    for name, ver in _dsl_distributions():
        if name == DSL_DIST:
            continue
        short = name[len(DSL_DIST) + 1:].removeprefix("libs-")
        if ver != version:
            parts.append(f"{short}{ver}")
        elif short.startswith("cu"):  # base and core at the DSL's own version say nothing new
            parts.append(short)
    return "-".join([version, *parts])


def worker_env(arch: str, dump_dir: Path) -> dict[str, str]:
    """The compile worker's environment: this one without the DSL's code-generation variables,
    plus the target arch (read when ``cutlass`` is imported), IR keeping (the DSL writes the
    CuTe IR into its dump dir; the cubin is unchanged) and the DSL's own file cache beside that
    dump dir, in the build's temporary folder: no state of an earlier build (nor a
    ``$TMPDIR/<user>/cutlass_python_cache`` left behind) takes part in this one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(CODEGEN_ENV_PREFIXES)}
    env.update(CUTE_DSL_ARCH=arch, CUTE_DSL_KEEP="ir", CUTE_DSL_DUMP_DIR=str(dump_dir),
               CUTE_DSL_CACHE_DIR=str(Path(dump_dir).parent / "dsl-cache"),
               CUTE_EXPERIMENTAL_DSL_CACHE_DIR=str(Path(dump_dir).parent / "dsl-cache"),
               PYTHONDONTWRITEBYTECODE="1")
    return env
