"""Compiled kernels on disk and in memory.

Layout: ``<root>/v1/<spec.name>-<spec.content_hash>/<source_hash>-dsl<version>/`` holds what
``KernelArtifact.save`` writes. An entry appears only by ``os.rename`` of a finished directory,
so readers never see half an entry and need no lock; builders of one key serialise on a file lock
next to it (``<entry>.lock``), and a build that fails leaves ``<entry>.failed`` for a minute so
that the processes waiting on that lock fail at once with the same error instead of each
compiling again (not a build that timed out or whose worker was killed: that says nothing about
the kernel). A host without the DSL (it cannot compile) accepts an entry built by any DSL
version.

Files are read as regular files only, each kind up to a size cap (``safe_read.py``): a FIFO, a
device or a huge file in an entry is damage like any other, never a hang. Temporaries carry their
owner (``owner.py``), and are abandoned when that is a dead process of this host or when they are
an hour old. Maintenance (``clear``, ``prune``, the eviction after each write under
``FLASHCORE_CACHE_MAX_SIZE``) never follows a symlink: one that carries the cache's own name may
be removed as an entry, what it points to is never touched.

What can go wrong with the directory does not make compiles fail: an unreadable entry is damage
(set aside, or skipped where it cannot be moved); a cache that cannot be written is used
read-only, with one warning per process, and what is compiled is kept in memory; so is a kernel
whose entry could not be written (a full disk).

A catalog root (``index.json`` beside ``v1/``, see ``catalog.py``) opened by ``default_cache`` or
``load_catalog`` serves only the entries its index lists, each checked against the index's
meta.json checksum, and is never written to. Under ``FLASHCORE_CATALOG_SHA256`` the cache folder
must be a catalog with that index: without one it is refused, never used as a plain cache.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs
from filelock import FileLock, Timeout

from ..errors import CacheCorruptionError, CatalogError, CompileError
from ..specs import KernelSpec, spec_from_dict
from .artifact import META, KernelArtifact
from .catalog_index import CATALOG_SHA256_ENV, read_index
from .fingerprint import dsl_fingerprint, source_hash
from .layout import (
    CATALOG_INDEX,
    ENTRY_DIR,
    FAILED_SUFFIX,
    LAYOUT,
    LOCK_SUFFIX,
    QUARANTINE,
    SPEC_DIR,
    entry_name,
    spec_dir_name,
)
from .owner import OWNER, abandoned, owner_tag, parse_owner
from .safe_read import JSON_MAX, read_regular

CACHE_ENV = "FLASHCORE_CACHE_DIR"
MAX_SIZE_ENV = "FLASHCORE_CACHE_MAX_SIZE"
_TMP_PREFIX = ".tmp-"
_LOCK_TIMEOUT_S = 1800  # longer than any compile; a dead holder's flock is released by the OS
_FAILURE_TTL_S = 60.0  # a failed build's marker: long enough for every waiter of that lock
_STALE_TMP_S = 3600.0  # a temporary this old is abandoned even if its pid lives (pid reuse)
_READ_ONLY_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}
# A temporary's name ends in its owner (see owner.py) and a random part.
_TMP_OWNER = re.compile(rf"-{OWNER}-[0-9a-f]{{8}}$")


class TransientCompileError(CompileError):
    """A build that failed for a reason of its own run (a timeout, a killed worker), not of the
    kernel: it is not remembered, so the next caller builds again."""


class CacheWarning(UserWarning):
    """The cache could not do what it would (a damaged entry, a folder it cannot write)."""


def cache_root() -> Path:
    """``$FLASHCORE_CACHE_DIR`` if set, else the user's cache directory for flashcore."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path(platformdirs.user_cache_dir("flashcore"))


def parse_size(text: str) -> int:
    """``500M``, ``2G``, ``1.5GiB``, ``100k``, ``4096``: bytes (K, M, G, T are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 500M, 2G, 4096)")
    return int(float(m[1]) * 1024 ** " KMGT".index(m[2].upper() or " "))


def _tmp_name(name: str) -> str:
    """A temporary's name beside ``name``: its owner and a random part (see owner.py)."""
    return f"{_TMP_PREFIX}{name}-{owner_tag()}-{uuid.uuid4().hex[:8]}"


