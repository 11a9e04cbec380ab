"""Building a catalog folder in place of another (``flashcore precompile --out DIR``).

The new catalog is built in a stage folder beside DIR (``.DIR.new-<owner>-<random>``) and
swapped in by two renames: DIR, if there, goes aside as ``.DIR.old-<owner>-<random>`` (whole and
recoverable until the new one is in place), the stage becomes DIR, and only then is the old one
removed. Folders are made with ``mkdir``'s mode and the umask, as any other.

What may be replaced: nothing (DIR missing), an empty folder, or a folder that ``read_index``
accepts as a catalog. Anything else (a project that happens to hold an ``index.json``, an
old-format catalog) is refused and left untouched; this is checked before building and again
just before the swap.

Stages of killed builds (``.DIR.new-``/``.DIR.build-``, and ``.DIR.old-`` once DIR exists again)
are removed by the next build into DIR when their owner is a dead process of this host or nothing
in them changed for a day (see ``owner.py``: a pid of another host is not believed).

Reusing the old catalog's kernels: its checksums prove only that it is self-consistent (whoever
could write the folder could rewrite them), so its entries are reused only when its index.json
is vouched for from outside the folder: it has the pinned sha256 (``FLASHCORE_CATALOG_SHA256``),
or the sha256 that this user's last build into DIR recorded in the cache folder
(``<cache root>/catalogs/``). Otherwise every kernel is compiled again. A reused entry is loaded
and checked against the index (meta.json's sha256, then the cubin's) and re-saved from the
checked bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CatalogError
from ..specs import KernelSpec
from .artifact import KernelArtifact
from .cache import KernelCache, cache_root
from .catalog import catalog_sha256, write_catalog
from .catalog_index import CATALOG_SHA256_ENV, INDEX, CatalogIndex, read_index
from .layout import LAYOUT, entry_name, spec_dir_name
from .owner import OWNER, abandoned, owner_tag, parse_owner
from .safe_read import JSON_MAX, read_regular

STAGE_KINDS = ("new", "build", "old")
_STALE_STAGE_S = 24 * 3600.0  # no file in it changed for this long: abandoned, whoever owns it
_RECORDS = "catalogs"  # beside the cache's v1/: the index sha256 of each catalog built


@dataclass(frozen=True)
class Target:
    """What ``--out`` holds now: nothing, an empty folder, or a catalog (``index``)."""

    path: Path
    exists: bool
    index: CatalogIndex | None


@dataclass
class BuiltCatalog:
    """What ``build_catalog_folder`` did."""

    kernels: int
    sha256: str  # of the new index.json
    reused: int = 0
    not_reused: str | None = None  # why the old catalog's kernels were compiled again
    swept: list[Path] = field(default_factory=list)


def check_target(out: Path) -> Target:
    """``out`` as a build target; CatalogError (the folder untouched) unless it is missing,
    empty, or a catalog ``read_index`` accepts."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return Target(out, False, None)
    if not out.is_dir():
        raise CatalogError(f"{out}: exists and is not a folder")
    try:
        empty = not any(out.iterdir())
    except OSError as e:
        raise CatalogError(f"{out}: cannot be listed ({e.strerror or e})") from None
    if empty:
        return Target(out, True, None)
    if not (out / INDEX).exists() and not (out / INDEX).is_symlink():
        why = f"no {INDEX}"
    else:
        try:
            return Target(out, True, read_index(out))
        except CatalogError as e:
            why = f"its {INDEX} is not a catalog index this flashcore reads: {e}"
    raise CatalogError(
        f"{out}: not empty and not a flashcore catalog ({why}); refusing to replace it "
        "(choose a new or empty folder, or remove this one yourself)"
    )


def _stage_pattern(out: Path) -> re.Pattern:
    return re.compile(
        rf"\.{re.escape(out.name)}\.(?P<kind>{'|'.join(STAGE_KINDS)})-{OWNER}-[0-9a-f]{{8}}"
    )


def _make_stage(out: Path, kind: str) -> Path:
    """A new folder beside ``out`` named as this process's ``kind`` stage (mode: the umask's)."""
    path = out.parent / f".{out.name}.{kind}-{owner_tag()}-{uuid.uuid4().hex[:8]}"
    os.mkdir(path)  # not mkdtemp: its 0700 would become the catalog's mode
    return path


def _last_change(path: Path) -> float:
    """The newest mtime in a tree, symlinks not followed (a stage's top folder changes only
    when it is made)."""
    newest = path.lstat().st_mtime
    for top, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                newest = max(newest, os.lstat(os.path.join(top, name)).st_mtime)
    return newest


def sweep_stale_stages(out: Path) -> list[Path]:
    """Remove the abandoned stages of builds into ``out`` (see the module doc); those removed."""
    out = Path(out)
    pattern = _stage_pattern(out)
    try:
        names = os.listdir(out.parent)
    except OSError:
        return []
    out_there = out.exists()
    removed = []
    now = time.time()
    for name in names:
        m = pattern.fullmatch(name)
        if not m or (m["kind"] == "old" and not out_there):
            continue  # an old catalog whose replacement never arrived: the only copy, kept
        path = out.parent / name
        try:
            if not stat.S_ISDIR(path.lstat().st_mode):
                continue  # a symlink or a file with our name is not our stage
            if not abandoned(parse_owner(m), _last_change(path), _STALE_STAGE_S, now):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed


