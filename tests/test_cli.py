"""The command line, compile_and_dump, catalogs, and hosts without the DSL (CPU only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERBS = ["compile", "dump", "precompile", "cache", "catalog-hash", "info"]
# a prelude that makes the DSL unimportable, as on a GPU host that only runs prebuilt kernels
NO_DSL = "import sys; sys.modules['cutlass'] = None\n"


def run(args, cache, cwd=ROOT, prelude=""):
    env = dict(os.environ, FLASHCORE_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    code = prelude + "import sys; from flashcore.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_help(verb, tmp_path):
    p = run([verb, "--help"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "usage: flashcore " + verb in p.stdout


@pytest.mark.parametrize(
    "args", [["frobnicate"], ["compile", "--tile", "64"], ["dump", "--head-dim", "48"],
             ["cache", "explode"], ["compile", "--arch", "sm_75"]]
)
def test_bad_flags_are_usage_errors(args, tmp_path):
    p = run(args, tmp_path)
    assert p.returncode == 2
    assert "usage:" in p.stderr and "Traceback" not in p.stderr


def test_bad_spec_is_one_line_error(tmp_path):
    p = run(["compile", "--tile", "128", "64", "--warps", "8", "--head-dim", "128",
             "--arch", "sm_89", "--stages", "5"], tmp_path)
    assert p.returncode == 2 and "stages=5 is not supported" in p.stderr
    assert "Traceback" not in p.stderr


def test_compile_and_dump_example(tmp_path):
    env = dict(os.environ, FLASHCORE_CACHE_DIR=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "compile_and_dump.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr
    out = tmp_path / "dump" / "fc_attn_fwd_sm89_f16_d64_m64n64_w4_s1"
    for f in ("kernel.ptx", "kernel.cubin", "kernel.mlir", "spec.json", "resources.json"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    spec = json.loads((out / "spec.json").read_text())
    assert spec["arch"] == "sm_89" and spec["head_dim"] == 64 and spec["config"]["tile"] == [64, 64]
    res = json.loads((out / "resources.json").read_text())
    assert res["registers"] > 0 and res["stack_frame_bytes"] == 0
    ptx = (out / "kernel.ptx").read_text()
    n_mma = sum(1 for ln in ptx.splitlines() if ln.strip().startswith("mma.sync"))
    assert n_mma > 0 and res["instructions_ptx"]["mma"] == n_mma
    assert res["occupancy"]["ctas_per_sm"] >= 1
    if res.get("sass"):
        assert (out / "kernel.sass").is_file() and res["instructions_sass"]["mma"] > 0
    # the printed table names what a newcomer looks for
    for word in ("registers", "shared memory", "spills", "mma"):
        assert word in p.stdout


def test_dump_compare(tmp_path):
    a = "arch=sm_89,head_dim=64,tile=64x64,warps=4"
    b = "arch=sm_89,head_dim=64,tile=128x64,warps=8"
    p = run(["dump", "--compare", a, b], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "registers" in p.stdout and "mma" in p.stdout


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    root = tmp_path_factory.mktemp("catalog")
    p = run(["precompile", "--arch", "sm_89", "--limit", "2", "--jobs", "2",
             "--out", str(root)], root / "unused-cache")
    assert p.returncode == 0, p.stderr
    return root


def test_precompile_writes_a_complete_index(catalog):
    index = json.loads((catalog / "index.json").read_text())
    assert index["archs"] == ["sm_89"]
    assert len(index["kernels"]) == 2
    for k in index["kernels"]:
        assert (catalog / k["path"] / "kernel.cubin").is_file()


def test_parallel_precompile_two_archs(tmp_path):
    p = run(["precompile", "--arch", "sm_90", "sm_89", "--limit", "1", "--jobs", "2",
             "--out", str(tmp_path)], tmp_path / "c")
    assert p.returncode == 0, p.stderr
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["archs"] == ["sm_89", "sm_90"]
    assert {k["arch"] for k in index["kernels"]} == {"sm_89", "sm_90"}


def test_cache_verify_catches_a_flipped_byte(catalog, tmp_path):
    import shutil

    copy = tmp_path / "cat"
    shutil.copytree(catalog, copy)
    assert run(["cache", "verify"], copy).returncode == 0
    cubin = next(copy.rglob("kernel.cubin"))
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0x01
    cubin.write_bytes(bytes(data))
    p = run(["cache", "verify"], copy)
    assert p.returncode == 1 and "BAD" in p.stdout and "kernel.cubin" in p.stdout


def test_host_without_dsl_runs_catalog_and_refuses_missing(catalog):
    index = json.loads((catalog / "index.json").read_text())
    present = index["kernels"][0]["spec"]
    code = NO_DSL + f"""
import json, flashcore
from flashcore.specs import spec_from_dict
assert not flashcore.can_compile()
art = flashcore.compile_kernel(spec_from_dict(json.loads({json.dumps(json.dumps(present))})))
print("LOADED", art.entry, len(art.cubin))
missing = flashcore.AttentionSpec(arch="sm_90", head_dim=128,
                                  config=flashcore.TileConfig((16, 32), warps=1))