def _is_stale_tmp(path: Path, now: float) -> bool:
    try:
        changed = path.lstat().st_mtime
    except OSError:
        return False
    return abandoned(parse_owner(_TMP_OWNER.search(path.name)), changed, _STALE_TMP_S, now)


def _is_real_dir(path: Path) -> bool:
    """A directory, not a symlink to one: maintenance never follows a link out of the cache."""
    return path.is_dir() and not path.is_symlink()


def _rmtree(path: Path, failed: list[tuple[Path, str]]) -> None:
    """Remove ``path`` (a tree or a file); what cannot be removed is added to ``failed``."""

    def note(_fn, p, exc) -> None:
        e = exc[1] if isinstance(exc, tuple) else exc
        if not isinstance(e, FileNotFoundError):
            failed.append((Path(p), getattr(e, "strerror", None) or str(e)))

    if path.is_symlink() or not path.is_dir():
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            failed.append((path, e.strerror or str(e)))
        return
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=note)
    else:
        shutil.rmtree(path, onerror=note)


def _tree_size(path: Path) -> int:
    """Bytes of the regular files under ``path``, symlinks not followed (``path`` included)."""
    try:
        if not _is_real_dir(path):
            return path.lstat().st_size
    except OSError:
        return 0
    return _walk_size(path)


def _walk_size(path: Path) -> int:
    """Bytes of the regular files under the folder ``path``; symlinks below it not followed."""
    total = 0
    for top, _dirs, files in os.walk(path, followlinks=False):
        for name in files:
            with contextlib.suppress(OSError):  # removed while we walked, or unreadable
                st = os.lstat(os.path.join(top, name))
                total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


@dataclass
class PruneReport:
    """What ``KernelCache.prune`` did."""

    removed: list[Path] = field(default_factory=list)
    freed_bytes: int = 0
    failed: list[tuple[Path, str]] = field(default_factory=list)
    size_bytes: int = 0  # after


_warned_read_only: set[Path] = set()
_warned_lock = threading.Lock()


