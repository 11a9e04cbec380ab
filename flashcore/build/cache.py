"""Compiled kernels on disk and in memory.

Layout: ``<root>/v1/<spec.name>-<spec.content_hash>/<source_hash>-dsl<version>/`` holds what
``KernelArtifact.save`` writes. An entry appears only by ``os.rename`` of a finished directory,
so readers never see half an entry; builders of one key serialise on a file lock next to it.
A host without the DSL (it cannot compile) accepts an entry built by any DSL version.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import platformdirs
from filelock import FileLock

from ..errors import CacheCorruptionError
from ..spec import KernelSpec, spec_from_dict
from .artifact import META, KernelArtifact
from .fingerprint import dsl_fingerprint, source_hash

CACHE_ENV = "FLASHCORE_CACHE_DIR"
LAYOUT = "v1"
QUARANTINE = "quarantine"
_TMP_PREFIX = ".tmp-"
_LOCK_TIMEOUT_S = 1800  # longer than any compile; a dead holder's flock is released by the OS


class CacheWarning(UserWarning):
    """A cache entry was damaged and has been set aside."""


def cache_root() -> Path:
    """``$FLASHCORE_CACHE_DIR`` if set, else the user's cache directory for flashcore."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path(platformdirs.user_cache_dir("flashcore"))


def spec_dir_name(spec: KernelSpec) -> str:
    return f"{spec.name}-{spec.content_hash}"


def entry_name(source: str, dsl: str | None) -> str:
    """``<source hash>-dsl<DSL fingerprint>``: one build of one spec."""
    return f"{source}-dsl{dsl}"


