"""Trust, second round: what planted files, symlinks, FIFOs, devices, other containers and dying
workers can do to the cache, catalogs and the CLI (no GPU, no real compile)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pytest

from flashcore import cli
from flashcore.compiler import cache as cache_mod
from flashcore.compiler import compiler, owner
from flashcore.compiler.artifact import CUBIN, META, KernelArtifact
from flashcore.compiler.cache import CacheWarning, KernelCache, TransientCompileError
from flashcore.compiler.catalog import verify_catalog, write_catalog
from flashcore.errors import CatalogError, CompileError
from flashcore.ops.masks import UNBOUNDED, WINDOW_MAX, masking
from flashcore.specs import AttentionSpec
from tests.artifact_helpers import SPEC, isolate_cache, one_line_error, synthetic_artifact

DSL = "4.8.1-cu12"
OTHER = AttentionSpec(arch="sm_90", head_dim=64)
THIRD = AttentionSpec(arch="sm_90", head_dim=64, causal=True)
OTHER_HOST = "0badc0de"  # a host tag that is not this process's


def _art(spec=SPEC, **kw) -> KernelArtifact:
    return synthetic_artifact(spec, dsl=DSL, **kw)


@pytest.fixture(autouse=True)
def fake_dsl(tmp_path, monkeypatch):
    """The DSL 'installed' at a fixed version, a private cache root and process cache table."""
    isolate_cache(tmp_path, monkeypatch, DSL)
    assert OTHER_HOST != owner.host_tag()


def _within(seconds: float, fn, *args, **kw):
    """``fn(*args)``, failing the test (not hanging it) if it takes longer than ``seconds``."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} hung (still running after {seconds} s)")
    if "error" in result:
        raise result["error"]
    return result["value"]


@contextlib.contextmanager
def _memory_cap(extra: int = 1 << 30):
    """Cap this process's heap at its current size plus ``extra`` bytes (RLIMIT_DATA), so that a
    regression that reads /dev/zero fails with MemoryError instead of exhausting the host."""
    try:
        import resource
    except ImportError:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    with open("/proc/self/status") as f:
        used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData"))
    cap = used + extra if hard == resource.RLIM_INFINITY else min(hard, used + extra)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    for p in [path, *(path.rglob("*") if path.is_dir() and not path.is_symlink() else [])]:
        os.utime(p, (t, t), follow_symlinks=False)


def _make_catalog(root: Path, specs=(SPEC, OTHER), **kw) -> list[KernelArtifact]:
    cache = KernelCache(root)
    arts = [cache.get_or_build(s, lambda s: _art(s, **kw)) for s in specs]
    write_catalog(root, arts)
    return arts


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in folder.rglob("*")}


# == 1. precompile --out: only a catalog is replaced ==============================================
def _fake_compile_many(log: list | None = None, during=None):
    """compile_many without the compiler: synthetic artifacts through the given cache."""

    def compile_many(specs, *, jobs=None, cache=None, progress=None):
        if during is not None:
            during()
        out = []
        for spec in specs:
            def build(s):
                if log is not None:
                    log.append(s)
                return _art(s)
            out.append(cache.get_or_build(spec, build))
            if progress:
                progress(spec)
        return out

    return compile_many


def _precompile(out: Path, *extra: str) -> int:
    return cli.main(["precompile", "--arch", "sm_90", "--limit", "2", "--out", str(out), *extra])


FOREIGN_INDEX = {
    "a web app's index.json": lambda p: p.write_text('{"name": "my-web-app", "version": "1"}'),
    "an index.json that is not JSON": lambda p: p.write_text("<html>docs</html>"),
    "a format-1 catalog": lambda p: p.write_text(json.dumps(
        {"format": 1, "flashcore": "0.0.1", "archs": [], "kernels": []})),
    "a FIFO as index.json": lambda p: os.mkfifo(p),
}


