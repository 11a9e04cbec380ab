"""Compile worker: ``python -m flashcore.dsl.worker OUTDIR`` with a JSON list of specs on stdin.

The parent sets CUTE_DSL_ARCH before starting this process (the DSL reads it at import), so every
spec given to one worker must have that arch. For spec i, writes OUTDIR/i/{kernel.ptx, kernel.cubin,
kernel.mlir, build.json}. Exits non-zero with the traceback on stderr if any spec fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    out = Path(sys.argv[1])
    from ..spec import spec_from_dict
    from .build import build

    specs = [spec_from_dict(d) for d in json.load(sys.stdin)]
    for i, spec in enumerate(specs):
        d = out / str(i)
        p = build(spec, d / "dump")
        (d / "kernel.ptx").write_text(p.ptx)
        (d / "kernel.cubin").write_bytes(p.cubin)
        (d / "kernel.mlir").write_text(p.ir)
        (d / "build.json").write_text(
            json.dumps({"smem_dynamic": p.smem_dynamic, "dsl_version": p.dsl_version})
        )
        print(f"built {spec.name}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