class KernelCache:
    """Artifacts by spec: an in-process table in front of a directory tree (see module doc)."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else cache_root()
        self._memory: dict[tuple[KernelSpec, str], KernelArtifact] = {}
        self._memory_lock = threading.Lock()

    @property
    def base(self) -> Path:
        return self.root / LAYOUT

    def spec_dir(self, spec: KernelSpec) -> Path:
        return self.base / spec_dir_name(spec)

    # -- lookup --------------------------------------------------------------------------------
    def get(self, spec: KernelSpec) -> KernelArtifact | None:
        """The cached artifact for ``spec`` and the current kernel source, or None."""
        key = (spec, source_hash())
        with self._memory_lock:
            hit = self._memory.get(key)
        if hit is not None:
            return hit
        return self._get_disk(spec, locked=False)

    def _get_disk(self, spec: KernelSpec, *, locked: bool) -> KernelArtifact | None:
        for path in self._candidates(spec):
            try:
                art = self._load_checked(path, spec)
            except CacheCorruptionError as e:
                art = self._quarantine(path, spec, str(e), locked=locked)
                if art is None:
                    continue
            with self._memory_lock:
                return self._memory.setdefault((spec, source_hash()), art)
        return None

    def _candidates(self, spec: KernelSpec) -> list[Path]:
        source = source_hash()
        version = dsl_fingerprint()
        sdir = self.spec_dir(spec)
        if version is not None:
            exact = sdir / entry_name(source, version)
            return [exact] if exact.is_dir() else []
        # Offline: any DSL version will do, the most recently written first.
        found = [p for p in sdir.glob(f"{source}-dsl*") if p.is_dir()]
        return sorted(found, key=_mtime, reverse=True)

    @staticmethod
    def _load_checked(path: Path, spec: KernelSpec) -> KernelArtifact:
        art = KernelArtifact.load(path)
        if art.spec != spec:
            raise CacheCorruptionError(f"{path / META}: holds {art.spec.name}, not {spec.name}")
        if art.source_hash != source_hash():
            raise CacheCorruptionError(
                f"{path / META}: built from kernel source {art.source_hash}, "
                f"its directory says {source_hash()}"
            )
        return art

    # -- store ---------------------------------------------------------------------------------
    def put(self, artifact: KernelArtifact) -> Path:
        """Write ``artifact`` into place atomically; an entry already there is kept."""
        version = artifact.toolchain.get("nvidia-cutlass-dsl") or dsl_fingerprint()
        sdir = self.spec_dir(artifact.spec)
        dest = sdir / entry_name(artifact.source_hash, version)
        sdir.mkdir(parents=True, exist_ok=True)
        tmp = sdir / f"{_TMP_PREFIX}{dest.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            artifact.save(tmp)
            os.rename(tmp, dest)
        except OSError:
            if not (dest / META).is_file():
                raise
            # Another writer got there first; entries of one key are interchangeable.
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        with self._memory_lock:
            self._memory.setdefault((artifact.spec, artifact.source_hash), artifact)
        return dest

    def get_or_build(
        self, spec: KernelSpec, build: Callable[[KernelSpec], KernelArtifact]
    ) -> KernelArtifact:
        """From memory, else from disk, else ``build(spec)`` under a per-key file lock."""
        art = self.get(spec)
        if art is not None:
            return art
        with self._lock(spec):
            art = self._get_disk(spec, locked=True)  # someone may have built it while we waited
            if art is not None:
                return art
            art = build(spec)
            if art.spec != spec:
                raise ValueError(f"build({spec.name}) returned an artifact for {art.spec.name}")
            self.put(art)
        with self._memory_lock:
            self._memory[(spec, source_hash())] = art
        return art

    def _lock(self, spec: KernelSpec) -> FileLock:
        sdir = self.spec_dir(spec)
        sdir.mkdir(parents=True, exist_ok=True)
        name = entry_name(source_hash(), dsl_fingerprint())
        return FileLock(sdir / f"{name}.lock", timeout=_LOCK_TIMEOUT_S)

    def _quarantine(
        self, path: Path, spec: KernelSpec, problem: str, *, locked: bool
    ) -> KernelArtifact | None:
        """Move a corrupt entry aside; returns the artifact instead if a good one replaced it."""
        # Move it only while holding the key's lock and after re-checking, so a good entry that a
        # builder has just put in its place is never the one moved away. (flock is not
        # re-entrant across lock objects, hence `locked` when the caller already holds it.)
        with contextlib.nullcontext() if locked else self._lock(spec):
            try:
                return self._load_checked(path, spec)  # replaced by a good one meanwhile
            except CacheCorruptionError:
                pass
            qdir = self.base / QUARANTINE
            qdir.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            dest = qdir / f"{path.parent.name}--{path.name}-{stamp}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(path, dest)
            except FileNotFoundError:
                return None  # another process moved it first
        warnings.warn(
            f"flashcore cache: corrupt entry {path}: {problem}; moved to {dest}, will rebuild",
            CacheWarning,
            stacklevel=3,
        )
        return None

    # -- maintenance ---------------------------------------------------------------------------
    def entries(self) -> list[tuple[Path, KernelSpec | None]]:
        """Every entry directory, with its spec (None if meta.json cannot be read)."""
        out = []
        if not self.base.is_dir():
            return out
        for sdir in sorted(self.base.iterdir()):
            if not sdir.is_dir() or sdir.name == QUARANTINE:
                continue
            for edir in sorted(sdir.iterdir()):
                if edir.is_dir() and not edir.name.startswith(_TMP_PREFIX):
                    out.append((edir, _peek_spec(edir)))
        return out

    def verify(self) -> list[tuple[Path, str]]:
        """Load every entry and check it sits where its key says; the problems found."""
        problems = []
        for path, spec in self.entries():
            try:
                art = KernelArtifact.load(path)
            except CacheCorruptionError as e:
                problems.append((path, str(e)))
                continue
            version = art.toolchain.get("nvidia-cutlass-dsl")
            want = (spec_dir_name(art.spec), entry_name(art.source_hash, version))
            # put() names an entry without a recorded DSL version after the installed one
            placed = path.parent.name == want[0] and (
                path.name == want[1] if version else path.name.startswith(f"{art.source_hash}-dsl")
            )
            if not placed:
                problems.append((path, f"misplaced: its content belongs in {'/'.join(want)}"))
        return problems

    def clear(self) -> None:
        """Remove every entry (and the quarantine) and forget the in-memory table."""
        shutil.rmtree(self.base, ignore_errors=True)
        with self._memory_lock:
            self._memory.clear()

    def size_bytes(self) -> int:
        if not self.base.is_dir():
            return 0
        total = 0
        for p in self.base.rglob("*"):
            try:
                total += p.stat().st_size if p.is_file() else 0
            except FileNotFoundError:  # removed while we walked
                pass
        return total


def _mtime(path: Path) -> float:
    try:
        return (path / META).stat().st_mtime
    except OSError:
        return 0.0


def _peek_spec(path: Path) -> KernelSpec | None:
    try:
        return spec_from_dict(json.loads((path / META).read_text())["spec"])
    except (OSError, ValueError, KeyError, TypeError):  # unreadable: reported, not trusted
        return None


_defaults: dict[Path, KernelCache] = {}
_defaults_lock = threading.Lock()


def default_cache() -> KernelCache:
    """The process's cache for the current root (``$FLASHCORE_CACHE_DIR`` is read each call)."""
    root = cache_root().resolve()
    with _defaults_lock:
        cache = _defaults.get(root)
        if cache is None:
            cache = _defaults[root] = KernelCache(root)
        return cache
