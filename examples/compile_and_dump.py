"""Compile an attention kernel on this machine (no GPU needed) and show what was built.

    python examples/compile_and_dump.py                      # the mission kernel, sm_89 fp16 d64 64x64
    python examples/compile_and_dump.py --arch sm_90 --head-dim 128 --tile 128 64 --causal
    python examples/compile_and_dump.py --all                # every spec of the catalog

Writes ./dump/<kernel name>/ with kernel.mlir (CuTe IR), kernel.ptx, kernel.cubin, kernel.sass (when
nvdisasm is installed), spec.json and resources.json, and prints a table.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from flashcore.cli import main

if __name__ == "__main__":
    sys.exit(main(["dump", *sys.argv[1:]]))