@pytest.mark.parametrize("kind", sorted(FOREIGN_INDEX))
def test_precompile_never_replaces_a_folder_read_index_refuses(tmp_path, monkeypatch, capsys,
                                                              kind):
    monkeypatch.setattr(compiler, "compile_many", _fake_compile_many())
    site = tmp_path / "site"
    site.mkdir(mode=0o750)
    os.chmod(site, 0o750)
    FOREIGN_INDEX[kind](site / "index.json")
    (site / "notes.txt").write_text("mine")
    before = sorted(os.listdir(site))
    assert _within(20, _precompile, site) == 2
    one_line_error(capsys, "--out", str(site), "not a flashcore catalog", "refusing")
    assert sorted(os.listdir(site)) == before and (site / "notes.txt").read_text() == "mine"
    assert stat.S_IMODE(site.stat().st_mode) == 0o750
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no stage left


def test_a_folder_that_stops_being_a_catalog_during_the_build_is_left_alone(tmp_path,
                                                                            monkeypatch, capsys):
    out = tmp_path / "catalog"
    monkeypatch.setattr(compiler, "compile_many", _fake_compile_many())
    assert _precompile(out) == 0

    def swap_in_a_project():
        (out / "index.json").write_text('{"name": "web app"}')
        (out / "app.js").write_text("mine")

    monkeypatch.setattr(compiler, "compile_many", _fake_compile_many(during=swap_in_a_project))
    assert _precompile(out) == 2
    one_line_error(capsys, "not a flashcore catalog")
    assert (out / "app.js").read_text() == "mine"
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no stage left


@pytest.mark.parametrize("no_ir", [False, True])
def test_catalogs_are_made_with_the_umask_not_0700(tmp_path, monkeypatch, no_ir):
    monkeypatch.setattr(compiler, "compile_many", _fake_compile_many())
    old = os.umask(0o022)
    try:
        out = tmp_path / "site" / "catalog"
        extra = ["--no-ir"] if no_ir else []
        assert _precompile(out, *extra) == 0
        assert stat.S_IMODE(out.stat().st_mode) == 0o755
        assert _precompile(out, *extra) == 0  # replacing a catalog: the same
        assert stat.S_IMODE(out.stat().st_mode) == 0o755
        for p in out.rglob("*"):
            assert stat.S_IMODE(p.stat().st_mode) == (0o755 if p.is_dir() else 0o644), p
    finally:
        os.umask(old)


def test_the_old_catalog_is_kept_aside_until_the_new_one_is_in_place(tmp_path, monkeypatch,
                                                                     capsys):
    out = tmp_path / "catalog"
    monkeypatch.setattr(compiler, "compile_many", _fake_compile_many())
    assert _precompile(out) == 0
    before = _snapshot(out)
    real_rename = os.rename
    seen = []

    def rename(src, dst, *a, **kw):
        if Path(dst) == out and Path(src).name.startswith(".catalog.new-"):
            # the swap: the old catalog is aside, whole, under a recoverable name
            aside = [p for p in tmp_path.iterdir() if p.name.startswith(".catalog.old-")]
            seen.append([_snapshot(p) == before for p in aside])
            raise OSError(28, "No space left on device", str(dst))
        return real_rename(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", rename)
    assert _precompile(out) == 2
    assert "No space left" in capsys.readouterr().err
    assert seen == [[True]]
    monkeypatch.setattr(os, "rename", real_rename)
    assert _snapshot(out) == before  # put back
    assert sorted(os.listdir(tmp_path)) == ["catalog", "env-cache"]


def test_precompile_sweeps_stale_stages_that_are_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(compiler, "compile_many", _fake_compile_many())
    out = tmp_path / "catalog"
    me, host = owner.owner_tag(), owner.host_tag()

    def stage(name: str, age: float = 0.0) -> Path:
        d = tmp_path / name
        (d / "v1").mkdir(parents=True)
        (d / "v1" / "half").write_text("x")
        if age:
            _age(d, age)
        return d

    dead = _dead_pid()
    gone = [stage(f".catalog.new-h{host}-{dead}-0123abcd"),  # this host, dead
            stage(f".catalog.build-h{host}-{dead}-1123abcd"),
            stage(f".catalog.new-h{OTHER_HOST}-{dead}-2123abcd", age=2 * 86400)]  # old
    kept = [stage(f".catalog.new-h{OTHER_HOST}-{dead}-3123abcd"),  # another host: pid unknown
            stage(f".catalog.new-{me}-4123abcd"),  # this very process
            stage(f".catalog.new-h{host}-1-5123abcd"),  # pid 1 lives
            stage(f".catalog.old-h{host}-{dead}-6123abcd"),  # catalog missing: the only copy
            stage(".catalog.notes"), stage(f".other.new-h{host}-{dead}-7123abcd")]
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    link = tmp_path / f".catalog.new-h{host}-{dead}-8123abcd"
    link.symlink_to(target)
    kept.append(link)
    assert _precompile(out) == 0
    assert not any(p.exists() for p in gone)
    assert all(p.exists() or p.is_symlink() for p in kept)
    assert (target / "keep").exists()
    # once the catalog exists, an abandoned old copy beside it goes too
    assert _precompile(out) == 0
    assert not kept[3].exists() and kept[4].exists()


# == 2. the pin ====================================================================================
def test_a_pinned_cache_dir_without_an_index_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "cat"
    _make_catalog(root, [SPEC])
    digest = hashlib.sha256((root / "index.json").read_bytes()).hexdigest()
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(root))
    monkeypatch.setenv("FLASHCORE_CATALOG_SHA256", digest)
    assert cache_mod.default_cache().get(SPEC) is not None
    # tamper: delete the index, replace the kernel: the folder must not turn into a plain cache
    (root / "index.json").unlink()
    entry = next(root.rglob(META)).parent
    forged = _art(SPEC, cubin=b"\x7fELF evil")
    forged.save(entry)
    monkeypatch.setattr(cache_mod, "_defaults", {})
    with pytest.raises(CatalogError, match="no index.json.*pinned"):
        cache_mod.default_cache()
    with pytest.raises(CatalogError, match="pinned"):
        compiler.compile_kernel(SPEC)


