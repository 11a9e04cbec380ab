"""A cache, catalogs and compile workers you can trust (CPU only).

What each part is trusted with, and the ways it must not fail: precompile replacing a folder,
compile workers importing what lies in the working directory, a cache key that misses part of the
build, catalogs serving what their index does not list, read-only and full disks, clearing,
pruning, waiting on failed builds, unreadable entries, and the command line's errors.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from flashcore import cli
from flashcore.compiler import cache as cache_mod
from flashcore.compiler import catalog as catalog_mod
from flashcore.compiler import compiler, fingerprint, owner
from flashcore.compiler.artifact import CUBIN, META, MLIR, PTX, KernelArtifact
from flashcore.compiler.cache import CacheWarning, KernelCache, parse_size
from flashcore.compiler.catalog import copy_catalog, verify_catalog, write_catalog
from flashcore.errors import CatalogError, CompileError, KernelNotAvailableError
from flashcore.specs import AttentionSpec, QuantizeSpec
from tests.artifact_helpers import (
    SPEC,
    child_get_or_build_failing,
    isolate_cache,
    one_line_error,
    synthetic_artifact,
)

ROOT = Path(__file__).resolve().parent.parent
DSL = "4.8.1-cu12"
OTHER = AttentionSpec(arch="sm_90", head_dim=64)
THIRD = AttentionSpec(arch="sm_90", head_dim=64, causal=True)


def _art(spec=SPEC, **kw) -> KernelArtifact:
    return synthetic_artifact(spec, dsl=DSL, **kw)


@pytest.fixture
def fake_dsl(tmp_path, monkeypatch):
    """Synthetic tests: the DSL 'installed' at a fixed version, a private process cache table."""
    isolate_cache(tmp_path, monkeypatch, DSL)


def _no_dsl(monkeypatch) -> None:
    monkeypatch.setattr(cache_mod, "dsl_fingerprint", lambda: None)
    monkeypatch.setattr(compiler, "dsl_fingerprint", lambda: None)


def _cache_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _make_catalog(root: Path, specs=(SPEC, OTHER), **kw) -> list[KernelArtifact]:
    cache = KernelCache(root)
    arts = [cache.get_or_build(s, lambda s: _art(s, **kw)) for s in specs]
    write_catalog(root, arts)
    return arts


# -- a read-only file system, as far as this process can tell -------------------------------------
class ReadOnly:
    """Every write under the given roots fails with EROFS, as on a read-only mount. (Tests run as
    root here, for whom chmod takes nothing away.)"""

    def __init__(self, monkeypatch) -> None:
        self.roots: list[str] = []
        real = {n: getattr(os, n) for n in
                ("mkdir", "open", "rename", "replace", "unlink", "remove", "rmdir", "utime")}
        real_open = io.open

        def under(path) -> bool:
            if isinstance(path, int):
                return False
            p = os.path.realpath(os.fspath(path))
            return any(p == r or p.startswith(r + os.sep) for r in self.roots)

        def deny(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

        def guard(name, *paths_at):
            def f(*args, **kw):
                if self.roots and (kw.get("dir_fd") is not None or kw.get("src_dir_fd") is not None
                                   or any(under(args[i]) for i in paths_at if i < len(args))):
                    deny(args[0])
                return real[name](*args, **kw)
            return f

        write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

        def os_open(path, flags, *args, **kw):
            if flags & write_flags and (under(path) or (self.roots and kw.get("dir_fd"))):
                deny(path)
            return real["open"](path, flags, *args, **kw)

        def io_open(file, mode="r", *args, **kw):
            if any(c in mode for c in "wax+") and under(file):
                deny(file)
            return real_open(file, mode, *args, **kw)

        for name in ("mkdir", "unlink", "remove", "rmdir", "utime"):
            monkeypatch.setattr(os, name, guard(name, 0))
        for name in ("rename", "replace"):
            monkeypatch.setattr(os, name, guard(name, 0, 1))
        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(io, "open", io_open)
        monkeypatch.setattr("builtins.open", io_open)

    def __call__(self, root: Path) -> Path:
        self.roots.append(os.path.realpath(root))
        return root


@pytest.fixture
def read_only(monkeypatch) -> ReadOnly:
    return ReadOnly(monkeypatch)


def test_read_only_simulation_denies_writes(tmp_path, read_only):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "old").write_text("x")
    read_only(ro)
    for write in (lambda: (ro / "d").mkdir(), lambda: (ro / "f").write_text(""),
                  lambda: tempfile.TemporaryFile(dir=ro).close(),
                  lambda: os.rename(ro, tmp_path / "m"),
                  lambda: (ro / "old").unlink(), lambda: shutil.rmtree(ro)):
        with pytest.raises(OSError) as e:
            write()
        assert e.value.errno == errno.EROFS
    assert (ro / "old").read_text() == "x"
    (tmp_path / "rw").mkdir()  # elsewhere all is well


# == 1. precompile --out ===========================================================================
def _fake_compile_many(log: list | None = None, fail: bool = False):
    """compile_many without the compiler: synthetic artifacts, built through the cache (locks and
    all) as the real one does."""

    def compile_many(specs, *, jobs=None, cache=None, progress=None):
        if fail:
            raise CompileError("compiling the catalog failed: the stand-in compiler gave up")
        out = []
        for spec in specs:
            def build(s):
                if log is not None:
                    log.append(s)
                return _art(s)
            out.append((cache or cache_mod.default_cache()).get_or_build(spec, build))
            if progress:
                progress(spec)
        return out

    return compile_many


def _beside(folder: Path) -> list[str]:
    return sorted(p for p in os.listdir(folder) if p != "env-cache")


def _precompile(out: Path, *extra: str) -> int:
    return cli.main(["precompile", "--arch", "sm_90", "--limit", "2", "--out", str(out), *extra])


def test_precompile_refuses_a_folder_that_is_not_a_catalog(tmp_path, fake_dsl, monkeypatch,
                                                           capsys):
    monkeypatch.setattr(compiler, "compile_many", _fake_compile_many())
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    assert _precompile(mine, "--no-ir") == 2
    err = capsys.readouterr().err
    assert "not a flashcore catalog" in err and str(mine) in err and len(err.splitlines()) == 1
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert _beside(tmp_path) == ["mine"]
    (tmp_path / "file").write_text("x")
    assert _precompile(tmp_path / "file") == 2
    assert "not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("no_ir", [False, True])
def test_precompile_swaps_a_new_catalog_in_and_leaves_nothing_behind(tmp_path, fake_dsl,
                                                                     monkeypatch, capsys, no_ir):
    monkeypatch.setattr(compiler, "compile_many", _fake_compile_many())
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    parent = tmp_path / "site"
    out = parent / "catalog"
    extra = ["--no-ir"] if no_ir else []
    assert _precompile(out, *extra) == 0  # a new folder
    first = (out / "index.json").read_bytes()
    assert _precompile(out, *extra) == 0  # over an existing catalog: replaced
    stdout = capsys.readouterr().out
    index = verify_catalog(out)
    assert len(index["kernels"]) == 2 and (out / "index.json").read_bytes() == first
    digest = hashlib.sha256(first).hexdigest()
    assert f"sha256 {digest}" in stdout
    assert os.listdir(parent) == ["catalog"]  # no staging or old folder beside it
    assert os.listdir(tmpdir) == []  # nothing in $TMPDIR
    assert not list(out.rglob("*.lock")) and not list(out.rglob(".tmp-*"))  # item 12
    assert bool(list(out.rglob(MLIR))) is not no_ir


def test_precompile_keeps_the_old_catalog_until_the_new_one_is_complete(tmp_path, fake_dsl,
                                                                        monkeypatch, capsys):
    out = tmp_path / "catalog"
    monkeypatch.setattr(compiler, "compile_many", _fake_compile_many())
    assert _precompile(out) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    monkeypatch.setattr(compiler, "compile_many", _fake_compile_many(fail=True))
    assert _precompile(out, "--no-ir") == 2
    assert "stand-in compiler gave up" in capsys.readouterr().err
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert _beside(tmp_path) == ["catalog"]


def test_precompile_reuses_the_kernels_of_the_catalog_it_replaces(tmp_path, fake_dsl,
                                                                  monkeypatch):
    built: list = []
    monkeypatch.setattr(compiler, "compile_many", _fake_compile_many(built))
    out = tmp_path / "catalog"
    assert _precompile(out) == 0 and len(built) == 2
    assert _precompile(out) == 0 and len(built) == 2


def test_precompile_no_ir_for_real_leaves_no_temporary_directories(tmp_path):
    # the real compiler, in a process of its own with its own $TMPDIR
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    out = tmp_path / "site" / "catalog"
    out.mkdir(parents=True)
    env = dict(os.environ, TMPDIR=str(tmpdir), FLASHCORE_CACHE_DIR=str(tmp_path / "unused"),
               PYTHONPATH=str(ROOT))
    code = "import sys; from flashcore.cli import main; sys.exit(main(sys.argv[1:]))"
    p = subprocess.run([sys.executable, "-c", code, "precompile", "--arch", "sm_89", "--limit",
                        "1", "--no-ir", "--out", str(out)], env=env, capture_output=True,
                       text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr
    assert os.listdir(tmpdir) == []  # no flashcore-catalog-*, no flashcore-build-*
    assert os.listdir(out.parent) == ["catalog"]
    index = verify_catalog(out)
    assert len(index["kernels"]) == 1
    assert not list(out.rglob(MLIR)) and not list(out.rglob("*.lock"))


# == 2. the compile worker runs the installed flashcore, and no longer than its parent =============
PLANTED = """
import os
with open(os.path.join({marker!r}, {name!r}), "w") as f:
    f.write("imported from " + __file__)
