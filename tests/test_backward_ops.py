"""The backward's host side without a GPU: the registered op's fake implementation, the
autograd formula's bookkeeping and the input checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flashcore.ops.backward as bw
import flashcore.ops.backward_varlen as bwv
from flashcore.ops.masks import masking
from flashcore.specs import BackwardSpec, TileConfig
from flashcore.specs.backward import default_backward_config


def test_fake_implementation_gives_the_gradients_shapes():
    with FakeTensorMode():
        q = torch.empty(2, 8, 100, 64, dtype=torch.float16)
        k = torch.empty(2, 2, 70, 64, dtype=torch.float16)
        lse = torch.empty(2, 8, 100)
        dq, dk, dv = torch.ops.flashcore.attention_backward(q, q, k, k, q, lse, True, None)
        masked = torch.ops.flashcore.attention_backward(q, q, k, k, q, lse, True, None, None,
                                                        "bottom_right", [16, 0], 30.0)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
    assert [t.shape for t in masked] == [q.shape, k.shape, k.shape]
    assert dq.dtype == dk.dtype == torch.float16


def _call(**changes):
    args = {"q": torch.empty(1, 2, 3, 64, dtype=torch.float16),
            "k": torch.empty(1, 2, 3, 64, dtype=torch.float16),
            "v": torch.empty(1, 2, 3, 64, dtype=torch.float16), "causal": True,
            "softmax_scale": None, "return_lse": False, "tile": None, "warps": None,
            "stages": None, "kv_splits": None, "num_splits": None, "precision": "fp16",
            "k_descale": None, "v_descale": None, "mask_align": "top_left", "window": None,
            "softcap": None, "config": None, "alibi_slopes": None, "deterministic": False}
    args.update(changes)
    return tuple(args[name] for name in bw.input_names("attention"))


def _ctx(inputs, lse_rows: int = 6):
    ctx = SimpleNamespace(save_for_backward=lambda *t: setattr(ctx, "saved_tensors", t))
    out = torch.empty(1, 2, 3, 64, dtype=torch.float16)
    bw.setup_attention_context(ctx, inputs, (out, torch.empty(lse_rows)))
    return ctx


def _recorded(monkeypatch, op: str) -> dict:
    """Replace ``torch.ops.flashcore.<op>`` by a recorder of its arguments ("args")."""
    seen: dict = {}

    def fake_backward(*args):
        seen["args"] = args
        return tuple(torch.empty(1) for _ in range(3))

    monkeypatch.setattr(torch.ops.flashcore, op, fake_backward)
    return seen


def test_setup_context_saves_what_the_backward_needs():
    ctx = _ctx(_call(softmax_scale=0.5))
    assert ctx.why_not is None and ctx.causal and ctx.softmax_scale == 0.5
    assert len(ctx.saved_tensors) == 5


@pytest.mark.parametrize("changes, reason", [
    ({"precision": "fp8"}, "precision"),
    ({"k": torch.empty(1, 2, 3, 64, dtype=torch.float8_e4m3fn)}, "FP8 KV cache"),
    ({"alibi_slopes": torch.ones(2)}, "ALiBi"),
])
def test_calls_without_a_backward_say_so_when_differentiated(changes, reason):
    ctx = _ctx(_call(**changes))
    with pytest.raises(RuntimeError, match=reason):
        bw.attention_op_backward(ctx, torch.empty(1), None)


@pytest.mark.parametrize("changes", [
    {"mask_align": "bottom_right"}, {"window": [4, 0]}, {"softcap": 30.0},
    {"mask_align": "bottom_right", "window": [7, 0], "softcap": 5.0},
])
def test_masked_calls_have_a_backward_that_gets_their_masks(changes, monkeypatch):
    ctx = _ctx(_call(**changes))
    assert ctx.why_not is None
    seen = _recorded(monkeypatch, "attention_backward")
    bw.attention_op_backward(ctx, torch.empty(1), None)
    *_, align, window, softcap, _ = seen["args"]
    assert align == changes.get("mask_align", "top_left")
    assert window == changes.get("window") and softcap == changes.get("softcap")


@pytest.mark.parametrize("masks, match", [
    ({"window": (4, 2)}, "window"),  # right of a causal diagonal
    ({"window": (4,)}, "window"),
    ({"softcap": -1.0}, "softcap"),
    ({"mask_align": "middle"}, "mask_align"),
])
def test_bad_masks_are_refused_naming_the_argument(masks, match):
    q = torch.empty(1, 2, 3, 64, dtype=torch.float16)
    lse = torch.empty(1, 2, 3)
    with pytest.raises((ValueError, TypeError), match=match):
        bw.attention_backward(q, q, q, q, q, lse, True, **masks)


def test_a_forward_without_its_lse_is_refused_in_the_backward():
    ctx = _ctx(_call(), lse_rows=0)
    with pytest.raises(RuntimeError, match="without its LSE"):
        bw.attention_op_backward(ctx, torch.empty(1), None)


def test_inputs_are_checked_naming_the_argument():
    q = torch.empty(1, 2, 3, 64, dtype=torch.float16)
    lse = torch.empty(1, 2, 3)
    with pytest.raises(ValueError, match="on cpu"):
        bw.attention_backward(q, q, q, q, q, lse)


def test_backward_choices_default_override_and_env(monkeypatch):
    monkeypatch.delenv(bw.CHOICES_ENV, raising=False)
    assert bw.backward_choices("sm_90", 128) == (default_backward_config(128, "sm_90"), None)
    assert bw.backward_choices("sm_89", 128) == (default_backward_config(128), None)
    monkeypatch.setenv(bw.CHOICES_ENV, "128:64x64w8s1a-")
    assert bw.backward_choices("sm_90", 128) == (TileConfig((64, 64), warps=8), ())
    assert bw.backward_choices("sm_90", 64) == (default_backward_config(64, "sm_90"), None)
    with bw.backward_choices_override("64x128w8s2a242"):
        assert bw.backward_choices("sm_90", 128) == (
            TileConfig((64, 128), warps=8, stages=2), (2, 4, 2))
    assert bw.backward_choices("sm_90", 128) == (TileConfig((64, 64), warps=8), ())


def test_backward_specs_of_one_pass():
    pre, main, post = bw.backward_specs("sm_89", "bfloat16", 128, default_backward_config(128),
                                        True)
    assert (pre.op, main.op, post.op) == ("attention_bwd_pre", "attention_bwd",
                                          "attention_bwd_post")
    assert main == BackwardSpec(arch="sm_89", dtype="bfloat16", head_dim=128, causal=True,
                                config=default_backward_config(128), warps_m=(4, 2, 2))
    legacy = bw.backward_specs("sm_89", "bfloat16", 128, default_backward_config(128), True,
                               warps_m=())[1]
    assert legacy == main.replace(warps_m=())
    assert pre.rows_per_cta == post.rows_per_cta == 8
    masked = bw.backward_specs("sm_89", "float16", 64, default_backward_config(64), True,
                               masking(True, "bottom_right", (8, 0), 20.0))[1]
    assert (masked.mask_align, masked.window, masked.softcap) == ("bottom_right", True, True)


@pytest.mark.parametrize("asked, flag, want", [
    (False, False, False), (True, False, True), (False, True, True)])
def test_deterministic_comes_from_the_call_or_torchs_flag(asked, flag, want, monkeypatch):
    """As FlashAttention takes it: a forward argument, or torch's deterministic mode when the
    forward runs; the backward op gets it."""
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: flag)
    ctx = _ctx(_call(deterministic=asked))
    seen = _recorded(monkeypatch, "attention_backward")
    bw.attention_op_backward(ctx, torch.empty(1), None)
    assert seen["args"][-1] is want


@pytest.mark.parametrize("deterministic, tma", [(False, False), (True, False), (False, True)])
def test_the_main_launch_gets_zeroed_turn_counters_when_deterministic(deterministic, tma,
                                                                       monkeypatch):
    """The main kernel's last argument: (pointer, batch · heads · query blocks) int32 counters
    past the fp32 workspace, zeroed before the first launch; none without ``deterministic``.
    A main kernel that copies by TMA gets Q, K, V and dO as ``tma_args`` makes them (two
    arguments each: descriptor and extents), the rest as any other."""
    launched, loaded, described = [], [], []

    def kernels(dev, dtype, d, config, causal, masks, warps_m, det, varlen=False):
        loaded.append(det)
        return tuple(SimpleNamespace(artifact=SimpleNamespace(spec=SimpleNamespace(
            rows_per_cta=8)), tensor_maps=("q", "k", "v", "do") if tma and i == 1 else ())
            for i in range(3))

    def tma_args(kern, inputs, dtype, head_dim):
        described.append((inputs, dtype, head_dim))
        return sum((((f"desc{i}",), ("extents",)) for i in range(len(inputs))), ())

    buffers = []
    real_empty = torch.empty

    def empty(*shape, **kw):
        t = real_empty(*shape, **{k: v for k, v in kw.items() if k != "device"})
        t.fill_(7.0)  # poison: the counters must be zeroed
        buffers.append(t)
        return t

    def launch(kernel, grid, args, dev):
        launched.append((grid, args))

    monkeypatch.setattr(bw, "backward_kernels", kernels)
    monkeypatch.setattr(bw, "launch", launch)
    monkeypatch.setattr(bw, "tma_args", tma_args)
    monkeypatch.setattr(bw, "arch_of", lambda dev: "sm_90")
    monkeypatch.setattr(bw, "sm_count", lambda dev: 132)
    monkeypatch.setattr(bw, "check_extents", lambda *a: None)
    monkeypatch.setattr(bw, "prepared", lambda t: (t, (t.data_ptr(),)))
    monkeypatch.setattr(bw.torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    B, H, Hkv, S, D = 2, 4, 2, 200, 64
    q = real_empty(B, H, S, D, dtype=torch.float16).normal_()
    k = real_empty(B, Hkv, S, D, dtype=torch.float16).normal_()
    lse = real_empty(B, H, S).normal_()
    bw.attention_backward(q, q, k, k, q, lse, True, deterministic=deterministic,
                          dq=torch.zeros_like(q), dk=torch.zeros_like(k),
                          dv=torch.zeros_like(k))
    assert loaded == [deterministic]
    grid, main_args = launched[1]
    # q, k, v, dO, the three workspaces, dK, dV, the two scales (no mask sizes), the counters
    assert len(main_args) == 11 + deterministic + 4 * tma
    if tma:
        inputs = tuple((t.data_ptr(),) for t in (q, k, k, q))
        assert described == [(inputs, "float16", D)]
        assert main_args[:8] == tuple(x for i in range(4) for x in ((f"desc{i}",), ("extents",)))
    else:
        assert not described
    work = buffers[0]
    config = bw.backward_choices("sm_90", D)[0]
    # the four (batch, K/V head) pairs' two key blocks fit one wave: one chunk
    assert config.tile_n == 128 and grid == (2 * B * Hkv, 1, 1)
    blocks = -(-S // config.tile_m)
    rows = -(-S // bw.ROW_PAD) * bw.ROW_PAD
    if deterministic:
        ptr, n = main_args[-1]
        assert n == B * H * blocks
        first = (ptr - work.data_ptr()) // 4
        assert first == B * H * rows * (D + 2)
        assert work.numel() == first + n
        assert (work[first:].view(torch.int32) == 0).all()
    else:
        assert work.numel() == B * H * rows * (D + 2)


def test_varlen_fake_implementation_gives_the_gradients_shapes():
    with FakeTensorMode():
        q = torch.empty(300, 8, 64, dtype=torch.float16)
        k = torch.empty(250, 2, 64, dtype=torch.float16)
        lse = torch.empty(8, 300)
        cu = torch.empty(4, dtype=torch.int32)
        dq, dk, dv = torch.ops.flashcore.attention_varlen_backward(
            q, q, k, k, q, lse, cu, cu, 120, 100, True, None, None, "bottom_right", [16, 0])
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)


def _varlen_call(**changes):
    args = {"q": torch.empty(10, 2, 64, dtype=torch.float16),
            "k": torch.empty(9, 1, 64, dtype=torch.float16),
            "v": torch.empty(9, 1, 64, dtype=torch.float16),
            "cu_seqlens_q": torch.tensor([0, 4, 10], dtype=torch.int32),
            "cu_seqlens_k": torch.tensor([0, 5, 9], dtype=torch.int32),
            "max_seqlen_q": 6, "max_seqlen_k": 5, "causal": True, "softmax_scale": 0.3,
            "return_lse": False, "mask_align": "bottom_right", "window": [3, 0],
            "softcap": None, "tile": None, "warps": None, "stages": None, "kv_splits": None,
            "check_lengths": False, "config": None, "alibi_slopes": None,
            "deterministic": False}
    args.update(changes)
    return tuple(args[name] for name in bw.input_names("attention_varlen"))


def _varlen_ctx(inputs, lse_rows: int = 20):
    ctx = SimpleNamespace(save_for_backward=lambda *t: setattr(ctx, "saved_tensors", t))
    out = torch.empty(10, 2, 64, dtype=torch.float16)
    bwv.setup_varlen_context(ctx, inputs, (out, torch.empty(lse_rows)))
    return ctx


def test_varlen_autograd_hands_the_backward_the_call(monkeypatch):
    """The packed batch's offsets, lengths, masks and check_lengths reach the backward op;
    ALiBi, a forward without its LSE and wide head dims say what is missing."""
    ctx = _varlen_ctx(_varlen_call())
    assert ctx.why_not is None and len(ctx.saved_tensors) == 7
    seen = _recorded(monkeypatch, "attention_varlen_backward")
    grads = bwv.varlen_op_backward(ctx, torch.empty(1), torch.empty(1))
    assert len(grads) == len(bw.input_names("attention_varlen"))
    a = seen["args"]
    assert a[6].tolist() == [0, 4, 10] and a[7].tolist() == [0, 5, 9] and a[8:10] == (6, 5)
    assert a[10:] == (True, 0.3, None, "bottom_right", [3, 0], None, False, False)
    assert _varlen_ctx(_varlen_call(deterministic=True)).deterministic
    for changes, reason in (({"alibi_slopes": torch.ones(2)}, "ALiBi"),
                            ({"q": torch.empty(10, 2, 48, dtype=torch.float16)}, "head_dim")):
        with pytest.raises(RuntimeError, match=reason):
            bwv.varlen_op_backward(_varlen_ctx(_varlen_call(**changes)), torch.empty(1), None)
    with pytest.raises(RuntimeError, match="without its LSE"):
        bwv.varlen_op_backward(_varlen_ctx(_varlen_call(), lse_rows=0), torch.empty(1), None)


def test_varlen_backward_launches_with_the_offsets_and_the_batch_in_z(monkeypatch):
    """The main launch: (longest keys' blocks x K/V heads, 1, batch), the offsets after the
    masks' sizes; the workspace rows cover a query block running past the last sequence; k's
    rows outside every sequence are 0; deterministic adds zeroed counters."""
    launched, loaded, buffers = [], [], []

    def kernels(dev, dtype, d, config, causal, masks, warps_m, det, varlen):
        loaded.append((det, varlen, masks.spec_fields))
        return tuple(SimpleNamespace(artifact=SimpleNamespace(spec=SimpleNamespace(
            rows_per_cta=8)), tensor_maps=()) for _ in range(3))

    real_empty = torch.empty

    def empty(*shape, **kw):
        t = real_empty(*shape, **{k: v for k, v in kw.items() if k != "device"})
        buffers.append(t)
        return t

    monkeypatch.setattr(bw, "backward_kernels", kernels)
    monkeypatch.setattr(bw, "launch", lambda kern, grid, args, dev: launched.append((grid, args)))
    monkeypatch.setattr(bw, "arch_of", lambda dev: "sm_90")
    monkeypatch.setattr(bw, "prepared", lambda t: (t, (t.data_ptr(),)))
    monkeypatch.setattr(bw.torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    H, Hkv, D = 4, 2, 64
    cu_q = torch.tensor([0, 100, 100, 230], dtype=torch.int32)
    cu_k = torch.tensor([0, 150, 160, 290], dtype=torch.int32)
    q = real_empty(230, H, D, dtype=torch.float16).normal_()
    k = real_empty(300, Hkv, D, dtype=torch.float16).normal_()  # 10 rows in no sequence
    lse = real_empty(H, 230).normal_()
    dq, dk, dv = bwv.attention_varlen_backward(q, q, k, k, q, lse, cu_q, cu_k, 130, 150, True,
                                              mask_align="bottom_right", check_lengths=False)
    assert loaded == [(False, True, ("bottom_right", False, False, False))]
    config = bw.backward_choices("sm_90", D)[0]
    grid, args = launched[1]
    assert grid == (-(-150 // config.tile_n) * Hkv, 1, 3)
    assert [a[0] for a in args[-2:]] == [cu_q.data_ptr(), cu_k.data_ptr()]
    assert [a[1] for a in args[-2:]] == [4, 4]
    rows = buffers[0].numel() // (H * (D + 2))
    assert rows % bw.ROW_PAD == 0 and rows >= 230 + config.tile_m - 1
    assert launched[0][0] == (rows // 8 * H, 1, 1) and launched[2][0] == (-(-230 // 8) * H, 1, 1)
    assert (dk[290:] == 0).all() and (dv[290:] == 0).all() and dq.shape == q.shape
    # deterministic: a counter per (sequence, head, query block of the longest sequence)
    launched.clear()
    buffers.clear()
    bwv.attention_varlen_backward(q, q, k, k, q, lse, cu_q, cu_k, 130, 150, True,
                                  mask_align="bottom_right", check_lengths=False,
                                  deterministic=True)
    counters = 3 * H * -(-130 // config.tile_m)
    ptr, n = launched[1][1][-1]
    assert n == counters and buffers[0].numel() == rows * H * (D + 2) + counters
    assert ptr == buffers[0].data_ptr() + 4 * rows * H * (D + 2)
    assert (buffers[0][rows * H * (D + 2):].view(torch.int32) == 0).all()
    with pytest.raises(ValueError, match="lse"):
        bwv.attention_varlen_backward(q, q, k, k, q, lse.t(), cu_q, cu_k, 130, 150)


def test_the_main_grid_walks_chunks_of_pairs_key_block_by_key_block():
    """``abi.backward_grid``: y the chunks of (batch, K/V head) pairs, x a chunk's key blocks
    with its pairs fastest; every CTA of the grid is one (key block, pair), each once. The
    chunk holds as many pairs' key blocks as one wave of CTAs, divides the pairs, and keeps
    the grid's y within its limit."""
    from flashcore.compiler.abi import MAX_GRID_Y, backward_chunk, backward_grid

    def coords(x, y, grid, blocks, heads):  # the kernel's key_block_coords
        chunk = grid[0] // blocks
        pair = y * chunk + x % chunk
        return x // chunk, pair % heads, pair // heads

    for sk, hkv, b, tn, sms in ((4096, 8, 4, 128, 132), (4096, 16, 4, 128, 132),
                                (32768, 32, 1, 128, 132), (200, 2, 2, 128, 58),
                                (100, 7, 3, 64, 58), (5000, 3, 1, 64, 132)):
        chunk = backward_chunk(sk, hkv, b, tn, sms)
        blocks = -(-sk // tn)
        assert (hkv * b) % chunk == 0
        assert chunk == 1 or chunk * blocks <= sms
        grid = backward_grid(sk, hkv, b, tn, chunk)
        seen = [coords(x, y, grid, blocks, hkv) for y in range(grid[1]) for x in range(grid[0])]
        assert sorted(seen) == sorted((n, h, z) for n in range(blocks) for h in range(hkv)
                                      for z in range(b))
        if chunk > 1:  # a chunk's first key block of every pair comes before any second one
            assert [n for n, _, _ in seen[:chunk]] == [0] * chunk
    assert backward_chunk(4096, 8, 4, 128, 132) == 4  # GQA 32/8: 4 x 32 key blocks a wave
    assert backward_chunk(32768, 32, 1, 128, 132) == 1  # longer than a wave: one pair
    many = backward_chunk(64, 32, 4096, 64, 132)  # 131072 pairs: y must stay in bounds
    assert 131072 // many <= MAX_GRID_Y
    with pytest.raises(ValueError, match="does not divide"):
        backward_grid(4096, 8, 4, 128, 3)
