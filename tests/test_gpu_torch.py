"""flashcore as a PyTorch citizen (GPU): the registered ops under torch.compile, torch.export,
CUDA graphs and opcheck; no silently lost gradients; the tuned tile by default; no launch limits
below SDPA's; ``out=`` that cannot alias the inputs; first calls from fresh threads; two GPUs."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import flashcore.ops.library  # noqa: F401 - registers torch.ops.flashcore.*
from flashcore import reference
from flashcore.ops import attention
from flashcore.ops.fp8 import quantize_fp8
from tests.gpu_utils import current_arch, max_abs, requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


def _qkv(b=2, hq=4, hkv=2, sq=64, sk=96, d=64, dtype=torch.float16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=g)
                 for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))


class Block(torch.nn.Module):
    """A small attention block: projections, flashcore attention (GQA), output projection."""

    def __init__(self, dim=256, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim, dtype=torch.float16)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd, dtype=torch.float16)
        self.o = torch.nn.Linear(dim, dim, dtype=torch.float16)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        y = attention(q, k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


@torch.no_grad()
def test_compile_fullgraph_matches_eager_bit_for_bit():
    torch.manual_seed(0)
    block = Block().cuda()
    x = torch.randn(2, 96, 256, device="cuda", dtype=torch.float16)
    eager = block(x)
    compiled = torch.compile(block, fullgraph=True)
    assert torch.equal(compiled(x), eager)
    f = torch.compile(lambda q, k, v: attention(q, k, v) * 2, fullgraph=True)
    q, k, v = _qkv()
    assert torch.equal(f(q, k, v), attention(q, k, v) * 2)


@torch.no_grad()
def test_compile_reduce_overhead_cuda_graphs():
    torch.manual_seed(1)
    block = Block().cuda()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up runs, then graph replays
        x = torch.randn(2, 64, 256, device="cuda", dtype=torch.float16)
        assert torch.equal(compiled(x).clone(), block(x))


@torch.no_grad()
def test_export():
    block = Block().cuda()
    x = torch.randn(1, 32, 256, device="cuda", dtype=torch.float16)
    ep = torch.export.export(block, (x,))
    assert "flashcore.attention" in str(ep.graph)
    assert torch.equal(ep.module()(x), block(x))


def test_opcheck():
    q, k, v = _qkv()
    for kwargs in ({}, {"causal": True, "return_lse": True}, {"tile": [32, 64], "warps": 2}):
        torch.library.opcheck(torch.ops.flashcore.attention.default, (q, k, v), kwargs)
    decode = _qkv(b=2, hq=8, hkv=2, sq=1, sk=700, d=128)
    torch.library.opcheck(torch.ops.flashcore.attention.default, decode,
                          {"return_lse": True, "num_splits": 3})
    if current_arch() in ("sm_89", "sm_90"):
        k8, kd = quantize_fp8(k, granularity="token")
        v8, vd = quantize_fp8(v, granularity="token")
        # opcheck's schema test does arithmetic on the inputs, which torch has no e4m3 CUDA
        # kernels for ("mul_cuda not implemented for Float8_e4m3fn"): the other checks only
        no_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(torch.ops.flashcore.attention.default, (q, k8, v8),
                              {"k_descale": kd, "v_descale": vd}, test_utils=no_schema)
        for kwargs in ({"granularity": "token"}, {}, {"transpose": True}):  # two passes per head
            torch.library.opcheck(torch.ops.flashcore.quantize_fp8.default, (k,), kwargs)
        q8, qd = quantize_fp8(q, granularity="token")
        vt8, vdh = quantize_fp8(v, transpose=True)
        torch.library.opcheck(torch.ops.flashcore.attention_fp8.default,
                              (q8, k8, vt8, qd, kd, vdh), {"causal": True}, test_utils=no_schema)


def test_inputs_that_require_grad_raise_unless_told():
    """A call the backward does not build (FP8 operands) refuses inputs that require grad;
    ``tests/test_gpu_backward.py`` checks the calls it builds."""
    q, k, v = _qkv()
    q.requires_grad_()
    fp8 = {"causal": True, "precision": "fp8"}
    with pytest.raises(RuntimeError, match="no backward for precision='fp8' yet.*q require grad"):
        attention(q, k, v, **fp8)
    with torch.no_grad():
        expected = attention(q, k, v, **fp8)
    out = attention(q, k, v, allow_no_grad=True, **fp8)
    assert torch.equal(out, expected) and out.grad_fn is None
    with torch.inference_mode():
        assert torch.equal(attention(q, k, v, **fp8), expected)
    # compiled: the forward runs, and a backward through it says why it cannot
    f = torch.compile(lambda q, k, v: attention(q, k, v, **fp8).float().sum())
    with pytest.raises(RuntimeError, match="no backward for precision='fp8' yet"):
        f(q, k, v).backward()


def test_differentiable_calls_train_eagerly_and_compiled():
    q, k, v = _qkv()
    q.requires_grad_()
    out = attention(q, k, v, causal=True)
    assert out.grad_fn is not None
    out.float().sum().backward()
    eager = q.grad.clone()
    q.grad = None
    f = torch.compile(lambda q, k, v: attention(q, k, v, causal=True).float().sum(),
                      fullgraph=True)
    f(q, k, v).backward()
    assert torch.isfinite(eager).all() and torch.allclose(q.grad, eager, atol=1e-2)


def test_default_tile_is_the_tuned_one():
    from flashcore.ops import launcher
    from flashcore.ops.plan import tuned_config

    q, k, v = _qkv(b=1, hq=8, hkv=8, sq=512, sk=512)
    launcher.forget()
    attention(q, k, v)
    want = tuned_config(current_arch(), 64, False, 512, "fp16")
    assert [p.kern.artifact.spec.config for p in launcher._plans.values()] == [want]
    ref = reference.attention(q, k, v, device=q.device)
    assert max_abs(attention(q, k, v, tile=(64, 64)), ref) < 1e-2  # an explicit tile still works


def test_a_short_prefill_over_many_heads_runs_the_mid_tile():
    """8 sequences of 16 query heads at 300 tokens: enough CTAs of the mid bucket's tile that
    it runs instead of the short bucket's (``plan.SHORT_TO_MID_WAVES``), and it is right."""
    from flashcore.ops import launcher, plan
    from flashcore.tuned.table import lookup

    q, k, v = _qkv(b=8, hq=16, hkv=4, sq=300, sk=300, d=128, dtype=torch.bfloat16)
    launcher.forget()
    out = attention(q, k, v, causal=True)
    arch = current_arch()
    want = plan.tuned_config(arch, 128, True, 300, "fp16", pairs=8 * 16,
                             slots=plan.sm_count(q.get_device()))
    assert [p.kern.artifact.spec.config for p in launcher._plans.values()] == [want]
    assert want == lookup(arch, 128, True, "mid") != lookup(arch, 128, True, "short")
    ref = reference.attention(q, k, v, causal=True, device=q.device)
    assert torch.isfinite(out).all() and max_abs(out, ref) < 2e-2