class KernelCache:
    """Artifacts by spec: an in-process table in front of a directory tree (see module doc).

    ``catalog``: the entries to serve (``path -> meta.json sha256``, a catalog index's ``served()``);
    with it, nothing else is served and nothing is written into the folder. ``catalog_sha256``:
    the sha256 of the index those entries come from (what a pin is compared with).
    """

    def __init__(
        self,
        root: Path | str | None = None,
        *,
        catalog: dict[str, str] | None = None,
        read_only: bool = False,
        catalog_sha256: str | None = None,
    ) -> None:
        self.root = Path(root) if root is not None else cache_root()
        self.catalog = dict(catalog) if catalog is not None else None
        self.catalog_sha256 = catalog_sha256
        self.read_only = read_only or catalog is not None  # set when a write is refused
        self._memory: dict[tuple[KernelSpec, str], KernelArtifact] = {}
        self._memory_lock = threading.Lock()
        self._key_locks: dict[tuple[KernelSpec, str], threading.Lock] = {}
        self._failures: dict[tuple[KernelSpec, str], tuple[float, str]] = {}

    @property
    def base(self) -> Path:
        return self.root / LAYOUT

    def spec_dir(self, spec: KernelSpec) -> Path:
        return self.base / spec_dir_name(spec)

    def is_catalog_root(self) -> bool:
        return (self.root / CATALOG_INDEX).exists()

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
                art = self._set_aside(path, spec, str(e), locked=locked)
                if art is None:
                    continue
            self._touch(path)
            with self._memory_lock:
                return self._memory.setdefault((spec, source_hash()), art)
        return None

    def _candidates(self, spec: KernelSpec) -> list[Path]:
        source = source_hash()
        version = dsl_fingerprint()
        sdir = self.spec_dir(spec)
        if self.catalog is not None:
            prefix = f"{LAYOUT}/{spec_dir_name(spec)}/"
            names = [p[len(prefix):] for p in self.catalog if p.startswith(prefix)]
        else:
            try:
                names = [p.name for p in sdir.iterdir() if p.is_dir()] if sdir.is_dir() else []
            except OSError as e:  # unreadable folder: nothing can be served from it
                self._warn(f"cannot read {sdir} ({e.strerror or e}); treating it as empty")
                return []
        if version is not None:
            exact = entry_name(source, version)
            return [sdir / exact] if exact in names else []
        # Offline: any DSL version will do, the most recently written first.
        found = [sdir / n for n in names if n.startswith(f"{source}-dsl")]
        return sorted(found, key=_mtime, reverse=True)

    def _load_checked(self, path: Path, spec: KernelSpec) -> KernelArtifact:
        want = None
        if self.catalog is not None:
            want = self.catalog.get(path.relative_to(self.root).as_posix())
            if want is None:  # cannot happen: candidates come from the index
                raise CacheCorruptionError(f"{path}: not listed in the catalog's index")
        art = KernelArtifact.load(path, meta_sha256=want)
        if art.spec != spec:
            raise CacheCorruptionError(f"{path / META}: holds {art.spec.name}, not {spec.name}")
        if art.source_hash != source_hash():
            raise CacheCorruptionError(
                f"{path / META}: built from kernel source {art.source_hash}, "
                f"its directory says {source_hash()}"
            )
        return art

    def _touch(self, path: Path) -> None:
        """Record a use (the entry folder's mtime): ``prune`` evicts the least recently used."""
        if not self.read_only:
            with contextlib.suppress(OSError, NotImplementedError):
                os.utime(path, follow_symlinks=False)  # a linked entry's target is not ours

    # -- store ---------------------------------------------------------------------------------
    def put(self, artifact: KernelArtifact) -> Path:
        """Write ``artifact`` into place atomically; an entry already there is kept.

        Raises OSError when the folder cannot be written (``get_or_build`` keeps the artifact in
        memory then)."""
        if self.catalog is not None:
            raise PermissionError(errno.EROFS, "a catalog is not written to", str(self.root))
        version = artifact.toolchain.get("nvidia-cutlass-dsl") or dsl_fingerprint()
        sdir = self.spec_dir(artifact.spec)
        dest = sdir / entry_name(artifact.source_hash, version)
        sdir.mkdir(parents=True, exist_ok=True)
        self._prune_temporaries(sdir, PruneReport())  # what killed writers left here
        tmp = sdir / _tmp_name(dest.name)
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
        self._prune_to_env_limit(keep=dest)
        return dest

    def get_or_build(
        self, spec: KernelSpec, build: Callable[[KernelSpec], KernelArtifact]
    ) -> KernelArtifact:
        """From memory, else from disk, else ``build(spec)`` under a per-key file lock."""
        art = self.get(spec)
        if art is not None:
            return art
        key = (spec, source_hash())
        with self._key_lock(key), self._build_lock(spec) as locked:
            with self._memory_lock:
                art = self._memory.get(key)  # another thread built it while we waited
            if art is None:
                # someone may have built it while we waited
                art = self._get_disk(spec, locked=locked)
            if art is not None:
                return art
            self._raise_recent_failure(spec, key)
            try:
                art = build(spec)
            except TransientCompileError:
                raise  # says nothing about the kernel: the next caller tries again
            except CompileError as e:
                self._record_failure(spec, key, str(e), locked=locked)
                raise
            if art.spec != spec:
                raise ValueError(f"build({spec.name}) returned an artifact for {art.spec.name}")
            self._store(art)
            if locked:
                with contextlib.suppress(OSError):
                    self._failure_marker(spec).unlink(missing_ok=True)
        with self._memory_lock:
            self._memory[key] = art
            self._failures.pop(key, None)
        return art

    def _key_lock(self, key) -> threading.Lock:
        with self._memory_lock:
            return self._key_locks.setdefault(key, threading.Lock())

    @contextlib.contextmanager
    def _build_lock(self, spec: KernelSpec) -> Iterator[bool]:
        """The key's file lock, held; yields False where the folder cannot hold one (read-only),
        and builds then go on without it."""
        lock = None
        if not self.read_only:
            try:
                lock = self._lock(spec)
                lock.acquire()
            except Timeout:
                raise CompileError(
                    f"{spec.name}: waited {_LOCK_TIMEOUT_S} s for the build lock {lock.lock_file} "
                    "(another process is compiling this kernel, or hung doing so); remove the "
                    "lock file if no flashcore process is running"
                ) from None
            except OSError as e:
                lock = None
                self._write_failed(e, f"cannot create the build lock for {spec.name}",
                                   "building without it")
        try:
            yield lock is not None
        finally:
            if lock is not None:
                lock.release()

    def _lock(self, spec: KernelSpec) -> FileLock:
        sdir = self.spec_dir(spec)
        sdir.mkdir(parents=True, exist_ok=True)
        path = sdir / f"{entry_name(source_hash(), dsl_fingerprint())}{LOCK_SUFFIX}"
        # FileLock opens it with O_TRUNC: a symlink or a FIFO in its place is not ours to open
        with contextlib.suppress(OSError):
            if not stat.S_ISREG(path.lstat().st_mode):
                path.unlink()
        return FileLock(path, timeout=_LOCK_TIMEOUT_S)

    def _store(self, art: KernelArtifact) -> None:
        """``put``, but a folder that cannot take it costs a warning, not the compiled kernel."""
        if self.read_only:
            return
        try:
            self.put(art)
        except OSError as e:
            self._write_failed(e, f"could not store {art.spec.name}")

    def _write_failed(self, e: OSError, what: str,
                      then: str = "kept in memory for this process only") -> None:
        if e.errno in _READ_ONLY_ERRNOS:
            self.read_only = True
            with _warned_lock:
                first = self.root not in _warned_read_only
                _warned_read_only.add(self.root)
            if first:
                self._warn(
                    f"{self.root} is not writable ({e.strerror or e}); using it read-only: kernels "
                    "compiled now are kept in memory for this process only (set "
                    f"{CACHE_ENV} to a writable folder to keep them)"
                )
        else:
            self._warn(f"{what} in {self.root} ({e.strerror or e}); {then}")

    @staticmethod
    def _warn(message: str) -> None:
        warnings.warn(f"flashcore cache: {message}", CacheWarning, stacklevel=4)

    # -- failed builds ------------------------------------------------------------------------
    def _failure_marker(self, spec: KernelSpec) -> Path:
        name = entry_name(source_hash(), dsl_fingerprint())
        return self.spec_dir(spec) / f"{name}{FAILED_SUFFIX}"

    def _record_failure(self, spec: KernelSpec, key, message: str, *, locked: bool) -> None:
        with self._memory_lock:
            self._failures[key] = (time.time(), message)
        if locked:  # only the lock holder writes it, and only waiters of that lock read it
            marker = self._failure_marker(spec)
            tmp = marker.with_name(_tmp_name(marker.name))
            try:
                tmp.write_text(json.dumps({"time": time.time(), "pid": os.getpid(),
                                           "error": message}))
                os.replace(tmp, marker)
            except OSError:
                with contextlib.suppress(OSError):
                    tmp.unlink()

    def _raise_recent_failure(self, spec: KernelSpec, key) -> None:
        """Re-raise the CompileError of a build of this key that failed moments ago."""
        with self._memory_lock:
            failure = self._failures.get(key)
        when, message, who = (failure[0], failure[1], "this process") if failure else (0, "", "")
        if not failure and not self.read_only:
            marker = self._failure_marker(spec)
            try:
                data = json.loads(read_regular(marker, JSON_MAX).decode())
                when, message = float(data["time"]), str(data["error"])
                who = f"process {int(data['pid'])}"
            except FileNotFoundError:
                return
            except (OSError, ValueError, KeyError, TypeError, RecursionError):
                with contextlib.suppress(OSError):
                    marker.unlink()
                return
        age = time.time() - when
        if not message or not 0 <= age < _FAILURE_TTL_S:
            return
        raise CompileError(
            f"{message}\n(this build failed in {who} {age:.0f} s ago; not retried for "
            f"{_FAILURE_TTL_S:.0f} s)"
        )

    # -- damaged entries ----------------------------------------------------------------------
    def _set_aside(
        self, path: Path, spec: KernelSpec, problem: str, *, locked: bool
    ) -> KernelArtifact | None:
        """Move a corrupt entry into the quarantine (or skip it where that cannot be done);
        returns the artifact instead if a good one replaced it."""
        why = "a catalog" if self.catalog is not None else "a read-only cache"
        if not self.read_only:
            try:
                return self._quarantine(path, spec, problem, locked=locked)
            except Timeout:
                why = "its lock is held"
            except OSError as e:
                self._write_failed(e, f"could not move the corrupt entry {path} aside",
                                   "leaving it")
                why = f"cannot move it: {e.strerror or e}"
        self._warn(f"corrupt entry {path}: {problem}; skipped (left in place: {why})")
        return None

    def _quarantine(
        self, path: Path, spec: KernelSpec, problem: str, *, locked: bool
    ) -> KernelArtifact | None:
        # Move it only while holding the key's lock and after re-checking, so a good entry that a
        # builder has just put in its place is never the one moved away. (flock is not
        # re-entrant across lock objects, hence `locked` when the caller already holds it.)
        with contextlib.nullcontext() if locked else self._lock(spec):
            try:
                return self._load_checked(path, spec)  # replaced by a good one meanwhile
            except CacheCorruptionError:
                pass
            qdir = self.base / QUARANTINE
            if qdir.is_symlink():
                raise OSError(errno.ELOOP, "the quarantine is a symlink; nothing is moved out of "
                              "the cache", str(qdir))
            qdir.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            dest = qdir / f"{path.parent.name}--{path.name}-{stamp}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(path, dest)
            except FileNotFoundError:
                return None  # another process moved it first
        self._warn(f"corrupt entry {path}: {problem}; moved to {dest}, will rebuild")
        return None

    # -- maintenance ---------------------------------------------------------------------------
    def entries(self) -> list[tuple[Path, KernelSpec | None]]:
        """Every entry directory, with its spec (None if meta.json cannot be read)."""
        return [(path, _peek_spec(path)) for path in self._scan()[0]]

    def _spec_dirs(self, problems: list[tuple[Path, str]], *,
                   links: list[Path] | None = None) -> list[Path]:
        """The spec folders (real directories only: a symlinked one is never walked into, so
        maintenance stays inside the cache); symlinks with a spec folder's name go to ``links``."""
        try:
            named = [p for p in self.base.iterdir()
                     if p.name != QUARANTINE and SPEC_DIR.fullmatch(p.name)
                     ] if self.base.is_dir() else []
        except OSError as e:
            problems.append((self.base, f"cannot be listed: {e.strerror or e}"))
            return []
        if links is not None:
            links += sorted(p for p in named if p.is_symlink())
        return sorted(p for p in named if _is_real_dir(p))

    def _scan(self) -> tuple[list[Path], list[tuple[Path, str]]]:
        """The entry folders, and the folders that could not be listed."""
        problems: list[tuple[Path, str]] = []
        out = []
        for sdir in self._spec_dirs(problems):
            try:
                out += sorted(e for e in sdir.iterdir()
                              if ENTRY_DIR.fullmatch(e.name) and e.is_dir())
            except OSError as e:
                problems.append((sdir, f"cannot be listed: {e.strerror or e}"))
        return out, problems

    def verify(self) -> list[tuple[Path, str]]:
        """Load every entry and check it sits where its key says; the problems found.

        On a catalog root, also each entry's meta.json against the index, and an entry the index
        does not list is a problem (it is never served)."""
        paths, problems = self._scan()
        served = self.catalog
        if served is None and self.is_catalog_root():
            try:
                served = read_index(self.root).served()
            except CatalogError as e:
                problems.append((self.root / CATALOG_INDEX, str(e)))
        for path in paths:
            rel = path.relative_to(self.root).as_posix()
            if served is not None and rel not in served:
                problems.append((path, "not listed in the catalog's index.json (never served)"))
                continue
            try:
                art = KernelArtifact.load(path, meta_sha256=served.get(rel) if served else None)
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
        if served is not None:
            listed = {p.relative_to(self.root).as_posix() for p in paths}
            problems += [(self.root / p, "listed in index.json but missing")
                         for p in sorted(set(served) - listed)]
        return problems

    def clear(self, *, force: bool = False) -> list[tuple[Path, str]]:
        """Remove what the cache wrote (entries, quarantine, temporaries, locks, failure
        markers) and forget the in-memory table; other files in the folder stay. Returns what
        could not be removed.

        A catalog root (index.json) is refused unless ``force``; then its index goes too."""
        index = self.root / CATALOG_INDEX
        if index.exists() and not force:
            raise CatalogError(
                f"{self.root} is a flashcore catalog ({CATALOG_INDEX}); not clearing it (use "
                "--force to remove its kernels and its index)"
            )
        failed: list[tuple[Path, str]] = []
        if force and index.exists():
            _rmtree(index, failed)
        qdir = self.base / QUARANTINE
        if qdir.exists() or qdir.is_symlink():
            _rmtree(qdir, failed)  # a symlink is unlinked, its target left alone
        links: list[Path] = []
        for sdir in self._spec_dirs(failed, links=links):
            try:
                children = list(sdir.iterdir())
            except OSError as e:
                failed.append((sdir, e.strerror or str(e)))
                continue
            for p in children:
                n = p.name
                if (ENTRY_DIR.fullmatch(n) or n.startswith(_TMP_PREFIX)
                        or n.endswith((LOCK_SUFFIX, FAILED_SUFFIX))):
                    _rmtree(p, failed)
            with contextlib.suppress(OSError):
                sdir.rmdir()  # only when empty: a file of the user's keeps it
        for link in links:  # the cache's own name: the link goes, what it points to stays
            _rmtree(link, failed)
        with contextlib.suppress(OSError):
            self.base.rmdir()
        with self._memory_lock:
            self._memory.clear()
            self._failures.clear()
        return failed

    def prune(self, max_size: int | None = None, *, keep: Path | None = None) -> PruneReport:
        """Remove abandoned temporaries (see ``owner.abandoned``: their writer is gone, or they
        are older than an hour), the quarantine's contents and expired failure markers; then,
        with ``max_size`` (bytes), the least recently used entries until the cache is no larger,
        never ``keep`` (the entry just written). A catalog's entries are never evicted. Symlinks
        are removed as entries where they carry the cache's names, never followed."""
        report = PruneReport()
        for sdir in self._spec_dirs(report.failed):
            self._prune_temporaries(sdir, report)
            now = time.time()
            with contextlib.suppress(OSError):
                for f in sdir.glob(f"*{FAILED_SUFFIX}"):
                    if now - f.lstat().st_mtime > _FAILURE_TTL_S:
                        self._remove(f, report)
        qdir = self.base / QUARANTINE
        if qdir.is_symlink():  # not the cache's: the link goes, its target is never emptied
            self._remove(qdir, report)
        elif qdir.is_dir():
            with contextlib.suppress(OSError):
                for q in sorted(qdir.iterdir()):
                    self._remove(q, report)
        if max_size is not None and not self.is_catalog_root() and self.catalog is None:
            total = self.size_bytes()
            for path in sorted(self._scan()[0], key=_last_use):
                if total <= max_size:
                    break
                if keep is not None and path == keep:
                    continue
                # out of the key's name first, so no reader sees half an entry
                gone = path.with_name(_tmp_name(f"{path.name}-evict"))
                size = _tree_size(path)
                try:
                    os.rename(path, gone)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    report.failed.append((path, e.strerror or str(e)))
                    continue
                n_failed = len(report.failed)
                _rmtree(gone, report.failed)
                if len(report.failed) == n_failed:
                    report.removed.append(path)
                    report.freed_bytes += size
                    total -= size
        report.size_bytes = self.size_bytes()
        return report

    def _prune_temporaries(self, sdir: Path, report: PruneReport) -> None:
        if not _is_real_dir(sdir):  # a symlinked spec folder: not the cache's to sweep
            return
        now = time.time()
        try:
            stale = [p for p in sdir.iterdir()
                     if p.name.startswith(_TMP_PREFIX) and _is_stale_tmp(p, now)]
        except OSError:
            return
        for p in stale:
            self._remove(p, report)

    @staticmethod
    def _remove(path: Path, report: PruneReport) -> None:
        size = _tree_size(path)
        n = len(report.failed)
        _rmtree(path, report.failed)
        if len(report.failed) == n:
            report.removed.append(path)
            report.freed_bytes += size

    def _prune_to_env_limit(self, keep: Path) -> None:
        text = os.environ.get(MAX_SIZE_ENV)
        if not text:
            return
        try:
            limit = parse_size(text)
        except ValueError as e:
            self._warn(f"{MAX_SIZE_ENV}: {e}; not pruning")
            return
        size = _tree_size(keep)
        if size > limit:
            self._warn(f"{MAX_SIZE_ENV}={text} is below the size of one entry ({size} bytes, "
                       f"{keep.parent.name}); keeping the entry just written")
        self.prune(limit, keep=keep)

    def size_bytes(self) -> int:
        return _walk_size(self.base) if self.base.is_dir() else 0


