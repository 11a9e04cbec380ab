"""flashcore as an attention implementation of Hugging Face transformers.

    from flashcore.integrations import transformers as fc_transformers
    name = fc_transformers.register()            # "fcore_attention"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=name)

The name must not contain "flash": transformers takes any such name for a FlashAttention
flavour (``is_flash_attention_requested``) and then loads its functions from the
``flash_attn`` package or the Hub, so ``register`` refuses one.

``register`` adds an attention function (``AttentionInterface``) and a mask function
(``AttentionMaskInterface``). Without the latter transformers builds no mask at all for an
unknown name (its padding would be lost); with it, the mask the attention function receives is
one of:

* None: every key valid, causal diagonal bottom-right (prefill, decode with a growing cache);
* a (batch,) int32 count of valid leading keys (a static cache, whose tensor is longer);
* a (batch, L) boolean padding mask (FlashAttention's semantics: padded tokens are dropped);
* a 4-D mask (anything else: packed sequences, extra mask functions, a user's 4-D mask).

The first two run ``attention`` / ``attention_paged`` on the K/V tensors as they are (GQA
without ``repeat_kv``); padding runs ``attention_varlen`` on the unpadded tokens, and a
decode step under padding ``attention_paged`` over the kept keys in place (``padding``). 4-D
masks, dropout, float32 inputs, head dims the kernels lack, padding of more than one query
token under ``torch.compile`` (unpadding reads lengths on the host) and backward passes
flashcore does not have (a static cache's row lengths) go to torch
(``sdpa_fallback``), each counted: ``fallback_count()``, ``fallback_reasons()``. Under
``torch.compile`` a fallback is counted when traced, not per call.

transformers 5.24's continuous batching (``generate_batch``, its paged cache) accepts only
'paged|eager', 'sdpa' and FlashAttention-named implementations (which it loads from flash_attn
or the Hub), so a registered backend cannot serve it.

Sliding windows follow transformers' masks: causal, a window of ``sliding_window`` keys
counting the current one (flashcore ``window=(sliding_window - 1, 0)``); bidirectional, keys at
distance <= ``sliding_window``. ``softcap`` is flashcore's. The plain causal path, a static
cache's and decode under a padding mask trace under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

import torch

from .. import ops
from ..ops.backward import needs_grad, why_no_backward
from ..specs import HEAD_DIMS
from . import padding, sdpa_fallback

DEFAULT_NAME = "fcore_attention"
_BUILTIN = ("eager", "sdpa", "flex_attention", "paged|eager")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class Fallbacks:
    """Calls that ran in torch instead of flashcore's kernels, by reason."""

    reasons: Counter = field(default_factory=Counter)

    def add(self, why: str) -> None:
        if not torch.compiler.is_compiling():
            self.reasons[why] += 1


_FALLBACKS = Fallbacks()


def fallback_count() -> int:
    """How many attention calls ran in torch (eager calls; traces under torch.compile)."""
    return sum(_FALLBACKS.reasons.values())


def fallback_reasons() -> dict[str, int]:
    return dict(_FALLBACKS.reasons)


def reset_fallbacks() -> None:
    _FALLBACKS.reasons.clear()


# -- the mask function ------------------------------------------------------------------------


def _lengths(valid, batch: int, device) -> torch.Tensor:
    if isinstance(valid, torch.Tensor):
        return valid.to(device=device, dtype=torch.int32).reshape(-1).expand(batch).contiguous()
    return torch.full((batch,), int(valid), dtype=torch.int32, device=device)


def attention_mask_function(batch_size: int, q_length: int | None = None,
                            kv_length: int | None = None, q_offset=0, kv_offset: int = 0,
                            mask_function=None, attention_mask: torch.Tensor | None = None,
                            allow_is_causal_skip: bool = True, use_vmap: bool = False,
                            **kwargs):
    """transformers' mask hook (``AttentionMaskInterface``): the compact masks listed in the
    module docstring where the mask is causal (or bidirectional) plus padding; otherwise the
    SDPA backend's 4-D boolean mask. transformers clears ``allow_is_causal_skip`` for packed
    sequences and extra mask functions (``use_vmap``) beyond one query token, which is when the
    pattern is more than that."""
    if attention_mask is not None and attention_mask.dim() == 1:
        return attention_mask  # made here already (generate prepares masks ahead for static caches)
    cache_position = kwargs.get("cache_position")
    if q_length is None and cache_position is not None:  # the older hook's arguments
        q_length, q_offset = cache_position.shape[0], cache_position[0]
    device = kwargs.get("device")
    if device is None:
        device = attention_mask.device if attention_mask is not None else "cpu"
    if use_vmap or not (allow_is_causal_skip or q_length == 1):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                         q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                         attention_mask=attention_mask, allow_is_causal_skip=False,
                         use_vmap=use_vmap, **kwargs)
    if attention_mask is None:
        valid = q_offset + q_length - kv_offset
        if not isinstance(valid, torch.Tensor) and valid == kv_length:
            return None
        return _lengths(valid, batch_size, device)
    pad = attention_mask[:, -kv_length:].to(torch.bool)
    if torch.compiler.is_compiling():
        return pad  # its values cannot be read while tracing
    if bool(pad.all()):
        return None if pad.shape[1] == kv_length else _lengths(pad.shape[1], batch_size, device)
    return pad


