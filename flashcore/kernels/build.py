"""Trace and compile one spec with the CuTe DSL. Runs in a process whose CUTE_DSL_ARCH is the spec's.

``build(spec, workdir)`` returns the raw products (PTX, cubin, IR, dynamic shared memory); the
parent process turns them into a KernelArtifact. Nothing here touches a GPU.

The compiled function's arguments are fake tensors made from the spec: every batch, head and
sequence extent and every stride is a run-time value (one cubin serves every shape); head_dim is
static and contiguous, and strides are multiples of 16 bytes so 128-bit copies stay legal.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..specs import AttentionSpec, BackwardSpec, CombineSpec, KernelSpec, QuantizeSpec, dsl_arch


@dataclass
class BuildProducts:
    ptx: str
    cubin: bytes
    ir: str
    smem_dynamic: int


def _fakes():
    """(bhsd, rows, per_head) makers of fake tensors (imports the DSL: call inside a worker)."""
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import make_fake_tensor

    def bhsd(dtype, d: int, transposed: bool = False):
        """(batch, heads, seq, d), or (batch, heads, d, seq) for FP8 Vᵀ."""
        div = 16 // max(dtype.width // 8, 1)
        s = cute.sym_int32()
        shape = ((cute.sym_int32(), cute.sym_int32(), d, s) if transposed else
                 (cute.sym_int32(), cute.sym_int32(), s, d))
        stride = tuple(cute.sym_int64(divisibility=div) for _ in range(3)) + (1,)
        return make_fake_tensor(dtype, shape, stride, assumed_align=16)

    def rows():  # (batch, heads, seq) float32, unit last stride: LSE and per-token descales
        return make_fake_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), cute.sym_int32()),
                                (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)

    def per_head():  # (batch, heads) float32
        return make_fake_tensor(Float32, (cute.sym_int32(), cute.sym_int32()),
                                (cute.sym_int64(), 1), assumed_align=4)

    return bhsd, rows, per_head


def _page_scales():
    """(pages, heads, page_size) float32 with every stride dynamic: an e4m3 paged cache's
    per-key descales as the user's (pages, page_size, heads) tensor permuted."""
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(Float32, tuple(cute.sym_int32() for _ in range(3)),
                            tuple(cute.sym_int64() for _ in range(3)), assumed_align=4)