def test_a_pin_set_after_the_first_use_still_applies(tmp_path, monkeypatch):
    root = tmp_path / "plain"
    KernelCache(root).put(_art(SPEC))
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(root))
    assert cache_mod.default_cache().get(SPEC) is not None  # plain cache, no pin: fine
    monkeypatch.setenv("FLASHCORE_CATALOG_SHA256", "0" * 64)
    with pytest.raises(CatalogError, match="pinned"):
        cache_mod.default_cache()


def _forge(out: Path) -> bytes:
    """Replace the first kernel of the catalog in ``out`` and rewrite every checksum to match
    (what anyone who can write the folder can do); the forged cubin."""
    kernels = verify_catalog(out)["kernels"]
    evil = b"\x7fELF evil " + kernels[0]["name"].encode()
    arts = []
    for i, k in enumerate(kernels):
        art = KernelArtifact.load(out / k["path"])
        if i == 0:
            art = dataclasses.replace(art, cubin=evil)
            art.save(out / k["path"])  # fresh, self-consistent checksums
        arts.append(art)
    write_catalog(out, arts)
    verify_catalog(out)  # consistent: only a pin or an outside record can tell
    return evil


def test_precompile_does_not_reuse_kernels_of_a_rewritten_catalog(tmp_path, monkeypatch, capsys):
    built: list = []
    monkeypatch.setattr(compiler, "compile_many", _fake_compile_many(built))
    out = tmp_path / "catalog"
    assert _precompile(out) == 0 and len(built) == 2
    assert _precompile(out) == 0 and len(built) == 2  # its own last build: reused
    capsys.readouterr()
    evil = _forge(out)
    assert _precompile(out) == 0
    assert len(built) == 4  # compiled again, the forged one included
    assert "compiled again" in capsys.readouterr().err
    cubins = {KernelArtifact.load(out / k["path"]).cubin for k in verify_catalog(out)["kernels"]}
    assert evil not in cubins


def test_precompile_reuses_a_catalog_only_under_its_pin(tmp_path, monkeypatch, capsys):
    built: list = []
    monkeypatch.setattr(compiler, "compile_many", _fake_compile_many(built))
    out = tmp_path / "catalog"
    assert _precompile(out) == 0
    _forge(out)  # say, a catalog copied from elsewhere
    monkeypatch.setenv("FLASHCORE_CATALOG_SHA256", "f" * 64)
    assert _precompile(out) == 0 and len(built) == 4  # not the pinned one: rebuilt
    assert "pinned" in capsys.readouterr().err
    _forge(out)
    digest = hashlib.sha256((out / "index.json").read_bytes()).hexdigest()
    monkeypatch.setenv("FLASHCORE_CATALOG_SHA256", digest)  # the user vouches for it
    assert _precompile(out) == 0 and len(built) == 4


