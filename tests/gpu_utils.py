"""Helpers shared by the GPU tests (importable without CUDA)."""

from __future__ import annotations

import torch

requires_cuda = None
try:
    import pytest

    requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
except ImportError:  # pragma: no cover
    pass


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN so any element the kernel fails to write shows up."""
    return t.fill_(float("nan"))


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def attention_shapes(max_seq: int) -> dict:
    """Hypothesis strategies for the shape, dtype and masking of one attention call: batch 1-4,
    heads 1-16, sequence lengths up to ``max_seq`` (short ones drawn often), head dim 64 or 128."""
    from hypothesis import strategies as st

    return {
        "b": st.integers(1, 4),
        "h": st.integers(1, 16),
        "sq": st.one_of(st.integers(1, 300), st.integers(1, max_seq)),
        "sk": st.one_of(st.integers(1, 300), st.integers(1, max_seq)),
        "d": st.sampled_from([64, 128]),
        "dtype": st.sampled_from(["bfloat16", "float16"]),
        "causal": st.booleans(),
    }


# (tile, warps, kv_splits) of the split-KV kernels the GPU tests check
SPLIT_CONFIGS = [((32, 64), 2, 4), ((64, 64), 4, 2), ((16, 32), 1, 4), ((32, 64), 1, 2)]
FP8_SPLIT_CONFIGS = [((32, 64), 2, 4)]
# (tile, warps, kv_splits, stages) of the multi-stage K/V kernels the GPU tests check
STAGE_CONFIGS = [((64, 64), 4, 1, 2), ((128, 64), 8, 1, 3), ((32, 64), 2, 2, 2), ((16, 32), 1, 1, 3)]


def current_arch() -> str:
    """The arch whose kernels run here (``FLASHCORE_ARCH`` may pick an older one)."""
    from flashcore.runtime.device import arch_of

    return arch_of(torch.cuda.current_device())


def skip_unless_fits(head_dim: int, precision: str = "fp16", kv_fp8: bool = False,
                     **knobs) -> None:
    """Skip a test whose config does not fit this arch (an L4's 99 KB of shared memory when the
    sm_89 kernels run on an H100 from their PTX)."""
    import pytest

    from flashcore.errors import SpecError
    from flashcore.spec import AttentionSpec, TileConfig

    try:
        AttentionSpec(arch=current_arch(), head_dim=head_dim, precision=precision,
                      kv_fp8=kv_fp8, config=TileConfig(knobs.pop("tile"), **knobs))
    except SpecError as e:
        pytest.skip(f"does not fit {current_arch()}: {e}")