def _serving_args(spec: AttentionSpec) -> tuple:
    """cu_seqlens_q, cu_seqlens_k, block_table, seqlens_k: int32, None where unused."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    def vector():
        return make_fake_tensor(cutlass.Int32, (cute.sym_int32(),), (1,), assumed_align=4)

    cu_q = vector() if spec.varlen else None
    cu_k = vector() if spec.varlen and not spec.paged_kv else None
    table = seqlens_k = None
    if spec.paged_kv:
        table = make_fake_tensor(cutlass.Int32, (cute.sym_int32(), cute.sym_int32()),
                                 (cute.sym_int64(), 1), assumed_align=4)
        seqlens_k = vector()
    return cu_q, cu_k, table, seqlens_k


def _attention_args(spec: AttentionSpec) -> tuple:
    import cutlass

    from .common.dtypes import DTYPES, E4M3

    bhsd, rows, per_head = _fakes()
    d, out = spec.head_dim, DTYPES[spec.dtype]
    fp8 = spec.precision == "fp8"
    q_dtype = E4M3 if fp8 else out
    kv_dtype = E4M3 if (fp8 or spec.kv_fp8) else out
    o = bhsd(cutlass.Float32 if spec.split_kv else out, d)
    lse = rows() if (spec.return_lse or spec.split_kv) else None
    qd = kd = vd = None
    if fp8:
        qd, kd, vd = rows(), rows() if spec.k_scale == "token" else per_head(), per_head()
    elif spec.kv_fp8:
        kd, vd = (_page_scales(), _page_scales()) if spec.paged_kv else (rows(), rows())
    window = (cutlass.Int32(1), cutlass.Int32(1)) if spec.window else (None, None)
    softcap = (cutlass.Float32(1.0), cutlass.Float32(1.0)) if spec.softcap else (None, None)
    return (bhsd(q_dtype, d), bhsd(kv_dtype, d), bhsd(kv_dtype, d, transposed=fp8), o, lse,
            qd, kd, vd, cutlass.Float32(1.0), cutlass.Int32(1), cutlass.Int32(1), *window,
            *softcap, *_serving_args(spec))


def _combine_args(spec: CombineSpec) -> tuple:
    import cutlass

    from .common.dtypes import DTYPES

    bhsd, rows, _ = _fakes()
    lse = rows() if spec.return_lse else None
    return (bhsd(cutlass.Float32, spec.head_dim), rows(), bhsd(DTYPES[spec.dtype], spec.head_dim),
            lse, cutlass.Int32(1), cutlass.Int32(1))


def _quantize_args(spec: QuantizeSpec) -> tuple:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from .common.dtypes import DTYPES

    bhsd, rows, per_head = _fakes()
    x = bhsd(DTYPES[spec.dtype], spec.head_dim)
    y_shape = ((cute.sym_int32(), cute.sym_int32(), spec.head_dim, cute.sym_int32())
               if spec.transpose else
               (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), spec.head_dim))
    y = make_fake_tensor(cutlass.Float8E4M3FN, y_shape,
                         tuple(cute.sym_int64(divisibility=16) for _ in range(3)) + (1,),
                         assumed_align=16)
    if spec.granularity == "token":
        return x, y, rows()
    if spec.part == "amax":  # the partial maxima of each (batch, head)
        return x, rows()
    return x, y, rows(), per_head()  # the casts: from the partial maxima


def _backward_args(spec: BackwardSpec) -> tuple:
    """``flashcore.compiler.abi.backward_params``' tensors as fakes: 16-bit (batch, heads, seq,
    head_dim), fp32 row workspaces (batch, heads, rows) and the fp32 dQ accumulator."""
    import cutlass

    from .common.dtypes import DTYPES

    bhsd, rows, _ = _fakes()
    dt, d = DTYPES[spec.dtype], spec.head_dim
    if spec.op == "attention_bwd_pre":
        return bhsd(dt, d), bhsd(dt, d), rows(), rows(), rows(), bhsd(cutlass.Float32, d)
    if spec.op == "attention_bwd_post":
        return bhsd(cutlass.Float32, d), bhsd(dt, d), cutlass.Float32(1.0)
    window = (cutlass.Int32(1), cutlass.Int32(1)) if spec.window else (None, None)
    softcap = (cutlass.Float32(1.0), cutlass.Float32(1.0)) if spec.softcap else (None, None)
    return (bhsd(dt, d), bhsd(dt, d), bhsd(dt, d), bhsd(dt, d), rows(), rows(),
            bhsd(cutlass.Float32, d), bhsd(dt, d), bhsd(dt, d), cutlass.Float32(1.0),
            cutlass.Float32(1.0), *window, *softcap)


def _traced(spec: KernelSpec):
    """(object whose ``host`` is compiled, the device function to name, its arguments)."""
    if isinstance(spec, QuantizeSpec):
        from .quantize_fp8 import (
            AmaxPerHead,
            QuantizeFP8,
            QuantizeFP8PerToken,
            QuantizeFP8Transposed,
        )

        if spec.granularity == "token":
            cls = QuantizeFP8PerToken
        elif spec.part == "amax":
            cls = AmaxPerHead
        else:
            cls = QuantizeFP8Transposed if spec.transpose else QuantizeFP8
        return cls(spec.dtype, spec.head_dim, spec.threads), cls.kernel, _quantize_args(spec)
    if isinstance(spec, BackwardSpec):
        from .mma_sync_bwd.attention_bwd import AttentionBackward
        from .mma_sync_bwd.rows import BackwardPostprocess, BackwardPreprocess

        cls = {"attention_bwd": AttentionBackward, "attention_bwd_pre": BackwardPreprocess,
               "attention_bwd_post": BackwardPostprocess}[spec.op]
        return cls(spec), cls.kernel, _backward_args(spec)
    if isinstance(spec, CombineSpec):
        from .combine import CombineSplits

        return CombineSplits(spec), CombineSplits.kernel, _combine_args(spec)
    if spec.family == "wgmma_ws":
        from .wgmma_ws.attention_fwd import WgmmaWsAttentionForward as Forward
    else:
        from .mma_sync.attention_fwd import AttentionForward as Forward
    return Forward(spec), Forward.kernel, _attention_args(spec)


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