def test_a_reused_entry_damaged_on_disk_is_compiled_again(tmp_path, monkeypatch):
    built: list = []
    monkeypatch.setattr(compiler, "compile_many", _fake_compile_many(built))
    out = tmp_path / "catalog"
    assert _precompile(out) == 0 and len(built) == 2
    cubin = next(out.rglob(CUBIN))
    cubin.write_bytes(cubin.read_bytes()[:-1] + b"!")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        assert _precompile(out) == 0
    assert len(built) == 3 and verify_catalog(out)


# == 3. maintenance stays inside the cache =========================================================
def _project(tmp_path: Path) -> Path:
    """A user's folder full of names the cache also uses."""
    proj = tmp_path / "project"
    proj.mkdir()
    (proj / "Cargo.lock").write_text("lock")
    (proj / ".tmp-build-123-0123abcd").mkdir()
    (proj / f".tmp-x-h{owner.host_tag()}-{_dead_pid()}-0123abcd").write_text("t")
    (proj / "0123456789abcdef-dsl1").mkdir()
    (proj / "0123456789abcdef-dsl1" / "data").write_text("d" * 5000)
    (proj / "x.failed").write_text("f")
    _age(proj, 7200)
    return proj


def test_prune_never_empties_what_a_symlinked_quarantine_points_to(tmp_path):
    cache = KernelCache(tmp_path / "cache")
    cache.put(_art(SPEC))
    proj = _project(tmp_path)
    before = _snapshot(proj)
    (cache.base / "quarantine").symlink_to(proj)
    report = cache.prune()
    assert _snapshot(proj) == before
    assert cache.base / "quarantine" in report.removed  # the link, not its target
    assert not (cache.base / "quarantine").is_symlink()


def test_quarantine_never_moves_an_entry_out_of_the_cache(tmp_path):
    cache = KernelCache(tmp_path / "cache")
    entry = cache.put(_art(SPEC))
    (entry / CUBIN).write_bytes(b"broken")
    proj = _project(tmp_path)
    before = _snapshot(proj)
    (cache.base / "quarantine").symlink_to(proj)
    with pytest.warns(CacheWarning, match="quarantine is a symlink"):
        assert KernelCache(cache.root).get(SPEC) is None
    assert _snapshot(proj) == before


@pytest.mark.parametrize("how", ["clear", "prune", "prune --max-size 0", "max size env"])
def test_maintenance_never_follows_a_symlinked_spec_folder(tmp_path, monkeypatch, how):
    cache = KernelCache(tmp_path / "cache")
    cache.put(_art(SPEC))
    proj = _project(tmp_path)
    before = _snapshot(proj)
    size = cache.size_bytes()
    link = cache.base / cache_mod.spec_dir_name(OTHER)
    link.symlink_to(proj)
    assert cache.size_bytes() == size  # what the link points to is not the cache's
    if how == "clear":
        assert cache.clear() == []
        assert not link.is_symlink()  # the link carried the cache's name: removed
    elif how == "prune":
        cache.prune()
    elif how == "prune --max-size 0":
        cache.prune(max_size=0)
    else:
        monkeypatch.setenv("FLASHCORE_CACHE_MAX_SIZE", "1")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheWarning)
            cache.put(_art(THIRD))
    assert _snapshot(proj) == before


