"""The run-time parameters' one declaration (``flashcore.specs.params``): the packing, the
kernel's grouped argument and the kernel class all come from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flashcore.compiler.abi import params_for
from flashcore.specs import AttentionSpec, BackwardSpec, CombineSpec, QuantizeSpec, TileConfig
from flashcore.specs.packing import CoordParam, TensorMapParam
from flashcore.specs.params import ATTENTION, MASKS, signature

KERNELS = Path(__file__).resolve().parent.parent / "flashcore" / "kernels"
WS = TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws")
SPECS = [
    AttentionSpec(arch="sm_80"),
    AttentionSpec(arch="sm_89", precision="fp8", k_scale="head", split_kv=True, causal=True),
    AttentionSpec(arch="sm_89", kv_fp8=True, paged_kv=True, varlen=True, causal=True,
                  mask_align="bottom_right"),
    AttentionSpec(arch="sm_80", window=True, softcap=True, return_lse=True, causal=True),
    AttentionSpec(arch="sm_90", head_dim=128, config=WS, precision="fp8", return_lse=True),
    CombineSpec(arch="sm_80", return_lse=True),
    QuantizeSpec(arch="sm_89", part="amax"),
    QuantizeSpec(arch="sm_89", transpose=True),
    QuantizeSpec(arch="sm_89", granularity="token"),
    BackwardSpec(arch="sm_80", op="attention_bwd_pre"),
    BackwardSpec(arch="sm_80", window=True, softcap=True, causal=True),
    BackwardSpec(arch="sm_80", op="attention_bwd_post"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_the_kernel_argument_holds_what_the_packing_packs(spec):
    """``Args`` has every declared parameter by name, None where the spec has none; the others
    are the packing's parameters in order (a TMA operand: its descriptor and extents)."""
    sig = signature(spec)
    args = sig.args(spec, lambda a: a.abi_name)
    assert args._fields == tuple(g.name for g in sig.groups)
    present = [name for group in args for name in group if name is not None]
    packed = [p.tensor if isinstance(p, TensorMapParam) else p.name for p in params_for(spec)
              if not isinstance(p, CoordParam)]
    assert present == packed


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_the_signature_names_a_kernel_class_that_exists(spec):
    module, _, name = signature(spec).kernel(spec).partition(":")
    source = (KERNELS / (module.replace(".", "/") + ".py")).read_text()
    assert re.search(rf"^class {name}\b", source, re.MULTILINE)


def test_families_decide_tma_operands_and_key_shares():
    mma = AttentionSpec(arch="sm_90", head_dim=128, return_lse=True)
    ws = AttentionSpec(arch="sm_90", head_dim=128, return_lse=True, config=WS)
    assert signature(mma) is signature(ws) is ATTENTION
    names = [p.name for p in params_for(ws)]
    assert names[:6] == ["q_tma", "q_extents", "k_tma", "k_extents", "v_tma", "v_extents"]
    assert "num_splits" not in names and "num_splits" in [p.name for p in params_for(mma)]
    args = ATTENTION.args(ws, lambda a: a.name)
    assert args.softmax.num_splits is None and args.operands.v == "v"


def test_forward_and_backward_share_the_masks_group():
    fwd = AttentionSpec(arch="sm_80", window=True, causal=True)
    bwd = BackwardSpec(arch="sm_80", window=True, causal=True)
    assert signature(fwd).groups[-4] is MASKS and MASKS in signature(bwd).groups
    for spec in (fwd, bwd):
        masks = signature(spec).args(spec, lambda a: a.name).masks
        assert masks == ("window_left", "window_right", None, None)
