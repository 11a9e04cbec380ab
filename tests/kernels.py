"""Real PTX and cubins for the CPU tests: a tiny CuTe DSL kernel, and hand-written PTX.

The DSL fixes its target arch when ``cutlass`` is imported, so it runs in a subprocess and the
test process never imports it.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Run as a script in a subprocess: compile for sm_90 (no GPU needed), write k.ptx and k.cubin.
_DSL_SCRIPT = r"""
import os, sys
os.environ["CUTE_DSL_ARCH"] = "sm_90"
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

@cute.kernel
def k(mQ: cute.Tensor, mO: cute.Tensor, scale: cutlass.Float32):
    tidx, _, _ = cute.arch.thread_idx()
    b, h, s = cute.arch.block_idx()
    row = mQ[b, h, None, None]
    o = mO[b, h, None, None]
    if tidx < row.shape[0]:
        o[tidx, 0] = (row[tidx, 0].to(cutlass.Float32) * scale).to(cutlass.Float16)

@cute.jit
def host(mQ: cute.Tensor, mO: cute.Tensor, scale: cutlass.Float32):
    k(mQ, mO, scale).launch(grid=(1, 1, 1), block=(128, 1, 1))

def fake():
    i32, i64 = cute.sym_int32, cute.sym_int64
    return make_fake_tensor(
        cutlass.Float16,
        (i32(), i32(), i32(), 64),
        (i64(divisibility=8), i64(divisibility=8), i64(divisibility=8), 1),
        assumed_align=16,
    )

out = sys.argv[1]
os.makedirs(os.path.join(out, "dump"), exist_ok=True)
c = cute.compile(host, fake(), fake(), cutlass.Float32(1.0),
                 options=f"--keep-ptx --keep-cubin --dump-dir={os.path.join(out, 'dump')}")
open(os.path.join(out, "k.ptx"), "w").write(c.__ptx__)
open(os.path.join(out, "k.cubin"), "wb").write(c.__cubin__)
"""


@dataclass(frozen=True)
class CompiledKernel:
    ptx: str
    cubin: bytes


def have_dsl() -> bool:
    return importlib.util.find_spec("cutlass") is not None


def compile_tiny_dsl_kernel(out: Path) -> CompiledKernel:
    out.mkdir(parents=True, exist_ok=True)
    script = out / "tiny_kernel.py"  # the DSL reads the kernel's source, so it must be a file
    script.write_text(_DSL_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(out)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"DSL compile failed:\n{proc.stderr[-3000:]}")
    return CompiledKernel((out / "k.ptx").read_text(), (out / "k.cubin").read_bytes())


def handwritten_ptx(*, live: int = 48, local_bytes: int = 256, shared_bytes: int = 1536) -> str:
    """A kernel named `spilly` that spills (``live`` values under .maxnreg 24), has a stack frame
    (a dynamically indexed local array) and static shared memory."""
    n = live
    body = [
        ".version 8.0",
        ".target sm_90",
        ".address_size 64",
        "",
        "// .entry in a comment is not an entry",
        f".shared .align 16 .b8 smem_buf[{shared_bytes}];",
        "",
        ".visible .entry spilly(",
        "\t.param .u64 spilly_out,",
        "\t.param .u32 spilly_n,",
        "\t.param .f32 spilly_scale,",
        "\t.param .align 8 .b8 spilly_blob[24]",
        ")",
        ".maxnreg 24",
        ".reqntid 64",
        "{",
        f"\t.reg .b32 %r<{n + 4}>;",
        "\t.reg .b64 %rd<6>;",
        f"\t.local .align 4 .b8 buf[{local_bytes}];",
        "\tld.param.u64 %rd1, [spilly_out];",
        "\tld.param.u32 %r0, [spilly_n];",
    ]
    body += [f"\tld.volatile.global.u32 %r{i}, [%rd1+{4 * i}];" for i in range(1, n + 1)]
    body += [
        # a data-dependent index keeps the local array in memory: a stack frame
        f"\tand.b32 %r{n + 1}, %r0, {local_bytes // 4 - 2};",
        f"\tshl.b32 %r{n + 1}, %r{n + 1}, 2;",
        "\tmov.u64 %rd2, buf;",
        f"\tcvt.u64.u32 %rd3, %r{n + 1};",
        "\tadd.u64 %rd2, %rd2, %rd3;",
        "\tst.local.u32 [%rd2], %r1;",
        # touch the shared buffer so it is kept
        "\tmov.u64 %rd4, smem_buf;",
        "\tadd.u64 %rd4, %rd4, %rd3;",
        "\tst.shared.u32 [%rd4], %r2;",
        "\tbar.sync 0;",
        "\tld.shared.u32 %r3, [%rd4+4];",
    ]
    body += [f"\tst.volatile.global.u32 [%rd1+{4 * (n + i)}], %r{i};" for i in range(n, 0, -1)]
    body += [
        f"\tld.local.u32 %r{n + 2}, [%rd2+4];",
        f"\tst.global.u32 [%rd1], %r{n + 2};",
        "\tret;",
        "}",
    ]
    return "\n".join(body) + "\n"


def assemble(ptx: str, out: Path, arch: str = "sm_90") -> tuple[bytes, str]:
    """(cubin, ptxas -v report) of ``ptx`` assembled with the ptxas on PATH."""
    out.mkdir(parents=True, exist_ok=True)
    src, dst = out / "k.ptx", out / "k.cubin"
    src.write_text(ptx)
    proc = subprocess.run(
        ["ptxas", f"-arch={arch}", "-v", "-o", str(dst), str(src)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed:\n{proc.stderr}")
    return dst.read_bytes(), proc.stdout + proc.stderr


def have_ptxas() -> bool:
    return shutil.which("ptxas") is not None


def find_nvdisasm() -> str | None:
    """nvdisasm from PATH, or from the nvidia-cuda-nvdisasm wheel."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia  # namespace package of NVIDIA's wheels; importing it loads nothing
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for p in sorted(Path(root).glob("*/bin/nvdisasm")):
            return str(p)
    return None


PARKED_BYTES = 32  # a few values parked across the key loop: one store before, one load after


def assert_no_spills_in_loops(art, what: str = "") -> None:
    """A kernel may park a few values across its key loop in local memory (stored once before,
    loaded once after: seen for coordinates the epilogue needs), never spill inside a loop."""
    from flashcore.compiler.inspect import local_memory_in_loops, sass

    r = art.resources
    assert r.stack_frame_bytes <= PARKED_BYTES, (what, r)
    if r.spill_store_bytes is not None:
        assert r.spill_store_bytes <= PARKED_BYTES and r.spill_load_bytes <= PARKED_BYTES, (what, r)
    text = sass(art.cubin)
    if text is not None:
        assert local_memory_in_loops(text) == 0, f"{what}: local memory inside a loop"


def compiled_in_fresh_cache(specs: list, tmp_path_factory, jobs: int = 2) -> dict:
    """{spec: artifact} of ``specs`` compiled (``jobs`` workers) into a fresh cache of this test
    module's (FLASHCORE_CACHE_DIR points there from now on)."""
    import os

    os.environ["FLASHCORE_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    from flashcore.compiler.compiler import compile_many

    return dict(zip(specs, compile_many(specs, jobs=jobs)))
