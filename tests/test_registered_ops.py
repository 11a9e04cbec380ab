"""The registered ops (``flashcore.ops.library``, what torch.compile and tensor subclasses go
through) hand the eager code the caller's whole ``TileConfig``: every field, the kernel family
included. Checked on the CPU with the eager entry points replaced by recorders."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashcore.ops import library
from flashcore.specs import TileConfig

WS = TileConfig((128, 128), warps=8, stages=3, family="wgmma_ws")


@pytest.fixture
def seen(monkeypatch):
    """Each eager entry point records the config it was given and returns empty outputs."""
    got = {}

    def recorder(name, out_of):
        def fake(*args, **kwargs):
            got[name] = kwargs["config"] if "config" in kwargs else args[7]
            return out_of(args)
        return fake

    monkeypatch.setattr(library, "run", recorder("attention", lambda a: a[0].new_empty(a[0].shape)))
    monkeypatch.setattr(library, "run_fp8", recorder(
        "attention_fp8", lambda a: a[0].new_empty(a[0].shape, dtype=torch.float16)))
    monkeypatch.setattr(library, "run_varlen", recorder(
        "attention_varlen", lambda a: a[0].new_empty(a[0].shape)))
    monkeypatch.setattr(library, "run_paged", recorder(
        "attention_paged", lambda a: a[0].new_empty(a[0].shape)))
    return got


def _qkv(shape=(1, 2, 16, 64)):
    return tuple(torch.randn(shape, dtype=torch.float16) for _ in range(3))


@pytest.mark.parametrize("config", [WS, TileConfig((64, 64), warps=4, stages=2, kv_splits=2),
                                    TileConfig((16, 64), warps=1, family="mma_sync")])
def test_the_whole_config_reaches_the_eager_code(seen, config):
    q, k, v = _qkv()
    common = {"causal": False, "softmax_scale": None, "return_lse": False, "out": None}
    library.attention_op(q, k, v, tile=None, config=config, warps=None, stages=None,
                         kv_splits=None, num_splits=None, precision="fp16", k_descale=None,
                         v_descale=None, **common)
    library.attention_fp8_op(q, k, v, q, k, v, out_dtype=torch.float16, config=config,
                             num_splits=None, **common)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    library.attention_varlen_op(q[0], k[0], v[0], cu, cu, 16, 16, mask_align="top_left",
                                window=None, softcap=None, tile=None, config=config,
                                check_lengths=False, **common)
    library.attention_paged_op(q, k, v, cu, cu, cu_seqlens_q=None, max_seqlen_q=None,
                               mask_align="top_left", window=None, softcap=None, tile=None,
                               config=config, num_splits=None, check_lengths=False, **common)
    assert seen == dict.fromkeys(("attention", "attention_fp8", "attention_varlen",
                                  "attention_paged"), config)


def test_knobs_without_a_config_still_travel(seen):
    q, k, v = _qkv()
    library.attention_op(q, k, v, tile=(32, 64), config=None, warps=2, stages=2, kv_splits=None,
                         num_splits=None, precision="fp16", k_descale=None, v_descale=None,
                         causal=False, softmax_scale=None, return_lse=False, out=None)
    assert seen["attention"] is None  # the eager code resolves tile and knobs itself
    with pytest.raises(TypeError, match="config must be a TileConfig"):
        library.attention_op(q, k, v, tile=None, config=(64, 64), warps=None, stages=None,
                             kv_splits=None, num_splits=None, precision="fp16", k_descale=None,
                             v_descale=None, causal=False, softmax_scale=None,
                             return_lse=False, out=None)


def test_config_and_knobs_together_are_refused_in_the_op():
    with pytest.raises(ValueError, match="either config or tile"):
        library._op_config(library._config_arg(WS), [64, 64], None, None, None)
    assert library._op_config(library._config_arg(WS), None, None, None, None) == WS
    assert library._op_config(None, [32, 64], 2, None, None) == TileConfig((32, 64), warps=2)


def test_the_config_string_holds_every_field_and_traces():
    """Every ``TileConfig`` field round-trips (a field added later must be added to the string
    too), and torch.compile traces the encoding (it ran json's C encoder once, which it cannot)."""
    assert [f.name for f in dataclasses.fields(TileConfig)] == [
        "tile", "warps", "stages", "kv_splits", "family"]
    odd = TileConfig((192, 64), warps=12, stages=4, kv_splits=2, family="wgmma_ws")
    for config in (odd, WS, TileConfig()):
        assert library._op_config(library._config_arg(config), None, None, None, None) == config
    f = torch.compile(lambda x: x + len(library._config_arg(odd)), backend="eager",
                      fullgraph=True)
    assert f(torch.zeros(1)).item() == len("192,64,12,4,2,wgmma_ws")


def test_ops_run_with_fresh_scratch_and_eager_calls_reuse_it(monkeypatch):
    """Inside a registered op every scratch tensor is fresh (torch.compile's CUDA graphs run the
    op in their own memory pool, where a kept buffer would outlive the graph's ownership);
    outside, the per-stream buffer is reused."""
    from flashcore.runtime import scratch as scratch_mod

    depths = []

    def fake_run(*args, **kwargs):
        depths.append(getattr(scratch_mod._fresh, "depth", 0))
        return args[0].new_empty(args[0].shape)

    monkeypatch.setattr(library, "run", fake_run)
    q, k, v = _qkv()
    torch.ops.flashcore.attention(q, k, v)
    assert depths == [1] and getattr(scratch_mod._fresh, "depth", 0) == 0

    class FakeCuda:  # a tensor on "CUDA device 0" of the current device
        is_cuda = True
        device = "cpu"

        def get_device(self):
            return 0

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False,
                        raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 7, raising=False)
    monkeypatch.setattr(scratch_mod.torch, "empty",
                        lambda n, dtype=None, device=None: torch.zeros(n, dtype=dtype))
    monkeypatch.setattr(scratch_mod, "_buffers", {})
    like = FakeCuda()
    a, b = scratch_mod.scratch(like, 10), scratch_mod.scratch(like, 10)
    assert a is b
    with scratch_mod.fresh_scratch():
        c, d = scratch_mod.scratch(like, 10), scratch_mod.scratch(like, 10)
    assert c is not d and c is not a and d is not a
    assert scratch_mod.scratch(like, 10) is a
