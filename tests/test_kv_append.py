"""The KV-cache append kernel without a GPU: its spec as data, its compiled code (ABI against
the PTX, no local memory, the rotary's float32 math), and what ``flashcore.ops.kv_append``
launches (grid and arguments, from a stubbed launch)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from flashcore.compiler.abi import params_for
from flashcore.errors import SpecError
from flashcore.specs import KvAppendSpec, spec_from_dict
from tests.kernels import compiled_in_fresh_cache

SPECS = [
    KvAppendSpec(arch="sm_89", head_dim=128, rotary_dim=64),
    KvAppendSpec(arch="sm_90", dtype="bfloat16", head_dim=64),
    KvAppendSpec(arch="sm_80", head_dim=256, rotary_dim=256, interleaved=True,
                 table_dtype="float16"),
    KvAppendSpec(arch="sm_90", dtype="bfloat16", head_dim=96, rotary_dim=32,
                 table_dtype="bfloat16"),
]


def test_spec_is_validated_data():
    s = SPECS[0]
    assert s.name == "fc_kv_append_sm89_f16_d128_r64h_f32"
    assert SPECS[2].name == "fc_kv_append_sm80_f16_d256_r256i_f16"
    assert spec_from_dict(s.to_dict()) == s and KvAppendSpec.from_json(s.to_json()) == s
    names = [p.name for p in params_for(s)]
    assert names == ["k", "v", "k_cache", "v_cache", "block_table", "seqlens", "q", "q_out",
                     "cos", "sin", "q_step"]
    assert [p.name for p in params_for(SPECS[1])] == names[:6]  # no rotary: no q, no tables
    for bad, what in (({"rotary_dim": 130}, "rotary_dim"), ({"rotary_dim": 3}, "rotary_dim"),
                      ({"rotary_dim": True}, "rotary_dim"), ({"head_dim": 48}, "head_dim"),
                      ({"interleaved": True}, "interleaved"),
                      ({"rotary_dim": 64, "table_dtype": "float64"}, "table_dtype"),
                      ({"arch": "sm_75"}, "arch"), ({"op": "append"}, "op")):
        with pytest.raises(SpecError, match=what):
            KvAppendSpec(**bad)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return compiled_in_fresh_cache(SPECS, tmp_path_factory)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_kernel_compiles_with_its_abi(artifacts, spec):
    art = artifacts[spec]
    assert len(art.params) == len(params_for(spec))
    assert art.smem_dynamic == 0
    assert not art.resources.spill_store_bytes and art.resources.stack_frame_bytes == 0, art.resources
    body = art.ptx[art.ptx.index(".entry"):]
    if spec.rotary_dim:
        # the turn in float32: products of the widened feature pair and the tables
        assert "mul.f32" in body or "fma.rn.f32" in body
        assert "cvt.rn.f16x2.f32" in body or "cvt.rn.f16.f32" in body or "cvt.rn.bf16.f32" in body
    else:  # a plain copy: no float arithmetic
        assert "mul.f32" not in body and "fma.rn.f32" not in body


def test_launch_binds_the_caches_tables_and_rotary():
    """What ``append_kv`` launches: the new keys and values and the caches as
    (batch|pages, heads, seq|page_size, head_dim) views (the caches in place: their own
    addresses), the table and lengths, then q, the turned copy it returns, the tables and the
    queries' position step; grid (new + seq_q tokens, the more heads, batch)."""
    from flashcore.ops import kv_append

    launched = []
    b, sq, new, h, hkv, d, pages, ps = 3, 2, 4, 8, 2, 128, 10, 16
    q = torch.randn(b, sq, h, d).half()
    k, v = (torch.randn(b, new, hkv, d).half() for _ in range(2))
    kc, vc = (torch.randn(pages, ps, hkv, d).half() for _ in range(2))
    table = torch.arange(b * 3, dtype=torch.int32).view(b, 3)
    lens = torch.tensor([0, 5, 30], dtype=torch.int32)
    cos, sin = torch.randn(64, 32), torch.randn(64, 32)
    with (mock.patch.object(kv_append, "arch_of", return_value="sm_89"),
          mock.patch.object(kv_append, "kernel_for") as kernel_for,
          mock.patch.object(kv_append, "launch",
                            side_effect=lambda kern, grid, args, dev: launched.append((grid,
                                                                                       args))),
          mock.patch.object(torch.Tensor, "get_device", return_value=0)):
        out = kv_append.append_kv(k, v, kc, vc, table, lens, q=q, cos=cos, sin=sin,
                                  interleaved=True, q_per_token=False)
        assert kernel_for.call_args[0][0] == KvAppendSpec(
            arch="sm_89", head_dim=128, rotary_dim=64, interleaved=True)
        assert kv_append.append_kv(k, v, kc, vc, table, lens) is None
    (grid, args), (grid2, args2) = launched
    assert grid == (new + sq, h, b) and grid2 == (new, hkv, b)
    k_arg, _v, kc_arg, vc_arg, t_arg, l_arg, q_arg, o_arg, c_arg, s_arg, step = args
    assert kc_arg[:4] == (kc.data_ptr(), pages, hkv, ps) and vc_arg[0] == vc.data_ptr()
    assert kc_arg[4:] == (ps * hkv * d, d, hkv * d)  # the cache's own strides: written in place
    assert k_arg[1:4] == (b, hkv, new) and q_arg[1:4] == (b, h, sq)
    assert o_arg[0] == out.data_ptr() and out.shape == q.shape
    assert t_arg == (table.data_ptr(), b, 3, 3) and l_arg == (lens.data_ptr(), b)
    assert c_arg == (cos.data_ptr(), 64, 32, 32) and s_arg[0] == sin.data_ptr()
    assert step == (0,)
    assert args2 == args[:6]


