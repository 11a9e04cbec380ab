"""Who left a temporary file or folder (a cache's ``.tmp-*``, a compile's build folder, a
precompile's stage), and whether it is abandoned.

A pid means something only in the pid namespace and boot it came from: containers that share
``/tmp`` or a cache folder see each other's files, and a pid dead here may be a live process
there (or a pid alive here another process). So a temporary's name carries an owner,
``h<host tag>-<pid>``, where the host tag hashes the boot id, this process's pid namespace and
the host name. The pid is believed only under this process's own tag; a temporary of another
host, or of a flashcore whose names carry no tag, is abandoned only by age.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

OWNER = r"h(?P<host>[0-9a-f]{8})-(?P<pid>\d+)"


@dataclass(frozen=True)
class Owner:
    host: str  # host tag
    pid: int


@functools.lru_cache(maxsize=1)
def host_tag() -> str:
    """8 hex digits naming this boot, pid namespace and host name (pids compare only within)."""
    parts = [socket.gethostname()]
    for read in (lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                 lambda: os.readlink("/proc/self/ns/pid")):
        try:
            parts.append(read())
        except OSError:
            parts.append("?")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def owner_tag() -> str:
    """This process as the owner of what it writes: ``h<host tag>-<pid>``."""
    return f"h{host_tag()}-{os.getpid()}"


def parse_owner(match: re.Match | None) -> Owner | None:
    """The Owner of a match of a pattern that includes ``OWNER``; None without a match."""
    return Owner(match["host"], int(match["pid"])) if match else None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a process in this pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: it exists, owned by someone else
        return True
    return True


def is_mine(owner: Owner | None) -> bool:
    return owner is not None and owner.host == host_tag() and owner.pid == os.getpid()


def abandoned(owner: Owner | None, last_change: float, max_age_s: float,
              now: float | None = None) -> bool:
    """A temporary is abandoned when its owner is of this host and dead, or (any owner, pid
    reuse included) when it has not changed for ``max_age_s``."""
    now = time.time() if now is None else now
    if owner is not None and owner.host == host_tag() and not pid_alive(owner.pid):
        return True
    return now - last_change > max_age_s
