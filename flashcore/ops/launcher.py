"""Launching attention kernels: the loaded kernel of each spec; a call's plan (its kernels,
grids, GQA packing and split count, from ``flashcore.ops.plan``), worked out once per distinct
call; and the launches that bind a call's tensors to its plan (the attention kernel, and for
split-KV in a CUDA graph the combine kernel; an eager call's split kernel merges its shares
itself)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch

from ..compiler.abi import LOG2_E, attention_grid, combine_grid, varlen_grid
from ..runtime import tensor_map
from ..runtime.device import arch_of
from ..runtime.launch import kernel_for, launch
from ..runtime.scratch import scratch
from ..specs import DEFAULT_FAMILY, AttentionSpec, CombineSpec, SpecError, TileConfig, family
from . import plan
from .inputs import DTYPE_NAMES, rows_arg, tensor_arg
from .masks import NO_MASK, Masking


@dataclass(frozen=True)
class Serving:
    """A serving layout's part of one launch (``flashcore.ops.serving``): a packed batch
    (``varlen``) and/or a paged K/V cache (``page_size`` keys a page; 0: not paged), the int32
    tables' kernel arguments in ABI order, the batch size and the longest query and key
    sequences (the grid, the split plan)."""

    varlen: bool
    page_size: int
    tables: tuple
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def paged(self) -> bool:
        return self.page_size > 0


DENSE = Serving(False, 0, (), 0, 0, 0)
_TMA_MEMO_SIZE = 64  # TMA arguments kept per kernel (``tma_args``)


class KernelKey(NamedTuple):
    """What picks a call's attention kernel besides its device's arch (``loaded_kernel``):
    the ``AttentionSpec`` fields a plan decides, by name. ``masks``: (mask_align, window,
    softcap, alibi) as the spec holds them; ``page_size`` > 0 reads a paged cache."""

    dtype: str
    head_dim: int
    config: TileConfig
    causal: bool
    return_lse: bool
    precision: str
    k_scale: str
    kv_fp8: bool
    split_kv: bool
    merge_shares: bool
    masks: tuple
    varlen: bool
    page_size: int
    packed_tokens: bool


def loaded_kernel(device: int, key: KernelKey) -> Any:
    """The loaded attention kernel of ``key`` on CUDA device index ``device`` (from the
    runtime's one registry, ``runtime.launch.kernel_for``)."""
    return kernel_for(attention_spec(arch_of(device), key), device)


def attention_spec(arch: str, key: KernelKey) -> AttentionSpec:
    """The ``AttentionSpec`` of ``key`` on ``arch``. A paged cache's page size is compiled in
    when the family can copy such pages whole (the Hopper family's only way), else the kernel
    gathers any page size."""
    align, window, softcap, alibi = key.masks
    spec_of = partial(
        AttentionSpec, arch=arch, dtype=key.dtype, head_dim=key.head_dim,
        config=key.config, causal=key.causal, return_lse=key.return_lse, precision=key.precision,
        k_scale=key.k_scale, kv_fp8=key.kv_fp8, split_kv=key.split_kv,
        merge_shares=key.merge_shares, mask_align=align,
        window=window, softcap=softcap, alibi=alibi, varlen=key.varlen,
        paged_kv=key.page_size > 0, packed_tokens=key.packed_tokens)
    if key.page_size:
        try:
            return spec_of(page_size=key.page_size)
        except SpecError:  # pages this family does not copy whole: it gathers them
            pass
    return spec_of()


def combine_kernel(device: int, dtype: str, head_dim: int, return_lse: bool) -> Any:
    return kernel_for(CombineSpec(arch=arch_of(device), dtype=dtype, head_dim=head_dim,
                                  return_lse=return_lse), device)


def _descale_arg(t: torch.Tensor, paged: bool) -> tuple:
    """(B, H, S) per token with a unit last stride, (B, H) per head, or a paged cache's
    (pages, heads, page_size) per key with any strides (``specs.params.ATTENTION``)."""
    if paged:
        return (t.data_ptr(), *t.shape, *t.stride())
    if t.dim() == 3:
        return rows_arg(t)
    return (t.data_ptr(), *t.shape, t.stride(0))


def tma_args(kern, qkv_args: tuple, dtype: str, head_dim: int) -> tuple:
    """A TMA kernel's Q, K, V arguments: each tensor's descriptor, then its (seq, heads, batch)
    (``specs.families.WgmmaWs``). FP8 Vᵀ's ``transposed_arg`` (its keys in the seq
    slot, the head_dim stride in the seq stride's) is described as head_dim rows of keys.
    Memoised on the kernel per (arguments, dtype): a descriptor depends on nothing else, and an
    eager loop that reuses its buffers then pays one look-up a call, not three."""
    key = (qkv_args, dtype)
    out = kern.tma_args_memo.get(key)
    if out is not None:
        return out
    out = ()
    for p, arg in zip(kern.tensor_maps, qkv_args):
        ptr, b, h, s = arg[:4]
        rows, inner = (((ptr, b, h, head_dim, *arg[4:]), s) if p.transposed else (arg, head_dim))
        desc = tensor_map.encode(rows, p.dtype or dtype, inner, p.box_rows, p.box_cols,
                                 p.swizzle)
        out += ((desc,), (s, h, b))
    if len(kern.tma_args_memo) >= _TMA_MEMO_SIZE:  # buffers vary without bound in some programs
        kern.tma_args_memo.clear()
    kern.tma_args_memo[key] = out
    return out


_families: dict[tuple, Any] = {}  # (family, device) -> KernelFamily


def _family_of(config: TileConfig, device: int) -> Any:
    """The config's kernel family (what it builds: split keys, packed tokens), memoised: an
    eager decode call is host-bound."""
    key = (config.family, device)
    f = _families.get(key)
    if f is None:
        f = _families[key] = family(config.family or DEFAULT_FAMILY.get(arch_of(device), ""))
    return f


# how a call's query rows reach the kernel: as they are; a K/V head's (token, head) pairs that
# the kernel gathers (``plan.packs_tokens``); the query heads of one token as views' arguments
# (``plan.packs_heads``)
AS_IS, TOKENS, HEADS = 0, 1, 2


class Plan(NamedTuple):
    """What one call's shapes, config and masks decide (``plan_launch``): the loaded kernels,
    their grids, how the query rows are packed, and the scalar arguments in ABI order (the
    serving tables follow them). Memoised per distinct call, so that ``launch_plan`` only binds
    a call's tensors; a named tuple, as a frozen dataclass costs more to build and read."""

    device: int
    kern: Any
    grid: tuple
    packing: int  # AS_IS, TOKENS or HEADS
    heads_kv: int
    pack_q_descales: bool  # FP8 operands packed by heads: the query descales too
    scalars: tuple
    tma: bool  # the operands as TMA descriptors (``tma_args``) of this dtype and head dim
    dtype: str
    head_dim: int
    combine: Any = None  # split over CTAs: the combine kernel, its grid and scalars, and the
    combine_grid: tuple = ()  # fp32 partials' (splits * batch, heads, rows, head_dim)
    combine_scalars: tuple = ()
    partials: tuple = ()
    merged: bool = False  # split over CTAs, the last share's CTA merging (no combine kernel)


_plans: dict[tuple, Plan] = {}
_PLAN_MEMO_SIZE = 1024  # distinct calls kept (shapes vary without bound in some programs)


def plan_launch(device: int, batch: int, heads: int, seqlen_q: int, head_dim: int,
                heads_kv: int, key_blocks: int, out_dtype: torch.dtype, config: TileConfig,
                causal: bool, return_lse: bool, precision: str, k_per_head: bool,
                kv_fp8: bool, mask: Masking, varlen: bool, page_size: int, seqs: int,
                max_seqlen_q: int, num_splits: int | None, softmax_scale: float,
                host_bound: bool = False) -> Plan:
    """The plan of a call of these extents (``key_blocks``: key blocks of ``config.tile_n``,
    all a split count depends on; ``seqs``, ``max_seqlen_q``: a packed batch's grid;
    ``host_bound``: an eager call, not one a CUDA graph captures: ``plan.num_splits``)."""
    fam = _family_of(config, device)
    packing, rows_heads, rows, q_group = AS_IS, heads, seqlen_q, 1
    # prefill keeps its rows; so does ALiBi, whose slope is one per (batch, head) a CTA
    if not varlen and seqlen_q <= plan.DECODE_MAX_Q and not mask.alibi:
        if (precision != "fp8"
                and plan.packs_tokens(seqlen_q, heads, heads_kv, config.tile_m, config.tile_n,
                                      causal and not mask.shifted)
                and fam.packs_tokens):
            q_group = heads // heads_kv
            packing, rows_heads, rows = TOKENS, heads_kv, seqlen_q * q_group
        elif plan.packs_heads(seqlen_q, heads, heads_kv):
            q_group = heads // heads_kv
            packing, rows_heads, rows = HEADS, heads_kv, q_group
    splits = 1 if varlen else num_splits  # a packed batch: a CTA per (head, query tile) of each
    ctas = attention_grid(rows, rows_heads, batch, config.tile_m)[0]
    if splits is None:
        splits = 1
        if seqlen_q <= plan.DECODE_MAX_Q and fam.splits_keys:
            splits = plan.num_splits(ctas, key_blocks, plan.sm_count(device), kv_fp8,
                                     config.kv_splits, config.tile_m, head_dim, host_bound)
    # a family that splits no keys takes no key shares (``flashcore.specs.params.ATTENTION``)
    scalars = ((softmax_scale * LOG2_E,), (q_group,)) + (((splits,),) if fam.splits_keys else ())
    if mask is not NO_MASK:
        scalars += mask.scalars(softmax_scale)
    dtype = DTYPE_NAMES[out_dtype]
    key = KernelKey(dtype=dtype, head_dim=head_dim, config=config, causal=causal,
                    return_lse=return_lse, precision=precision,
                    k_scale="head" if k_per_head else "token", kv_fp8=kv_fp8, split_kv=False,
                    merge_shares=False, masks=mask.spec_fields, varlen=varlen, page_size=page_size,
                    packed_tokens=packing == TOKENS)
    common = {"device": device, "packing": packing, "heads_kv": heads_kv,
              "pack_q_descales": precision == "fp8", "scalars": scalars, "dtype": dtype,
              "head_dim": head_dim}
    if splits == 1:
        kern = loaded_kernel(device, key)
        grid = (varlen_grid(max_seqlen_q, rows_heads, seqs, config.tile_m) if varlen
                else attention_grid(rows, rows_heads, batch, config.tile_m))
        return Plan(kern=kern, grid=grid, tma=fam.loads_by_tma, **common)
    # split-KV across CTAs: fp32 partials of each share, merged into the caller's (B, Hq, S_q)
    # rows (q_group heads a token unpacked) by the last share's CTA of each query tile where
    # the host's work is what a call costs (a short eager call: ``plan.merges_shares``), else
    # by the combine kernel (a graph replays two launches for the price of one)
    grid = attention_grid(rows, rows_heads, batch, config.tile_m, splits)
    partials = (splits * batch, rows_heads, rows, head_dim)
    if host_bound and plan.merges_shares(splits, ctas, key_blocks, plan.sm_count(device),
                                         config.tile_m, head_dim):
        kern = loaded_kernel(device, key._replace(split_kv=True, merge_shares=True))
        return Plan(kern=kern, grid=grid, tma=False, partials=partials, merged=True, **common)
    kern = loaded_kernel(device, key._replace(return_lse=False, split_kv=True, varlen=False))
    return Plan(kern=kern, grid=grid, tma=False,
                combine=combine_kernel(device, dtype, head_dim, return_lse),
                combine_grid=combine_grid(seqlen_q, heads, batch),
                combine_scalars=((q_group,), (splits,)), partials=partials, **common)


def launch_plan(p: Plan, out, lse, qkv_args: tuple, descales: tuple,
                serving: Serving = DENSE, bias: tuple = ()) -> None:
    """Launch a planned call: bind its tensors' arguments (packed as planned) and launch
    (``bias``: ALiBi's slopes argument, where the spec takes one)."""
    out_arg = tensor_arg(out)
    lse_arg = None if lse is None else rows_arg(lse)
    final = (out_arg, lse_arg)
    if p.packing == HEADS:  # arguments, not views: a view costs more than its arguments
        hkv = p.heads_kv
        qkv_args = (plan.packed_arg(qkv_args[0], hkv), *qkv_args[1:])
        out_arg = plan.packed_arg(out_arg, hkv)
        lse_arg = None if lse_arg is None else plan.packed_arg(lse_arg, hkv)
        if p.pack_q_descales:
            descales = (plan.packed(descales[0], hkv), *descales[1:])
    descale_args = tuple(_descale_arg(t, serving.paged) for t in descales) if descales else ()
    tail = p.scalars + bias + serving.tables
    if not p.partials:
        if p.tma:
            qkv_args = tma_args(p.kern, qkv_args, p.dtype, p.head_dim)
        lse_args = () if lse_arg is None else (lse_arg,)
        launch(p.kern, p.grid, (*qkv_args, out_arg, *lse_args, *descale_args, *tail), p.device)
        return
    # one buffer holds the partial outputs and, after them, their LSEs: (n, H, S, D) and
    # (n, H, S), contiguous; reused call after call (an eager decode call is host-bound)
    n, h, r, d = p.partials
    rows = n * h * r
    final_out, final_lse = final
    lse_args = () if final_lse is None else (final_lse,)
    if p.merged:
        work, arrivals = scratch(out, rows * (d + 1), p.grid[0])  # held until the launch
    else:
        work = scratch(out, rows * (d + 1))  # held until both launches are queued
    ptr = work.data_ptr()
    o_part = (ptr, n, h, r, h * r * d, r * d, d)
    lse_part = (ptr + 4 * rows * d, n, h, r, h * r, r)
    if p.merged:
        launch(p.kern, p.grid, (*qkv_args, o_part, lse_part, *descale_args, *tail, final_out,
                                *lse_args, (arrivals.data_ptr(), arrivals.shape[0])), p.device)
        return
    launch(p.kern, p.grid, (*qkv_args, o_part, lse_part, *descale_args, *tail), p.device)
    launch(p.combine, p.combine_grid,
           (o_part, lse_part, final_out, *lse_args, *p.combine_scalars), p.device)


def forget() -> None:
    """Drop the plans (the next calls plan again; the runtime keeps the kernels loaded)."""
    _plans.clear()
    _families.clear()


def planned(key: tuple, args: tuple, key_blocks: int | None = None) -> Plan:
    """The memoised plan of ``key``, else ``plan_launch(*args)`` remembered under it (with
    ``key_blocks`` in its place in ``args`` where given)."""
    p = _plans.get(key)
    if p is None:
        if key_blocks is not None:
            args = (*args[:6], key_blocks, *args[7:])
        p = plan_launch(*args)
        if len(_plans) >= _PLAN_MEMO_SIZE:
            _plans.clear()
        _plans[key] = p
    return p


def launch_attention(q, k, out, lse, qkv_args: tuple, descales: tuple, config: TileConfig,
                     causal: bool, softmax_scale: float, num_splits: int | None, *,
                     kv_fp8: bool = False, precision: str = "fp16",
                     mask: Masking = NO_MASK, serving: Serving = DENSE,
                     bias: tuple = ()) -> None:
    """Plan (memoised per distinct call) and launch one attention (and, split over CTAs, its
    combine) into ``out``/``lse``.

    ``qkv_args``: the kernel arguments of q, k and v (Vᵀ for fp8 operands); ``descales``: the
    float32 descale tensors the spec takes, in ABI order ((B, H, S) per token, (B, H) per
    head, (pages, heads, page_size) per key of a paged cache). ``q``, ``k``, ``out`` and
    ``lse`` are the 4-d (3-d) views the kernel reads: a packed batch as batch 1, a paged cache
    as (pages, heads, page_size, head_dim)."""
    B, H, Sq, D = q.shape
    Sk = serving.max_seqlen_k if serving.paged else k.shape[2]
    key = (q.get_device(), B, H, Sq, D, k.shape[1], -(-Sk // config.tile_n), out.dtype, config,
           causal, lse is not None, precision,
           precision == "fp8" and descales[1].dim() == 2,  # FP8 K descaled per head (B, H)
           kv_fp8, mask, serving.varlen, serving.page_size, serving.batch, serving.max_seqlen_q,
           num_splits, softmax_scale, not plan.capturing())
    launch_plan(planned(key, key), out, lse, qkv_args, descales, serving, bias)
