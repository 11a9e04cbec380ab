"""Compile worker: ``python /abs/path/flashcore/kernels/worker.py OUTDIR`` with a JSON list of
specs on stdin.

Started by absolute path, never with ``-m``: Python then puts this file's folder first on
``sys.path`` (not the working directory), and the first thing done here is to replace it with
the folder that holds this flashcore package, so a ``flashcore/`` or ``cutlass/`` folder where
the user happens to run Python is never imported. The parent sets CUTE_DSL_ARCH (the DSL reads it
at import), so every spec of one worker has that arch. For spec i, writes OUTDIR/i/{kernel.ptx,
kernel.cubin, kernel.mlir, build.json}; build.json lists the flashcore files the worker imported,
which the parent checks against the cache key's sources. Exits non-zero with the traceback on
stderr if any spec fails, and at once (removing OUTDIR) if its parent dies.
"""

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent  # the folder that holds flashcore/


def _isolate() -> None:
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [str(ROOT)] + [p for p in sys.path if p not in ("", here, os.getcwd())]


def _exit_with_parent(out: Path) -> None:
    """A worker outlives nobody: when the parent is gone, remove the output and stop."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                shutil.rmtree(out, ignore_errors=True)
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _imported_flashcore_files() -> list[str]:
    files = []
    for name, mod in list(sys.modules.items()):
        if name == "flashcore" or name.startswith("flashcore."):
            f = getattr(mod, "__file__", None)
            if f:
                files.append(str(Path(f).resolve()))
    return sorted(files)


def main() -> int:
    out = Path(sys.argv[1])
    _exit_with_parent(out)
    _isolate()
    import flashcore

    if Path(flashcore.__file__).resolve().parent != ROOT / "flashcore":
        print(f"worker imported flashcore from {flashcore.__file__}, not {ROOT}", file=sys.stderr)
        return 4
    from flashcore.kernels.build import build
    from flashcore.specs import spec_from_dict

    specs = [spec_from_dict(d) for d in json.load(sys.stdin)]
    for i, spec in enumerate(specs):
        d = out / str(i)
        p = build(spec, d / "dump")
        (d / "kernel.ptx").write_text(p.ptx)
        (d / "kernel.cubin").write_bytes(p.cubin)
        (d / "kernel.mlir").write_text(p.ir)
        (d / "build.json").write_text(json.dumps({
            "smem_dynamic": p.smem_dynamic,
            "imported": _imported_flashcore_files(),
        }))
        print(f"built {spec.name}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
