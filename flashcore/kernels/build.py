"""Trace and compile one spec with the CuTe DSL. Runs in a process whose CUTE_DSL_ARCH is the spec's.

``build(spec, workdir)`` returns the raw products (PTX, cubin, IR, dynamic shared memory); the
parent process turns them into a KernelArtifact. Nothing here touches a GPU.

The compiled function's arguments are fake tensors made from the spec: every batch, head and
sequence extent and every stride is a run-time value (one cubin serves every shape); head_dim is
static and contiguous, and strides are multiples of 16 bytes so 128-bit copies stay legal.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..specs import KernelSpec, dsl_arch, params


@dataclass
class BuildProducts:
    ptx: str
    cubin: bytes
    ir: str
    smem_dynamic: int


def _fake_maker(spec: KernelSpec):
    """A function of a declared parameter (``flashcore.specs.params.Arg``) to its fake: a tensor
    of its kind or a scalar (imports the DSL: call inside a worker)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from .common.dtypes import DTYPES, E4M3

    dtypes = {**DTYPES, params.E4M3: E4M3, params.F32: cutlass.Float32,
              params.I32: cutlass.Int32}

    def bhsd(dtype, transposed: bool):
        """(batch, heads, seq, d), or (batch, heads, d, seq) for FP8 Vᵀ."""
        div = 16 // max(dtype.width // 8, 1)
        s, d = cute.sym_int32(), spec.head_dim
        shape = ((cute.sym_int32(), cute.sym_int32(), d, s) if transposed else
                 (cute.sym_int32(), cute.sym_int32(), s, d))
        stride = tuple(cute.sym_int64(divisibility=div) for _ in range(3)) + (1,)
        return make_fake_tensor(dtype, shape, stride, assumed_align=16)

    def dynamic(dtype, kind: params.Kind):
        """Every extent run-time, the strides too but a unit last one where the kind has it."""
        shape = tuple(cute.sym_int32() for _ in range(kind.shapes))
        unit = (1,) * (kind.shapes - kind.strides)
        stride = tuple(cute.sym_int64() for _ in range(kind.strides)) + unit
        return make_fake_tensor(dtype, shape, stride, assumed_align=4)

    def make(arg: params.Arg):
        dtype, kind = dtypes[arg.dtype], arg.kind
        if kind.fmt:
            return dtype(1.0) if kind is params.FLOAT else dtype(1)
        if kind in (params.BHSD, params.BHDS):
            return bhsd(dtype, kind is params.BHDS)
        return dynamic(dtype, kind)

    return make


def _traced(spec: KernelSpec):
    """(object whose ``host`` is compiled, the device function to name, its arguments): the
    kernel class the spec's signature names, and the signature's ``Args`` of fakes."""
    sig = params.signature(spec)
    module, _, name = sig.kernel(spec).partition(":")
    cls = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    return cls(spec), cls.kernel, (sig.args(spec, _fake_maker(spec)),)


def _cute_ir(compiled) -> str:
    """The CuTe IR the DSL kept (CUTE_DSL_KEEP=ir, set by the compiler), else the final module."""
    dump = os.environ.get("CUTE_DSL_DUMP_DIR")
    if dump:
        kept = sorted(Path(dump).rglob("*_clean*.mlir"), key=lambda p: p.stat().st_mtime)
        if kept:
            return kept[-1].read_text()
    module = getattr(compiled, "ir_module", None)
    return "" if module is None else str(module)


def build(spec: KernelSpec, workdir: Path) -> BuildProducts:
    arch, want = os.environ.get("CUTE_DSL_ARCH"), dsl_arch(spec)
    if arch != want:
        # The DSL fixes its target when cutlass is first imported.
        raise RuntimeError(f"build() for {spec.name} needs CUTE_DSL_ARCH={want}, not {arch!r}")
    import cutlass.cute as cute

    traced, device_fn, args = _traced(spec)
    # a stable entry name without "cutlass" in it (cutlass issue #3389: it can change ptxas
    # heuristics)
    device_fn.set_name_prefix(spec.name, remove_cutlass_symbol=True, keep_mangled_name=False)
    workdir.mkdir(parents=True, exist_ok=True)
    compiled = cute.compile(traced.host, *args,
                            options=f"--keep-ptx --keep-cubin --dump-dir={workdir}")
    ptx = compiled.__ptx__
    cubin = compiled.__cubin__
    if not isinstance(cubin, bytes) or not ptx.lstrip().startswith(("//", ".version")):
        raise RuntimeError(f"the DSL produced no PTX/cubin for {spec.name} (dump dir {workdir})")
    # The dynamic shared memory the launch asks for is not in the cubin: take it from the trace.
    smem = int(traced.smem_size)
    if smem != spec.smem_bytes:
        raise RuntimeError(
            f"{spec.name}: the kernel allocates {smem} B of shared memory, the spec's budget "
            f"check assumed {spec.smem_bytes} B (flashcore/spec: smem_bytes is out of date)"
        )
    return BuildProducts(ptx=ptx, cubin=cubin, ir=_cute_ir(compiled), smem_dynamic=smem)
