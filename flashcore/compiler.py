"""spec -> KernelArtifact: compile through the CuTe DSL in worker processes, keyed in the cache.

The DSL fixes its target arch when ``cutlass`` is imported (CUTE_DSL_ARCH), and ``cute.compile`` is
not thread-safe, so every compile runs in a fresh worker process with the spec's arch set. The
parent never imports the DSL: it reads the products back and assembles the artifact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import __version__
from .abi import check_against_entry, params_for
from .artifact import KernelArtifact
from .cache import KernelCache, default_cache, dsl_version, kernel_source_hash
from .errors import CompileError, KernelNotAvailableError
from .ptx_info import parse_entry, parse_reqntid, ptx_isa_version, ptx_target
from .spec import AttentionSpec

_WORKER_TIMEOUT_S = 600


def can_compile() -> bool:
    """True when this host has the CuTe DSL (compiling needs no GPU)."""
    return dsl_version() is not None


def compile_kernel(spec: AttentionSpec, *, cache: KernelCache | None = None) -> KernelArtifact:
    """The artifact for ``spec``: from memory, from the disk cache, or freshly compiled."""
    cache = cache or default_cache()
    return cache.get_or_build(spec, _build_one)


def compile_many(
    specs: Iterable[AttentionSpec],
    *,
    jobs: int | None = None,
    cache: KernelCache | None = None,
    progress: Callable[[AttentionSpec], None] | None = None,
) -> list[KernelArtifact]:
    """Compile many specs in parallel worker processes (one process per spec)."""
    cache = cache or default_cache()
    specs = list(specs)
    jobs = jobs or max(1, min(len(specs), os.cpu_count() or 1))

    def one(spec: AttentionSpec) -> KernelArtifact:
        art = cache.get_or_build(spec, _build_one)
        if progress:
            progress(spec)
        return art

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, specs))


def _build_one(spec: AttentionSpec) -> KernelArtifact:
    if not can_compile():
        raise KernelNotAvailableError(
            f"kernel {spec.name} is not in the cache and this host cannot compile it "
            f"(nvidia-cutlass-dsl is not installed).\n  spec: {spec.to_json()}\n"
            "Build it on any machine with the DSL (no GPU needed), e.g.\n"
            f"  python -c 'import flashcore; flashcore.compile_kernel(flashcore.AttentionSpec.from_json("
            f'{spec.to_json()!r}))\'\n'
            "then copy that machine's cache folder here and point FLASHCORE_CACHE_DIR at it "
            "(or use flashcore.load_catalog)."
        )
    with tempfile.TemporaryDirectory(prefix="flashcore-build-") as tmp:
        out = Path(tmp)
        _run_worker([spec], out)
        return _assemble(spec, out / "0")


def _run_worker(specs: list[AttentionSpec], out: Path) -> None:
    archs = {s.arch for s in specs}
    if len(archs) != 1:
        raise ValueError(f"one worker compiles one arch, got {sorted(archs)}")
    # CUTE_DSL_KEEP=ir: the DSL also writes the CuTe IR (after canonicalize+cse) into its dump
    # dir; neither is read by the compile itself, so the cubin is unchanged
    env = dict(os.environ, CUTE_DSL_ARCH=archs.pop(), CUTE_DSL_KEEP="ir",
               CUTE_DSL_DUMP_DIR=str(out / "ir"))
    # the worker imports flashcore from the same place as this process
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "flashcore.dsl.worker", str(out)],
            input=json.dumps([s.to_dict() for s in specs]),
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=_WORKER_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise CompileError(
            f"compiling {[s.name for s in specs]} took over {_WORKER_TIMEOUT_S} s"
        ) from None
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-30:])
        raise CompileError(f"compiling {[s.name for s in specs]} failed:\n{tail}")


def _assemble(spec: AttentionSpec, d: Path) -> KernelArtifact:
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
    from .cubin_info import read_resources  # pyelftools: needed only where kernels are built

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
            "nvidia-cutlass-dsl": info["dsl_version"],
            "ptx_isa": ptx_isa_version(ptx),
            "target": ptx_target(ptx),
        },
        source_hash=kernel_source_hash(),
        ir=(d / "kernel.mlir").read_text(),
    )
