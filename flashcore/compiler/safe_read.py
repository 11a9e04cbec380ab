"""Reading the files of a cache or catalog that anyone may have planted: regular files only, and
never more than a cap for their kind.

A FIFO would block ``open`` or ``read`` forever, a device (``/dev/zero``) never ends, and a huge
file costs all memory; so a path is ``stat``-ed before it is opened (a device is never opened),
opened non-blocking, ``fstat``-ed again (it may have been swapped meanwhile) and read to at most
its cap plus one byte. Every refusal is an ``OSError`` naming the problem, which the callers
already report as damage (a quarantined entry, an unreadable index).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

MiB = 1 << 20
JSON_MAX = 4 * MiB  # meta.json, failure markers, a dump's resources.json
INDEX_MAX = 64 * MiB  # a catalog's index.json: about 1 KiB per kernel
CUBIN_MAX = 64 * MiB  # real cubins are well under a few MiB
TEXT_MAX = 512 * MiB  # PTX and MLIR run to tens of MiB for the largest kernels

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


class UnsafeFileError(OSError):
    """A path that is not a regular file, or larger than its cap."""


def _check(path: Path, st: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        code = errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL
        raise UnsafeFileError(code, f"is {kind}, not a regular file; not read", str(path))
    if st.st_size > limit:
        raise UnsafeFileError(errno.EFBIG, f"{st.st_size} bytes, more than the {limit} bytes "
                              "a file of its kind may have; not read", str(path))


def read_regular(path: Path | str, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (a symlink to one is followed); ``OSError`` if it
    is missing or unreadable, ``UnsafeFileError`` (an OSError) if it is not a regular file or
    holds more than ``limit`` bytes."""
    path = Path(path)
    _check(path, os.stat(path), limit)  # before open: opening a FIFO or a device has effects
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _check(path, os.fstat(fd), limit)  # what was opened, if it changed since the stat
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, min(limit + 1 - size, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:  # grown since the fstat
                raise UnsafeFileError(errno.EFBIG, f"more than the {limit} bytes a file of its "
                                      "kind may have; not read", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)
