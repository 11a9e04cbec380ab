"""Attention's backward pass: ``attention_backward`` (eager), the registered op
``torch.ops.flashcore.attention_backward`` (with a fake implementation, so ``torch.compile``
traces it) and the autograd formula of ``torch.ops.flashcore.attention``
(``register_attention_backward``).

Three launches on torch's current stream (``flashcore.specs.backward``): the pre kernel (D =
rowsum(dO ∘ O), the LSE in log2 units, dQ's fp32 accumulator zeroed), the main kernel (a CTA
per key block: dK and dV in registers, dQ by fp32 atomics; on sm_90 at d64 and d128 the Hopper
backward's warpgroup MMAs, elsewhere the mma_sync family's) and the post kernel (dQ in q's
dtype). What it builds: fp16/bf16, every head dim of the forward (32, 64, 80, 96, 128, 256:
``spec.backward.default_backward_config`` picks each one's tile), any lengths, the forward's masks (causal
top-left as torch's ``is_causal`` or bottom-right, sliding windows, soft-capping), any softmax
scale, grouped-query attention (dK and dV summed over a K/V head's query heads inside one CTA:
deterministic). dQ's adds run in any order unless ``deterministic`` (or
``torch.use_deterministic_algorithms(True)``) asks for key-block order: the same bits every
run, for some speed. A packed batch: ``flashcore.ops.backward_varlen``. Not yet: FP8, an FP8 KV cache, a paged
cache, ALiBi.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from ..compiler.abi import (
    LOG2_E,
    backward_chunk,
    backward_grid,
    backward_rows_grid,
    varlen_backward_grid,
)
from ..runtime.device import arch_of
from ..runtime.launch import kernel_for, launch
from ..specs import BACKWARD_HEAD_DIMS, BackwardSpec, TileConfig
from ..specs.backward import (
    ROW_PAD,
    default_backward_config,
    default_warps_m,
    parse_backward_choices,
)
from .inputs import DTYPE_NAMES, prepared, rows_arg, tensor_arg, vector_arg
from .launcher import tma_args
from .masks import NO_MASK, Masking, call_masking, folded
from .plan import sm_count
from .validate import (
    check_extents,
    check_like,
    check_qkv,
    check_rows,
    grad_buffer,
    softmax_scale_of,
)

# (device, dtype, head_dim, config, warps_m, causal, mask fields) -> loaded kernels
_kernels: dict[tuple, tuple] = {}
# the main kernel's choices where a call gives no config (``backward_choices``)
CHOICES_ENV = "FLASHCORE_BWD_CONFIG"
_choices_override: list[str] = []


def backward_specs(arch: str, dtype: str, head_dim: int, config: TileConfig, causal: bool,
                   masks: Masking = NO_MASK, warps_m: tuple[int, ...] | None = None,
                   deterministic: bool = False, varlen: bool = False,
                   ) -> tuple[BackwardSpec, BackwardSpec, BackwardSpec]:
    """(pre, main, post): the specs of one backward pass (``warps_m`` None: the squarest warp
    tiles, ``spec.backward.default_warps_m``)."""
    align, window, softcap, _ = masks.spec_fields  # ALiBi has no backward (``why_no_backward``)
    if warps_m is None:
        warps_m = default_warps_m(head_dim, config)
    return (BackwardSpec(arch=arch, dtype=dtype, head_dim=head_dim, op="attention_bwd_pre"),
            BackwardSpec(arch=arch, dtype=dtype, head_dim=head_dim, config=config,
                         causal=causal, mask_align=align, window=window, softcap=softcap,
                         warps_m=warps_m, deterministic=deterministic, varlen=varlen),
            BackwardSpec(arch=arch, dtype=dtype, head_dim=head_dim, op="attention_bwd_post"))


_parsed_choices = functools.lru_cache(maxsize=16)(parse_backward_choices)  # a call's text


def backward_choices(arch: str, head_dim: int) -> tuple[TileConfig, tuple[int, ...] | None]:
    """(config, warps_m) of the main kernel for a call that gives no config: the innermost
    ``backward_choices_override``, else ``$FLASHCORE_BWD_CONFIG`` (``spec.backward.
    parse_backward_choices``; an A/B of variants without code changes), else the arch's
    default."""
    text = _choices_override[-1] if _choices_override else os.environ.get(CHOICES_ENV, "")
    if text:
        choices = _parsed_choices(text)
        hit = choices.get(head_dim, choices.get(None))
        if hit is not None:
            return hit
    return default_backward_config(head_dim, arch), None


@contextlib.contextmanager
def backward_choices_override(text: str) -> Iterator[None]:
    """Within the block, calls without a config use ``text``'s choices (the benchmark's
    variants)."""
    parse_backward_choices(text)  # refuse a bad one here
    _choices_override.append(text)
    try:
        yield
    finally:
        _choices_override.pop()


def backward_kernels(device: int, dtype: str, head_dim: int, config: TileConfig,
                     causal: bool, masks: Masking = NO_MASK,
                     warps_m: tuple[int, ...] | None = None,
                     deterministic: bool = False, varlen: bool = False) -> tuple:
    """The loaded (pre, main, post) kernels on CUDA device ``device``, built once."""
    key = (device, dtype, head_dim, config, warps_m, causal, masks.spec_fields, deterministic,
           varlen)
    ks = _kernels.get(key)
    if ks is None:
        specs = backward_specs(arch_of(device), dtype, head_dim, config, causal, masks,
                               warps_m, deterministic, varlen)
        ks = _kernels[key] = tuple(kernel_for(s, device) for s in specs)
    return ks


def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       causal: bool = False, softmax_scale: float | None = None, *,
                       mask_align: str = "top_left", window: tuple[int, int] | None = None,
                       softcap: float | None = None,
                       config: TileConfig | None = None,
                       warps_m: tuple[int, ...] | None = None, dlse: Tensor | None = None,
                       dq: Tensor | None = None, dk: Tensor | None = None,
                       dv: Tensor | None = None, deterministic: bool | None = None,
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``out = attention(q, k, v, causal, softmax_scale)`` for the output
    gradient ``dout``, from the forward's ``out`` and natural-log ``lse`` (float32 (B, H,
    S_q)). ``mask_align``, ``window`` and ``softcap``: the forward call's masks (as
    ``attention`` takes them). ``dlse``: the gradient of the LSE too, when the caller used it.
    dk and dv have k's
    (fewer, with GQA) heads; all three are in q's dtype, new contiguous tensors unless given
    (``dq``/``dk``/``dv``: contiguous, of q's and k's shapes). A row that saw no key (lse -inf)
    contributes no gradient. ``config``: the main kernel's tile (default
    ``backward_choices``: the arch's ``spec.backward.default_backward_config``); ``warps_m``:
    its warps along the rows of each product (``BackwardSpec.warps_m``; default the squarest
    warp tiles). ``deterministic``: dQ's fp32 adds in a fixed order, so every run gives the
    same bits (None: ``torch.are_deterministic_algorithms_enabled()``); dK and dV are always
    deterministic."""
    masks = call_masking(causal, mask_align, window, softcap)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    check_qkv(q, k, v)
    causal, masks = folded(causal, masks, q.shape[2], k.shape[2])
    if k.dtype != q.dtype:
        raise ValueError("attention_backward: an FP8 KV cache has no backward; k and v must "
                         "have q's dtype")
    check_like("dout", dout, q)
    check_like("out", out, q)
    lse = check_rows("lse", lse, q)
    if dlse is not None:
        dlse = check_rows("dlse", dlse, q)
    scale = softmax_scale_of(softmax_scale, q.shape[3])
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    dq = grad_buffer("dq", dq, q)
    dk = grad_buffer("dk", dk, k)
    dv = grad_buffer("dv", dv, k)
    if 0 in (B, H, Sq, Sk):  # no score: every gradient is 0
        return dq.zero_(), dk.zero_(), dv.zero_()
    negate = scale < 0
    if negate:  # the kernels take scale >= 0: -q with |scale| has the same logits
        q, scale = torch.neg(q), -scale
    check_extents(q, k, dout)
    launch_pass(q, k, v, dout, out, lse, dlse, dq, dk, dv, scale, causal, masks, config,
                warps_m, bool(deterministic))
    if negate:
        dq.neg_()
    return dq, dk, dv


