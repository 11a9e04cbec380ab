"""The backward of a packed batch (``attention_varlen``): ``attention_varlen_backward``
(eager), the registered op ``torch.ops.flashcore.attention_varlen_backward`` (with a fake
implementation) and the autograd formula of ``torch.ops.flashcore.attention_varlen``
(``register_varlen_backward``).

The same three kernels as the dense backward (``flashcore.ops.backward``) over the packed rows
viewed as one (1, heads, total rows, head_dim) batch: the row kernels see one long sequence,
the main kernel (``BackwardSpec.varlen``) reads each sequence's rows and keys through the
int32 offsets, with the batch in the grid's z and as many key blocks per head as the longest
sequence has. Rows of a query block past its sequence's end get no probability.
``deterministic``: dQ's adds take turns as the dense backward's do, per (sequence, head, query
block).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..specs import TileConfig
from .backward import Packed, deterministic_asked, input_names, launch_pass, why_not_of
from .masks import call_masking
from .serving import pack_view
from .table_checks import checking, cu_seqlens_faults, raise_faults
from .validate import (
    check_extents,
    check_int32,
    check_like,
    check_qkv,
    check_rows,
    int32_vector,
    softmax_scale_of,
)


def attention_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                              lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                              max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                              softmax_scale: float | None = None, *,
                              mask_align: str = "top_left",
                              window: tuple[int, int] | None = None,
                              softcap: float | None = None, config: TileConfig | None = None,
                              warps_m: tuple[int, ...] | None = None,
                              dlse: Tensor | None = None, check_lengths: bool = True,
                              deterministic: bool | None = None,
                              ) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``attention_varlen``: packed q, dout, out (total_q, heads, head_dim),
    k and v (total_k, heads_kv, head_dim), the forward's natural-log ``lse`` (float32 (heads,
    total_q)), the same int32 offsets, lengths and masks as the forward call. New tensors;
    rows of k that no sequence holds get 0. ``check_lengths``: the offsets are checked on the
    device first (one synchronisation), as the forward does. ``deterministic``: as
    ``attention_backward``'s (None: torch's deterministic mode)."""
    op = "attention_varlen_backward"
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{op}: {name} must be a (total, heads, head_dim) tensor, got "
                             f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}")
    q4, k4, v4 = (pack_view(t) for t in (q, k, v))
    check_qkv(q4, k4, v4)
    if k.dtype != q.dtype:
        raise ValueError(f"{op}: an FP8 KV cache has no backward; k and v must have q's dtype")
    check_like("dout", dout, q)
    check_like("out", out, q)
    heads, total_q = q.shape[1], q.shape[0]
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (heads, total_q):
        raise ValueError(f"{op}: lse must be float32 (heads, total_q) = {(heads, total_q)} as "
                         f"attention_varlen returns it, got {tuple(getattr(lse, 'shape', ()))}")
    lse3 = check_rows("lse", lse.view(1, heads, total_q), q4)
    dlse3 = None if dlse is None else check_rows("dlse", dlse.reshape(1, heads, total_q), q4)
    cu_q = int32_vector(op, "cu_seqlens_q", cu_seqlens_q, q.device)
    cu_k = int32_vector(op, "cu_seqlens_k", cu_seqlens_k, q.device, cu_q.shape[0])
    max_q = check_int32(op, "max_seqlen_q", max_seqlen_q)
    max_k = check_int32(op, "max_seqlen_k", max_seqlen_k)
    if checking(op, check_lengths):
        raise_faults(op, cu_seqlens_faults("cu_seqlens_q", cu_q, total_q, max_q)
                     + cu_seqlens_faults("cu_seqlens_k", cu_k, k.shape[0], max_k))
    masks = call_masking(causal, mask_align, window, softcap)
    scale = softmax_scale_of(softmax_scale, q.shape[2])
    # every row of dq is written (the post kernel covers the packed rows); rows of k that no
    # sequence holds are not, so dk and dv start at 0
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    if cu_q.shape[0] < 2 or 0 in (total_q, k.shape[0], max_q, max_k):
        return dq.zero_(), dk, dv  # no score
    negate = scale < 0
    if negate:  # the kernels take scale >= 0: -q with |scale| has the same logits
        q4, scale = pack_view(torch.neg(q)), -scale
    check_extents(q4, k4, pack_view(dout))
    launch_pass(q4, k4, v4, pack_view(dout), pack_view(out), lse3, dlse3, pack_view(dq),
                pack_view(dk), pack_view(dv), scale, causal, masks, config, warps_m,
                bool(deterministic), Packed(cu_q, cu_k, max_q, max_k))
    if negate:
        dq.neg_()
    return dq, dk, dv


# -- the registered op and the autograd formula --------------------------------------
@torch.library.custom_op("flashcore::attention_varlen_backward", mutates_args=())
def _attention_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                               lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                               softmax_scale: float | None = None, dlse: Tensor | None = None,
                               mask_align: str = "top_left", window: list[int] | None = None,
                               softcap: float | None = None, check_lengths: bool = True,
                               deterministic: bool = False,
                               ) -> tuple[Tensor, Tensor, Tensor]:
    return attention_varlen_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        causal, softmax_scale, mask_align=mask_align,
        window=None if window is None else tuple(window), softcap=softcap, dlse=dlse,
        check_lengths=check_lengths, deterministic=deterministic)


@_attention_varlen_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      causal=False, softmax_scale=None, dlse=None, mask_align="top_left", window=None,
      softcap=None, check_lengths=True, deterministic=False):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def setup_varlen_context(ctx, inputs: tuple, output: tuple) -> None:
    """``torch.ops.flashcore.attention_varlen``'s setup_context: q, k, v, out, lse and the
    offsets, and what the backward needs to know of the call."""
    args = dict(zip(input_names("attention_varlen"), inputs))
    ctx.inputs = len(inputs)
    out, lse = output
    ctx.why_not = why_not_of(args, out, lse)
    for name in ("causal", "softmax_scale", "mask_align", "window", "softcap", "return_lse",
                 "max_seqlen_q", "max_seqlen_k", "check_lengths"):
        setattr(ctx, name, args[name])
    ctx.deterministic = deterministic_asked(args)
    ctx.save_for_backward(args["q"], args["k"], args["v"], out, lse, args["cu_seqlens_q"],
                          args["cu_seqlens_k"])


def varlen_op_backward(ctx, dout: Tensor, dlse: Tensor | None):
    """The gradients of q, k and v of a packed batch (None for every other input)."""
    if ctx.why_not is not None:
        raise RuntimeError(f"flashcore.ops.attention_varlen has no backward for {ctx.why_not} "
                           "yet; run it under torch.no_grad() or detach its inputs")
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashcore.attention_varlen_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.causal,
        ctx.softmax_scale, dlse if ctx.return_lse else None, ctx.mask_align,
        None if ctx.window is None else list(ctx.window), ctx.softcap, ctx.check_lengths,
        ctx.deterministic)
    return (dq, dk, dv) + (None,) * (ctx.inputs - 3)


def register_varlen_backward(op) -> None:
    """Give the registered ``flashcore::attention_varlen`` op its autograd formula."""
    op.register_autograd(varlen_op_backward, setup_context=setup_varlen_context)
