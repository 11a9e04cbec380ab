"""Synthetic KernelArtifacts for the cache tests (no compiler needed), and a child-process builder.

Kept in an importable module so processes started with the "spawn" method can find them.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from flashcore.compiler import cache as cache_mod
from flashcore.compiler.artifact import KernelArtifact, ParamInfo, Resources
from flashcore.compiler.cache import KernelCache
from flashcore.compiler.fingerprint import source_hash
from flashcore.specs import AttentionSpec, KernelSpec, TileConfig

SPEC = AttentionSpec(arch="sm_90", head_dim=128, config=TileConfig((128, 64), warps=8),
                     causal=True)

_PTX = """.version 8.8
.target sm_90
.address_size 64
.visible .entry {entry}(
\t.param .align 8 .b8 {entry}_param_0[48],
\t.param .f32 {entry}_param_1
)
.reqntid {threads}, 1, 1
{{
\tret;
}}
"""


def synthetic_artifact(
    spec: KernelSpec = SPEC,
    *,
    cubin: bytes | None = None,
    ir: str = "module {\n}\n",
    dsl: str | None = None,
) -> KernelArtifact:
    entry = f"{spec.name}_0"
    return KernelArtifact(
        spec=spec,
        ptx=_PTX.format(entry=entry, threads=spec.threads),
        cubin=cubin if cubin is not None else b"\x7fELF fake cubin " + spec.name.encode() * 20,
        entry=entry,
        params=(
            ParamInfo(f"{entry}_param_0", 48, 8, ".b8"),
            ParamInfo(f"{entry}_param_1", 4, 4, ".f32"),
        ),
        block=(spec.threads, 1, 1),
        smem_dynamic=spec.smem_bytes,
        resources=Resources(
            registers=128,
            stack_frame_bytes=0,
            spill_store_bytes=0,
            spill_load_bytes=None,
            smem_static_bytes=0,
            smem_dynamic_bytes=spec.smem_bytes,
            threads_per_block=spec.threads,
        ),
        toolchain={
            "flashcore": "0.1.0",
            # the DSL as the cache sees it (tests patch it)
            "nvidia-cutlass-dsl": dsl or cache_mod.dsl_fingerprint() or "0",
            "ptx_isa": "8.8",
            "target": spec.arch,
        },
        source_hash=source_hash(),
        ir=ir,
    )


def slow_build(spec: KernelSpec, log: str, delay: float = 0.3) -> KernelArtifact:
    """A stand-in compiler: notes that it ran, takes a while, returns a per-process cubin."""
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(delay)
    return synthetic_artifact(spec, cubin=f"built by {os.getpid()}".encode())


def _build_for_child(spec: KernelSpec, log: str) -> KernelArtifact:
    return slow_build(spec, log)


def child_get_or_build(root: str, log: str, barrier, results) -> None:
    """Run in a spawned process: wait for the others, then get_or_build the same spec."""
    cache = KernelCache(Path(root))
    barrier.wait(timeout=60)
    try:
        art = cache.get_or_build(SPEC, lambda s: _build_for_child(s, log))
        results.put(("ok", os.getpid(), hashlib.sha256(art.cubin).hexdigest()))
    except Exception as e:
        results.put(("error", os.getpid(), repr(e)))  # so the parent fails with the reason
        raise


def failing_build(spec: KernelSpec, log: str, delay: float = 0.5) -> KernelArtifact:
    """A stand-in compiler that takes a while and then fails, noting that it ran."""
    from flashcore.errors import CompileError

    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(delay)
    raise CompileError(f"compiling {spec.name} failed: the stand-in compiler gave up")


def _fail_for_child(spec: KernelSpec, log: str) -> KernelArtifact:
    return failing_build(spec, log)


def child_get_or_build_failing(root: str, log: str, barrier, results) -> None:
    """Run in a spawned process: wait for the others, then get_or_build a spec that fails."""
    from flashcore.errors import CompileError

    cache = KernelCache(Path(root))
    barrier.wait(timeout=60)
    try:
        cache.get_or_build(SPEC, lambda s: _fail_for_child(s, log))
        results.put(("ok", os.getpid(), ""))
    except CompileError as e:
        results.put(("CompileError", os.getpid(), str(e)))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        results.put((type(e).__name__, os.getpid(), repr(e)))


def isolate_cache(tmp_path: Path, monkeypatch, dsl: str) -> None:
    """A test's own cache root and process cache table, with the DSL 'installed' at ``dsl``
    and no catalog pin or size limit from the environment."""
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path / "env-cache"))
    monkeypatch.delenv("FLASHCORE_CATALOG_SHA256", raising=False)
    monkeypatch.delenv("FLASHCORE_CACHE_MAX_SIZE", raising=False)
    monkeypatch.setattr(cache_mod, "dsl_fingerprint", lambda: dsl)
    monkeypatch.setattr(cache_mod, "_defaults", {})
    monkeypatch.setattr(cache_mod, "_warned_read_only", set())
    monkeypatch.setattr("flashcore.runtime.catalog.visible_archs", dict)


def one_line_error(capsys, *words) -> str:
    """The CLI's stderr: one line, no traceback, naming each of ``words``."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, err
    return err
