"""``tests.gpu_specs``: the list of kernels a DSL-less GPU host runs the GPU tests from must hold
every kernel those tests launch (a miss is a KernelNotAvailableError there)."""

from __future__ import annotations

import pytest

from flashcore.specs import AttentionSpec, TileConfig
from tests.gpu_specs import gpu_test_specs
from tests.gpu_utils import FP8_KV_CONFIGS


@pytest.fixture(scope="module", params=["sm_89", "sm_90"])
def specs(request):
    return request.param, gpu_test_specs(request.param, [])


def test_split_kernels_are_listed_as_the_launcher_builds_them(specs):
    """A split-KV kernel for a CUDA graph writes its shares' LSE whatever the call asked (the
    combine kernel writes the caller's): the launcher builds it without ``return_lse``. An
    eager call's split kernel merges its shares itself (with or without the caller's LSE):
    each graph kernel has both merging twins."""
    _, listed = specs
    split = [s for s in listed if getattr(s, "split_kv", False)]
    graph = [s for s in split if not s.merge_shares]
    assert graph and not any(s.return_lse for s in graph)
    names = {s.name for s in split}
    for s in graph:
        for lse in (False, True):
            assert s.replace(merge_shares=True, return_lse=lse).name in names


def test_the_kernels_the_sm89_run_missed_are_listed(specs):
    """Kernels sm_89's GPU tests need that a catalog of the listed specs once lacked."""
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


def test_the_fp8_kv_configs_the_decode_tests_run_are_listed(specs):
    """test_fp8_kv_cache_in_every_kind_of_config's three cases for each config and head dim:
    packed GQA decode (split, fp16), a causal bf16 prefill tile with LSE (unsplit), a causal
    two-token fp16 decode (split)."""
    arch, listed = specs
    names = {s.name for s in listed}
    wanted = []
    for config in FP8_KV_CONFIGS:
        for d in (64, 128):
            base = AttentionSpec(arch=arch, head_dim=d, config=config, kv_fp8=True)
            wanted += [base.replace(split_kv=True),
                       base.replace(dtype="bfloat16", causal=True, return_lse=True),
                       base.replace(causal=True, split_kv=True)]
    missing = [s.name for s in wanted if s.name not in names]
    assert not missing, missing


def test_the_kernels_the_sm90_catalog_run_missed_are_listed():
    """Kernels the sm_90 suite needs from a DSL-less catalog, which the list once left out:
    the Hopper tests' explicit configs, fp16 and FP8, and the mma_sync fallback a tuned Hopper
    entry hands a sliding window."""
    names = {s.name for s in gpu_test_specs("sm_90", [])}
    missing = sorted({
        "fc_attn_fwd_sm90_bf16_d128_m128n128_w8_s2_wgmma_ws_causal_lse",
        "fc_attn_fwd_sm90_bf16_d64_m128n64_w8_s3_wgmma_ws_lse_fp8",
        "fc_attn_fwd_sm90_f16_d128_m64n128_w4_s1_causal_window",
        "fc_attn_fwd_sm90_f16_d64_m192n128_w12_s2_wgmma_ws_causal_lse",
        "fc_attn_fwd_sm90_f16_d64_m64n64_w2_s1_causal_window",
    } - names)
    assert not missing, missing


@pytest.mark.parametrize("arch", ["sm_89", "sm_90"])
def test_the_backward_group_holds_the_forward_kernels_its_tests_run(arch):
    """``--only backward`` builds the forward kernels the backward's GPU tests and benchmark
    run (autograd's forward keeps the LSE), as the planner picks them for ``arch``: without
    them, a DSL-less host cannot run those tests and a host with the DSL spends its time
    compiling them. Calls drawn from test_gpu_backward.py and the benchmark, each asked of the
    launcher on its own here."""
    import torch

    from flashcore.ops import attention
    from tests.gpu_specs import GROUPS, launched_specs

    names = {s.name for s in GROUPS["backward"](arch)}
    calls = [  # (q shape, k shape, dtype, causal, masks)
        ((1, 1, 333, 64), (1, 1, 190, 64), torch.bfloat16, True,
         {"mask_align": "bottom_right", "window": (100, 0), "softcap": 10.0}),  # test_masks
        ((2, 12, 17, 128), (2, 3, 300, 128), torch.float16, False, {}),  # the property's GQA
        ((4, 32, 4096, 128), (4, 8, 4096, 128), torch.float16, True, {}),  # the benchmark's
    ]

    def run():
        for qs, ks, dt, causal, m in calls:
            k = torch.empty(ks, dtype=dt)
            attention(torch.empty(qs, dtype=dt), k, k, causal=causal, return_lse=True, **m)

    specs = launched_specs(arch, run)
    assert len(specs) == len(calls) and all(s.arch == arch and s.return_lse for s in specs)
    # the long GQA call runs the Hopper family on sm_90 only
    assert (specs[-1].config.family == "wgmma_ws") == (arch == "sm_90")
    missing = [s.name for s in specs if s.name not in names]
    assert not missing, missing


def test_check_tells_a_catalog_built_from_other_sources_or_damaged(tmp_path, monkeypatch,
                                                                     capsys):
    """``python -m tests.gpu_specs --check DIR``: a catalog whose kernels were built from other
    sources than this tree's is all misses on a GPU host (each would compile again there), and
    so is one whose entries the cache would not load (a kernel.mlir deleted by hand to save
    space: its checksums name it); one copied without the IR by ``copy_catalog`` is served."""
    import dataclasses

    from flashcore.compiler.cache import KernelCache
    from flashcore.compiler.catalog import copy_catalog, write_catalog
    from flashcore.compiler.fingerprint import source_hash
    from tests.artifact_helpers import SPEC, isolate_cache, synthetic_artifact
    from tests.gpu_specs import check_catalog

    dsl = "4.8.1-cu12"
    isolate_cache(tmp_path, monkeypatch, dsl)
    specs = (SPEC, AttentionSpec(arch="sm_90", head_dim=64))

    def catalog(name, hashes):
        root = tmp_path / name
        cache = KernelCache(root)
        arts = [dataclasses.replace(synthetic_artifact(s, dsl=dsl), source_hash=h)
                for s, h in zip(specs, hashes)]
        for a in arts:
            cache.put(a)
        write_catalog(root, arts)
        return root

    ours = source_hash()
    root = catalog("ours", [ours, ours])
    assert check_catalog(root) == 0
    assert "2 of 2 kernels built from this tree's sources" in capsys.readouterr().out
    assert check_catalog(catalog("other", [ours, "0123456789abcdef"])) == 1
    assert "1 of 2" in capsys.readouterr().out
    lean = copy_catalog(root, tmp_path / "lean").parent  # without the IR, re-saved
    assert not any(f.stat().st_size for f in lean.rglob("kernel.mlir"))
    assert check_catalog(lean) == 0
    capsys.readouterr()
    for ir in root.rglob("kernel.mlir"):
        ir.unlink()
    assert check_catalog(root) == 1
    out = capsys.readouterr().out
    assert "2 of 2 kernels built" in out and "2 entries the cache would not serve" in out
    assert "kernel.mlir" in out