@pytest.mark.parametrize("masks", [{"window": (100, 0)}, {"softcap": 30.0},
                                   {"mask_align": "bottom_right"}, {"varlen": True}],
                         ids=["window", "softcap", "bottom_right", "varlen"])
def test_masked_and_packed_short_prefill_over_many_heads_run_the_mid_tile(masks):
    """Masks and a packed batch (empty and one-token sequences among them) on a grid that
    takes the mid bucket's tile (``plan.SHORT_TO_MID_WAVES``): that tile runs, and every row
    matches the float64 reference."""
    from flashcore.ops import attention_varlen, launcher, plan
    from flashcore.ops.masks import call_masking

    arch, kw = current_arch(), dict(masks)
    varlen = kw.pop("varlen", False)
    launcher.forget()
    if varlen:
        lens = [0, 300, 1, 256, 129, 300]
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in
                   _qkv(b=1, hq=16, hkv=4, sq=sum(lens), sk=sum(lens), d=128, seed=7))
        out = attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                               mask_align="bottom_right")
        ref = reference.attention_varlen(q, k, v, cu, cu, causal=True, mask_align="bottom_right",
                                         device=q.device)
        mask, pairs, sq = call_masking(True, "bottom_right", None, None), 6 * 16, max(lens)
        features = (("varlen", True), *mask.features)
    else:
        sk = 500 if kw.get("mask_align") == "bottom_right" else 300
        q, k, v = _qkv(b=4, hq=16, hkv=4, sq=300, sk=sk, d=128, seed=8)
        out = attention(q, k, v, causal=True, **kw)
        ref = reference.attention(q, k, v, causal=True, device=q.device, **kw)
        mask = call_masking(True, kw.get("mask_align", "top_left"), kw.get("window"),
                            kw.get("softcap"))
        pairs, sq, features = 4 * 16, 300, mask.features
    want = plan.tuned_config(arch, 128, True, sq, "fp16", features, pairs=pairs,
                             slots=plan.sm_count(q.get_device()))
    assert want != plan.tuned_config(arch, 128, True, sq, "fp16", features)
    assert [p.kern.artifact.spec.config for p in launcher._plans.values()] == [want]
    assert torch.isfinite(out).all() and max_abs(out, ref) < 1e-2