def _record_path(out: Path) -> Path | None:
    root = cache_root()
    try:
        inside = root.resolve().is_relative_to(out.resolve())
    except (OSError, RuntimeError):
        return None
    if inside or (root / INDEX).exists():  # a catalog is never written to, by this neither
        return None
    key = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:32]
    return root / _RECORDS / f"{key}.json"


def recorded_sha256(out: Path) -> str | None:
    """The index sha256 this user's last build into ``out`` recorded, if any."""
    path = _record_path(out)
    if path is None:
        return None
    try:
        data = json.loads(read_regular(path, JSON_MAX).decode())
        if data["path"] == str(out.resolve()):
            return str(data["index_sha256"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass
    return None


def _record(out: Path, digest: str) -> None:
    """Best effort: without the record the next build compiles everything again."""
    path = _record_path(out)
    if path is None:
        return
    tmp = path.with_name(f".tmp-{path.name}-{owner_tag()}-{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"path": str(out.resolve()), "index_sha256": digest}))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _reusable(target: Target, pin: str | None) -> tuple[KernelCache | None, str | None]:
    """The old catalog as a cache to reuse kernels from, or None and why not."""
    index = target.index
    if index is None:
        return None, None
    if pin is not None:
        if index.sha256 == pin:
            return KernelCache(target.path, catalog=index.served(),
                               catalog_sha256=index.sha256), None
        return None, (f"its {INDEX} (sha256 {index.sha256}) is not the one pinned by "
                      f"{CATALOG_SHA256_ENV}")
    if recorded_sha256(target.path) == index.sha256:
        return KernelCache(target.path, catalog=index.served(), catalog_sha256=index.sha256), None
    return None, (f"its {INDEX} is not the one flashcore last wrote there (pin it with "
                  f"{CATALOG_SHA256_ENV} to reuse its kernels)")


def _reuse(previous: KernelCache, index: CatalogIndex, spec: KernelSpec,
           keep_without_ir: bool) -> KernelArtifact | None:
    art = previous.get(spec)  # meta.json checked against the index, the blobs against meta
    if art is None or not (art.ir or keep_without_ir):
        return None
    path = f"{LAYOUT}/{spec_dir_name(spec)}/" + entry_name(
        art.source_hash, art.toolchain.get("nvidia-cutlass-dsl"))
    listed = {k["path"]: k["cubin_sha256"] for k in index.kernels}.get(path)
    if listed != hashlib.sha256(art.cubin).hexdigest():
        return None
    return art


def build_catalog_folder(
    specs: list[KernelSpec],
    out: Path,
    compile_many: Callable[[list[KernelSpec], KernelCache], list[KernelArtifact]],
    *,
    no_ir: bool = False,
    pin: str | None = None,
) -> BuiltCatalog:
    """Build a catalog of ``specs`` into ``out`` (see the module doc): ``compile_many(specs,
    cache)`` compiles into the stage's cache. ``pin``: the sha256 the old catalog's index must
    have for its kernels to be reused (default ``$FLASHCORE_CATALOG_SHA256``)."""
    out = Path(out)
    pin = (pin or os.environ.get(CATALOG_SHA256_ENV) or "").strip().lower() or None
    target = check_target(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    swept = sweep_stale_stages(out)
    stage = _make_stage(out, "new")
    scratch = old = None
    try:
        if no_ir:  # compile (with IR) beside it, keep cubins and metadata only
            scratch = _make_stage(out, "build")
        cache = KernelCache(scratch or stage)
        previous, not_reused = _reusable(target, pin)
        reused = 0
        for spec in specs if previous is not None else []:
            art = _reuse(previous, target.index, spec, no_ir)
            if art is not None:
                cache.put(art)  # re-saved from the checked bytes
                reused += 1
        arts = compile_many(specs, cache)
        if no_ir:
            slim = KernelCache(stage)
            arts = [dataclasses.replace(art, ir="") for art in arts]
            for art in arts:
                slim.put(art)
        write_catalog(stage, arts)
        digest = catalog_sha256(stage)
        check_target(out)  # still nothing, empty or a catalog: it may have changed meanwhile
        if out.exists() or out.is_symlink():
            old = out.parent / f".{out.name}.old-{owner_tag()}-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
        try:
            os.rename(stage, out)
        except OSError:
            if old is not None:
                os.rename(old, out)
                old = None
            raise
        _record(out, digest)
        return BuiltCatalog(len(arts), digest, reused, not_reused, swept)
    finally:
        for d in (stage, scratch, old):
            if d is not None and (d.exists() or d.is_symlink()):
                _remove(d)


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(OSError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)