# -- the attention function -------------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    """One call's masks as flashcore takes them."""

    causal: bool
    window: tuple[int, int] | None
    softcap: float | None

    def kwargs(self, align: str) -> dict:
        return {"mask_align": align, "window": self.window, "softcap": self.softcap}


def _call(causal: bool, sliding_window, softcap, seqlen_q: int, seqlen_k: int) -> _Call:
    # a window only where it hides a key: the call keeps a kernel without it (and a backward)
    hides = sliding_window is not None and max(seqlen_q, seqlen_k) > sliding_window
    masks = _masks.__wrapped__ if torch.compiler.is_compiling() else _masks  # dynamo: no cache
    return masks(bool(causal), sliding_window if hides else None, softcap)


@functools.lru_cache(maxsize=64)
def _masks(causal: bool, sliding_window, softcap) -> _Call:
    """The _Call of a layer's masks (memoised: every layer of every step asks)."""
    window = None
    if sliding_window is not None:
        window = (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)
    return _Call(causal, window, None if not softcap else float(softcap))


_VARLEN_NAMES = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _varlen_kwargs(kwargs: dict) -> tuple | None:
    if kwargs.get("cu_seq_lens_q") is None:  # the usual call: no packed batch
        return None
    got = tuple(kwargs.get(n) for n in _VARLEN_NAMES)
    return got if all(x is not None for x in got) else None


def _why_torch(query, key, value, mask, dropout: float, call: _Call, packed,
               training: bool) -> str | None:
    """Why this call runs in torch (None: it runs on flashcore's kernels)."""
    if query.dtype not in _KERNEL_DTYPES:
        return f"dtype {query.dtype}"
    if query.shape[-1] not in HEAD_DIMS:
        return f"head_dim {query.shape[-1]}"
    if dropout and training:
        return "dropout"
    # dense calls and packed or padded batches (attention_varlen) have the op's backward
    # (``why_no_backward``); a static cache's row lengths (attention_paged) have none
    if needs_grad(query, key, value) and (
            (mask is not None and mask.dim() == 1) or why_no_backward(query, key) is not None):
        return "backward"
    if packed is not None:
        return None
    if mask is not None and mask.dim() == 4:
        return "4-D mask"
    if (mask is not None and mask.dim() == 2 and torch.compiler.is_compiling()
            and not _reads_kept_keys(query, key, value)):
        return "padding mask under torch.compile"  # unpadding reads lengths on the host
    return None


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask, scaling: float | None = None,
                      dropout: float = 0.0, sliding_window: int | None = None,
                      softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention hook: query (batch, heads, seqlen_q, head_dim), key and value
    (batch, heads_kv, seqlen_k, head_dim) -> ((batch, seqlen_q, heads, head_dim), None)."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("fcore attention: s_aux (attention sinks) is not supported")
    is_causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    call = _call(causal, sliding_window, softcap, query.shape[2], key.shape[2])
    packed = _varlen_kwargs(kwargs)
    why = _why_torch(query, key, value, attention_mask, dropout, call, packed, module.training)
    if why is not None:
        _FALLBACKS.add(why)
        keep = sdpa_fallback.keep_mask(attention_mask, query.shape[2], key.shape[2], call.causal,
                                       call.window, query.device)
        out = sdpa_fallback.attention(query, key, value, keep, scaling, call.softcap, dropout,
                                      module.training)
        return out.transpose(1, 2), None
    if packed is not None:
        return _packed(query, key, value, packed, scaling, call), None
    if attention_mask is None:
        return _dense(query, key, value, scaling, call), None
    if attention_mask.dim() == 1:
        return _prefix(query, key, value, attention_mask, scaling, call), None
    return _unpadded(query, key, value, attention_mask, scaling, call), None


def _dense(query, key, value, scaling, call: _Call) -> torch.Tensor:
    """Every key valid: ``attention``, writing (batch, seqlen_q, heads, head_dim) in place (one
    query token: (batch, heads, 1, head_dim) is that layout already, as a transposed view)."""
    seqlen_q = query.shape[2]
    same = seqlen_q == key.shape[2]
    align = "top_left" if same or not (call.causal or call.window) else "bottom_right"
    if seqlen_q == 1:  # every decode step of every layer: keywords spelled out (no ** unpacking)
        return ops.attention(query, key, value, causal=call.causal, softmax_scale=scaling,
                             mask_align=align, window=call.window,
                             softcap=call.softcap).transpose(1, 2)
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    ops.attention(query, key, value, causal=call.causal, softmax_scale=scaling,
                  out=out.transpose(1, 2), **call.kwargs(align))
    return out


