"""Launching attention kernels: the loaded kernel of each spec, and one call's launches
(the attention kernel, and for split-KV the combine kernel) with GQA packing and split counts
from ``flashcore.ops.plan``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..compiler.abi import LOG2_E, attention_grid, combine_grid, varlen_grid
from ..runtime import tensor_map
from ..runtime.device import arch_of
from ..runtime.launch import kernel_for, launch
from ..specs import DEFAULT_FAMILY, AttentionSpec, CombineSpec, TileConfig, family
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
_kernels: dict[tuple, Any] = {}  # (device, spec fields) -> LoadedKernel
_TMA_MEMO_SIZE = 64  # TMA arguments kept per kernel (``_tma_args``)


def loaded_kernel(device: int, *fields) -> Any:
    """The loaded attention kernel of ``AttentionSpec(arch, *fields)`` (dtype, head_dim, config,
    causal, return_lse, (precision, k_scale), kv_fp8, split_kv, (mask_align, window, softcap),
    varlen, page_size, packed_tokens) on CUDA device index ``device``, built once (the key is a
    plain tuple: every call looks it up). ``page_size`` > 0 reads a paged cache: the page size
    is compiled in when the family can copy such pages whole, else the kernel gathers any page
    size."""
    key = (device, *fields)
    k = _kernels.get(key)
    if k is None:
        (dtype, head_dim, config, causal, return_lse, operands, kv_fp8, split_kv, masks,
         varlen, page_size, packed_tokens) = fields
        align, window, softcap = masks
        precision, k_scale = operands
        spec = AttentionSpec(
            arch=arch_of(device), dtype=dtype, head_dim=head_dim, config=config, causal=causal,
            return_lse=return_lse, precision=precision, k_scale=k_scale, kv_fp8=kv_fp8,
            split_kv=split_kv, mask_align=align, window=window, softcap=softcap, varlen=varlen,
            paged_kv=page_size > 0, packed_tokens=packed_tokens)
        if page_size and family(spec.family).copies_whole_pages(spec, page_size):
            spec = spec.replace(page_size=page_size)
        k = _kernels[key] = kernel_for(spec, device)
    return k


def combine_kernel(device: int, dtype: str, head_dim: int, return_lse: bool) -> Any:
    key = ("combine", device, dtype, head_dim, return_lse)
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = kernel_for(CombineSpec(arch=arch_of(device), dtype=dtype,
                                                   head_dim=head_dim, return_lse=return_lse),
                                       device)
    return k


def _descale_arg(t: torch.Tensor, paged: bool) -> tuple:
    """(B, H, S) per token with a unit last stride, (B, H) per head, or a paged cache's
    (pages, heads, page_size) per key with any strides (``specs.params.ATTENTION``)."""
    if paged:
        return (t.data_ptr(), *t.shape, *t.stride())
    if t.dim() == 3:
        return rows_arg(t)
    return (t.data_ptr(), *t.shape, t.stride(0))


def _tma_args(kern, qkv_args: tuple, dtype: str, head_dim: int) -> tuple:
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


class Rows(NamedTuple):
    """What one call's query tiles hold as rows: the kernel arguments of q, out and lse (and
    the descales, an FP8 query's packed like it), (heads, rows) of the grid and the GQA group
    packed into rows (``q_group``); ``packed_tokens``: rows that the kernel gathers from q and
    scatters to out and lse as they are; ``final``: the caller's out and lse arguments, which
    a split call's combine writes. A named tuple: one is made every call, and a frozen
    dataclass costs ~1 µs more to build."""

    qkv_args: tuple
    out_arg: tuple
    lse_arg: tuple | None
    descales: tuple
    heads: int
    rows: int
    final: tuple
    q_group: int = 1
    packed_tokens: bool = False


def _rows_of(q, k, out, lse, qkv_args, descales, config, causal, precision, mask, serving,
             device) -> Rows:
    """A call's rows: a K/V head's (token, head) pairs of a few tokens, which the kernel
    gathers (``plan.packs_tokens``), the query heads of one token as views' arguments
    (``plan.packs_heads``), or each head's tokens as they are. Arguments, not views: an eager
    decode call is host-bound, and a view costs more than its arguments."""
    _, H, Sq, _ = q.shape
    Hkv = k.shape[1]
    out_arg = tensor_arg(out)
    lse_arg = None if lse is None else rows_arg(lse)
    final = (out_arg, lse_arg)
    if serving.varlen or Sq > plan.DECODE_MAX_Q:  # neither packing: prefill keeps its rows
        return Rows(qkv_args, out_arg, lse_arg, descales, H, Sq, final)
    if (precision != "fp8"
            and plan.packs_tokens(Sq, H, Hkv, config.tile_m, config.tile_n,
                                  causal and not mask.shifted)
            and _family_of(config, device).packs_tokens):
        return Rows(qkv_args, out_arg, lse_arg, descales, Hkv, Sq * (H // Hkv), final,
                    H // Hkv, True)
    if plan.packs_heads(Sq, H, Hkv):
        if precision == "fp8":  # the query descales are packed like the queries
            descales = (plan.packed(descales[0], Hkv), *descales[1:])
        return Rows((plan.packed_arg(qkv_args[0], Hkv), *qkv_args[1:]),
                    plan.packed_arg(out_arg, Hkv),
                    None if lse_arg is None else plan.packed_arg(lse_arg, Hkv), descales, Hkv,
                    H // Hkv, final, H // Hkv)
    return Rows(qkv_args, out_arg, lse_arg, descales, H, Sq, final)


def launch_attention(q, k, out, lse, qkv_args: tuple, descales: tuple, config: TileConfig,
                     causal: bool, softmax_scale: float, num_splits: int | None, *,
                     kv_fp8: bool = False, precision: str = "fp16",
                     mask: Masking = NO_MASK, serving: Serving = DENSE) -> None:
    """Plan and launch one attention (and, split over CTAs, its combine) into ``out``/``lse``.

    ``qkv_args``: the kernel arguments of q, k and v (Vᵀ for fp8 operands); ``descales``: the
    float32 descale tensors the spec takes, in ABI order ((B, H, S) per token, (B, H) per
    head, (pages, heads, page_size) per key of a paged cache). ``q``, ``k``, ``out`` and ``lse`` are the 4-d (3-d) views the kernel reads: a packed
    batch as batch 1, a paged cache as (pages, heads, page_size, head_dim)."""
    B, H, Sq, D = q.shape
    Sk = serving.max_seqlen_k if serving.paged else k.shape[2]
    dev = q.get_device()
    tokens = Sq  # the query length that makes a call decode (packing turns heads into rows)
    tiles = _rows_of(q, k, out, lse, qkv_args, descales, config, causal, precision, mask,
                     serving, dev)
    qkv_args, out_arg, lse_arg = tiles.qkv_args, tiles.out_arg, tiles.lse_arg
    descales, H, Sq, q_group = tiles.descales, tiles.heads, tiles.rows, tiles.q_group
    if serving.varlen:  # a packed batch: one CTA per (head, query tile) of each sequence
        num_splits = 1
    descale_args = tuple(_descale_arg(t, serving.paged) for t in descales) if descales else ()
    # FP8 operands: K's descales per token (B, H, S) or per head (B, H)
    operands = (precision, "head" if precision == "fp8" and descales[1].dim() == 2 else "token")
    dtype = DTYPE_NAMES[out.dtype]
    fam = _family_of(config, dev)
    splits = num_splits
    if splits is None:
        splits = 1
        if tokens <= plan.DECODE_MAX_Q and fam.splits_keys:
            splits = plan.num_splits(attention_grid(Sq, H, B, config.tile_m)[0],
                                     -(-Sk // config.tile_n), plan.sm_count(dev), kv_fp8,
                                     config.kv_splits, config.tile_m, D)
    # a family that splits no keys takes no key shares (``flashcore.specs.params.ATTENTION``)
    scalars = ((softmax_scale * LOG2_E,), (q_group,)) + (((splits,),) if fam.splits_keys else ())
    if mask is not NO_MASK:
        scalars += mask.scalars(softmax_scale)
    scalars += serving.tables
    masks = mask.spec_fields
    if splits == 1:
        kern = loaded_kernel(dev, dtype, D, config, causal, lse is not None, operands, kv_fp8,
                             False, masks, serving.varlen, serving.page_size, tiles.packed_tokens)
        lse_args = () if lse_arg is None else (lse_arg,)
        grid = (varlen_grid(serving.max_seqlen_q, H, serving.batch, config.tile_m)
                if serving.varlen else attention_grid(Sq, H, B, config.tile_m))
        if fam.loads_by_tma:  # the operands as TMA descriptors
            qkv_args = _tma_args(kern, qkv_args, dtype, D)
        launch(kern, grid, (*qkv_args, out_arg, *lse_args, *descale_args, *scalars), dev)
    else:
        # split-KV across CTAs: fp32 partials of each share, then the combine kernel; one
        # allocation holds the outputs and, after them, the LSEs (an eager decode call pays
        # ~3 us a torch.empty): (splits * B, H, Sq, D) and (splits * B, H, Sq), contiguous
        rows = splits * B * H * Sq
        work = torch.empty(rows * (D + 1), dtype=torch.float32, device=q.device)
        ptr = work.data_ptr()
        o_part = (ptr, splits * B, H, Sq, H * Sq * D, Sq * D, D)
        lse_part = (ptr + 4 * rows * D, splits * B, H, Sq, H * Sq, Sq)
        kern = loaded_kernel(dev, dtype, D, config, causal, False, operands, kv_fp8, True,
                             masks, False, serving.page_size, tiles.packed_tokens)
        launch(kern, attention_grid(Sq, H, B, config.tile_m, splits),
               (*qkv_args, o_part, lse_part, *descale_args, *scalars), dev)
        # the combine writes the caller's (B, Hq, S_q) rows, unpacking q_group heads a token
        comb = combine_kernel(dev, dtype, D, lse is not None)
        final_out, final_lse = tiles.final
        lse_args = () if final_lse is None else (final_lse,)
        launch(comb, combine_grid(tokens, out.shape[1], B),
               (o_part, lse_part, final_out, *lse_args, (q_group,), (splits,)), dev)