def _mtime(path: Path) -> float:
    try:
        return (path / META).stat().st_mtime
    except OSError:
        return 0.0


def _last_use(path: Path) -> float:
    try:
        return path.stat().st_mtime  # put() writes it, _touch() moves it on each first load
    except OSError:
        return 0.0


def _peek_spec(path: Path) -> KernelSpec | None:
    try:
        return spec_from_dict(json.loads(read_regular(path / META, JSON_MAX).decode())["spec"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # reported, not trusted
        return None


_defaults: dict[Path, KernelCache] = {}
_defaults_lock = threading.Lock()


def default_cache() -> KernelCache:
    """The process's cache for the current root (``$FLASHCORE_CACHE_DIR`` is read each call).

    A catalog root (index.json) is opened as a catalog: only what its index lists is served.
    ``FLASHCORE_CATALOG_SHA256``, when set, pins it: the folder must then be a catalog whose
    index.json has that sha256, else CatalogError (a folder without an index is never used as
    a plain, writable cache under a pin)."""
    root = cache_root().resolve()
    pin = (os.environ.get(CATALOG_SHA256_ENV) or "").strip().lower() or None
    with _defaults_lock:
        cache = _defaults.get(root)
        if cache is None or (pin is not None and cache.catalog_sha256 != pin):
            index_path = root / CATALOG_INDEX
            if pin is not None or index_path.exists() or index_path.is_symlink():
                try:
                    index = read_index(root, sha256=pin)  # no index under a pin: refused
                except CatalogError as e:
                    if pin is None:
                        raise
                    raise CatalogError(f"{CATALOG_SHA256_ENV} is set: {e}") from None
                cache = KernelCache(root, catalog=index.served(), catalog_sha256=index.sha256)
            else:
                cache = KernelCache(root)
            _defaults[root] = cache
        return cache


def use_catalog(root: Path, served: dict[str, str], sha256: str | None = None) -> KernelCache:
    """Make the process's cache for ``root`` serve exactly ``served`` (a verified index's
    entries, ``sha256`` that index's: ``load_catalog`` calls this)."""
    root = Path(root).resolve()
    with _defaults_lock:
        cache = _defaults[root] = KernelCache(root, catalog=served, catalog_sha256=sha256)
        return cache