@torch.no_grad()
def test_compiled_call_runs_the_configs_family():
    """A config's kernel family survives the registered op (it once travelled as tile and
    knobs only, and a compiled call ran the arch's default family instead)."""
    from flashcore.ops.plan import tuned_config

    if current_arch() != "sm_90":
        pytest.skip("the warp-specialised family is Hopper's")
    config = tuned_config("sm_90", 128, False, 4096, "fp16")
    assert config.family == "wgmma_ws"
    q, k, v = _qkv(b=1, hq=2, hkv=2, sq=300, sk=300, d=128)
    f = torch.compile(lambda q, k, v: attention(q, k, v, config=config), fullgraph=True)
    eager = attention(q, k, v, config=config)
    assert torch.equal(f(q, k, v), eager)
    assert max_abs(eager, reference.attention(q, k, v, device=q.device)) < 1e-2


def test_batch_beyond_the_grid_z_limit():
    """Batch 70000 (grid.z allows 65535): batch and heads fold into grid.x."""
    q, k, v = (torch.randn(70000, 1, 16, 64, device="cuda", dtype=torch.float16)
               for _ in range(3))
    out = attention(q, k, v)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert max_abs(out, sdpa) < 2e-3
    dec = attention(q[:, :, :1], k, v)  # decode: one token against 16 keys each
    # (torch's cuDNN backend fails on this decode shape; the float64 reference is the truth)
    assert max_abs(dec, reference.attention(q[:, :, :1], k, v, device=q.device)) < 2e-3


def test_out_that_aliases_an_input_is_refused():
    q, k, v = _qkv(hkv=4, sq=64, sk=64)
    for alias, name in ((q, "q"), (v, "v")):
        with pytest.raises(ValueError, match=f"shares memory with {name}"):
            attention(q, k, v, out=alias)
    expanded = torch.empty(2, 4, 1, 64, device="cuda", dtype=torch.float16).expand(2, 4, 64, 64)
    with pytest.raises(ValueError, match="overlaps itself|strides"):
        attention(q, k, v, out=expanded)
    out = torch.empty_like(q)
    before = out._version
    attention(q, k, v, out=out)
    assert out._version > before  # autograd and views see the write


def test_first_call_from_a_fresh_thread():
    """A thread whose first CUDA work is attention has no current context yet."""
    q, k, v = _qkv()
    expected = attention(q, k, v)  # loads the kernel here
    torch.cuda.synchronize()
    result, errors = {}, []

    def work():
        try:
            result["out"] = attention(q, k, v)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    assert torch.equal(result["out"], expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_and_two_processes(tmp_path):
    """Kernels load per device; calls on cuda:1; load_catalog checks every device; two
    processes (torch.distributed, one GPU each) share one cache directory without a race."""
    from flashcore.compiler.fingerprint import PACKAGE

    q, k, v = _qkv()
    q1, k1, v1 = (t.to("cuda:1") for t in (q, k, v))
    out1 = attention(q1, k1, v1)
    assert out1.device == q1.device
    assert torch.equal(out1.cpu(), attention(q, k, v).cpu())
    script = Path(__file__).with_name("two_gpu_worker.py")
    # this checkout first, then whatever path the caller's packages (the DSL) came from
    path = os.pathsep.join(filter(None, (str(PACKAGE.parent), os.environ.get("PYTHONPATH"))))
    env = dict(os.environ, FLASHCORE_CACHE_DIR=str(tmp_path / "shared-cache"), PYTHONPATH=path)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        str(script)], env=env, capture_output=True, text=True, timeout=600,
                       check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("rank ok") == 2
