"""``tests.gpu_specs``: the list of kernels a DSL-less GPU host runs the GPU tests from must hold
every kernel those tests launch (a miss is a KernelNotAvailableError there)."""

from __future__ import annotations

import pytest

from flashcore.spec import AttentionSpec, TileConfig
from tests.gpu_specs import gpu_test_specs


@pytest.fixture(scope="module", params=["sm_89", "sm_90"])
def specs(request):
    return request.param, gpu_test_specs(request.param, [])


def test_split_kernels_are_listed_as_the_launcher_builds_them(specs):
    """A split-KV kernel writes its shares' LSE whatever the call asked (the combine kernel
    writes the caller's): the launcher builds it without ``return_lse``."""
    _, listed = specs
    split = [s for s in listed if getattr(s, "split_kv", False)]
    assert split and not any(s.return_lse for s in split)


def test_the_kernels_the_sm89_run_missed_are_listed(specs):
    """Kernels that sm_89's GPU run of 2026-11-24 found missing from the catalog."""
    arch, listed = specs
    names = {s.name for s in listed}
    tile = TileConfig((64, 64))
    wanted = [
        # test_matches_reference_within_sdpa_error: (64, 64), bf16, S_q = 1 (split)
        AttentionSpec(arch=arch, dtype="bfloat16", head_dim=128, config=tile, split_kv=True),
        # test_paged_matches_the_reference's chunked-prefill example (pages of 256)
        AttentionSpec(arch=arch, dtype="bfloat16", head_dim=64, config=tile, causal=True,
                      return_lse=True, mask_align="bottom_right", paged_kv=True,
                      page_size=256),
    ]
    missing = [s.name for s in wanted if s.name not in names]
    assert not missing, missing
