"""The package's structure, read from its own source: layers import downwards only, no import
cycles, only the kernels import the CuTe DSL, and kernel code stays in small pieces."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flashcore"

# What each layer may import from flashcore (besides itself). The top: cli, bench/autotune
# entry points and the package's lazy __init__ may use anything.
LAYERS = {
    "errors": set(),
    "version": set(),
    "specs": {"errors"},
    "kernels": {"specs", "errors"},
    "compiler": {"specs", "errors", "version"},
    "runtime": {"compiler", "specs", "errors"},
    "tuned": {"specs", "errors"},
    "ops": {"runtime", "compiler", "specs", "errors", "tuned"},
    # the benchmarks time the clients' paths too (``bench --host``: the transformers hook)
    "tuning": {"ops", "runtime", "compiler", "specs", "errors", "tuned", "integrations"},
    "integrations": {"ops", "specs", "errors"},
    "distributed": {"ops"},
    "reference": {"kernels.common.block_info"},
}
TOP = {"cli", "bench", "autotune", "__init__", "spec", "build"}  # spec, build: old names


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    """Import nodes under ``if TYPE_CHECKING:`` (annotations only: never run)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                skip.update(ast.walk(sub))
    return skip


def _imports(name: str, path: Path) -> set[str]:
    """flashcore modules imported anywhere in the file (function-level imports included)."""
    tree = ast.parse(path.read_text())
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    skip = _type_checking_only(tree)
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("flashcore"):
                mod = node.module.removeprefix("flashcore").lstrip(".")
            else:
                continue
            found.add(mod)
            found.update(f"{mod}.{a.name}".strip(".") for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("flashcore.") for a in node.names
                         if a.name.startswith("flashcore."))
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        targets = set()
        for imp in _imports(name, path):
            while imp and imp not in mods:  # `from .x import name` names an attribute
                imp = imp.rpartition(".")[0]
            if imp and imp != name:
                targets.add(imp)
        graph[name] = targets
    return graph


def _layer(module: str) -> str:
    return module.split(".")[0] if module else "__init__"


def test_no_import_cycles():
    graph = _graph()
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    # a package's __init__ re-exporting its own modules is not a cycle worth the name
    cycles = [c for c in cycles if not all(m.split(".")[0] == c[0].split(".")[0] and
                                           any(x == c[0].split(".")[0] for x in c) for m in c)]
    assert cycles == [], f"import cycles: {cycles}"


def test_layers_import_downwards_only():
    bad = []
    for module, targets in _graph().items():
        layer = _layer(module)
        if layer in TOP or module.split(".")[-1] == "__init__":
            continue
        allowed = LAYERS[layer] | {layer}
        for t in targets:
            tl = _layer(t)
            if tl not in allowed and t not in allowed and not (
                    layer == "tuning" and tl == "tuning"):
                bad.append(f"{module} -> {t}")
    assert bad == [], bad


# Besides flashcore's own kernels, the benchmark's peers run other projects' CuTe DSL programs
# (NVIDIA's FA2 example): they import the DSL when that peer is asked for.
DSL_IMPORTERS = ("kernels", "tuning.peers")


def test_only_the_kernels_import_the_dsl():
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        uses = any(
            (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "cutlass" for a in n.names))
            or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "cutlass")
            for n in ast.walk(tree))
        assert not uses or name.startswith(DSL_IMPORTERS), f"{name} imports cutlass"


_NO_DSL = r"""
import glob, importlib, sys

class NoDSL:  # a GPU host running from a catalog has no cutlass
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "cutlass":
            raise ImportError(f"no module named {name!r} (blocked)")

sys.meta_path.insert(0, NoDSL())
importlib.import_module("tests.conftest")
from hypothesis import settings
settings.register_profile("gpu", settings())  # conftest registers it only where CUDA is
for f in sorted(glob.glob("tests/test_*.py")):
    importlib.import_module(f[:-3].replace("/", "."))
print("ok")
"""


def test_the_test_modules_collect_without_the_dsl():
    """``pytest -m gpu`` on a host that runs from a catalog (no DSL) must collect every module:
    kernel helpers a test needs are imported inside it."""
    import subprocess
    import sys

    root = PACKAGE.parent
    r = subprocess.run([sys.executable, "-c", _NO_DSL], cwd=root, capture_output=True, check=False,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_kernel_code_in_small_pieces():
    for path in (PACKAGE / "kernels").rglob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 400, f"{path.name}: {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 80, f"{path.name}:{node.name} is {length} lines"
