"""FP8 (E4M3) attention: quantise with data-derived scales, then the e4m3 mma.sync kernel.

``quantize_fp8`` scales by 448 / amax, so no finite input saturates however large it is: Q and K
per token (an outlier token costs precision only to itself), V per (batch, head). ``attention_fp8``
takes tensors in the form it returns (the form a serving engine keeps its KV cache in): Q and K as
(batch, heads, seq, head_dim) e4m3 with float32 (batch, heads, seq) descales, V transposed to
(batch, heads, head_dim, seq_k padded to a multiple of 128) with keys permuted within each group of
32 (``key_permutation``) and a float32 (batch, heads) descale.

Speed: on Ada (sm_89) the e4m3 MMAs are native (twice the fp16 rate). Hopper (sm_90) has FP8 only
in wgmma: ptxas lowers e4m3 ``mma.sync`` to f16 MMAs plus unpacks, so there this path is correct
but slower than fp16 (a warning says so when such a kernel is first loaded).
"""

from __future__ import annotations

import math
import warnings

import torch

from ..build.abi import LOG2_E, attention_grid
from ..runtime.device import arch_of
from ..runtime.launch import kernel_for, launch
from ..spec import HEAD_DIMS, AttentionSpec, QuantizeSpec, TileConfig
from ..tuning.table import bucket_of, lookup
from .inputs import DTYPE_NAMES, E4M3, prepared, tensor_arg, transposed_arg

VT_PAD = 128  # Vᵀ's key extent is padded to this (the largest tile_n): its tiles are never ragged
_kernels: dict[tuple, object] = {}  # call-site key -> loaded kernel (no spec work per call)