# == 4. hostile files: refused, never waited on ===================================================
def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def _huge(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(600 << 20)  # sparse: costs no disk


HOSTILE = {
    "meta.json FIFO": (META, _fifo),
    "cubin FIFO": (CUBIN, _fifo),
    "meta.json -> /dev/zero": (META, _dev_zero),
    "cubin -> /dev/zero": (CUBIN, _dev_zero),
    "huge meta.json": (META, _huge),
    "huge cubin": (CUBIN, _huge),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_entry_files_are_damage_not_hangs(tmp_path, monkeypatch, capsys, kind):
    root = tmp_path / "cache"
    entry = KernelCache(root).put(_art(SPEC))
    name, plant = HOSTILE[kind]
    plant(entry / name)
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(root))
    with _memory_cap():
        assert _within(20, cli.main, ["cache", "verify"]) == 1
        assert f"BAD {entry}" in capsys.readouterr().out
        assert _within(20, cli.main, ["cache", "list"]) == 0
        with pytest.warns(CacheWarning, match="not a regular file|more than"):
            art = _within(20, KernelCache(root).get_or_build, SPEC, _art)  # set aside, rebuilt
    assert art.spec == SPEC and KernelCache(root).verify() == []


@pytest.mark.parametrize("plant", [os.mkfifo, lambda p: p.symlink_to("/dev/zero")])
def test_a_hostile_index_json_is_refused_not_waited_on(tmp_path, monkeypatch, capsys, plant):
    root = tmp_path / "cat"
    _make_catalog(root, [SPEC])
    (root / "index.json").unlink()
    plant(root / "index.json")
    with _memory_cap():
        assert _within(20, cli.main, ["catalog-hash", str(root)]) == 2
        one_line_error(capsys, "index.json", "not a regular file")
        monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(root))
        with pytest.raises(CatalogError, match="not a regular file"):
            _within(20, compiler.compile_kernel, SPEC)
        assert _within(20, cli.main, ["cache", "verify"]) == 1


def test_a_fifo_failure_marker_is_not_waited_on(tmp_path):
    cache = KernelCache(tmp_path / "cache")
    marker = cache._failure_marker(SPEC)
    marker.parent.mkdir(parents=True)
    os.mkfifo(marker)
    assert _within(20, cache.get_or_build, SPEC, _art).spec == SPEC


def test_a_lock_file_symlink_does_not_truncate_its_target(tmp_path):
    cache = KernelCache(tmp_path / "cache")
    victim = tmp_path / "Cargo.lock"
    victim.write_text("precious")
    lock = cache._lock(SPEC).lock_file
    Path(lock).unlink(missing_ok=True)
    Path(lock).symlink_to(victim)
    assert cache.get_or_build(SPEC, _art).spec == SPEC
    assert victim.read_text() == "precious"


def test_dump_compare_reads_no_fifo(tmp_path, capsys):
    d = tmp_path / "dump"
    d.mkdir()
    os.mkfifo(d / "resources.json")
    assert _within(20, cli.main, ["dump", "--compare", str(d), str(d)]) == 2
    one_line_error(capsys, "resources.json", "not a regular file")


# == 5. workers: timeouts, deaths, missing products ===============================================
def test_a_transient_failure_is_not_remembered(tmp_path):
    root = tmp_path / "cache"
    calls = []

    def slow(s):
        calls.append(s)
        raise TransientCompileError(f"compiling {s.name}: the worker took over 600 s")

    with pytest.raises(CompileError, match="600 s"):
        KernelCache(root).get_or_build(SPEC, slow)
    assert not list(KernelCache(root).spec_dir(SPEC).glob("*.failed"))
    cache = KernelCache(root)
    with pytest.raises(CompileError, match="600 s"):
        cache.get_or_build(SPEC, slow)
    assert cache.get_or_build(SPEC, _art).spec == SPEC  # same process: tried again too
    assert len(calls) == 2