raise ImportError("planted {name} imported")
"""


def _plant(where: Path, markers: Path) -> None:
    for name in ("flashcore", "cutlass"):
        (where / name).mkdir(parents=True)
        (where / name / "__init__.py").write_text(PLANTED.format(marker=str(markers), name=name))


@pytest.fixture(scope="module")
def real_compile(tmp_path_factory):
    """One real compile of AttentionSpec(arch="sm_89") run from a working directory holding a
    planted flashcore/ and cutlass/; what the worker imported is recorded."""
    if not compiler.can_compile():
        pytest.skip("nvidia-cutlass-dsl is not installed")
    base = tmp_path_factory.mktemp("planted")
    cwd, markers = base / "cwd", base / "markers"
    markers.mkdir()
    _plant(cwd, markers)
    seen: list[list[str]] = []
    real_check = compiler._check_imports

    def check(spec, imported):
        seen.append(list(imported))
        return real_check(spec, imported)

    compiler._check_imports = check
    old = os.getcwd()
    os.chdir(cwd)
    try:
        art = compiler.compile_kernel(AttentionSpec(arch="sm_89"),
                                      cache=KernelCache(base / "cache"))
    finally:
        os.chdir(old)
        compiler._check_imports = real_check
    return art, seen, markers, cwd


def test_worker_ignores_flashcore_and_cutlass_planted_in_the_cwd(real_compile):
    art, _, markers, _ = real_compile
    assert art.spec == AttentionSpec(arch="sm_89") and len(art.cubin) > 0
    assert os.listdir(markers) == []


def test_worker_started_in_a_planted_cwd_imports_the_installed_packages(real_compile, tmp_path):
    # the worker itself, with its working directory where the planted packages are
    _, _, markers, cwd = real_compile
    out = tmp_path / "out"
    out.mkdir()
    spec = AttentionSpec(arch="sm_89")
    p = subprocess.run([sys.executable, str(compiler._WORKER), str(out)],
                       input=json.dumps([spec.to_dict()]), cwd=cwd,
                       env=fingerprint.worker_env(spec.arch, out / "ir"), capture_output=True,
                       text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr
    assert os.listdir(markers) == []
    assert (out / "0" / "kernel.cubin").read_bytes() == real_compile[0].cubin


def _proc_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None  # gone


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
def test_worker_exits_and_removes_its_output_when_its_parent_dies(tmp_path):
    out = tmp_path / "out"
    (out / "0").mkdir(parents=True)
    (out / "0" / "partial.ptx").write_text("half a kernel")
    read_end, write_end = os.pipe()  # the worker's stdin stays open: only the watcher can end it
    starter = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, {str(compiler._WORKER)!r}, {str(out)!r}], "
        f"stdin={read_end})\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", starter], pass_fds=(read_end,),
                              stdout=subprocess.PIPE, text=True)
    try:
        os.close(read_end)
        worker = int(parent.stdout.readline())
        deadline = time.time() + 30  # its watcher thread is running: it knows its parent
        while len(os.listdir(f"/proc/{worker}/task")) < 2:
            assert time.time() < deadline, "the worker never started its watcher"
            time.sleep(0.05)
        parent.kill()
        parent.wait()
        deadline = time.time() + 20
        while _proc_state(worker) not in (None, "Z") or out.exists():
            assert time.time() < deadline, f"worker {worker} outlived its parent"
            time.sleep(0.1)
    finally:
        os.close(write_end)
        parent.kill()
        parent.wait()


def test_compiler_sweeps_build_dirs_of_dead_processes_before_a_build(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    host = owner.host_tag()  # build folders are named by host tag and pid (flashcore.compiler.owner)
    dead = tmp_path / f"flashcore-build-h{host}-{_dead_pid()}-x1y2z3"
    (dead / "0").mkdir(parents=True)
    (dead / "0" / "kernel.ptx").write_text("left by a killed process")
    mine = tmp_path / f"flashcore-build-{owner.owner_tag()}-abc"
    alive = tmp_path / f"flashcore-build-h{host}-1-def"  # pid 1 is alive
    other = tmp_path / "someone-elses"
    for d in (mine, alive, other):
        d.mkdir()
    seen = []

    def worker(specs, out):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        raise CompileError("stop here")

    monkeypatch.setattr(compiler, "can_compile", lambda: True)
    monkeypatch.setattr(compiler, "_run_worker", worker)
    with pytest.raises(CompileError, match="stop here"):
        compiler._build_one(AttentionSpec(arch="sm_89"))
    assert dead.name not in seen[0]
    assert {mine.name, alive.name, other.name} <= set(seen[0])
    assert not dead.exists() and mine.exists() and alive.exists() and other.exists()
    assert list(tmp_path.glob(f"flashcore-build-{owner.owner_tag()}-*")) == [mine]  # its own: gone


# == 3. the cache key covers the build ============================================================
def test_source_hash_changes_with_a_spec_property_the_kernel_reads(tmp_path, monkeypatch):
    copy = tmp_path / "flashcore"
    shutil.copytree(fingerprint.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(fingerprint, "PACKAGE", copy)
    before = fingerprint.fresh_source_hash()
    assert before == fingerprint.fresh_source_hash()
    attention = copy / "specs" / "attention.py"
    text = attention.read_text()
    assert "def programmatic_launch" in text and "return self.arch in PDL_ARCHS" in text
    attention.write_text(text.replace("return self.arch in PDL_ARCHS",
                                      'return self.arch in PDL_ARCHS or self.arch == "sm_89"'))
    assert fingerprint.fresh_source_hash() != before
    # and every kernel source: a file added to the kernels changes it too
    attention.write_text(text)
    assert fingerprint.fresh_source_hash() == before
    (copy / "kernels" / "common" / "new_helper.py").write_text("X = 1\n")
    assert fingerprint.fresh_source_hash() != before


def test_a_real_compile_imports_only_files_the_key_covers(real_compile):
    _, seen, _, _ = real_compile
    assert len(seen) == 1 and seen[0], "the worker reported no imports"
    hashed = {str(p.resolve()) for p in fingerprint.build_source_files()}
    assert set(seen[0]) <= hashed
    assert any(f.endswith("kernels/worker.py") or "kernels" in f for f in seen[0])


def test_an_import_outside_the_key_is_a_compile_error():
    inside = [str(p.resolve()) for p in fingerprint.build_source_files()[:3]]
    compiler._check_imports(SPEC, inside)  # fine
    outside = str((fingerprint.PACKAGE / "compiler" / "cache.py").resolve())
    with pytest.raises(CompileError, match=r"imported .*compiler/cache\.py.*does not cover"):
        compiler._check_imports(SPEC, [*inside, outside])


def test_codegen_variables_in_the_environment_do_not_change_the_cubin(real_compile, tmp_path,
                                                                      monkeypatch):
    base = real_compile[0]
    for k, v in {"CUTE_DSL_LINEINFO": "1", "CUTE_DSL_DEBUG": "1", "CUTE_DSL_OPT_LEVEL": "0",
                 "CUTE_DSL_KEEP": "ptx", "CUTE_EXPERIMENTAL_DSL_LINEINFO": "1",
                 "CUTLASS_DEBUG": "1"}.items():
        monkeypatch.setenv(k, v)
    art = compiler.compile_kernel(AttentionSpec(arch="sm_89"), cache=KernelCache(tmp_path / "c"))
    assert art.cubin == base.cubin and art.ptx == base.ptx


def test_dsl_fingerprint_names_the_libraries_flavour(monkeypatch):
    class Dist:
        def __init__(self, name, version):
            self.metadata = {"Name": name}
            self.version = version

    def installed(*dists):
        monkeypatch.setattr(fingerprint.importlib.metadata, "distributions", lambda: list(dists))
        fingerprint._dsl_distributions.cache_clear()

    monkeypatch.setattr(fingerprint, "dsl_version", lambda: "4.8.1")
    try:
        installed(Dist("nvidia-cutlass-dsl", "4.8.1"), Dist("nvidia_cutlass_dsl_libs_base", "4.8.1"),
                  Dist("nvidia-cutlass-dsl-libs-core", "4.8.1"),
                  Dist("nvidia-cutlass-dsl-libs-cu12", "4.8.1"), Dist("torch", "2.13.0"))
        assert fingerprint.dsl_fingerprint() == "4.8.1-cu12"
        installed(Dist("nvidia-cutlass-dsl", "4.8.1"), Dist("nvidia-cutlass-dsl-libs-cu13", "4.8.1"))
        assert fingerprint.dsl_fingerprint() == "4.8.1-cu13"
        installed(Dist("nvidia-cutlass-dsl", "4.8.1"), Dist("nvidia-cutlass-dsl-libs-cu12", "4.8.2"))
        assert fingerprint.dsl_fingerprint() == "4.8.1-cu124.8.2"
    finally:
        fingerprint._dsl_distributions.cache_clear()


# == 4. catalogs: what is served, paths, malformed indexes, pinning ===============================
def test_a_loaded_catalog_serves_only_what_its_index_lists(tmp_path, fake_dsl):
    import flashcore

    root = tmp_path / "cat"
    _make_catalog(root, [SPEC])
    planted = KernelCache(root).put(_art(OTHER))  # an entry the index does not list
    assert planted.is_dir()
    flashcore.load_catalog(root)
    served = cache_mod.default_cache()
    assert served.get(SPEC) is not None
    assert served.get(OTHER) is None
    built = []
    art = served.get_or_build(OTHER, lambda s: built.append(s) or _art(s, cubin=b"mine"))
    assert built == [OTHER] and art.cubin == b"mine"
    assert KernelArtifact.load(planted).cubin != b"mine"  # nothing written into the catalog
    # cache verify names the stowaway
    problems = dict(KernelCache(root).verify())
    assert "not listed" in problems[planted]


def test_a_catalog_entry_changed_after_loading_is_not_served(tmp_path, fake_dsl):
    import flashcore

    root = tmp_path / "cat"
    _make_catalog(root, [SPEC])
    flashcore.load_catalog(root)
    entry = next(root.glob("v1/*/*-dsl*"))
    # a self-consistent rewrite: new cubin, checksums redone; only the index can tell
    evil = _art(SPEC, cubin=b"\x7fELF something else")
    shutil.rmtree(entry)
    evil.save(entry)
    assert KernelArtifact.load(entry).cubin == evil.cubin
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache_mod.default_cache().get(SPEC) is None
    assert any("catalog index records" in m for m in _cache_warnings(caught))
    assert entry.is_dir()  # a catalog is never rearranged


@pytest.mark.parametrize("path", ["../outside/{entry}", "{abs}", "v1/../../outside/{entry}",
                                  "v1/{sdir}/../../../outside/{entry}", "v1\\..\\x"])
def test_index_paths_leaving_the_catalog_are_refused(tmp_path, fake_dsl, path):
    import flashcore

    root = tmp_path / "cat"
    _make_catalog(root, [SPEC])
    index = json.loads((root / "index.json").read_text())
    entry = root / index["kernels"][0]["path"]
    outside = tmp_path / "outside" / entry.name  # a good entry, but not the catalog's
    shutil.copytree(entry, outside)
    path = path.format(entry=entry.name, abs=outside, sdir=entry.parent.name)
    index["kernels"][0]["path"] = path
    (root / "index.json").write_text(json.dumps(index))
    for call in (lambda: verify_catalog(root), lambda: copy_catalog(root, tmp_path / "copy"),
                 lambda: flashcore.load_catalog(root)):
        with pytest.raises(CatalogError, match="leaves it|outside the catalog") as e:
            call()
        assert repr(path) in str(e.value)
    assert not (tmp_path / "copy").exists()


def test_an_index_path_through_a_symlink_out_of_the_catalog_is_refused(tmp_path, fake_dsl):
    root = tmp_path / "cat"
    _make_catalog(root, [SPEC])
    elsewhere = tmp_path / "elsewhere"
    sdir = next(root.glob("v1/*"))
    shutil.move(sdir, elsewhere)
    sdir.symlink_to(elsewhere)
    with pytest.raises(CatalogError, match="leads outside the catalog"):
        verify_catalog(root)


def _mutations():
    """Each takes the index (a dict) and returns what to write instead."""
    def top(f):
        def go(ix):
            f(ix)
            return ix
        return go

    def kernels(f):
        return top(lambda ix: f(ix["kernels"][0]))

    return {
        "index is a list": lambda ix: [ix],
        "no kernels": top(lambda ix: ix.pop("kernels")),
        "kernels not a list": top(lambda ix: ix.update(kernels={"a": 1})),
        "no archs": top(lambda ix: ix.pop("archs")),
        "archs wrong": top(lambda ix: ix.update(archs=["sm_80"])),
        "kernel not an object": top(lambda ix: ix.update(kernels=["v1/x"])),
        "missing path": kernels(lambda k: k.pop("path")),
        "missing meta_sha256": kernels(lambda k: k.pop("meta_sha256")),
        "path not a string": kernels(lambda k: k.update(path=7)),
        "spec not an object": kernels(lambda k: k.update(spec="fc")),
        "spec invalid": kernels(lambda k: k["spec"].update(head_dim=96)),
        "spec missing field": kernels(lambda k: k["spec"].pop("arch")),
        "name not its spec's": kernels(lambda k: k.update(name="fc_other")),
        "sha256 not hex": kernels(lambda k: k.update(cubin_sha256="xyz")),
        "path of another spec": kernels(lambda k: k.update(
            path=k["path"].replace(k["path"].split("/")[1], "fc_x-0123456789abcdef"))),
    }


@pytest.mark.parametrize("kind", sorted(_mutations()))
def test_a_malformed_index_is_a_catalog_error_naming_the_problem(tmp_path, fake_dsl, monkeypatch,
                                                               kind):
    import flashcore

    root = tmp_path / "cat"
    _make_catalog(root, [SPEC])
    index = json.loads((root / "index.json").read_text())
    (root / "index.json").write_text(json.dumps(_mutations()[kind](index)))
    for call in (lambda: verify_catalog(root), lambda: copy_catalog(root, tmp_path / "copy"),
                 lambda: flashcore.load_catalog(root), lambda: catalog_mod.read_index(root)):
        with pytest.raises(CatalogError) as e:  # never KeyError, TypeError, AttributeError
            call()
        assert "index.json" in str(e.value)
    # and through FLASHCORE_CACHE_DIR too
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(root))
    with pytest.raises(CatalogError):
        cache_mod.default_cache()


def test_pinning_a_catalog_by_the_sha256_of_its_index(tmp_path, fake_dsl, monkeypatch, capsys):
    import flashcore

    root = tmp_path / "cat"
    _make_catalog(root, [SPEC])
    digest = hashlib.sha256((root / "index.json").read_bytes()).hexdigest()
    assert cli.main(["catalog-hash", str(root)]) == 0
    assert capsys.readouterr().out.split()[0] == digest
    assert catalog_mod.catalog_sha256(root) == digest
    assert flashcore.load_catalog(root, sha256=digest) == root.resolve()
    with pytest.raises(CatalogError, match=f"sha256 {digest}.*pinned"):
        flashcore.load_catalog(root, sha256="0" * 64)
    monkeypatch.setenv("FLASHCORE_CATALOG_SHA256", "0" * 64)
    with pytest.raises(CatalogError, match="pinned"):
        flashcore.load_catalog(root)
    # a catalog rebuilt by someone else, its checksums all consistent: the pin refuses it
    monkeypatch.setenv("FLASHCORE_CATALOG_SHA256", digest)
    flashcore.load_catalog(root)
    _make_catalog(root, [SPEC, OTHER])
    with pytest.raises(CatalogError, match="pinned"):
        flashcore.load_catalog(root)
    monkeypatch.setattr(cache_mod, "_defaults", {})
    with pytest.raises(CatalogError, match="pinned"):  # FLASHCORE_CACHE_DIR=catalog: pinned too
        cache_mod.default_cache()
    assert cli.main(["catalog-hash", str(tmp_path / "nothing")]) == 2
    assert "no index.json" in capsys.readouterr().err


# == 5. read-only and full caches ================================================================
def test_read_only_home_without_cache_dir(tmp_path, fake_dsl, monkeypatch, read_only):
    import platformdirs

    home = tmp_path / "home"
    home.mkdir()
    read_only(home)
    monkeypatch.delenv("FLASHCORE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(platformdirs, "user_cache_dir", lambda name: str(home / ".cache" / name))
    built = []
    monkeypatch.setattr(compiler, "_build_one", lambda s: built.append(s) or _art(s))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = compiler.compile_kernel(SPEC)
        b = compiler.compile_kernel(OTHER)
        assert compiler.compile_kernel(SPEC) is a and compiler.compile_kernel(OTHER) is b
    assert built == [SPEC, OTHER]
    msgs = _cache_warnings(caught)
    assert len(msgs) == 1 and "not writable" in msgs[0] and "kept in memory" in msgs[0]
    assert not (home / ".cache").exists()


def test_read_only_cache_dir_is_used_read_only(tmp_path, fake_dsl, monkeypatch, read_only):
    root = tmp_path / "cache"
    KernelCache(root).put(_art(SPEC))
    read_only(root)
    cache = KernelCache(root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.get_or_build(SPEC, lambda s: pytest.fail("rebuilt")) == _art(SPEC)
        assert _cache_warnings(caught) == []  # a hit needs no lock and no write
        art = cache.get_or_build(OTHER, lambda s: _art(s))
        assert cache.get_or_build(OTHER, lambda s: pytest.fail("rebuilt")) is art
        third = KernelCache(root).get_or_build(THIRD, lambda s: _art(s))  # same process
    assert third.spec == THIRD
    msgs = _cache_warnings(caught)
    assert len(msgs) == 1 and str(root) in msgs[0] and "read-only" in msgs[0]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod")
def test_read_only_cache_dir_by_permissions(tmp_path, fake_dsl):
    root = tmp_path / "cache"
    KernelCache(root).put(_art(SPEC))
    for p in [root, *root.rglob("*")]:
        if p.is_dir():
            p.chmod(0o555)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache = KernelCache(root)
            assert cache.get(SPEC) is not None
            assert cache.get_or_build(OTHER, lambda s: _art(s)).spec == OTHER
        assert len(_cache_warnings(caught)) == 1
    finally:
        for p in [root, *root.rglob("*")]:
            if p.is_dir():
                p.chmod(0o755)


@pytest.mark.parametrize("catalog", [True, False])
def test_a_miss_in_a_read_only_folder_without_the_dsl_is_kernel_not_available(
    tmp_path, fake_dsl, monkeypatch, read_only, catalog
):
    root = tmp_path / "shipped"
    if catalog:
        _make_catalog(root, [SPEC])
    else:
        KernelCache(root).put(_art(SPEC))
    read_only(root)
    _no_dsl(monkeypatch)
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(root))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert compiler.compile_kernel(SPEC).spec == SPEC
        with pytest.raises(KernelNotAvailableError, match="not in the cache"):
            compiler.compile_kernel(OTHER)


@pytest.mark.parametrize("catalog", [True, False])
def test_a_corrupt_entry_in_a_read_only_folder_is_skipped(tmp_path, fake_dsl, monkeypatch,
                                                         read_only, catalog):
    root = tmp_path / "shipped"
    if catalog:
        _make_catalog(root, [SPEC])
    else:
        KernelCache(root).put(_art(SPEC))
    entry = next(root.glob("v1/*/*-dsl*"))
    (entry / CUBIN).write_bytes(b"flipped")
    read_only(root)
    _no_dsl(monkeypatch)
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(root))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KernelNotAvailableError):
            compiler.compile_kernel(SPEC)
    msgs = _cache_warnings(caught)
    assert any(str(entry) in m and "skipped" in m for m in msgs), msgs
    assert entry.is_dir() and not (root / "v1" / "quarantine").exists()


def test_a_full_disk_keeps_the_compiled_kernel_in_memory(tmp_path, fake_dsl, monkeypatch):
    cache = KernelCache(tmp_path / "cache")

    def full(self, directory):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / CUBIN).write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(KernelArtifact, "save", full)
    built = []
    with pytest.warns(CacheWarning, match="could not store .*No space left on device.*in memory"):
        art = cache.get_or_build(SPEC, lambda s: built.append(s) or _art(s))
    assert art.spec == SPEC and built == [SPEC]
    assert cache.get_or_build(SPEC, lambda s: pytest.fail("rebuilt")) is art
    assert not list(cache.base.rglob(".tmp-*")) and cache.entries() == []


# == 7. clear ====================================================================================
def test_clear_removes_only_what_the_cache_wrote(tmp_path, fake_dsl):
    cache = KernelCache(tmp_path / "cache")
    a = cache.get_or_build(SPEC, _art)
    cache.put(_art(OTHER))
    (cache.base / "results.csv").write_text("mine")
    (cache.base / "notes").mkdir()
    (cache.base / "notes" / "x.txt").write_text("mine too")
    sdir = cache.spec_dir(SPEC)
    (sdir / ".tmp-half-1-0123abcd").mkdir()
    (sdir / "README").write_text("a user's note in a spec folder")
    (cache.base / "quarantine" / "old").mkdir(parents=True)
    assert list(sdir.glob("*.lock"))
    assert cache.clear() == []
    assert cache.entries() == [] and cache.get(SPEC) is None and a.spec == SPEC
    left = sorted(p.relative_to(cache.root).as_posix() for p in cache.root.rglob("*"))
    assert left == sorted(["v1", "v1/notes", "v1/notes/x.txt", "v1/results.csv",
                           f"v1/{sdir.name}", f"v1/{sdir.name}/README"])


def test_cache_clear_refuses_a_catalog_unless_forced(tmp_path, fake_dsl, monkeypatch, capsys):
    root = tmp_path / "cat"
    _make_catalog(root, [SPEC])
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(root))
    assert cli.main(["cache", "clear"]) == 2
    err = capsys.readouterr().err
    assert "is a flashcore catalog" in err and "--force" in err and len(err.splitlines()) == 1
    assert verify_catalog(root)
    assert cli.main(["cache", "clear", "--force"]) == 0
    assert "cleared" in capsys.readouterr().out
    assert not (root / "index.json").exists() and not list(root.rglob(META))


def test_cache_clear_on_a_read_only_cache_reports_and_fails(tmp_path, fake_dsl, monkeypatch,
                                                            capsys, read_only):
    root = tmp_path / "cache"
    KernelCache(root).put(_art(SPEC))
    read_only(root)
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(root))
    assert cli.main(["cache", "clear"]) == 1
    out, err = capsys.readouterr()
    assert "cleared" not in out
    assert "could not remove" in err and "Read-only file system" in err
    assert "Traceback" not in err and KernelCache(root).get(SPEC) is not None


# == 8. temporaries of killed writers ===========================================================
def test_put_and_prune_remove_temporaries_of_dead_or_old_writers(tmp_path, fake_dsl):
    cache = KernelCache(tmp_path / "cache")
    sdir = cache.spec_dir(SPEC)
    sdir.mkdir(parents=True)
    me = owner.owner_tag()  # temporaries are named by host tag and pid (flashcore.compiler.owner)
    dead = sdir / f".tmp-x-dsl{DSL}-h{owner.host_tag()}-{_dead_pid()}-0123abcd"
    old = sdir / f".tmp-x-dsl{DSL}-{me}-4567abcd"
    live = sdir / f".tmp-x-dsl{DSL}-{me}-89abcdef"
    for d in (dead, old, live):
        d.mkdir()
        (d / CUBIN).write_bytes(b"half")
    hour_ago = time.time() - 3700
    os.utime(old, (hour_ago, hour_ago))
    cache.put(_art(SPEC))  # opportunistically, in the folder it writes to
    assert not dead.exists() and not old.exists() and live.exists()
    osdir = cache.spec_dir(OTHER)
    osdir.mkdir(parents=True)
    dead2 = osdir / f".tmp-y-h{owner.host_tag()}-{_dead_pid()}-0123abcd"
    dead2.mkdir()
    report = cache.prune()
    assert dead2 in report.removed and live.exists()


# == 9. waiting on a build that fails ===========================================================
def test_waiters_on_a_failed_build_fail_at_once_with_its_error(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    root, log = tmp_path / "cache", tmp_path / "builds.log"
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=child_get_or_build_failing,
                         args=(str(root), str(log), barrier, results)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [kind for kind, _, _ in got] == ["CompileError"] * 3, got
    assert len(log.read_text().split()) == 1  # built once: the waiters did not retry
    assert all("the stand-in compiler gave up" in msg for _, _, msg in got)


def test_a_failure_marker_is_short_lived(tmp_path, fake_dsl, monkeypatch):
    root = tmp_path / "cache"

    def fail(s):
        raise CompileError(f"compiling {s.name} failed: boom")

    with pytest.raises(CompileError, match="boom"):
        KernelCache(root).get_or_build(SPEC, fail)
    assert list(KernelCache(root).spec_dir(SPEC).glob("*.failed"))
    with pytest.raises(CompileError, match=r"boom\n\(this build failed in process"):
        KernelCache(root).get_or_build(SPEC, lambda s: pytest.fail("retried at once"))
    monkeypatch.setattr(cache_mod, "_FAILURE_TTL_S", 0.0)
    art = KernelCache(root).get_or_build(SPEC, _art)  # later: tried again, and the marker goes
    assert art.spec == SPEC and not list(KernelCache(root).spec_dir(SPEC).glob("*.failed"))


def test_a_lock_wait_that_times_out_is_a_compile_error(tmp_path, fake_dsl, monkeypatch):
    cache = KernelCache(tmp_path / "cache")
    lock_path = cache._lock(SPEC).lock_file
    holder = subprocess.Popen(
        [sys.executable, "-c", ("import sys, time; from filelock import FileLock; "
                                f"l = FileLock({str(lock_path)!r}); l.acquire(); "
                                "print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(cache_mod, "_LOCK_TIMEOUT_S", 0.3)
        with pytest.raises(CompileError) as e:
            cache.get_or_build(SPEC, lambda s: pytest.fail("built without the lock"))
        assert SPEC.name in str(e.value) and str(lock_path) in str(e.value)
    finally:
        holder.kill()
        holder.wait()


# == 10. unreadable entries ====================================================================
def _eio(monkeypatch, target: Path, err: int):
    real = os.open

    def os_open(path, flags, *args, **kw):
        if os.fspath(path) == str(target):
            raise OSError(err, os.strerror(err), str(path))
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", os_open)


UNREADABLE = {
    "cubin is a directory": lambda e, mp: ((e / CUBIN).unlink(), (e / CUBIN).mkdir()),
    "meta.json symlink loop": lambda e, mp: ((e / META).unlink(), (e / META).symlink_to(e / META)),
    "ptx EIO": lambda e, mp: _eio(mp, e / PTX, errno.EIO),
    "meta.json permission": lambda e, mp: _eio(mp, e / META, errno.EACCES),
}


@pytest.mark.parametrize("kind", sorted(UNREADABLE))
def test_unreadable_entries_are_bad_entries_not_os_errors(tmp_path, fake_dsl, monkeypatch,
                                                          capsys, kind):
    root = tmp_path / "cache"
    entry = KernelCache(root).put(_art(SPEC))
    UNREADABLE[kind](entry, monkeypatch)
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(root))
    assert cli.main(["cache", "verify"]) == 1
    out = capsys.readouterr().out
    assert f"BAD {entry}" in out and "unreadable" in out and "1 bad" in out
    with pytest.warns(CacheWarning, match="unreadable"):
        assert KernelCache(root).get(SPEC) is None  # set aside; a build replaces it


# == 11. prune ==================================================================================
def test_parse_size():
    assert parse_size("500M") == 500 * 2**20 and parse_size("2G") == 2 * 2**30
    assert parse_size("1.5GiB") == int(1.5 * 2**30) and parse_size("4096") == 4096
    assert parse_size("100k") == 102400 and parse_size(" 1T ") == 2**40
    for bad in ("", "lots", "-1G", "5Q", "1.2.3M"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)


def test_prune_evicts_the_least_recently_used_first(tmp_path, fake_dsl):
    cache = KernelCache(tmp_path / "cache")
    paths = {s: cache.put(_art(s, ir="x" * 20000)) for s in (SPEC, OTHER, THIRD)}
    now = time.time()
    for age, s in ((300, SPEC), (200, OTHER), (100, THIRD)):
        os.utime(paths[s], (now - age, now - age))
    assert KernelCache(cache.root).get(SPEC) is not None  # a use: SPEC is now the newest
    (cache.base / "quarantine" / "junk").mkdir(parents=True)
    (cache.base / "quarantine" / "junk" / CUBIN).write_bytes(b"x" * 1000)
    keep = sum(f.stat().st_size for s in (SPEC, THIRD) for f in paths[s].iterdir())
    report = cache.prune(max_size=keep)
    assert report.removed[0].name == "junk" and report.removed[1:] == [paths[OTHER]]
    assert paths[SPEC].is_dir() and paths[THIRD].is_dir()
    assert report.size_bytes == keep and report.failed == []
    assert not list(cache.base.rglob(".tmp-*"))
    assert cache.verify() == []


def test_cache_prune_command(tmp_path, fake_dsl, monkeypatch, capsys):
    root = tmp_path / "cache"
    for s in (SPEC, OTHER):
        KernelCache(root).put(_art(s))
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(root))
    assert cli.main(["cache", "prune"]) == 0
    assert len(KernelCache(root).entries()) == 2
    assert cli.main(["cache", "prune", "--max-size", "1K"]) == 0
    assert "removed 2 items" in capsys.readouterr().out
    assert KernelCache(root).entries() == []
    with pytest.raises(SystemExit) as e:
        cli.main(["cache", "prune", "--max-size", "lots"])
    assert e.value.code == 2 and "not a size" in capsys.readouterr().err


def test_max_size_from_the_environment_prunes_after_each_put(tmp_path, fake_dsl, monkeypatch):
    cache = KernelCache(tmp_path / "cache")
    first = cache.put(_art(SPEC))
    size = cache.size_bytes()
    monkeypatch.setenv("FLASHCORE_CACHE_MAX_SIZE", str(int(size * 1.5)))
    old = time.time() - 100
    os.utime(first, (old, old))
    second = cache.put(_art(OTHER))
    assert not first.exists() and second.is_dir()


def test_a_catalog_is_never_evicted(tmp_path, fake_dsl):
    root = tmp_path / "cat"
    _make_catalog(root, [SPEC, OTHER])
    report = KernelCache(root).prune(max_size=0)
    assert report.removed == [] and verify_catalog(root)


# == 12. no lock files in catalogs =============================================================
def test_catalogs_carry_no_lock_files(tmp_path, fake_dsl):
    root = tmp_path / "cat"
    _make_catalog(root, [SPEC, OTHER])  # built through get_or_build: locks were taken
    assert not list(root.rglob("*.lock"))
    src = KernelCache(tmp_path / "src")
    arts = [src.get_or_build(s, _art) for s in (SPEC, OTHER)]
    assert list(src.root.rglob("*.lock"))
    write_catalog(src.root, arts)
    copy_catalog(src.root, tmp_path / "copy", keep_ir=True)
    assert not list(src.root.rglob("*.lock")) and not list((tmp_path / "copy").rglob("*.lock"))


# == 13. repr ==================================================================================
def test_artifact_repr_is_short():
    art = _art(SPEC, ir="module {\n" + "  op\n" * 100000 + "}\n")
    text = repr(art)
    assert len(text) < 400, text
    for part in (SPEC.name, art.entry, f"cubin={len(art.cubin)} B", "registers=128"):
        assert part in text
    q = synthetic_artifact(QuantizeSpec(arch="sm_90"), dsl=DSL)
    assert q.spec.name in repr(q)


# == 14. info and help ========================================================================
def test_info_prints_the_versions_that_matter(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path))
    assert cli.main(["info"]) == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    for key in ("torch", "cuda-python", "cuda-bindings", "nvidia-cutlass-dsl", "dsl_fingerprint"):
        assert key in rows
    assert rows["dsl_fingerprint"].strip() == str(fingerprint.dsl_fingerprint())
    from importlib.metadata import version

    assert rows["torch"].strip() == version("torch")
    assert rows["cuda-bindings"].strip() == version("cuda-bindings")


def test_top_level_help_shows_no_rst_markup():
    text = cli.build_parser().format_help()
    assert "``" not in text and "The flashcore command" in text


def test_every_flag_of_every_verb_has_help():
    ap = cli.build_parser()
    missing = []
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            for verb, sub in action.choices.items():
                missing += [f"{verb} {a.option_strings or a.dest}" for a in sub._actions
                            if not a.help]
    assert missing == []


# == 15. CLI errors: one line, exit 2, before any compile =====================================
@pytest.fixture
def no_compile(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("compiled before checking its arguments")

    monkeypatch.setattr(compiler, "compile_kernel", refuse)
    monkeypatch.setattr(compiler, "compile_many", refuse)


def test_dump_out_not_a_folder(tmp_path, capsys, no_compile):
    (tmp_path / "file").write_text("x")
    assert cli.main(["dump", "--arch", "sm_89", "--out", str(tmp_path / "file")]) == 2
    one_line_error(capsys, "--out", "not a folder")
    assert cli.main(["dump", "--out", str(tmp_path / "file" / "below")]) == 2
    one_line_error(capsys, "--out", "cannot write there")


def test_dump_out_read_only(tmp_path, capsys, no_compile, read_only):
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(ro)
    assert cli.main(["dump", "--out", str(ro)]) == 2
    one_line_error(capsys, "--out", str(ro), "cannot write there", "Read-only")
    assert cli.main(["dump", "--out", str(ro / "new")]) == 2
    one_line_error(capsys, "cannot write there")


def test_dump_compare_no_such_folder(tmp_path, capsys, no_compile):
    assert cli.main(["dump", "--compare", str(tmp_path / "nosuchdir"), "arch=sm_89"]) == 2
    one_line_error(capsys, "nosuchdir", "neither a dump folder")


def test_dump_compare_folder_without_a_report(tmp_path, capsys, no_compile):
    assert cli.main(["dump", "--compare", "arch=sm_89", str(tmp_path)]) == 2
    one_line_error(capsys, "not a dump folder", "resources.json")


def test_dump_compare_unknown_spec_field(capsys, no_compile):
    assert cli.main(["dump", "--compare", "arch=sm_89,bogus=1", "arch=sm_89"]) == 2
    one_line_error(capsys, "unknown spec field 'bogus'")


def _autotune(*args, tmp_path):
    env = dict(os.environ, FLASHCORE_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT),
               CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "flashcore.autotune", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120, check=False)


def test_autotune_build_unknown_arch(tmp_path):
    p = _autotune("build", "--arch", "sm_75", "--out", str(tmp_path / "o"), tmp_path=tmp_path)
    assert p.returncode == 2 and "invalid choice: 'sm_75'" in p.stderr
    assert "Traceback" not in p.stderr


def test_autotune_build_unknown_bucket(tmp_path):
    p = _autotune("build", "--out", str(tmp_path / "o"), "--buckets", "bogus", tmp_path=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert p.stderr.startswith("autotune build: unknown bucket 'bogus'; choose from [")


def test_autotune_run_without_a_gpu(tmp_path):
    p = _autotune("run", tmp_path=tmp_path)  # CUDA_VISIBLE_DEVICES="": no GPU, whatever the host
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "needs a CUDA GPU" in p.stderr
