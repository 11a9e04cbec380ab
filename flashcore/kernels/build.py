"""Trace and compile one spec with the CuTe DSL. Runs in a process whose CUTE_DSL_ARCH is the spec's.

``build(spec, workdir)`` returns the raw products (PTX, cubin, IR, dynamic shared memory); the
parent process turns them into a KernelArtifact. Nothing here touches a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..spec import AttentionSpec, KernelSpec, QuantizeSpec


@dataclass
class BuildProducts:
    ptx: str
    cubin: bytes
    ir: str
    smem_dynamic: int


def _fake_tensors(spec: AttentionSpec):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    out = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[spec.dtype]
    fp8 = spec.precision == "fp8"
    op = cutlass.Float8E4M3FN if fp8 else out

    def bhsd(dtype, transposed=False):
        # batch, heads, seq and their strides are run-time values; head_dim is static and
        # contiguous (for fp8 Vᵀ: head_dim static, keys contiguous). Strides divisible by 16 bytes
        # keep the 128-bit copies legal.
        div = 16 // (dtype.width // 8)
        d = spec.head_dim
        s = cute.sym_int32()
        shape = (cute.sym_int32(), cute.sym_int32(), d, s) if transposed else (
            cute.sym_int32(), cute.sym_int32(), s, d)
        stride = tuple(cute.sym_int64(divisibility=div) for _ in range(3)) + (1,)
        return make_fake_tensor(dtype, shape, stride, assumed_align=16)

    lse = make_fake_tensor(
        cutlass.Float32,
        (cute.sym_int32(), cute.sym_int32(), cute.sym_int32()),
        (cute.sym_int64(), cute.sym_int64(), 1),
        assumed_align=4,
    )
    if not fp8:
        return bhsd(op), bhsd(op), bhsd(op), bhsd(out), lse

    def per_token():  # (batch, heads, seq)
        return make_fake_tensor(
            cutlass.Float32,
            (cute.sym_int32(), cute.sym_int32(), cute.sym_int32()),
            (cute.sym_int64(), cute.sym_int64(), 1),
            assumed_align=4,
        )

    v_descale = make_fake_tensor(  # (batch, heads)
        cutlass.Float32, (cute.sym_int32(), cute.sym_int32()), (cute.sym_int64(), 1), assumed_align=4
    )
    return (bhsd(op), bhsd(op), bhsd(op, transposed=True), bhsd(out), lse,
            per_token(), per_token(), v_descale)


def _quantize_args(spec: QuantizeSpec):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    d = spec.head_dim
    x_dtype = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[spec.dtype]
    s = cute.sym_int32()
    x = make_fake_tensor(
        x_dtype,
        (cute.sym_int32(), cute.sym_int32(), s, d),
        tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,),
        assumed_align=16,
    )
    y_shape = (cute.sym_int32(), cute.sym_int32(), d, cute.sym_int32()) if spec.transpose else (
        cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), d)
    y = make_fake_tensor(
        cutlass.Float8E4M3FN,
        y_shape,
        tuple(cute.sym_int64(divisibility=16) for _ in range(3)) + (1,),
        assumed_align=16,
    )
    if spec.granularity == "token":
        descale = make_fake_tensor(
            cutlass.Float32,
            (cute.sym_int32(), cute.sym_int32(), cute.sym_int32()),
            (cute.sym_int64(), cute.sym_int64(), 1),
            assumed_align=4,
        )
    else:
        descale = make_fake_tensor(
            cutlass.Float32, (cute.sym_int32(), cute.sym_int32()), (cute.sym_int64(), 1),
            assumed_align=4,
        )
    if spec.transpose:  # Vᵀ takes its (batch, heads) amax as an input
        amax = make_fake_tensor(
            cutlass.Float32, (cute.sym_int32(), cute.sym_int32()), (cute.sym_int64(), 1),
            assumed_align=4,
        )
        return x, y, amax, descale
    return x, y, descale


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
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch != spec.arch:
        # The DSL fixes its target when cutlass is first imported.
        raise RuntimeError(f"build() for {spec.arch} needs CUTE_DSL_ARCH={spec.arch}, not {arch!r}")
    import cutlass
    import cutlass.cute as cute

    from .mma_sync.attention_fwd import AttentionForward

    if isinstance(spec, QuantizeSpec):
        from .quantize_fp8 import QuantizeFP8, QuantizeFP8PerToken, QuantizeFP8Transposed

        if spec.granularity == "token":
            traced = QuantizeFP8PerToken(spec.dtype, spec.head_dim, spec.threads)
            device_fn = QuantizeFP8PerToken.kernel
        else:
            if spec.transpose:
                traced = QuantizeFP8Transposed(spec.dtype, spec.head_dim, spec.threads)
                device_fn = QuantizeFP8Transposed.kernel
            else:
                traced = QuantizeFP8(spec.dtype, spec.head_dim, spec.threads)
                device_fn = QuantizeFP8.kernel
        host_fn, args = traced.host, _quantize_args(spec)
    else:
        traced = AttentionForward(spec)
        fp8 = spec.precision == "fp8"
        device_fn = AttentionForward.kernel_fp8 if fp8 else AttentionForward.kernel
        host_fn = traced.host_fp8 if fp8 else traced.host
        args = (*_fake_tensors(spec), cutlass.Float32(1.0))
    # a stable entry name without "cutlass" in it (cutlass issue #3389: it can change ptxas heuristics)
    device_fn.set_name_prefix(spec.name, remove_cutlass_symbol=True, keep_mangled_name=False)
    workdir.mkdir(parents=True, exist_ok=True)
    compiled = cute.compile(
        host_fn, *args, options=f"--keep-ptx --keep-cubin --dump-dir={workdir}"
    )
    ptx = compiled.__ptx__
    cubin = compiled.__cubin__
    if not isinstance(cubin, bytes) or not ptx.lstrip().startswith(("//", ".version")):
        raise RuntimeError(f"the DSL produced no PTX/cubin for {spec.name} (dump dir {workdir})")
    # The dynamic shared memory the launch asks for is not in the cubin: take it from the trace.
    smem = int(traced.smem_size)
    if isinstance(spec, AttentionSpec) and smem != spec.smem_bytes:
        raise RuntimeError(
            f"{spec.name}: the kernel allocates {smem} B of shared memory, the spec's budget "
            f"check assumed {spec.smem_bytes} B (flashcore/spec.py smem_bytes is out of date)"
        )
    return BuildProducts(
        ptx=ptx,
        cubin=cubin,
        ir=_cute_ir(compiled),
        smem_dynamic=smem,
    )