def key_permutation() -> list[int]:
    """perm[p] = the key stored at position p of each group of 32 in Vᵀ."""
    perm = []
    for p in range(32):
        half, q = divmod(p, 16)
        t, i = divmod(q, 4)
        perm.append(16 * half + 8 * (i // 2) + 2 * t + i % 2)
    return perm


def padded_keys(seqlen_k: int) -> int:
    return -(-seqlen_k // VT_PAD) * VT_PAD


def quantize_fp8(
    x: torch.Tensor, *, transpose: bool = False, granularity: str = "head"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, descale) with x ≈ x8.float() * descale, the descale per (batch, head) (shape (B, H))
    or per token (``granularity="token"``, shape (B, H, S)).

    x is (batch, heads, seq, head_dim) float16/bfloat16 on CUDA, every element finite. With
    ``transpose`` x8 is Vᵀ in the FP8 attention kernel's layout (see module docstring).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"quantize_fp8: x must be a 4-d tensor, got {getattr(x, 'shape', x)!r}")
    if x.dtype not in DTYPE_NAMES:
        raise TypeError(f"quantize_fp8: x has dtype {x.dtype}; expected float16 or bfloat16")
    if x.device.type != "cuda":
        raise ValueError(f"quantize_fp8: x is on {x.device}; expected a CUDA tensor")
    B, H, S, D = x.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"quantize_fp8: head_dim {D} is not supported; supported are {HEAD_DIMS}")
    if x.numel() == 0:
        raise ValueError(f"quantize_fp8: x is empty (shape {tuple(x.shape)})")
    x, x_arg = prepared(x)
    key = ("quant", x.device.index, x.dtype, D, transpose, granularity)
    kern = _kernels.get(key)
    if kern is None:  # building and validating a spec costs more than the launch
        spec = QuantizeSpec(arch=arch_of(x.get_device()), dtype=DTYPE_NAMES[x.dtype], head_dim=D,
                            transpose=transpose, granularity=granularity)
        kern = _kernels[key] = kernel_for(spec, x.get_device())
    if transpose:
        # the kernel writes every padded key (zeros past S: P is 0 there and V must be finite),
        # a CTA per 32 * threads / D keys, with the amax of each (batch, head) given: one
        # reduction here, so the cast is not one CTA per head
        out = torch.empty((B, H, D, padded_keys(S)), dtype=E4M3, device=x.device)
        amax = torch.linalg.vector_norm(x, ord=math.inf, dim=(2, 3), dtype=torch.float32)
        descale = torch.empty((B, H), dtype=torch.float32, device=x.device)
        args = (x_arg, transposed_arg(out), (amax.data_ptr(), B, H, H),
                (descale.data_ptr(), B, H, H))
        keys_per_cta = 32 * (kern.artifact.spec.threads // D)
        launch(kern, (-(-padded_keys(S) // keys_per_cta), H, B), args, x.get_device())
        return out, descale
    out = torch.empty((B, H, S, D), dtype=E4M3, device=x.device)
    out_arg = tensor_arg(out)
    if granularity == "token":
        descale = torch.empty((B, H, S), dtype=torch.float32, device=x.device)
        args = (x_arg, out_arg, (descale.data_ptr(), B, H, S, H * S, S))
        rows = kern.artifact.spec.threads // (D // 8)
        launch(kern, (-(-S // rows), H, B), args, x.get_device())
    else:
        descale = torch.empty((B, H), dtype=torch.float32, device=x.device)
        args = (x_arg, out_arg, (descale.data_ptr(), B, H, H))
        launch(kern, (H, B, 1), args, x.get_device())
    return out, descale


def _check_fp8(name: str, t: torch.Tensor, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != E4M3:
        raise TypeError(f"attention_fp8: {name} must be a float8_e4m3fn tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != shape:
        raise ValueError(f"attention_fp8: {name} has shape {tuple(t.shape)}, expected {shape}")
    st = t.stride()
    if st[3] != 1 or t.data_ptr() % 16 or any(s % 16 for s in st[:3]):
        raise ValueError(f"attention_fp8: {name} needs a contiguous last dim and 16-byte aligned "
                         f"base and strides; got strides {st}")


def _check_descale(name: str, t: torch.Tensor, shape: tuple, device) -> torch.Tensor:
    if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32
            or tuple(t.shape) != shape or t.device != device):
        raise ValueError(f"attention_fp8: {name} must be float32 of shape {shape} on {device}, "
                         f"got {getattr(t, 'dtype', None)} {tuple(getattr(t, 'shape', ()))}")
    return t.contiguous()


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
    out: torch.Tensor | None = None,
):
    """Attention on already-quantised tensors (see module docstring for their layout)."""
    if q8.dim() != 4 or k8.dim() != 4:
        raise ValueError("attention_fp8: q8 and k8 must be (batch, heads, seq, head_dim)")
    B, H, Sq, D = q8.shape
    Sk = k8.shape[2]
    _check_fp8("q8", q8, (B, H, Sq, D))
    _check_fp8("k8", k8, (B, H, Sk, D))
    _check_fp8("vt8", vt8, (B, H, D, padded_keys(Sk)))
    if not (q8.device == k8.device == vt8.device) or q8.device.type != "cuda":
        raise ValueError("attention_fp8: q8, k8 and vt8 must be on one CUDA device")
    if D not in HEAD_DIMS or min(B, H, Sq, Sk) == 0:
        raise ValueError(f"attention_fp8: unsupported or empty shape {tuple(q8.shape)}")
    if out_dtype not in DTYPE_NAMES:
        raise TypeError(f"attention_fp8: out_dtype must be float16 or bfloat16, got {out_dtype}")
    qd = _check_descale("q_descale", q_descale, (B, H, Sq), q8.device)
    kd = _check_descale("k_descale", k_descale, (B, H, Sk), q8.device)
    vd = _check_descale("v_descale", v_descale, (B, H), q8.device)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)
    device = q8.get_device()
    if config is None:
        config = lookup(arch_of(device), D, causal, bucket_of(Sq), "fp8")
    key = ("attn", device, out_dtype, D, config, causal, return_lse)
    kern = _kernels.get(key)
    if kern is None:
        spec = AttentionSpec(
            arch=arch_of(device), dtype=DTYPE_NAMES[out_dtype], head_dim=D, config=config,
            causal=causal, return_lse=return_lse, precision="fp8",
        )
        kern = _kernels[key] = kernel_for(spec, device)
        if spec.arch == "sm_90":
            warnings.warn(
                "flashcore FP8 on sm_90: Hopper has no e4m3 mma.sync (ptxas emulates it with f16 "
                "MMAs), so this path is slower than precision='fp16' there; it is fast on sm_89",
                RuntimeWarning,
                stacklevel=3,
            )
    spec = kern.artifact.spec
    if out is None:
        out = torch.empty((B, H, Sq, D), dtype=out_dtype, device=q8.device)
    elif out.shape != (B, H, Sq, D) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"attention_fp8: out must be contiguous {out_dtype} of shape {(B, H, Sq, D)}")
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q8.device) if return_lse else None
    lse_arg = (lse.data_ptr(), B, H, Sq, H * Sq, Sq) if return_lse else (0,) * 6
    args = (
        tensor_arg(q8), tensor_arg(k8), transposed_arg(vt8), tensor_arg(out), lse_arg,
        (qd.data_ptr(), B, H, Sq, H * Sq, Sq), (kd.data_ptr(), B, H, Sk, H * Sk, Sk),
        (vd.data_ptr(), B, H, H),
        (softmax_scale * LOG2_E,),
    )
    launch(kern, attention_grid(Sq, H, B, spec.tile_m), args, q8.get_device())
    return (out, lse) if return_lse else out


def attention_via_fp8(q, k, v, *, causal, softmax_scale, return_lse, config, out):
    """Quantise fp16/bf16 q, k, v, then ``attention_fp8``; the output has q's dtype."""
    q8, qd = quantize_fp8(q, granularity="token")
    k8, kd = quantize_fp8(k, granularity="token")
    vt8, vd = quantize_fp8(v, transpose=True)
    return attention_fp8(
        q8, k8, vt8, qd, kd, vd, causal=causal, softmax_scale=softmax_scale,
        return_lse=return_lse, out_dtype=q.dtype, config=config, out=out,
    )
