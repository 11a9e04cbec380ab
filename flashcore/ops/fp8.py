"""FP8 (E4M3) attention: quantise with data-derived scales, then an e4m3 kernel (the arch's
family: ``mma_sync`` on Ada, mostly the warp-specialised ``wgmma_ws`` on Hopper).

``quantize_fp8`` scales by 448 / amax, so no finite input saturates however large it is: Q and K
per token (an outlier token costs precision only to itself), V per (batch, head). ``attention_fp8``
takes tensors in the form it returns (the form a serving engine keeps its KV cache in): Q and K as
(batch, heads, seq, head_dim) e4m3 with float32 (batch, heads, seq) descales (K's may be one per
(batch, head), ``quantize_fp8(k)``: the kernel then folds it into each row's exp2 scale, and no
score is multiplied by its key's descale: faster on Hopper), V transposed to
(batch, heads, head_dim, seq_k padded to a multiple of 128) with keys permuted within each group of
32 (``key_permutation``) and a float32 (batch, heads) descale.

Speed: on Ada (sm_89) the e4m3 MMAs are native (twice the fp16 rate). Hopper (sm_90) has FP8 only
in wgmma: the warp-specialised family (``wgmma_ws``) multiplies e4m3 there (SASS QGMMA) and is the
tuned default for most buckets; ptxas lowers the mma_sync family's e4m3 ``mma.sync`` to f16 MMAs
plus unpacks, correct but slower than fp16 (a warning says so when such a kernel is first used).
"""

from __future__ import annotations

import torch

from ..specs import TileConfig
from .eager import run_fp8
from .inputs import E4M3
from .library import attention_fp8_op, quantize_fp8_op
from .quantize import VT_PAD, key_permutation, padded_keys, run_quantize

__all__ = ["E4M3", "VT_PAD", "attention_fp8", "key_permutation", "padded_keys", "quantize_fp8",
           "quantize_paged_cache"]


def _tracing(t) -> bool:
    return type(t) is not torch.Tensor or torch.compiler.is_compiling()


def quantize_fp8(
    x: torch.Tensor, *, transpose: bool = False, granularity: str = "head",
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, descale) with x ≈ x8.float() * descale, the descale per (batch, head) (shape (B, H))
    or per token (``granularity="token"``, shape (B, H, S)).

    x is (batch, heads, seq, head_dim) float16/bfloat16 on CUDA. With ``transpose`` x8 is Vᵀ in
    the FP8 attention kernel's layout (see module docstring). An inf or NaN in x would make its
    whole scale group quantise to NaN, so ``check_finite`` (the default) refuses one with a
    ValueError, at the cost of one read of x and one synchronisation; ``check_finite=False``
    skips that for inputs known to be finite, and inside a CUDA graph capture it is skipped.
    """
    if _tracing(x):
        return quantize_fp8_op(x, transpose=transpose, granularity=granularity,
                               check_finite=check_finite)
    return run_quantize(x, transpose=transpose, granularity=granularity,
                        check_finite=check_finite)


def quantize_paged_cache(cache: torch.Tensor, *, check_finite: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache8, descale): an e4m3 paged KV cache and its float32 per-key descales, shaped
    (pages, page_size, heads_kv, head_dim) and (pages, page_size, heads_kv), for
    ``flashcore.ops.attention_paged``'s ``k_descale``/``v_descale``. Per key and head, like
    ``quantize_fp8(granularity="token")`` (448 / amax of each row: no overflow for any finite
    input; ``check_finite`` as there). Both are permuted views of the (pages, heads_kv,
    page_size) tensors the quantiser writes; the kernel reads them as they are."""
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
        raise ValueError("quantize_paged_cache: cache must be a 4-d (pages, page_size, heads_kv,"
                         f" head_dim) tensor, got {getattr(cache, 'shape', cache)!r}")
    x8, descale = quantize_fp8(cache.permute(0, 2, 1, 3), granularity="token",
                               check_finite=check_finite)
    return x8.permute(0, 2, 1, 3), descale.permute(0, 2, 1)


def attention_fp8(
    q8: torch.Tensor,
    k8: torch.Tensor,
    vt8: torch.Tensor,
    q_descale: torch.Tensor,
    k_descale: torch.Tensor,
    v_descale: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    out_dtype: torch.dtype = torch.float16,
    config: TileConfig | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
):
    """Attention on already-quantised tensors (see module docstring for their layout). K/V may
    have fewer heads than Q (grouped-query attention)."""
    kw = {"causal": causal, "softmax_scale": softmax_scale, "return_lse": return_lse,
          "out_dtype": out_dtype, "config": config, "num_splits": num_splits, "out": out}
    if _tracing(q8):
        return attention_fp8_op(q8, k8, vt8, q_descale, k_descale, v_descale, **kw)
    return run_fp8(q8, k8, vt8, q_descale, k_descale, v_descale, **kw)
