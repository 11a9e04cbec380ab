"""Rebuild a sample of a catalog's kernels with this tree and compare them with the catalog's:
cubin and PTX bytes, and the SASS (nvdisasm, addresses stripped). A source change that should
not change code (moving constants, renaming helpers) shows as all-identical, so the catalog's
device results still describe it.

    python scripts/compare_builds.py OLD_CATALOG NEW_CACHE_DIR [--per-kind 2]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
from pathlib import Path

from flashcore.compiler.cache import KernelCache
from flashcore.compiler.compiler import compile_many
from flashcore.compiler.fingerprint import source_hash
from flashcore.compiler.inspect import find_nvdisasm
from flashcore.specs import spec_from_dict


def kind(name: str) -> str:
    for tag in ("combine", "quant", "kvfp8_split", "kvfp8", "_fp8", "split", "_k2"):
        if tag in name:
            return tag.strip("_")
    return "plain"


def sass(cubin: bytes, nvdisasm: str) -> list[str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    return [line.split("/*")[0] + line.split("*/", 1)[-1] for line in text.splitlines()
            if "/*" in line]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path, help="a catalog (with index.json)")
    ap.add_argument("new", type=Path, help="cache folder for the rebuilt kernels")
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        raise SystemExit("nvdisasm not found (pip install '.[sass]')")
    by_kind: dict[str, list[dict]] = {}
    for k in json.loads((a.old / "index.json").read_text())["kernels"]:
        by_kind.setdefault(kind(k["name"]), []).append(k)
    rng = random.Random(1)
    chosen = [k for ks in by_kind.values() for k in rng.sample(ks, min(a.per_kind, len(ks)))]
    print(f"this tree's kernel source hash {source_hash()}; rebuilding {len(chosen)} kernels")
    arts = compile_many([spec_from_dict(k["spec"]) for k in chosen], cache=KernelCache(a.new),
                        jobs=a.jobs)
    same = 0
    for k, art in zip(chosen, arts):
        old = a.old / k["path"]
        cubin = (old / "kernel.cubin").read_bytes()
        ptx = (old / "kernel.ptx").read_text()
        equal_sass = sass(cubin, nvdisasm) == sass(art.cubin, nvdisasm)
        same += equal_sass
        marks = ["==" if x else "!=" for x in (cubin == art.cubin, ptx == art.ptx, equal_sass)]
        print(f"{k['name']:60s} cubin {marks[0]}  ptx {marks[1]}  sass {marks[2]}")
    print(f"{same}/{len(chosen)} identical SASS")
    return 0 if same == len(chosen) else 1


if __name__ == "__main__":
    raise SystemExit(main())
