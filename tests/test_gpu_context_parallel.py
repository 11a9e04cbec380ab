"""Context-parallel attention on two GPUs (NCCL, bf16) against one GPU's flashcore and the
float64 reference, within the error bound of the single-GPU tests (2x SDPA's own error); for
the GQA cases also the gradients (the ring backward) against the reference's autograd.

Skipped without two CUDA GPUs and NCCL. One spawn runs every case; each case is a test below.
"""

from __future__ import annotations

import json
import zlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from flashcore import reference
from flashcore.distributed import (
    all_gather_attention,
    ring_attention,
    shard_contiguous,
    shard_zigzag,
    unshard_zigzag,
)
from tests.gpu_utils import allowed_error, max_abs, requires_cuda, sdpa

pytestmark = [
    pytest.mark.gpu,
    requires_cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                       reason="needs two CUDA GPUs and NCCL"),
]

WORLD = 2
# (name, op, layout, causal, (q heads, k/v heads), contiguous shard lengths or None)
CASES = [
    (f"{op}-{layout}-{'causal' if causal else 'full'}-h{hkv}", op, layout, causal, (8, hkv), None)
    for op in ("ring", "all_gather") for layout in ("contiguous", "zigzag")
    for causal in (False, True) for hkv in (8, 2)
] + [
    ("ring-uneven-full", "ring", "contiguous", False, (8, 8), (384, 1664)),
    ("ring-uneven-causal", "ring", "contiguous", True, (8, 2), (1280, 768)),
    ("all_gather-uneven-causal", "all_gather", "contiguous", True, (8, 2), (1280, 768)),
]
B, S, D = 2, 2048, 128


def _gather(x: torch.Tensor, lengths: list[int], layout: str) -> torch.Tensor:
    longest = max(lengths)
    pad = list(x.shape)
    pad[2] = longest - x.shape[2]
    padded = torch.cat([x, x.new_zeros(pad)], dim=2).contiguous()
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded)
    parts = [p[:, :, :n] for p, n in zip(parts, lengths)]
    return unshard_zigzag(parts, WORLD) if layout == "zigzag" else torch.cat(parts, dim=2)


def _case(case: tuple, rank: int) -> dict[str, float]:
    from flashcore.ops import attention

    name, op, layout, causal, (hq, hkv), lengths = case
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))  # same inputs on every rank
    q = torch.randn(B, hq, S, D, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, hkv, S, D, device="cuda", generator=g).to(torch.bfloat16)
            for _ in range(2))
    lens = list(lengths or [S // WORLD] * WORLD)
    shard = ((lambda t: shard_zigzag(t, rank, WORLD)) if layout == "zigzag"
             else (lambda t: shard_contiguous(t, lens, rank)))
    fn = ring_attention if op == "ring" else all_gather_attention
    out, lse = fn(shard(q), shard(k), shard(v), causal=causal, layout=layout, return_lse=True)
    full, full_lse = _gather(out, lens, layout), _gather(lse.contiguous(), lens, layout)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, device="cuda")
    single = attention(q, k, v, causal=causal)
    err_sdpa = max_abs(sdpa(q, k, v, causal, None), ref)
    found = {"err": max_abs(full, ref), "err_vs_single": max_abs(full, single),
             "allowed": allowed_error(err_sdpa, ref, torch.bfloat16, q, k, v),
             "lse_err": max_abs(full_lse, ref_lse), "lse_dtype": str(lse.dtype)}
    if lengths is None and hkv == 2:  # the backward: every layout, op and mask, GQA
        found.update(_gradient_errors(q, k, v, causal, fn, shard, lens, layout, g))
    return found


def _gradient_errors(q, k, v, causal, fn, shard, lens, layout, g) -> dict[str, float]:
    """The sharded gradients (gathered) against autograd of the float64 reference, beside the
    one-GPU flashcore backward's error: each within twice that, plus a rounding term."""
    from flashcore.ops import attention

    dout = torch.randn(q.shape, device="cuda", generator=g).to(torch.bfloat16)
    full = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference.attention(*full, causal=causal, device="cuda").backward(dout.double())
    one = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    attention(*one, causal=causal).backward(dout)
    local = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
    fn(*local, causal=causal, layout=layout).backward(shard(dout))
    errs = {}
    for name, mine, single, ref in zip(("dq", "dk", "dv"), local, one, full):
        got = _gather(mine.grad.contiguous(), lens, layout)
        scale = ref.grad.abs().max().item()
        errs[f"{name}_err"] = max_abs(got, ref.grad)
        errs[f"{name}_allowed"] = 2 * max_abs(single.grad, ref.grad) + 1e-2 * scale
    return errs


def _worker(rank: int, rdv: str, result: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{rdv}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))
    try:
        found = {case[0]: _case(case, rank) for case in CASES}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(result, "w") as f:
            json.dump(found, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("cp_gpu")
    mp.spawn(_worker, args=(str(tmp / "rdv"), str(tmp / "result.json")), nprocs=WORLD,
             join=True)
    return json.loads((tmp / "result.json").read_text())


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_context_parallel_matches_one_gpu(results, name):
    r = results[name]
    assert r["err"] <= r["allowed"], r
    assert r["err_vs_single"] <= r["allowed"], r
    assert r["lse_dtype"] == "torch.float32" and r["lse_err"] <= 1e-3, r
    for grad in ("dq", "dk", "dv"):  # the cases that run the backward
        if f"{grad}_err" in r:
            assert r[f"{grad}_err"] <= r[f"{grad}_allowed"], (grad, r)
