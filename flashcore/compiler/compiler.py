"""spec -> KernelArtifact: compile through the CuTe DSL in worker processes, keyed in the cache.

The DSL fixes its target arch when ``cutlass`` is imported (CUTE_DSL_ARCH), and ``cute.compile`` is
not thread-safe, so every compile runs in a fresh worker process with the spec's arch set. The
parent never imports the DSL: it reads the products back and assembles the artifact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import CompileError, KernelNotAvailableError
from ..specs import KernelSpec, dsl_arch
from ..version import __version__
from .abi import check_against_entry, params_for
from .artifact import KernelArtifact
from .cache import KernelCache, TransientCompileError, default_cache
from .cubin_info import read_resources
from .fingerprint import (
    PACKAGE,
    build_source_files,
    dsl_fingerprint,
    fresh_source_hash,
    source_hash,
    worker_env,
)
from .owner import OWNER, abandoned, is_mine, owner_tag, parse_owner
from .ptx_info import parse_entry, parse_reqntid, ptx_isa_version, ptx_target

_WORKER_TIMEOUT_S = 600
_WORKER = PACKAGE / "kernels" / "worker.py"
_BUILD_PREFIX = "flashcore-build-"
_BUILD_DIR = re.compile(rf"{_BUILD_PREFIX}{OWNER}-")
# a build folder this old is abandoned whoever owns it: a worker runs at most _WORKER_TIMEOUT_S
_STALE_BUILD_S = 3600.0


def can_compile() -> bool:
    """True when this host has the CuTe DSL (compiling needs no GPU)."""
    return dsl_fingerprint() is not None


def compile_kernel(spec: KernelSpec, *, cache: KernelCache | None = None) -> KernelArtifact:
    """The artifact for ``spec``: from memory, from the disk cache, or freshly compiled."""
    cache = cache or default_cache()
    return cache.get_or_build(spec, _build_one)


def compile_many(
    specs: Iterable[KernelSpec],
    *,
    jobs: int | None = None,
    cache: KernelCache | None = None,
    progress: Callable[[KernelSpec], None] | None = None,
) -> list[KernelArtifact]:
    """Compile many specs in parallel worker processes (one process per spec); ``jobs``: how
    many at once, an int >= 1 (default: one per CPU core)."""
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"compile_many: jobs must be an int >= 1 or None, got {jobs!r}")
    cache = cache or default_cache()
    specs = list(specs)
    jobs = jobs or max(1, min(len(specs), os.cpu_count() or 1))

    def one(spec: KernelSpec) -> KernelArtifact:
        art = cache.get_or_build(spec, _build_one)
        if progress:
            progress(spec)
        return art

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, specs))


def _build_one(spec: KernelSpec) -> KernelArtifact:
    if not can_compile():
        raise KernelNotAvailableError(
            f"kernel {spec.name} is not in the cache and this host cannot compile it "
            f"(nvidia-cutlass-dsl is not installed).\n  spec: {spec.to_json()}\n"
            "Build it on any machine with the DSL (no GPU needed), e.g.\n"
            "  python -c 'import flashcore; from flashcore.specs import spec_from_dict; "
            f"flashcore.compile_kernel(spec_from_dict({spec.to_dict()!r}))'\n"
            "then copy that machine's cache folder here and point FLASHCORE_CACHE_DIR at it "
            "(or use flashcore.load_catalog)."
        )
    key = source_hash()
    sweep_stale_build_dirs()
    with tempfile.TemporaryDirectory(prefix=f"{_BUILD_PREFIX}{owner_tag()}-") as tmp:
        out = Path(tmp)
        imported = _run_worker([spec], out)
        try:
            art = _assemble(spec, out / "0")
        except CompileError:
            raise
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            # the worker said it succeeded but its products are missing or broken
            raise CompileError(
                f"{spec.name}: the compile worker's output is missing or unreadable "
                f"({type(e).__name__}: {e})"
            ) from e
    if fresh_source_hash() != key:
        raise CompileError(
            f"{spec.name}: flashcore's kernel sources changed while it compiled; the result is "
            "not stored (restart the process to build from the new sources)"
        )
    _check_imports(spec, imported)
    return art


def sweep_stale_build_dirs() -> list[Path]:
    """Remove the ``$TMPDIR/flashcore-build-*`` folders of builds killed before they could clean
    up: their owner is a dead process of this host, or they are older than an hour (another
    container sharing ``$TMPDIR``, an older flashcore's names: a pid is not believed there; see
    ``owner.py``). The folders removed."""
    removed = []
    tmp = Path(tempfile.gettempdir())
    try:
        candidates = list(tmp.glob(f"{_BUILD_PREFIX}*"))
    except OSError:
        return removed
    now = time.time()
    for d in candidates:
        owner = parse_owner(_BUILD_DIR.match(d.name))
        try:
            st = d.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or is_mine(owner):
            continue  # a symlink or file is not a build folder; this process's are in use
        if not abandoned(owner, st.st_mtime, _STALE_BUILD_S, now):
            continue
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            removed.append(d)
    return removed


def _check_imports(spec: KernelSpec, imported: list[str]) -> None:
    """Every flashcore file the worker ran must be one the cache key hashes."""
    hashed = {str(p.resolve()) for p in build_source_files()}
    outside = sorted(f for f in imported if f not in hashed)
    if outside:
        raise CompileError(
            f"{spec.name}: the compile worker imported {outside}, which the cache key does not "
            "cover (flashcore/compiler/fingerprint.py BUILD_SOURCES)"
        )


def _run_worker(specs: list[KernelSpec], out: Path) -> list[str]:
    """Run one worker over ``specs`` (one arch) into ``out``; the flashcore files it imported."""
    archs = {dsl_arch(s) for s in specs}
    if len(archs) != 1:
        raise ValueError(f"one worker compiles one DSL target, got {sorted(archs)}")
    env = worker_env(archs.pop(), out / "ir")
    names = [s.name for s in specs]
    try:
        proc = subprocess.run(
            [sys.executable, str(_WORKER), str(out)],
            input=json.dumps([s.to_dict() for s in specs]),
            check=False,
            capture_output=True,
            text=True,
            env=env,
            cwd=out,
            timeout=_WORKER_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        # a loaded host, not the kernel: not remembered as this kernel's failure
        raise TransientCompileError(
            f"compiling {names}: the worker took over {_WORKER_TIMEOUT_S} s and was stopped"
        ) from None
    tail = "\n".join((proc.stderr or "").strip().splitlines()[-30:])
    if proc.returncode < 0:  # killed (the OOM killer, a user): says nothing about the kernel
        raise TransientCompileError(
            f"compiling {names}: worker killed by {_signal_name(-proc.returncode)}"
            + (f"; its last output:\n{tail}" if tail else " (no output)")
        )
    if proc.returncode != 0:
        raise CompileError(
            f"compiling {names} failed (worker exit status {proc.returncode})"
            + (f":\n{tail}" if tail else ", with no output on stderr")
        )
    imported: set[str] = set()
    for i in range(len(specs)):
        report = out / str(i) / "build.json"
        try:
            imported.update(json.loads(report.read_text())["imported"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CompileError(
                f"compiling {names}: the worker exited 0 but its report {report} is missing or "
                f"unreadable ({type(e).__name__}: {e})"
            ) from None
    return sorted(imported)


def _signal_name(number: int) -> str:
    """``signal 9 (SIGKILL)``."""
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


def _assemble(spec: KernelSpec, d: Path) -> KernelArtifact:
    ptx = (d / "kernel.ptx").read_text()
    cubin = (d / "kernel.cubin").read_bytes()
    info = json.loads((d / "build.json").read_text())
    entry, params = parse_entry(ptx)
    try:
        check_against_entry(params_for(spec), params)
    except ValueError as e:
        raise CompileError(f"{spec.name}: kernel signature does not match flashcore.abi: {e}") from e
    block = parse_reqntid(ptx) or (spec.threads, 1, 1)
    if block != (spec.threads, 1, 1):
        raise CompileError(f"{spec.name}: block {block} is not ({spec.threads}, 1, 1)")
    resources = read_resources(
        cubin, entry, ptx=ptx, arch=spec.arch, smem_dynamic=info["smem_dynamic"]
    )
    return KernelArtifact(
        spec=spec,
        ptx=ptx,
        cubin=cubin,
        entry=entry,
        params=params,
        block=block,
        smem_dynamic=info["smem_dynamic"],
        resources=resources,
        toolchain={
            "flashcore": __version__,
            "nvidia-cutlass-dsl": dsl_fingerprint() or "",
            "ptx_isa": ptx_isa_version(ptx),
            "target": ptx_target(ptx),
        },
        source_hash=source_hash(),
        ir=(d / "kernel.mlir").read_text(),
    )