class Packed(NamedTuple):
    """A packed batch's tables as the main kernel takes them."""

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def launch_pass(q, k, v, dout, out, lse, dlse, dq, dk, dv, scale: float, causal: bool,
                masks: Masking, config, warps_m, deterministic: bool,
                packed: Packed | None = None) -> None:
    """The three launches of one backward pass over (batch, heads, seq, head_dim) tensors (a
    packed batch: (1, heads, total rows, head_dim) views and its ``packed`` tables); ``lse``,
    ``dlse``: (batch, heads, seq) float32; ``scale`` >= 0."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    dtype = DTYPE_NAMES[q.dtype]
    dev = q.get_device()
    if config is None:
        config, chosen = backward_choices(arch_of(dev), D)
        warps_m = chosen if warps_m is None else warps_m
    pre, main, post = backward_kernels(dev, dtype, D, config, causal, masks, warps_m,
                                       deterministic, packed is not None)
    # keep any copies prepared() makes alive until the launches are queued
    q, q_arg = prepared(q)
    k, k_arg = prepared(k)
    v, v_arg = prepared(v)
    dout, do_arg = prepared(dout)
    out, o_arg = prepared(out)

    # one 4-byte workspace: dQ's accumulator (B, H, rows, D), the log2 LSE and D (B, H, rows),
    # and with ``deterministic`` the int32 turn counters (batch, H, query blocks: a packed
    # batch's sequences, its longest one's), zeroed here. A packed batch's last query block may
    # reach tile_m - 1 rows past its end: padding rows.
    rows = -(-(Sq + (config.tile_m if packed else 0)) // ROW_PAD) * ROW_PAD
    n = B * H * rows
    counters = 0
    if deterministic:
        seqs, longest = (B, Sq) if packed is None else (
            packed.cu_seqlens_q.shape[0] - 1, packed.max_seqlen_q)
        counters = seqs * H * -(-longest // config.tile_m)
    work = torch.empty(n * (D + 2) + counters, dtype=torch.float32, device=q.device)
    ptr = work.data_ptr()
    dq_acc = (ptr, B, H, rows, H * rows * D, rows * D, D)
    lse2 = (ptr + 4 * n * D, B, H, rows, H * rows, rows)
    dpsum = (ptr + 4 * n * (D + 1), B, H, rows, H * rows, rows)
    tables: tuple = ()
    if packed is None:
        grid = backward_grid(Sk, Hkv, B, config.tile_n,
                             backward_chunk(Sk, Hkv, B, config.tile_n, sm_count(dev)))
    else:
        tables = (vector_arg(packed.cu_seqlens_q), vector_arg(packed.cu_seqlens_k))
        grid = varlen_backward_grid(packed.max_seqlen_k, Hkv, packed.cu_seqlens_q.shape[0] - 1,
                                    config.tile_n)
    turns: tuple = ()
    if deterministic:
        work[n * (D + 2):].zero_()  # 0.0 is int32 0
        turns = ((ptr + 4 * n * (D + 2), counters),)

    launch(pre, backward_rows_grid(rows, H, B, pre.artifact.spec.rows_per_cta),
           (o_arg, do_arg, rows_arg(lse), lse2, dpsum, dq_acc), dev)
    if dlse is not None:
        # d lse_i / d s_ij = P_ij: dS = P ∘ (dP − (D − dlse))
        work[n * (D + 1):n * (D + 2)].view(B, H, rows)[:, :, :Sq].sub_(dlse)
    inputs = (q_arg, k_arg, v_arg, do_arg)
    if main.tensor_maps:  # the Hopper kernel over a dense batch copies by TMA
        inputs = tma_args(main, inputs, dtype, D)
    launch(main, grid,
           (*inputs, lse2, dpsum, dq_acc, tensor_arg(dk), tensor_arg(dv),
            (scale * LOG2_E,), (scale,), *masks.scalars(scale), *tables, *turns), dev)
    launch(post, backward_rows_grid(Sq, H, B, post.artifact.spec.rows_per_cta),
           (dq_acc, tensor_arg(dq), (scale,)), dev)


# -- the registered ops ------------------------------------------------------------------------
@torch.library.custom_op("flashcore::attention_backward", mutates_args=())
def _attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        causal: bool = False, softmax_scale: float | None = None,
                        dlse: Tensor | None = None, mask_align: str = "top_left",
                        window: list[int] | None = None, softcap: float | None = None,
                        deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    return attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, dlse=dlse,
                              mask_align=mask_align,
                              window=None if window is None else tuple(window), softcap=softcap,
                              deterministic=deterministic)


@_attention_backward.register_fake
def _(dout, q, k, v, out, lse, causal=False, softmax_scale=None, dlse=None,
      mask_align="top_left", window=None, softcap=None, deterministic=False):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def why_no_backward(q: Tensor, k: Tensor, *, causal: bool = False, precision: str = "fp16",
                    k_descale: Tensor | None = None, mask_align: str = "top_left",
                    window=None, softcap=None) -> str | None:
    """Why an ``attention`` call has no backward yet (None: it has one), for a message. Every
    mask has one (``mask_align``, ``window`` and ``softcap`` are taken for the signature)."""
    if precision != "fp16":
        return f"precision={precision!r}"
    if k_descale is not None or k.dtype != q.dtype:
        return "an FP8 KV cache"
    if q.shape[-1] not in BACKWARD_HEAD_DIMS:
        return f"head_dim={q.shape[-1]} (the backward is built for {BACKWARD_HEAD_DIMS})"
    return None


def why_not_of(args: dict, out: Tensor, lse: Tensor) -> str | None:
    """Why a registered attention op's call (``args`` by input name, its ``out`` and ``lse``)
    has no backward (None: it has one)."""
    if args.get("alibi_slopes") is not None:
        return "ALiBi"
    why = why_no_backward(args["q"], args["k"], causal=args["causal"],
                          precision=args.get("precision", "fp16"),
                          k_descale=args.get("k_descale"))
    if why is None and lse.numel() != out.numel() // out.shape[-1]:
        return "a forward call without its LSE (return_lse=False inside the op)"
    return why


def deterministic_asked(args: dict) -> bool:
    """Ordered dQ adds: asked of the call, or of torch when the forward runs (as FlashAttention
    takes it)."""
    return bool(args.get("deterministic")) or torch.are_deterministic_algorithms_enabled()


@functools.cache
def input_names(op: str) -> tuple[str, ...]:
    """The names of registered op ``flashcore::op``'s inputs, in order (its schema: the one
    declaration of its signature)."""
    return tuple(a.name for a in getattr(torch.ops.flashcore, op).default._schema.arguments)


def setup_attention_context(ctx, inputs: tuple, output: tuple) -> None:
    """``torch.ops.flashcore.attention``'s setup_context: saves q, k, v, out and lse (the op
    must have computed the LSE: the public function asks for it whenever an input requires
    grad) and what the backward needs to know of the call."""
    args = dict(zip(input_names("attention"), inputs))
    ctx.inputs = len(inputs)
    out, lse = output
    ctx.why_not = why_not_of(args, out, lse)
    ctx.causal = args["causal"]
    ctx.softmax_scale = args["softmax_scale"]
    ctx.mask_align = args.get("mask_align", "top_left")
    ctx.window = args.get("window")
    ctx.softcap = args.get("softcap")
    ctx.return_lse = args["return_lse"]
    ctx.deterministic = deterministic_asked(args)
    ctx.save_for_backward(args["q"], args["k"], args["v"], out, lse)


def attention_op_backward(ctx, dout: Tensor, dlse: Tensor | None):
    """The gradients of q, k and v (None for every other input of the op)."""
    if ctx.why_not is not None:
        raise RuntimeError(f"flashcore.ops.attention has no backward for {ctx.why_not} yet; "
                           "run it under torch.no_grad() or detach its inputs")
    q, k, v, out, lse = ctx.saved_tensors
    dlse = dlse if ctx.return_lse else None
    window = None if ctx.window is None else list(ctx.window)
    dq, dk, dv = torch.ops.flashcore.attention_backward(
        dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, dlse, ctx.mask_align, window,
        ctx.softcap, ctx.deterministic)
    return (dq, dk, dv) + (None,) * (ctx.inputs - 3)


def register_attention_backward(op) -> None:
    """Give the registered ``flashcore::attention`` op its autograd formula."""
    op.register_autograd(attention_op_backward, setup_context=setup_attention_context)


def needs_grad(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a forward call must keep what its backward needs (its LSE)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)

