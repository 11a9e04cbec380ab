"""A compiled kernel as a value: PTX, cubin, entry point, ABI and resources, and its on-disk form.

``save`` writes the blobs as plain files plus ``meta.json`` holding everything else, the sha256 of
each blob and a sha256 over meta's own canonical content. ``load`` checks all of it, so a flipped
byte, a truncated, missing or unreadable file (permissions, a directory in its place, a symlink
loop, an I/O error) or broken JSON raises CacheCorruptionError instead of handing a damaged cubin
to the driver. These checksums sit beside the data: they prove it is intact, not who wrote it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CacheCorruptionError, SpecError
from ..specs import KernelSpec, spec_from_dict
from .safe_read import CUBIN_MAX, JSON_MAX, TEXT_MAX, read_regular

ARTIFACT_FORMAT = 1
META = "meta.json"
CUBIN = "kernel.cubin"
PTX = "kernel.ptx"
MLIR = "kernel.mlir"
_META_HASH = "meta_sha256"
_LIMITS = {META: JSON_MAX, CUBIN: CUBIN_MAX, PTX: TEXT_MAX, MLIR: TEXT_MAX}


@dataclass(frozen=True)
class ParamInfo:
    """One kernel parameter as declared in the PTX ``.entry``."""

    name: str
    size: int
    align: int
    ptx_type: str  # ".u64", ".u32", ".f32", ".b8" (a struct passed by value), ...


@dataclass(frozen=True)
class Resources:
    """What one CTA of the kernel uses, read from the cubin (spills from ptxas, when available)."""

    registers: int
    stack_frame_bytes: int
    spill_store_bytes: int | None
    spill_load_bytes: int | None
    smem_static_bytes: int
    smem_dynamic_bytes: int
    threads_per_block: int  # 0 when the kernel does not fix its block size


@dataclass(frozen=True, repr=False)
class KernelArtifact:
    spec: KernelSpec  # AttentionSpec or QuantizeSpec
    ptx: str
    cubin: bytes
    entry: str
    params: tuple[ParamInfo, ...]
    block: tuple[int, int, int]
    smem_dynamic: int
    resources: Resources
    toolchain: dict[str, str] = field(hash=False)
    source_hash: str
    ir: str = ""

    def __repr__(self) -> str:
        # short: the PTX and IR run to hundreds of kilobytes
        r = self.resources
        return (
            f"KernelArtifact({self.spec.name}, entry={self.entry}, cubin={len(self.cubin)} B, "
            f"ptx={len(self.ptx)} chars, ir={len(self.ir)} chars, registers={r.registers}, "
            f"smem_dynamic={self.smem_dynamic} B, stack={r.stack_frame_bytes} B, "
            f"spills={r.spill_store_bytes}/{r.spill_load_bytes} B, block={self.block})"
        )

    def save(self, directory: Path) -> None:
        """Write the artifact into ``directory`` (created if needed); meta.json is written last."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        blobs = {CUBIN: self.cubin, PTX: self.ptx.encode()}
        if self.ir:
            blobs[MLIR] = self.ir.encode()
        else:
            (directory / MLIR).unlink(missing_ok=True)  # no stale IR from an earlier save
        for name, data in blobs.items():
            (directory / name).write_bytes(data)
        meta = self._meta()
        meta["files"] = {
            name: {"sha256": _sha256(data), "size": len(data)} for name, data in blobs.items()
        }
        meta[_META_HASH] = _sha256(_canonical(meta).encode())
        # Without meta.json a directory is not an artifact, so a save cut short is never loaded.
        (directory / META).write_text(_meta_text(meta))

    @classmethod
    def load(cls, directory: Path, *, meta_sha256: str | None = None) -> KernelArtifact:
        """Read and verify an artifact written by ``save``; CacheCorruptionError on any damage.

        ``meta_sha256``: the sha256 its meta.json must have (a catalog's index records it)."""
        directory = Path(directory)
        meta = _read_meta(directory / META, meta_sha256)
        blobs = {}
        for name, want in meta["files"].items():
            if name not in (CUBIN, PTX, MLIR):
                raise CacheCorruptionError(f"{directory / META}: lists unknown file {name!r}")
            blobs[name] = _read_blob(directory / name, want)
        for required in (CUBIN, PTX):
            if required not in blobs:
                raise CacheCorruptionError(f"{directory / META}: lists no {required}")
        try:
            return cls._from_meta(meta, blobs)
        except (KeyError, TypeError, ValueError, UnicodeDecodeError, SpecError) as e:
            raise CacheCorruptionError(
                f"{directory / META}: does not describe a valid artifact: {type(e).__name__}: {e}"
            ) from e

    # -- meta.json -----------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return {
            "format": ARTIFACT_FORMAT,
            "spec": self.spec.to_dict(),
            "entry": self.entry,
            "params": [dataclasses.asdict(p) for p in self.params],
            "block": list(self.block),
            "smem_dynamic": self.smem_dynamic,
            "resources": dataclasses.asdict(self.resources),
            "toolchain": dict(self.toolchain),
            "source_hash": self.source_hash,
        }

    @classmethod
    def _from_meta(cls, meta: dict[str, Any], blobs: dict[str, bytes]) -> KernelArtifact:
        block = tuple(int(x) for x in meta["block"])
        if len(block) != 3:
            raise ValueError(f"block {meta['block']} is not three numbers")
        toolchain = meta["toolchain"]
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in toolchain.items()):
            raise ValueError("toolchain must map strings to strings")
        return cls(
            spec=spec_from_dict(meta["spec"]),
            ptx=blobs[PTX].decode(),
            cubin=blobs[CUBIN],
            entry=_str(meta["entry"]),
            params=tuple(ParamInfo(**p) for p in meta["params"]),
            block=block,  # type: ignore[arg-type]
            smem_dynamic=int(meta["smem_dynamic"]),
            resources=Resources(**meta["resources"]),
            toolchain=dict(toolchain),
            source_hash=_str(meta["source_hash"]),
            ir=blobs[MLIR].decode() if MLIR in blobs else "",
        )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(meta: dict[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != _META_HASH}
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _meta_text(meta: dict[str, Any]) -> str:
    # One fixed layout, so load can also insist on it: then no byte of meta.json is free to change.
    return json.dumps(meta, sort_keys=True, indent=1) + "\n"


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {v!r}")
    return v


def _read_bytes(path: Path) -> bytes:
    """The file's bytes; any failure to read it (not only a missing file) is damage, and so is
    anything but a regular file of at most its kind's size (a FIFO, ``/dev/zero``)."""
    try:
        return read_regular(path, _LIMITS[path.name])
    except FileNotFoundError:
        raise CacheCorruptionError(f"{path}: missing") from None
    except OSError as e:  # PermissionError, IsADirectoryError, ELOOP, EIO, ...
        raise CacheCorruptionError(
            f"{path}: unreadable ({type(e).__name__}: {e.strerror or e})"
        ) from None


def _read_meta(path: Path, want_sha256: str | None = None) -> dict[str, Any]:
    raw = _read_bytes(path)
    if want_sha256 is not None and _sha256(raw) != want_sha256:
        raise CacheCorruptionError(
            f"{path}: sha256 {_sha256(raw)[:16]}... is not the {want_sha256[:16]}... its catalog "
            "index records (modified)"
        )
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise CacheCorruptionError(f"{path}: not UTF-8 text ({e})") from None
    try:
        meta = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise CacheCorruptionError(f"{path}: broken JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        raise CacheCorruptionError(f"{path}: not an artifact's meta (no 'files' table)")
    if meta.get(_META_HASH) != _sha256(_canonical(meta).encode()):
        raise CacheCorruptionError(
            f"{path}: checksum mismatch (content changed since it was saved)"
        )
    if text != _meta_text(meta):
        raise CacheCorruptionError(f"{path}: not in the layout flashcore writes (edited by hand?)")
    if meta.get("format") != ARTIFACT_FORMAT:
        raise CacheCorruptionError(
            f"{path}: artifact format {meta.get('format')!r}, this flashcore reads {ARTIFACT_FORMAT}"
        )
    return meta


def _read_blob(path: Path, want: Any) -> bytes:
    if not isinstance(want, dict) or not {"sha256", "size"} <= set(want):
        raise CacheCorruptionError(f"{path}: meta.json has no checksum for it")
    data = _read_bytes(path)
    if len(data) != want["size"]:
        raise CacheCorruptionError(
            f"{path}: {len(data)} bytes, expected {want['size']} (truncated or appended to)"
        )
    if _sha256(data) != want["sha256"]:
        raise CacheCorruptionError(f"{path}: checksum mismatch (sha256 {_sha256(data)[:16]}...)")
    return data