def _prefix(query, key, value, lengths, scaling, call: _Call) -> torch.Tensor:
    """The first lengths[b] keys of row b valid: ``attention_paged`` with each row of the K/V
    tensors as one page (its transposed view is the cache layout; no copy, no sync). The table
    and the lengths are this module's own (``attention_mask_function``): no device check."""
    batch = query.shape[0]
    table = torch.arange(batch, dtype=torch.int32, device=query.device)[:, None]
    out = query.new_empty(batch, query.shape[2], query.shape[1], query.shape[3])
    ops.attention_paged(query, key.transpose(1, 2), value.transpose(1, 2), table, lengths,
                        call.causal, scaling, out=out.transpose(1, 2), check_lengths=False,
                        **call.kwargs("bottom_right"))
    return out


def _packed(query, key, value, packed, scaling, call: _Call) -> torch.Tensor:
    """Sequences packed along one row, with transformers' cu_seq_lens / max_length kwargs."""
    cu_q, cu_k, max_q, max_k = packed
    q, k, v = (t.transpose(1, 2).reshape(-1, *t.shape[1:2], t.shape[3])
               for t in (query, key, value))
    out = ops.attention_varlen(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q),
                               int(max_k), call.causal, scaling, **call.kwargs("bottom_right"))
    return out.view(query.shape[0], query.shape[2], *out.shape[1:])


def _unpadded(query, key, value, pad, scaling, call: _Call) -> torch.Tensor:
    """A padding mask, FlashAttention's way: the valid tokens packed (``attention_varlen``)
    and the result scattered back (padded query rows are 0). Queries are the last seqlen_q
    columns of the mask (left padding). One query token a row reads its kept keys in place
    (``_kept_keys``). The offsets are made once per mask (``padding``), for every layer."""
    batch, heads, seqlen_q, dim = query.shape
    length = pad.shape[1]
    if _reads_kept_keys(query, key, value):
        return _kept_keys(query, key, value, pad, scaling, call)
    key, value = key[:, :, :length], value[:, :, :length]  # a static cache is longer
    un = padding.unpadding(pad, seqlen_q)
    k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim)[un.keys]
            for t in (key, value))
    q = query.transpose(1, 2).reshape(batch * seqlen_q, heads, dim)[un.queries]
    res = ops.attention_varlen(q, k, v, un.cu_queries, un.cu_keys, un.max_queries, un.max_keys,
                               call.causal, scaling, check_lengths=False,
                               **call.kwargs("bottom_right"))
    out = query.new_zeros(batch * seqlen_q, heads, dim)
    out[un.queries] = res
    return out.view(batch, seqlen_q, heads, dim)


def _kept_keys(query, key, value, pad, scaling, call: _Call) -> torch.Tensor:
    """Decode under a padding mask: ``attention_paged`` over K and V as pages of one key, its
    table listing each row's kept keys (``padding.kept_keys``): no copy of the cache and no
    synchronisation. The one query sees every kept key (bottom-right), as the unpadded call
    would; a padded query row gets its row's attention rather than 0 (its output is unused)."""
    batch, heads, _, dim = query.shape
    kept = padding.kept_keys(pad, padding.key_row_step(key))
    out = query.new_empty(batch, 1, heads, dim)
    ops.attention_paged(query, padding.key_pages(key), padding.key_pages(value), kept.table,
                        kept.lengths, call.causal, scaling, out=out.transpose(1, 2),
                        check_lengths=False, **call.kwargs("bottom_right"))
    return out


def _reads_kept_keys(query, key, value) -> bool:
    """Whether a padded call runs as ``_kept_keys``: one query token, K and V laid out alike
    as pages of one key with contiguous rows (the kernels read them in place), no gradient
    (``attention_paged`` has no backward)."""
    return (query.shape[2] == 1 and key.stride() == value.stride() and key.stride(3) == 1
            and padding.key_row_step(key) is not None and not needs_grad(query, key, value))


# -- registration -----------------------------------------------------------------------------


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"register: name must be a non-empty str, got {name!r}")
    try:
        from transformers.utils.generic import is_flash_attention_requested

        flash = is_flash_attention_requested(requested_attention_implementation=name)
    except ImportError:  # older transformers: the same substring rule
        flash = "flash" in name
    if flash:
        raise ValueError(f"register: name {name!r} reads as a FlashAttention flavour to "
                         "transformers, which would load flash_attn or a Hub kernel for it; "
                         "pick a name without 'flash'")
    if name in _BUILTIN or "/" in name or ":" in name or "|" in name:
        raise ValueError(f"register: name {name!r} is a built-in implementation or reads as "
                         "a Hub kernel; pick another")


def register(name: str = DEFAULT_NAME) -> str:
    """Register flashcore's attention and mask functions with transformers under ``name``;
    returns it, for ``attn_implementation=`` or ``model.set_attn_implementation``."""
    _check_name(name)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask_function)
    return name


__all__ = ["DEFAULT_NAME", "Fallbacks", "attention_forward", "attention_mask_function",
           "fallback_count", "fallback_reasons", "register", "reset_fallbacks"]
