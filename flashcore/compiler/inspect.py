"""Look inside a built kernel: instruction histograms (PTX and SASS), SASS, and a dump folder.

Used by ``examples/compile_and_dump.py`` and ``flashcore dump``. Needs no GPU; SASS needs
``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel, or a CUDA toolkit on PATH).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .artifact import KernelArtifact
from .cubin_info import occupancy

# category -> (PTX regex, SASS opcode regex). Counted per static instruction, not executed.
CATEGORIES: dict[str, tuple[str, str]] = {
    "mma": (r"^\s*(@\S+\s+)?(mma\.sync|wgmma\.mma_async)\b", r"^(HMMA|IMMA|QMMA|HGMMA|QGMMA)\b"),
    "ldmatrix": (r"^\s*(@\S+\s+)?ldmatrix\b", r"^LDSM\b"),
    "cp_async": (r"^\s*(@\S+\s+)?cp\.async\.c[ag]\b", r"^LDGSTS\b"),
    "ld_shared": (r"^\s*(@\S+\s+)?ld\.shared\b", r"^LDS\b"),
    "st_shared": (r"^\s*(@\S+\s+)?st\.shared\b", r"^STS\b"),
    "ld_global": (r"^\s*(@\S+\s+)?ld\.global\b", r"^LDG\b"),
    "st_global": (r"^\s*(@\S+\s+)?st\.global\b", r"^STG\b"),
    "exp2": (r"^\s*(@\S+\s+)?ex2\.approx\b", r"^MUFU\.EX2\b"),
    "shuffle": (r"^\s*(@\S+\s+)?shfl\.sync\b", r"^SHFL\b"),
    "barrier": (r"^\s*(@\S+\s+)?(bar\.sync|barrier\.sync)\b", r"^BAR\b"),
    "local_mem": (r"^\s*(@\S+\s+)?(ld|st)\.local\b", r"^(LDL|STL)\b"),
}


def ptx_histogram(ptx: str) -> dict[str, int]:
    lines = ptx.splitlines()
    return {k: sum(1 for ln in lines if re.match(p, ln)) for k, (p, _) in CATEGORIES.items()}


def find_nvdisasm() -> str | None:
    """nvdisasm from PATH, or from the nvidia-cuda-nvdisasm wheel."""
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    try:
        import nvidia  # namespace package of NVIDIA's wheels
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for cand in sorted(Path(root).glob("*/bin/nvdisasm")) + sorted(Path(root).glob("*/*/bin/nvdisasm")):
            if cand.is_file():
                return str(cand)
    return None


def sass(cubin: bytes) -> str | None:
    """Disassembled SASS, or None when nvdisasm is not installed."""
    exe = find_nvdisasm()
    if exe is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([exe, "-c", f.name], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {proc.stderr.strip()[-500:]}")
    return proc.stdout


def sass_opcodes(text: str) -> list[str]:
    """Opcodes (with modifiers) of every SASS instruction, predicates stripped."""
    ops = []
    for m in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text, re.MULTILINE):
        ops.append(m.group(1))
    return ops


_LABEL = re.compile(r"^(\.L_x_\d+):", re.MULTILINE)
_BRANCH = re.compile(r"\bBRA\s+`\((\.L_x_\d+)\)")


def loop_bodies(text: str) -> list[tuple[int, int]]:
    """(first, last) line numbers of every loop in the SASS: a branch back to a label above it."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := _LABEL.match(ln))}
    loops = []
    for i, ln in enumerate(lines):
        m = _BRANCH.search(ln)
        if m and labels.get(m.group(1), i) < i:
            loops.append((labels[m.group(1)], i))
    return loops


def local_memory_in_loops(text: str) -> int:
    """Local-memory (spill) instructions inside loops: the ones that cost every iteration."""
    lines = text.splitlines()
    inside = set()
    for first, last in loop_bodies(text):
        inside.update(range(first, last + 1))
    return sum(1 for i in inside if re.search(r"\s(LDL|STL)(\.\S+)?\s", lines[i]))


def sass_histogram(text: str) -> dict[str, int]:
    ops = sass_opcodes(text)
    return {k: sum(1 for op in ops if re.match(p, op)) for k, (_, p) in CATEGORIES.items()}


def resources_report(art: KernelArtifact, sass_text: str | None) -> dict:
    r = dataclasses.asdict(art.resources)
    report = {
        "kernel": art.spec.name,
        "entry": art.entry,
        "arch": art.spec.arch,
        "block": list(art.block),
        **r,
        "occupancy": occupancy(art.resources, art.spec.arch),
        "instructions_ptx": ptx_histogram(art.ptx),
        "toolchain": art.toolchain,
    }
    if sass_text is not None:
        report["instructions_sass"] = sass_histogram(sass_text)
        wide = sum(1 for op in sass_opcodes(sass_text) if re.match(r"^LDGSTS.*\.128", op))
        report["cp_async_16B"] = wide
        report["local_mem_in_loops"] = local_memory_in_loops(sass_text)
    return report


def dump(art: KernelArtifact, out: Path) -> dict:
    """Write IR, PTX, cubin, SASS (if possible), spec.json and resources.json into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel.ptx").write_text(art.ptx)
    (out / "kernel.cubin").write_bytes(art.cubin)
    (out / "kernel.mlir").write_text(art.ir or "")
    (out / "spec.json").write_text(json.dumps(art.spec.to_dict(), indent=2, sort_keys=True) + "\n")
    text = sass(art.cubin)
    sass_file = out / "kernel.sass"
    if text is not None:
        sass_file.write_text(text)
    elif sass_file.exists():
        sass_file.unlink()
    report = resources_report(art, text)
    report["sass"] = "kernel.sass" if text is not None else None
    (out / "resources.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