try:
    flashcore.compile_kernel(missing)
except flashcore.KernelNotAvailableError as e:
    print("REFUSED", e)
"""
    env = dict(os.environ, FLASHCORE_CACHE_DIR=str(catalog), PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=False)
    assert p.returncode == 0, p.stderr
    assert "LOADED" in p.stdout
    assert "REFUSED kernel fc_attn_fwd_sm90_f16_d128_m16n32_w1_s1 is not in the cache" in p.stdout
    assert "nvidia-cutlass-dsl is not installed" in p.stdout and "FLASHCORE_CACHE_DIR" in p.stdout


def test_load_catalog_checks_integrity_and_arch(catalog, tmp_path, monkeypatch):
    import shutil

    import flashcore
    from flashcore.errors import CatalogError
    from flashcore.runtime import catalog as cat

    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path / "before"))
    assert flashcore.load_catalog(catalog) == catalog.resolve()
    assert os.environ["FLASHCORE_CACHE_DIR"] == str(catalog.resolve())
    # a GPU of another arch than the catalog's, and every visible device is checked
    monkeypatch.setattr("flashcore.runtime.catalog.visible_archs",
                        lambda: {0: "sm_89", 1: "sm_90"})
    with pytest.raises(CatalogError, match=r"holds kernels for \['sm_89'\].*cuda:1 needs sm_90"):
        cat.load_catalog(catalog)
    monkeypatch.setattr("flashcore.runtime.catalog.visible_archs", dict)
    # a tampered entry
    copy = tmp_path / "cat"
    shutil.copytree(catalog, copy)
    meta = next(copy.rglob("meta.json"))
    meta.write_text(meta.read_text().replace('"registers": ', '"registers": 1'))
    with pytest.raises(CatalogError, match="modified"):
        cat.load_catalog(copy)
    with pytest.raises(CatalogError, match="no index.json"):
        cat.load_catalog(tmp_path)


def test_catalog_without_ir_still_verifies_and_loads(catalog, tmp_path):
    from flashcore.compiler.artifact import KernelArtifact
    from flashcore.compiler.catalog import copy_catalog, verify_catalog

    copy_catalog(catalog, tmp_path / "slim")
    index = verify_catalog(tmp_path / "slim")
    assert len(index["kernels"]) == 2
    for k in index["kernels"]:
        art = KernelArtifact.load(tmp_path / "slim" / k["path"])
        assert art.ir == "" and len(art.cubin) > 0
        assert not (tmp_path / "slim" / k["path"] / "kernel.mlir").exists()


def test_spec_flags_come_from_the_spec(tmp_path):
    """Every spec field is a typed flag: the kernel-families issue's command, and a compare
    whose pairs are parsed with the fields' types."""
    p = run(["dump", "--arch", "sm_89", "--kv-splits", "2", "--precision", "fp8",
             "--out", str(tmp_path / "d")], tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    spec = json.loads(next((tmp_path / "d").glob("*/spec.json")).read_text())
    assert spec["config"]["kv_splits"] == 2 and spec["precision"] == "fp8"
    p = run(["dump", "--compare", "arch=sm_89,tile=32x64,warps=2",
             "arch=sm_89,tile=32x64,warps=2,kv_splits=2"], tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    assert "registers" in p.stdout
    from flashcore.cli import build_parser

    helps = build_parser()._subparsers._group_actions[0].choices["compile"].format_help()
    for flag in ("--kv-splits", "--stages", "--precision", "--kv-fp8", "--split-kv", "--family",
                 "--return-lse", "--lse"):
        assert flag in helps, flag


def test_any_kernel_dumps_from_its_spec_json(tmp_path):
    """``--spec`` takes any kernel's JSON (its op picks the kernel: here the KV-cache append),
    or a dump's spec.json to build the same kernel again; bad JSON is a one-line error."""
    spec = {"op": "kv_append", "arch": "sm_90", "dtype": "bfloat16", "head_dim": 64,
            "rotary_dim": 32, "interleaved": True}
    p = run(["dump", "--spec", json.dumps(spec), "--out", str(tmp_path / "d")], tmp_path / "c")
    assert p.returncode == 0, p.stderr
    out = tmp_path / "d" / "fc_kv_append_sm90_bf16_d64_r32i_f32"
    saved = json.loads((out / "spec.json").read_text())
    assert {k: saved[k] for k in spec} == spec and (out / "kernel.ptx").stat().st_size > 0
    p = run(["compile", "--spec", str(out / "spec.json")], tmp_path / "c")
    assert p.returncode == 0 and "fc_kv_append_sm90_bf16_d64_r32i_f32" in p.stdout, p.stderr
    for bad, what in (("{not json", "not valid JSON"), (str(tmp_path / "none.json"),
                                                        "not a readable file"),
                      ('{"op": "frobnicate"}', "unknown kernel op")):
        p = run(["compile", "--spec", bad], tmp_path / "c")
        assert p.returncode == 2 and what in p.stderr and "Traceback" not in p.stderr, p.stderr
