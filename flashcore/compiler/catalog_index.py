"""A catalog's index.json: reading and checking it (paths, checksums, format, a pin)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import CacheCorruptionError, CatalogError, SpecError
from ..specs import spec_from_dict
from .artifact import META, KernelArtifact
from .layout import CATALOG_INDEX, ENTRY_DIR, LAYOUT, spec_dir_name
from .safe_read import INDEX_MAX, JSON_MAX, read_regular

INDEX = CATALOG_INDEX
CATALOG_FORMAT = 2  # 2: specs carry a TileConfig; the kernel sources moved (rebuild format 1)
CATALOG_SHA256_ENV = "FLASHCORE_CATALOG_SHA256"
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class CatalogIndex:
    """A catalog's index.json, checked for shape (not yet against the entries)."""

    root: Path
    data: dict  # as parsed: format, flashcore, archs, kernels
    sha256: str  # of index.json's bytes

    @property
    def kernels(self) -> list[dict]:
        return self.data["kernels"]

    def served(self) -> dict[str, str]:
        """Entry path (``v1/<spec dir>/<entry>``) -> the sha256 its meta.json must have."""
        return {k["path"]: k["meta_sha256"] for k in self.kernels}


def _index_problem(root: Path, what: str) -> CatalogError:
    return CatalogError(f"{root / INDEX}: {what}")


def _check_entry(root: Path, i: int, k) -> None:
    if not isinstance(k, dict):
        raise _index_problem(root, f"kernels[{i}] is {type(k).__name__}, not an object")
    want = {"name": str, "arch": str, "spec": dict, "path": str, "cubin_sha256": str,
            "meta_sha256": str}
    missing = sorted(set(want) - set(k))
    if missing:
        raise _index_problem(root, f"kernels[{i}] lacks {', '.join(missing)}")
    for key, typ in want.items():
        if not isinstance(k[key], typ):
            raise _index_problem(
                root, f"kernels[{i}].{key} is {type(k[key]).__name__}, not {typ.__name__}"
            )
    where = f"kernels[{i}] ({k['name']})"
    for key in ("cubin_sha256", "meta_sha256"):
        if not _HEX64.fullmatch(k[key]):
            raise _index_problem(root, f"{where}.{key} {k[key]!r} is not a sha256 (64 hex)")
    try:
        spec = spec_from_dict(k["spec"])
    except (SpecError, KeyError, TypeError, ValueError) as e:
        raise _index_problem(root, f"{where}.spec is not a valid spec: {e}") from None
    if spec.name != k["name"] or spec.arch != k["arch"]:
        raise _index_problem(root, f"{where}: name or arch does not match its spec ({spec.name})")
    path = k["path"]
    rel = PurePosixPath(path)
    parts = rel.parts
    if (
        rel.is_absolute()
        or "\\" in path
        or ".." in parts
        or len(parts) != 3
        or parts[0] != LAYOUT
        or parts[1] != spec_dir_name(spec)
        or not ENTRY_DIR.fullmatch(parts[2])
    ):
        raise _index_problem(
            root,
            f"{where}.path {path!r} is not {LAYOUT}/{spec_dir_name(spec)}/<entry> inside the "
            "catalog (refusing a path that leaves it)",
        )
    try:
        resolved = (root / path).resolve()
        inside = resolved.is_relative_to(root.resolve())
    except (OSError, RuntimeError) as e:  # symlink loops
        raise _index_problem(root, f"{where}.path {path!r} cannot be resolved: {e}") from None
    if not inside:
        raise _index_problem(root, f"{where}.path {path!r} leads outside the catalog ({resolved})")


def read_index(root: str | Path, *, sha256: str | None = None) -> CatalogIndex:
    """Read ``root/index.json`` and check its shape; CatalogError naming any problem.

    ``sha256``: the value index.json's sha256 must have (a pin: the index names every entry's
    checksums, so pinning it pins the whole catalog). Only a regular file of at most
    ``INDEX_MAX`` bytes is read (a FIFO or a device is refused, never waited on)."""
    root = Path(root)
    try:
        raw = read_regular(root / INDEX, INDEX_MAX)
    except FileNotFoundError:
        if sha256 is not None:
            raise CatalogError(
                f"{root} has no {INDEX}, but a catalog sha256 is pinned ({sha256.strip()}); "
                "refusing it (a pinned folder must be the catalog you pinned)"
            ) from None
        raise CatalogError(f"{root} is not a flashcore catalog: no {INDEX}") from None
    except OSError as e:
        raise CatalogError(f"{root / INDEX} is unreadable: {e.strerror or e}") from None
    digest = hashlib.sha256(raw).hexdigest()
    if sha256 is not None and digest != sha256.strip().lower():
        raise CatalogError(
            f"{root / INDEX}: sha256 {digest}, but the pinned value is {sha256.strip()}; "
            "refusing this catalog (it is not the one you pinned)"
        )
    try:
        index = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CatalogError(f"{root / INDEX} is unreadable: {e}") from None
    if not isinstance(index, dict):
        raise _index_problem(root, f"not a catalog index (a {type(index).__name__})")
    if index.get("format") != CATALOG_FORMAT:
        raise CatalogError(
            f"{root / INDEX}: catalog format {index.get('format')!r}, this flashcore reads "
            f"{CATALOG_FORMAT}; remove the folder and rebuild it with: flashcore precompile "
            f"--arch ... --out {root}"
        )
    for key, typ in (("archs", list), ("kernels", list)):
        if key not in index:
            raise _index_problem(root, f"no {key!r} list")
        if not isinstance(index[key], typ):
            raise _index_problem(root, f"{key!r} is {type(index[key]).__name__}, not a list")
    for i, k in enumerate(index["kernels"]):
        _check_entry(root, i, k)
    archs = sorted({k["arch"] for k in index["kernels"]})
    if index["archs"] != archs:
        raise _index_problem(root, f"archs {index['archs']!r} are not its kernels' {archs}")
    paths = [k["path"] for k in index["kernels"]]
    if len(set(paths)) != len(paths):
        raise _index_problem(root, "lists one path twice")
    return CatalogIndex(root, index, digest)


def verify_index(root: Path, sha256: str | None = None) -> CatalogIndex:
    """``read_index``, then every entry checked against it (``verify_catalog``)."""
    root = Path(root)
    index = read_index(root, sha256=sha256)
    for k in index.kernels:
        where = root / k["path"]
        try:
            meta = read_regular(where / META, JSON_MAX)
        except FileNotFoundError:
            raise CatalogError(f"catalog entry {k['name']} is missing ({where})") from None
        except OSError as e:
            raise CatalogError(
                f"catalog entry {k['name']} is unreadable ({where / META}: {e.strerror or e})"
            ) from None
        if hashlib.sha256(meta).hexdigest() != k["meta_sha256"]:
            raise CatalogError(f"catalog entry {k['name']} was modified: {where}/meta.json")
        try:
            art = KernelArtifact.load(where, meta_sha256=k["meta_sha256"])
        except CacheCorruptionError as e:
            raise CatalogError(f"catalog entry {k['name']} is damaged: {e}") from None
        if art.spec.to_dict() != k["spec"]:
            raise CatalogError(f"catalog entry {k['name']} holds {art.spec.name}, not its spec")
        if hashlib.sha256(art.cubin).hexdigest() != k["cubin_sha256"]:
            raise CatalogError(f"catalog entry {k['name']}: cubin differs from the index")
    return index


def catalog_sha256(root: str | Path) -> str:
    """The sha256 of a verified catalog's index.json: the value to pin it with."""
    return verify_index(Path(root), None).sha256