def _paged_append_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, h, hkv, sq, new, d, pages, ps = 2, 8, 2, 3, 4, 64, 6, 16
    q = torch.randn(b, h, sq, d, generator=g).half()
    k, v = (torch.randn(b, hkv, new, d, generator=g).half() for _ in range(2))
    kc, vc = (torch.randn(pages, ps, hkv, d, generator=g).half() for _ in range(2))
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    lens = torch.tensor([7, 30], dtype=torch.int32)
    cos, sin = torch.randn(64, 16), torch.randn(64, 16)
    return q, k, v, kc, vc, table, lens, cos, sin


def test_append_paged_kv_launches_on_the_callers_tensors():
    """``append_paged_kv`` in flashcore's (batch, heads, seq, head_dim) layout: the kernel reads
    k, v and q where they are and writes the caches in place; the turned q comes back in q's
    layout; the device-side length check names the new positions."""
    from flashcore.ops import kv_append
    from tests.device_stub import stubbed_device

    q, k, v, kc, vc, table, lens, cos, sin = _paged_append_case()
    launched = []
    with (stubbed_device([]), mock.patch.object(kv_append, "arch_of", return_value="sm_90"),
          mock.patch.object(kv_append, "kernel_for"),
          mock.patch.object(kv_append, "launch",
                            side_effect=lambda kern, grid, args, dev: launched.append((grid,
                                                                                       args)))):
        turned = kv_append.append_paged_kv(k, v, kc, vc, table, lens, q=q, rotary_cos=cos,
                                           rotary_sin=sin, check_lengths=False)
        assert turned.shape == q.shape and turned.dtype == q.dtype
        (grid, args), = launched
        assert grid == (4 + 3, 8, 2)
        assert args[0] == (k.data_ptr(), 2, 2, 4, *k.stride()[:3])  # k as it is
        assert args[2][0] == kc.data_ptr() and args[3][0] == vc.data_ptr()
        assert args[6][0] == q.data_ptr() and args[7][0] == turned.data_ptr()
        assert kv_append.append_paged_kv(k, v, kc, vc, table, lens, check_lengths=False) is None
        with (mock.patch.object(kv_append, "checking", return_value=True),
              pytest.raises(ValueError, match="seqlens \\+ the 4 new tokens is over the block "
                                              "table's 3 pages x 16")):
            kv_append.append_paged_kv(k, v, kc, vc, table, torch.tensor([7, 45],
                                                                         dtype=torch.int32))


@pytest.mark.parametrize("change, what", [
    ({"k_cache": lambda c: c[:, :, :1]}, "must be \\(pages, page_size, 2, 64\\)"),
    ({"k_cache": lambda c: torch.cat((c.flatten(), c.flatten()[:4]))[4:].view(c.shape)},
     "written in place"),  # a base 8 bytes off 16
    ({"block_table": lambda t: t[:1]}, "block_table has 1 rows for a batch of 2"),
    ({"seqlens": lambda s: s[:1]}, "seqlens has 1 entries, expected 2"),
    ({"v": lambda x: x.float()}, "v has dtype"),
    ({"q": lambda x: None}, "rotary takes rotary_cos, rotary_sin and q together"),
    ({"rotary_cos": lambda c: torch.randn(64, 40)}, "rotary_dim in 2..64"),
])
def test_append_paged_kv_names_what_is_wrong(change, what):
    from flashcore.ops import kv_append
    from tests.device_stub import stubbed_device

    q, k, v, kc, vc, table, lens, cos, sin = _paged_append_case()
    kw = {"k": k, "v": v, "k_cache": kc, "v_cache": vc, "block_table": table, "seqlens": lens,
          "q": q, "rotary_cos": cos, "rotary_sin": sin}
    for name, fn in change.items():
        kw[name] = fn(kw[name])
    with stubbed_device([]), mock.patch.object(kv_append, "launch") as launched, \
            pytest.raises((ValueError, TypeError), match=what):
        kv_append.append_paged_kv(**kw, check_lengths=False)
    assert not launched.called