@pytest.fixture
def fake_worker(tmp_path, monkeypatch):
    """compiler._build_one with subprocess.run replaced: set ``.result`` to what it returns (or
    an exception to raise); ``.make`` writes products into the worker's folder first."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(compiler, "can_compile", lambda: True)

    class Worker:
        result: object = None
        make = None
        runs = 0

        def run(self, cmd, **kw):
            self.runs += 1
            if self.make:
                self.make(Path(cmd[-1]))
            if isinstance(self.result, BaseException):
                raise self.result
            return subprocess.CompletedProcess(cmd, self.result, "", self.stderr)

        stderr = ""

    w = Worker()
    monkeypatch.setattr(compiler.subprocess, "run", w.run)
    return w


def test_a_worker_timeout_is_not_shared_with_other_callers(tmp_path, fake_worker):
    fake_worker.result = subprocess.TimeoutExpired(["worker"], 600)
    root = tmp_path / "cache"
    for _ in range(2):  # a new process each time, as far as the cache can tell
        with pytest.raises(TransientCompileError, match=f"{re.escape(SPEC.name)}.*600 s"):
            compiler.compile_kernel(SPEC, cache=KernelCache(root))
    assert fake_worker.runs == 2


def test_a_worker_killed_by_a_signal_names_the_signal(tmp_path, fake_worker):
    fake_worker.result = -9
    with pytest.raises(CompileError) as e:
        compiler.compile_kernel(SPEC, cache=KernelCache(tmp_path / "cache"))
    assert SPEC.name in str(e.value) and "killed by signal 9 (SIGKILL)" in str(e.value)
    assert isinstance(e.value, TransientCompileError)


def test_a_worker_failing_silently_says_so(tmp_path, fake_worker):
    fake_worker.result = 1
    with pytest.raises(CompileError) as e:
        compiler.compile_kernel(SPEC, cache=KernelCache(tmp_path / "cache"))
    assert SPEC.name in str(e.value) and "exit status 1" in str(e.value)
    assert "no output" in str(e.value) and not isinstance(e.value, TransientCompileError)


@pytest.mark.parametrize("products", ["none", "report only", "broken ptx"])
def test_missing_worker_products_are_a_compile_error(tmp_path, fake_worker, products):
    fake_worker.result = 0

    def make(out: Path) -> None:
        d = out / "0"
        if products == "none":
            return
        d.mkdir(parents=True)
        (d / "build.json").write_text(json.dumps({"smem_dynamic": 0, "imported": []}))
        if products == "broken ptx":
            (d / "kernel.ptx").write_text("not ptx")
            (d / "kernel.cubin").write_bytes(b"")

    fake_worker.make = make
    with pytest.raises(CompileError) as e:
        compiler.compile_kernel(SPEC, cache=KernelCache(tmp_path / "cache"))
    assert SPEC.name in str(e.value)
    assert type(e.value) is CompileError  # not FileNotFoundError, ValueError


# == 5. masks ======================================================================================
def test_softcap_with_a_zero_softmax_scale():
    m = masking(False, "top_left", None, 30.0)
    assert m.scalars(0.0) == ((0.0,), (0.0,))  # every logit 0, capped or not
    assert m.scalars(0.5) == ((0.5 / 30.0,), (30.0 / 0.5,))


@pytest.mark.parametrize("window", [(2**40, 0), (0, 2**31), (-2, 0), (2**63, 2**63)])
def test_a_window_outside_int32_is_a_value_error_naming_its_range(window):
    with pytest.raises(ValueError, match=rf"window .*0\.\.{WINDOW_MAX} or -1"):
        masking(False, "top_left", window, None)


def test_a_window_side_past_any_sequence_is_the_kernels_unbounded():
    m = masking(False, "top_left", (WINDOW_MAX, 5), None)
    assert m.scalars(1.0) == ((UNBOUNDED,), (5,))
    assert masking(False, "top_left", (3, -1), None).scalars(1.0) == ((3,), (UNBOUNDED,))


# == 5. CLI arguments ==============================================================================
@pytest.mark.parametrize("args", [["precompile", "--jobs", "-1"], ["precompile", "--jobs", "0"],
                                  ["precompile", "--limit", "-1"], ["precompile", "--limit", "0"],
                                  ["precompile", "--jobs", "many"]])
def test_bad_counts_are_usage_errors(args, capsys, monkeypatch):
    monkeypatch.setattr(compiler, "compile_many", lambda *a, **kw: pytest.fail("compiled"))
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and args[1] in err


FOREIGN_REPORTS = {
    "a list": [1, 2],
    "occupancy not a table": {"kernel": "k", "occupancy": 1},
    "no kernel": {"occupancy": {"ctas_per_sm": 1}},
    "registers a string": {"kernel": "k", "occupancy": {"ctas_per_sm": 1}, "registers": "many"},
    "histogram of strings": {"kernel": "k", "occupancy": {"ctas_per_sm": 1},
                             "instructions_ptx": {"mma": "lots"}},
}


@pytest.mark.parametrize("kind", sorted(FOREIGN_REPORTS))
def test_dump_compare_of_a_foreign_folder_is_a_one_line_error(tmp_path, capsys, monkeypatch,
                                                              kind):
    monkeypatch.setattr(compiler, "compile_kernel", lambda *a, **kw: pytest.fail("compiled"))
    d = tmp_path / "foreign"
    d.mkdir()
    (d / "resources.json").write_text(json.dumps(FOREIGN_REPORTS[kind]))
    assert cli.main(["dump", "--compare", str(d), str(d)]) == 2
    one_line_error(capsys, "--compare", "not a flashcore dump report")


def test_dump_compare_of_reports_of_different_versions(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, hist in ((a, {"mma": 4, "ld": 2}), (b, {"mma": 5, "st": 1})):
        d.mkdir()
        (d / "resources.json").write_text(json.dumps(
            {"kernel": d.name, "occupancy": {"ctas_per_sm": 2}, "registers": 100,
             "instructions_ptx": hist}))
    assert cli.main(["dump", "--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "mma (ptx)" in out and "st (ptx)" in out and "ld (ptx)" in out


# == 5. a size limit below one entry ===============================================================
def test_a_size_limit_below_one_entry_keeps_the_entry_just_written(tmp_path, monkeypatch):
    cache = KernelCache(tmp_path / "cache")
    first = cache.put(_art(SPEC))
    _age(first, 100)
    monkeypatch.setenv("FLASHCORE_CACHE_MAX_SIZE", "1K")
    with pytest.warns(CacheWarning, match="below the size of one entry.*keeping the entry"):
        second = cache.put(_art(OTHER))
    assert second.is_dir() and not first.exists()
    assert KernelCache(cache.root).get(OTHER) is not None
    with pytest.warns(CacheWarning, match="below the size of one entry"):
        art = KernelCache(cache.root).get_or_build(THIRD, _art)
    assert KernelCache(cache.root).get(THIRD) == art


# == 5. staleness across containers sharing a folder ===============================================
def test_a_temporary_of_another_host_is_judged_by_age_not_pid(tmp_path):
    cache = KernelCache(tmp_path / "cache")
    sdir = cache.spec_dir(SPEC)
    sdir.mkdir(parents=True)
    dead = _dead_pid()  # dead here; in another container the same number may be alive
    other = sdir / f".tmp-x-dsl{DSL}-h{OTHER_HOST}-{dead}-0123abcd"
    legacy = sdir / f".tmp-x-dsl{DSL}-{dead}-1123abcd"  # an older flashcore's: no host tag
    other_old = sdir / f".tmp-x-dsl{DSL}-h{OTHER_HOST}-{dead}-2123abcd"
    for d in (other, legacy, other_old):
        d.mkdir()
    _age(other_old, 7200)
    report = cache.prune()
    assert other.exists() and legacy.exists() and not other_old.exists()
    assert report.removed == [other_old]


def test_a_build_folder_of_another_host_is_judged_by_age_not_pid(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = _dead_pid()
    other = tmp_path / f"flashcore-build-h{OTHER_HOST}-{dead}-abc"
    legacy = tmp_path / f"flashcore-build-{dead}-def"
    other_old = tmp_path / f"flashcore-build-h{OTHER_HOST}-{dead}-ghi"
    here_dead = tmp_path / f"flashcore-build-h{owner.host_tag()}-{dead}-jkl"
    for d in (other, legacy, other_old, here_dead):
        d.mkdir()
    _age(other_old, 7200)
    assert sorted(compiler.sweep_stale_build_dirs()) == sorted([other_old, here_dead])
    assert other.exists() and legacy.exists()


def test_processes_of_one_pid_namespace_share_the_host_tag():
    tag = owner.host_tag()
    assert len(tag) == 8 and int(tag, 16) >= 0
    ns = "/proc/self/ns/pid"
    if not os.path.exists(ns):
        pytest.skip("no /proc pid namespace here")
    other = subprocess.run([sys.executable, "-c",
                            "from flashcore.compiler.owner import host_tag; print(host_tag())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert other == tag  # the same namespace: pids compare


@pytest.mark.parametrize("jobs", [-1, 0, 1.5, True])
def test_compile_many_refuses_a_bad_job_count(jobs):
    with pytest.raises(ValueError, match="jobs must be an int >= 1"):
        compiler.compile_many([SPEC], jobs=jobs, cache=KernelCache(Path("/nonexistent")))
