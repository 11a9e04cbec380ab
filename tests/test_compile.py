"""Compile the real kernels on this GPU-less host and check what can be checked without running."""

from __future__ import annotations

import re
import struct

import pytest

from flashcore import AttentionSpec, compile_kernel
from flashcore.compiler.abi import params_for
from flashcore.specs import SMEM_PER_BLOCK, TileConfig
from tests.kernels import assert_no_spills_in_loops, compiled_in_fresh_cache

SPECS = [
    AttentionSpec(arch="sm_80", dtype="bfloat16", head_dim=128, causal=True, return_lse=True),
    AttentionSpec(arch="sm_89", dtype="float16", head_dim=64, config=TileConfig((64, 64))),
    AttentionSpec(arch="sm_89", dtype="float16", head_dim=128, config=TileConfig((128, 64), warps=8)),
    AttentionSpec(arch="sm_90", dtype="float16", head_dim=64, causal=True, config=TileConfig((64, 64))),
    AttentionSpec(arch="sm_89", dtype="float16", head_dim=64, causal=True, return_lse=True, config=TileConfig((32, 64), warps=2, kv_splits=4)),
    AttentionSpec(arch="sm_89", dtype="bfloat16", head_dim=128, causal=True, config=TileConfig((64, 64), stages=2)),
]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return compiled_in_fresh_cache(SPECS, tmp_path_factory)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_ptx_has_the_instructions_we_meant(artifacts, spec):
    art = artifacts[spec]
    ptx = art.ptx
    assert re.search(rf"\.target\s+{spec.arch}\b", ptx), "PTX targets another arch"
    # m16n8k16 with fp32 accumulation and the input dtype
    dt = {"float16": "f16", "bfloat16": "bf16"}[spec.dtype]
    mma = re.findall(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{dt}\.{dt}\.f32", ptx)
    # two code paths (masked and unmasked), each S = Q K^T and O += P V over the tile
    per_block = 2 * (spec.tile_m // (16 * spec.warps)) * (spec.tile_n // 8) * (spec.head_dim // 16)
    assert len(mma) == 2 * per_block
    assert "ldmatrix.sync.aligned" in ptx and ".trans" in ptx  # V is read transposed
    assert re.search(r"cp\.async\.cg\.shared\.global(\.L2::\d+B)? \[[^]]+\], \[[^]]+\], 16", ptx)
    assert "ex2.approx" in ptx
    assert "st.global.v4" in ptx  # 128-bit output stores
    assert "ld.local" not in ptx and "st.local" not in ptx
    if spec.kv_splits > 1:  # each split's group syncs on its own named barrier of its threads
        assert re.search(rf"bar\.sync\s+\S+, {spec.group_threads};", ptx)
    # Hopper kernels are launched with PDL: they must wait for the previous grid before their
    # first global access; older archs have no griddepcontrol
    body = ptx[ptx.index(".entry"):]
    if spec.arch == "sm_90":
        wait = body.index("griddepcontrol.wait;")
        first_access = min(body.index(op) for op in ("cp.async", "ld.global", "st.global")
                           if op in body)
        assert wait < first_access, "a global access before griddepcontrol.wait"
        assert wait < body.index("griddepcontrol.launch_dependents;")
    else:
        assert "griddepcontrol" not in body


def test_hopper_kernel_works_out_its_coordinates_before_waiting_for_the_previous_grid(artifacts):
    """With programmatic dependent launch a CTA is resident before the previous grid ends: its
    coordinates (integer divisions: I2F.RP, MUFU.RCP) and addresses are worked out before the
    wait (ACQBULK), which then comes right before the first global load."""
    from flashcore.compiler.inspect import sass, sass_opcodes

    text = sass(artifacts[SPECS[3]].cubin)
    if text is None:
        pytest.skip("nvdisasm is not installed")
    ops = sass_opcodes(text)
    wait = ops.index("ACQBULK")
    first_load = min(i for i, op in enumerate(ops) if op.startswith(("LDG", "LDGSTS")))
    assert "MUFU.RCP" in ops[:wait] and "MUFU.RCP" not in ops[wait:first_load]
    assert wait < first_load <= wait + 40, (wait, first_load)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_resources_within_budget(artifacts, spec):
    art = artifacts[spec]
    r = art.resources
    assert 0 < r.registers <= 255
    assert_no_spills_in_loops(art, spec.name)
    assert art.smem_dynamic == spec.smem_bytes <= SMEM_PER_BLOCK[spec.arch]
    assert art.block == (spec.threads, 1, 1)
    assert art.entry.startswith(spec.name) and "cutlass" not in art.entry


@pytest.mark.parametrize("spec", SPECS[:1], ids=lambda s: s.name)
def test_parameter_packing_matches_entry(artifacts, spec):
    art = artifacts[spec]
    params = params_for(spec)
    assert len(art.params) == len(params)
    for want, got in zip(params, art.params):
        assert (want.size, want.align) == (got.size, got.align), want.name
        assert struct.calcsize(want.fmt) == got.size
    # a tensor struct: pointer, three i32 extents, padding, three i64 strides
    q = params[0]
    raw = struct.pack(q.fmt, 0x1000, 2, 3, 5, 7, 11, 13)
    assert struct.unpack_from("<Q3i", raw) == (0x1000, 2, 3, 5)
    assert struct.unpack_from("<3q", raw, 24) == (7, 11, 13)


def test_second_call_hits_memory(artifacts):
    spec = SPECS[1]
    assert compile_kernel(spec) is compile_kernel(spec)


def test_sm80_has_no_fp8_but_compiles_fp16():
    # sm_80 builds the fp16 kernel; the spec refuses an unknown arch clearly
    with pytest.raises(ValueError, match="arch='sm_75'"):
        AttentionSpec(arch="sm_75")


@pytest.mark.parametrize("spec", [SPECS[0], AttentionSpec(arch="sm_90", precision="fp8")],
                         ids=lambda s: s.name)
def test_launch_buffer_places_each_parameter_at_its_pointer(spec):
    import ctypes
    from types import SimpleNamespace

    from flashcore.runtime.loader import LoadedKernel

    params = params_for(spec)
    art = SimpleNamespace(entry="k", block=(spec.threads, 1, 1), smem_dynamic=0, spec=spec)
    lk = LoadedKernel(art, 0, None, None, params)
    per_param = []
    for i, p in enumerate(params):
        n = struct.unpack("<" + p.fmt.lstrip("<"), b"\0" * p.size).__len__()
        vals = tuple(range(1000 * (i + 1), 1000 * (i + 1) + n))
        per_param.append(tuple(float(x) for x in vals) if p.fmt.endswith("f") else vals)
    lk._struct.pack_into(lk._buf, 0, *[x for t in per_param for x in t])
    for i, p in enumerate(params):
        addr = lk._argv[i]
        assert addr % p.align == 0, p.name
        raw = ctypes.string_at(addr, p.size)
        assert struct.unpack(p.fmt, raw) == per_param[i], p.name


def test_prepared_keeps_kernel_ready_views_and_copies_the_rest():
    import torch

    from flashcore.ops.inputs import prepared, tensor_arg

    base = torch.randn(2, 40, 3, 64, dtype=torch.float16)  # (b, s, h, d) storage
    view = base.transpose(1, 2)  # (b, h, s, d): last dim contiguous, strides multiples of 8
    t, arg = prepared(view)
    assert t.data_ptr() == view.data_ptr() and arg == tensor_arg(view)
    odd = torch.randn(2, 3, 64, 40, dtype=torch.float16).transpose(2, 3)  # last dim strided
    t, arg = prepared(odd)
    assert t.is_contiguous() and torch.equal(t, odd) and arg == tensor_arg(t)
    # a broadcast (an expand: stride 0 over more than one element) is copied, since a TMA
    # descriptor cannot step by 0; a zero stride over one element is no broadcast
    one = torch.randn(1, 3, 40, 64, dtype=torch.float16)
    for wide in (one.expand(4, 3, 40, 64), one[:, :1].expand(1, 3, 40, 64)):
        t, arg = prepared(wide)
        assert t.is_contiguous() and torch.equal(t, wide) and 0 not in t.stride()
    single = one[:, :1].expand(1, 1, 40, 64).as_strided((1, 1, 40, 64), (0, 0, 64, 1))
    t, arg = prepared(single)
    assert t.data_ptr() == single.data_ptr() and arg == tensor_arg(single)


def test_every_tuned_config_fits_an_l4(tmp_path, monkeypatch):
    """The performance issue's sm_89 target: each autotuned fp16 config of the sm_90 table,
    compiled for sm_89, stays within the L4's 99 KB of shared memory per block and does not
    spill (beyond a value parked across the key loop, as above)."""
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path))
    from flashcore.compiler.compiler import compile_many
    from flashcore.tuned.table import winner_specs

    specs = list(winner_specs("sm_90", build_arch="sm_89", precisions=("fp16",)).values())
    assert len(specs) == 16  # the d64/d128 entries, and the fallbacks of d96/d256's long bucket
    unique = list(dict.fromkeys(specs))
    for spec, art in zip(unique, compile_many(unique, jobs=2)):
        assert art.smem_dynamic <= SMEM_PER_BLOCK["sm_89"], spec.name
        assert_no_spills_in_loops(art, spec.name)
