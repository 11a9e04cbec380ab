"""KernelArtifact's on-disk form and the KernelCache: integrity, atomicity, locking, offline use."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashcore.compiler import cache as cache_mod
from flashcore.compiler.artifact import CUBIN, META, MLIR, PTX, KernelArtifact
from flashcore.compiler.cache import (
    CacheWarning,
    KernelCache,
    default_cache,
    entry_name,
    source_hash,
    spec_dir_name,
)
from flashcore.errors import CacheCorruptionError
from flashcore.specs import AttentionSpec, QuantizeSpec
from tests.artifact_helpers import SPEC, child_get_or_build, synthetic_artifact

DSL = "4.8.1"


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    # never touch the user's cache; pretend the DSL is installed at a fixed version
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path / "env-cache"))
    monkeypatch.setattr(cache_mod, "dsl_fingerprint", lambda: DSL)


@pytest.fixture
def cache(tmp_path) -> KernelCache:
    return KernelCache(tmp_path / "cache")


def _art(spec=SPEC, **kw) -> KernelArtifact:
    return synthetic_artifact(spec, dsl=kw.pop("dsl", DSL), **kw)


class Builds:
    """A build function that counts its calls."""

    def __init__(self, **kw) -> None:
        self.calls: list = []
        self.kw = kw

    def __call__(self, spec):
        self.calls.append(spec)
        return _art(spec, **self.kw)


# -- save / load -------------------------------------------------------------------------------
def test_round_trip(tmp_path):
    art = _art()
    art.save(tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted([CUBIN, PTX, MLIR, META])
    back = KernelArtifact.load(tmp_path / "a")
    assert back == art
    assert isinstance(back.params, tuple) and isinstance(back.block, tuple)


def test_round_trip_without_ir_and_other_spec_kinds(tmp_path):
    for i, spec in enumerate([AttentionSpec(), QuantizeSpec(arch="sm_90", transpose=True)]):
        art = _art(spec, ir="")
        art.save(tmp_path / str(i))
        assert not (tmp_path / str(i) / MLIR).exists()
        assert KernelArtifact.load(tmp_path / str(i)) == art


def test_resave_without_ir_drops_stale_ir(tmp_path):
    _art().save(tmp_path)
    _art(ir="").save(tmp_path)
    assert not (tmp_path / MLIR).exists() and KernelArtifact.load(tmp_path).ir == ""


def _flip(path: Path, pos: int, mask: int = 0xFF) -> None:
    data = bytearray(path.read_bytes())
    data[pos % len(data)] ^= mask
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flip cubin": (lambda d: _flip(d / CUBIN, 17), CUBIN, "checksum mismatch"),
    "flip ptx": (lambda d: _flip(d / PTX, 3), PTX, "checksum mismatch"),
    "flip mlir": (lambda d: _flip(d / MLIR, 0), MLIR, "checksum mismatch"),
    "flip meta value": (
        lambda d: (d / META).write_text(
            (d / META).read_text().replace('"registers": 128', '"registers": 129')
        ),
        META,
        "checksum mismatch",
    ),
    "flip meta syntax": (lambda d: _flip(d / META, 0), META, "broken JSON|not UTF-8"),
    "truncate cubin": (
        lambda d: (d / CUBIN).write_bytes((d / CUBIN).read_bytes()[:-1]),
        CUBIN,
        "truncated",
    ),
    "extend ptx": (
        lambda d: (d / PTX).write_bytes((d / PTX).read_bytes() + b"\n"),
        PTX,
        "bytes, expected",
    ),
    "truncate meta": (
        lambda d: (d / META).write_bytes((d / META).read_bytes()[:40]),
        META,
        "broken JSON",
    ),
    "empty meta": (lambda d: (d / META).write_bytes(b""), META, "broken JSON"),
    "missing cubin": (lambda d: (d / CUBIN).unlink(), CUBIN, "missing"),
    "missing mlir": (lambda d: (d / MLIR).unlink(), MLIR, "missing"),
    "missing meta": (lambda d: (d / META).unlink(), META, "missing"),
    "meta not an object": (lambda d: (d / META).write_text("[1, 2]\n"), META, "not an artifact"),
    "meta reformatted": (
        lambda d: (d / META).write_text(json.dumps(json.loads((d / META).read_text()))),
        META,
        "layout",
    ),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_every_corruption_detected(tmp_path, kind):
    damage, file, message = CORRUPTIONS[kind]
    _art().save(tmp_path)
    damage(tmp_path)
    with pytest.raises(CacheCorruptionError, match=message) as e:
        KernelArtifact.load(tmp_path)
    assert str(tmp_path / file) in str(e.value)  # names the file


def test_rehashed_but_invalid_meta_detected(tmp_path):
    # consistent checksums around content that is not an artifact (e.g. a bad spec)
    from flashcore.compiler import artifact as artifact_mod

    _art().save(tmp_path)
    meta = json.loads((tmp_path / META).read_text())
    meta["spec"]["head_dim"] = 48
    meta["meta_sha256"] = artifact_mod._sha256(artifact_mod._canonical(meta).encode())
    (tmp_path / META).write_text(artifact_mod._meta_text(meta))
    with pytest.raises(
        CacheCorruptionError, match="does not describe a valid artifact.*head_dim=48"
    ):
        KernelArtifact.load(tmp_path)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    file=st.sampled_from([CUBIN, PTX, MLIR, META]),
    pos=st.integers(0, 10**6),
    mask=st.integers(1, 255),
)
def test_any_flipped_byte_detected(tmp_path, file, pos, mask):
    d = tmp_path / "h"
    shutil.rmtree(d, ignore_errors=True)
    _art().save(d)
    _flip(d / file, pos, mask)
    with pytest.raises(CacheCorruptionError):
        KernelArtifact.load(d)


# -- put / get -------------------------------------------------------------------------------------
def test_put_layout_and_get(cache):
    art = _art()
    path = cache.put(art)
    assert path == cache.root / "v1" / spec_dir_name(SPEC) / entry_name(source_hash(), DSL)
    assert path.parent.name == f"{SPEC.name}-{SPEC.content_hash}"
    assert path.name == f"{source_hash()}-dsl{DSL}"
    assert KernelCache(cache.root).get(SPEC) == art  # a fresh table reads it from disk
    assert KernelCache(cache.root).get(AttentionSpec()) is None


def test_put_is_atomic_and_keeps_existing(cache, monkeypatch):
    first = cache.put(_art(cubin=b"first"))
    second = cache.put(_art(cubin=b"second"))
    assert first == second
    assert KernelArtifact.load(first).cubin == b"first"
    assert [p.name for p in first.parent.iterdir() if p.name.startswith(".tmp")] == []

    # a save that dies half way leaves no entry and no temporary directory
    other = AttentionSpec()
    real_save = KernelArtifact.save

    def dying_save(self, directory):
        real_save(self, directory)
        (Path(directory) / META).unlink()
        raise OSError("disk full")

    monkeypatch.setattr(KernelArtifact, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        cache.put(_art(other))
    assert list(cache.spec_dir(other).iterdir()) == []


def test_get_or_build_builds_once_then_memory(cache, monkeypatch):
    build = Builds()
    art = cache.get_or_build(SPEC, build)
    assert len(build.calls) == 1 and cache.get(SPEC) is art
    # memory table hit: no disk access at all
    shutil.rmtree(cache.base)

    def no_load(directory):
        raise AssertionError("disk was read")

    monkeypatch.setattr(KernelArtifact, "load", no_load)
    assert cache.get_or_build(SPEC, build) is art
    assert len(build.calls) == 1


def test_get_or_build_from_disk(cache):
    cache.put(_art())
    build = Builds()
    assert KernelCache(cache.root).get_or_build(SPEC, build) == _art()
    assert build.calls == []


def test_corrupt_entry_quarantined_and_rebuilt(cache):
    path = cache.put(_art(cubin=b"original"))
    _flip(path / CUBIN, 2)
    fresh = KernelCache(cache.root)
    build = Builds(cubin=b"rebuilt")
    with pytest.warns(CacheWarning, match=f"corrupt entry {path}.*{CUBIN}.*checksum mismatch"):
        art = fresh.get_or_build(SPEC, build)
    assert art.cubin == b"rebuilt" and len(build.calls) == 1
    assert KernelArtifact.load(path).cubin == b"rebuilt"
    quarantined = list((cache.base / "quarantine").iterdir())
    assert len(quarantined) == 1 and quarantined[0].name.startswith(path.parent.name)
    assert (quarantined[0] / CUBIN).read_bytes() != b"original"  # the damaged copy, kept aside
    assert cache.verify() == []


def test_get_quarantines_too(cache):
    path = cache.put(_art())
    (path / META).write_text("{")
    with pytest.warns(CacheWarning, match="broken JSON"):
        assert KernelCache(cache.root).get(SPEC) is None
    assert not path.exists()


def test_failed_build_leaves_nothing(cache):
    def broken(spec):
        raise RuntimeError("compiler exploded")

    with pytest.raises(RuntimeError, match="exploded"):
        cache.get_or_build(SPEC, broken)
    assert cache.entries() == []
    assert [p for p in cache.spec_dir(SPEC).iterdir() if p.is_dir()] == []
    assert cache.get(SPEC) is None


def test_build_returning_wrong_spec_rejected(cache):
    with pytest.raises(ValueError, match="returned an artifact for"):
        cache.get_or_build(SPEC, lambda s: _art(AttentionSpec()))
    assert cache.entries() == []


def test_misplaced_entry_is_not_loaded(cache):
    path = cache.put(_art(AttentionSpec()))
    wrong = cache.spec_dir(SPEC) / path.name
    wrong.parent.mkdir(parents=True)
    shutil.copytree(path, wrong)
    assert [p for p, _ in cache.verify()] == [wrong]
    with pytest.warns(CacheWarning, match="holds"):
        assert KernelCache(cache.root).get(SPEC) is None


# -- DSL versions: exact online, any offline ---------------------------------------------------
def test_other_dsl_version_misses_online(cache, monkeypatch):
    cache.put(_art(dsl="4.7.0"))
    assert KernelCache(cache.root).get(SPEC) is None


def test_offline_accepts_any_dsl_version_newest_first(cache, monkeypatch):
    old = cache.put(_art(dsl="4.6.0", cubin=b"old"))
    new = cache.put(_art(dsl="4.7.0", cubin=b"new"))
    now = time.time()
    os.utime(old / META, (now - 100, now - 100))
    os.utime(new / META, (now, now))
    monkeypatch.setattr(cache_mod, "dsl_fingerprint", lambda: None)
    assert KernelCache(cache.root).get(SPEC).cubin == b"new"
    os.utime(old / META, (now + 100, now + 100))
    assert KernelCache(cache.root).get(SPEC).cubin == b"old"
    # a corrupt newest entry is set aside and the next one used
    _flip(old / CUBIN, 0)
    with pytest.warns(CacheWarning):
        assert KernelCache(cache.root).get(SPEC).cubin == b"new"
    # and without any entry, the (offline) build function is what runs
    assert KernelCache(cache.root).get(AttentionSpec()) is None


# -- several processes at once -----------------------------------------------------------------
def test_concurrent_builders_in_three_processes(cache, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    log = tmp_path / "builds.log"
    barrier = ctx.Barrier(3)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=child_get_or_build, args=(str(cache.root), str(log), barrier, results))
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(status == "ok" for status, _, _ in got), got
    assert len({digest for _, _, digest in got}) == 1  # everyone got the same artifact
    assert len(log.read_text().split()) == 1  # built once; the others waited and loaded it
    entries = KernelCache(cache.root).entries()
    assert len(entries) == 1 and entries[0][1] == SPEC
    assert KernelCache(cache.root).verify() == []
    leftovers = [p for p in cache.spec_dir(SPEC).iterdir() if p.name.startswith(".tmp")]
    assert leftovers == []


# -- maintenance ---------------------------------------------------------------------------------
def test_entries_verify_size_clear(cache):
    assert cache.entries() == [] and cache.verify() == [] and cache.size_bytes() == 0
    a = cache.put(_art())
    b = cache.put(_art(AttentionSpec(), ir=""))
    assert sorted(cache.entries()) == sorted([(a, SPEC), (b, AttentionSpec())])
    assert cache.size_bytes() == sum(f.stat().st_size for f in cache.base.rglob("*") if f.is_file())
    _flip(b / PTX, 5)
    problems = cache.verify()
    assert [p for p, _ in problems] == [b] and "checksum mismatch" in problems[0][1]
    (a / META).write_text("nonsense")
    assert (a, None) in cache.entries()
    cache.clear()
    assert cache.entries() == [] and cache.size_bytes() == 0 and cache.get(SPEC) is None


def test_default_cache_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path / "one"))
    one = default_cache()
    assert one is default_cache() and one.root == (tmp_path / "one").resolve()
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path / "two"))
    assert default_cache() is not one and default_cache().root == (tmp_path / "two").resolve()
    monkeypatch.delenv("FLASHCORE_CACHE_DIR")
    assert "flashcore" in str(default_cache().root)


def test_source_hash(tmp_path, monkeypatch):
    from flashcore.compiler import fingerprint

    h = source_hash()
    assert len(h) == 16 and int(h, 16) >= 0 and source_hash() == h
    # it depends on every file's path and bytes
    tree = tmp_path / "pkg"
    (tree / "kernels" / "sub").mkdir(parents=True)
    (tree / "kernels" / "a.py").write_text("x = 1\n")
    (tree / "kernels" / "sub" / "b.py").write_text("y = 2\n")
    (tree / "kernels" / "notes.txt").write_text("ignored")
    monkeypatch.setattr(fingerprint, "PACKAGE", tree)
    monkeypatch.setattr(fingerprint, "BUILD_SOURCES", ("kernels",))
    compute = fingerprint.fresh_source_hash
    tree = tree / "kernels"
    base = compute()
    (tree / "notes.txt").write_text("still ignored")
    assert compute() == base
    (tree / "sub" / "b.py").write_text("y = 3\n")
    assert compute() != base
    (tree / "sub" / "b.py").write_text("y = 2\n")
    (tree / "sub" / "b.py").rename(tree / "b.py")
    assert compute() != base


def test_hash_and_version_do_not_import_the_dsl():
    code = (
        "import sys; from flashcore.compiler.fingerprint import source_hash, dsl_fingerprint; "
        "source_hash(); dsl_fingerprint(); "
        "assert 'cutlass' not in sys.modules, 'cutlass was imported'"
    )
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=60)


def test_warnings_are_cache_warnings(cache):
    path = cache.put(_art())
    (path / CUBIN).unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        KernelCache(cache.root).get(SPEC)
    assert [w.category for w in caught] == [CacheWarning]


def test_concurrent_builders_in_threads(cache, tmp_path):
    # compile_many runs get_or_build from a thread pool: one build per spec there too
    from concurrent.futures import ThreadPoolExecutor

    from tests.artifact_helpers import slow_build

    log = tmp_path / "threads.log"
    specs = [SPEC, SPEC, SPEC, AttentionSpec(), AttentionSpec()]
    with ThreadPoolExecutor(max_workers=5) as pool:
        arts = list(
            pool.map(lambda s: cache.get_or_build(s, lambda t: slow_build(t, str(log), 0.2)), specs)
        )
    assert len(log.read_text().split()) == 2
    assert arts[0] is arts[1] is arts[2] and arts[3] is arts[4]
    assert KernelCache(cache.root).verify() == [] and len(cache.entries()) == 2
