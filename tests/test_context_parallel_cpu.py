"""Context-parallel attention on CPU: gloo process groups of 2 and 4 ranks against the float64
reference, plus the merge, the layouts and the block plans on their own."""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass
from datetime import timedelta

import pytest
import torch

from flashcore import reference
from flashcore.distributed import (
    all_gather_attention,
    context_parallel_attention,
    merge_partials,
    ring_attention,
    shard_contiguous,
    shard_zigzag,
    unshard_zigzag,
)
from flashcore.distributed.common import Shards, check_shards
from flashcore.distributed.layout import plan_blocks

B, D, SEQ = 2, 8, 16
TOL = 1e-10


def ref_fn(q, k, v, *, causal, softmax_scale, return_lse, mask_align):
    """The reference with flashcore.ops.attention's signature subset, float64 out and lse."""
    assert return_lse
    return reference.attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                               return_lse=True, mask_align=mask_align)


def ref_bwd(dout, q, k, v, out, lse, *, causal, softmax_scale, dlse=None):
    """One block's gradients from the whole attention's ``out`` and ``lse`` (float64, top-left
    causal or full): P = exp(S - lse) is then the global softmax, and the blocks' sums are
    the whole gradient. dK and dV summed over each K/V head's query heads."""
    group = q.shape[1] // k.shape[1]
    kx, vx = (t.repeat_interleave(group, dim=1) for t in (k, v))
    s = q @ kx.transpose(-1, -2) * softmax_scale
    if causal:
        hidden = torch.ones(s.shape[-2:], dtype=torch.bool).triu(1)
        s = s.masked_fill(hidden, -math.inf)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # rows without a key: lse -inf, p 0
    dp = dout @ vx.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    if dlse is not None:
        ds = ds + p * dlse.unsqueeze(-1)
    dq = ds @ kx * softmax_scale
    b, hkv, sk, d = k.shape
    dk = (ds.transpose(-1, -2) @ q * softmax_scale).view(b, hkv, group, sk, d).sum(2)
    dv = (p.transpose(-1, -2) @ dout).view(b, hkv, group, sk, d).sum(2)
    return dq, dk, dv


@dataclass(frozen=True)
class Case:
    name: str
    op: str = "ring"  # ring, all_gather or auto
    layout: str = "contiguous"
    causal: bool = False
    heads: tuple[int, int] = (4, 4)  # (q heads, k/v heads)
    q_lengths: tuple[int, ...] | None = None  # contiguous shard lengths (None: equal)
    k_lengths: tuple[int, ...] | None = None  # (None: as q's)
    return_lse: bool = False
    scale: float | None = None


def cases(world: int) -> list[Case]:
    uneven = (5, 11) if world == 2 else (3, 0, 9, 4)
    k_uneven = (9, 7) if world == 2 else (6, 2, 3, 5)
    out = []
    for op in ("ring", "all_gather"):
        for layout in ("contiguous", "zigzag"):
            for causal in (False, True):
                out.append(Case(f"{op}-{layout}-{'causal' if causal else 'full'}", op, layout,
                                causal))
            out.append(Case(f"{op}-{layout}-gqa-lse", op, layout, True, (4, 1), return_lse=True))
        out += [
            Case(f"{op}-uneven-full", op, q_lengths=uneven, return_lse=True),
            Case(f"{op}-uneven-causal", op, causal=True, q_lengths=uneven, return_lse=True),
            Case(f"{op}-uneven-qk-full", op, q_lengths=uneven, k_lengths=k_uneven),
            Case(f"{op}-scale-gqa", op, "zigzag", True, (4, 2), scale=-0.7),
        ]
    out.append(Case("auto-gqa-causal", "auto", "zigzag", True, (4, 1), return_lse=True))
    out.append(Case("auto-mha-causal", "auto", "contiguous", True, return_lse=True))
    return out


def _inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))  # same on every rank
    hq, hkv = case.heads
    sk = sum(case.k_lengths) if case.k_lengths else SEQ
    q = torch.randn(B, hq, SEQ, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, hkv, sk, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _shard(x: torch.Tensor, case: Case, lengths: tuple[int, ...] | None, rank: int, world: int):
    if case.layout == "zigzag":
        return shard_zigzag(x, rank, world)
    return shard_contiguous(x, list(lengths or [x.shape[2] // world] * world), rank)


def _gather(x: torch.Tensor, world: int, layout: str) -> torch.Tensor:
    """Every rank's rows of x (..., seq_shard[, dim]) in global order (shards may differ)."""
    import torch.distributed as dist

    n = torch.tensor([x.shape[2]])
    lens = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(lens, n)
    longest = max(int(t) for t in lens)
    pad = list(x.shape)
    pad[2] = longest - x.shape[2]
    padded = torch.cat([x, x.new_zeros(pad)], dim=2)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    parts = [p[:, :, :int(m)] for p, m in zip(parts, lens)]
    return unshard_zigzag(parts, world) if layout == "zigzag" else torch.cat(parts, dim=2)


def _run(case: Case, rank: int, world: int) -> float:
    q, k, v = _inputs(case)
    ql = _shard(q, case, case.q_lengths, rank, world)
    kl, vl = (_shard(t, case, case.k_lengths or case.q_lengths, rank, world) for t in (k, v))
    op = {"ring": ring_attention, "all_gather": all_gather_attention,
          "auto": context_parallel_attention}[case.op]
    got = op(ql, kl, vl, causal=case.causal, softmax_scale=case.scale, layout=case.layout,
             return_lse=case.return_lse, attention_fn=ref_fn)
    out, lse = got if case.return_lse else (got, None)
    want_out, want_lse = reference.attention(q, k, v, causal=case.causal,
                                             softmax_scale=case.scale, return_lse=True)
    full = _gather(out, world, case.layout)
    err = (full - want_out).abs().max().item()
    if lse is not None:
        assert lse.dtype == torch.float64 and lse.shape == ql.shape[:3]
        full_lse = _gather(lse, world, case.layout)
        same_inf = torch.equal(torch.isinf(full_lse), torch.isinf(want_lse))
        finite = torch.isfinite(want_lse)
        err = max(err, (full_lse[finite] - want_lse[finite]).abs().max().item(),
                  0.0 if same_inf else math.inf)
    return err


def _run_backward(case: Case, rank: int, world: int) -> float:
    """The largest error of this case's gradients (dq, dk, dv of a loss on out and, with
    ``return_lse``, on the LSE too) against autograd of the float64 reference."""
    q, k, v = _inputs(case)
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + 1)
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(q.shape[:3], generator=g, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = reference.attention(*full, causal=case.causal, softmax_scale=case.scale,
                                   return_lse=True)
    loss = (out * dout).sum() + ((lse * dlse).sum() if case.return_lse else 0.0)
    loss.backward()
    shards = [_shard(t, case, case.q_lengths, rank, world) for t in (q, dout, dlse)]
    shards += [_shard(t, case, case.k_lengths or case.q_lengths, rank, world) for t in (k, v)]
    ql, dol, dll, kl, vl = shards
    local = [t.clone().requires_grad_() for t in (ql, kl, vl)]
    op = {"ring": ring_attention, "all_gather": all_gather_attention,
          "auto": context_parallel_attention}[case.op]
    out_l, lse_l = op(*local, causal=case.causal, softmax_scale=case.scale, layout=case.layout,
                      return_lse=True, attention_fn=ref_fn, backward_fn=ref_bwd)
    loss_l = (out_l * dol).sum() + ((lse_l * dll).sum() if case.return_lse else 0.0)
    loss_l.backward()
    errs = []
    for mine, whole, lengths in zip(local, full, (case.q_lengths, case.k_lengths or case.q_lengths,
                                                  case.k_lengths or case.q_lengths)):
        want = _shard(whole.grad, case, lengths, rank, world)
        errs.append((mine.grad - want).abs().max().item() if want.numel() else 0.0)
    return max(errs)


def _worker(rank: int, world: int, rdv: str, result: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2-4 ranks on two cores
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    errors = {}
    try:
        for case in cases(world):
            errors[case.name] = _run(case, rank, world)
            errors[f"{case.name}-backward"] = _run_backward(case, rank, world)
        # causal with q and k sharded differently is refused on every rank (none left hanging)
        q = torch.zeros(1, 1, 2 + rank, D, dtype=torch.float64)
        with pytest.raises(ValueError, match="causal: q and k must be sharded alike"):
            ring_attention(q, q[:, :, :2], q[:, :, :2], causal=True, attention_fn=ref_fn)
        errors["mismatch-refused"] = 0.0
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(result, "w") as f:
            json.dump({"errors": errors, "cases": [asdict(c) for c in cases(world)]}, f)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world_errors(request, tmp_path_factory) -> tuple[int, dict[str, float]]:
    """One spawn per world size runs every case; the tests below read its per-case errors."""
    import torch.multiprocessing as mp

    world = request.param
    tmp = tmp_path_factory.mktemp(f"cp{world}")
    result = tmp / "errors.json"
    mp.spawn(_worker, args=(world, str(tmp / "rdv"), str(result)), nprocs=world, join=True)
    return world, json.loads(result.read_text())["errors"]


def test_every_case_matches_the_reference(world_errors):
    world, errors = world_errors
    names = {c.name for c in cases(world)}
    assert set(errors) == names | {f"{n}-backward" for n in names} | {"mismatch-refused"}
    bad = {name: err for name, err in errors.items() if not err <= TOL}
    assert bad == {}, f"world {world}: errors over {TOL}: {bad}"


# -- pure unit tests ---------------------------------------------------------------------------


def _split_keys(q, k, v, cut, causal):
    """Reference (out, lse) of keys [0, cut) and [cut, S) of a causal or full problem, as two
    bottom-right-aligned pieces of the same global mask."""
    sq = q.shape[2]
    a = reference.attention(q, k[:, :, :cut], v[:, :, :cut], causal=causal, return_lse=True,
                            mask_align="top_left")
    # the second piece: query i sees key cut + j iff cut + j <= i, i.e. j <= i - cut
    hidden = torch.arange(k.shape[2] - cut)[None, :] + cut > torch.arange(sq)[:, None]
    s = (q @ k[:, :, cut:].transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(hidden, -math.inf)
    lse_b = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse_b), lse_b, 0.0)[..., None])
    return a, (p @ v[:, :, cut:], lse_b)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cut", [0, 3, 9, 16])
def test_merge_of_two_key_sets_is_the_whole(causal, cut):
    g = torch.Generator().manual_seed(cut)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    (oa, la), (ob, lb) = _split_keys(q, k, v, cut, causal)
    out, lse = merge_partials(oa, la, ob, lb)
    want, want_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert (out - want).abs().max() < TOL
    assert (lse - want_lse).abs().max() < TOL
    out2, lse2 = merge_partials(ob, lb, oa, la)  # symmetric
    assert (out2 - out).abs().max() < TOL and (lse2 - lse).abs().max() < TOL


def test_merge_handles_empty_rows_without_nan():
    o = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    empty_o, empty_l = torch.zeros_like(o), torch.full((1, 1, 3), -math.inf, dtype=torch.float64)
    lse = torch.tensor([[[0.5, -math.inf, 1e4]]], dtype=torch.float64)
    out, got = merge_partials(o * torch.isfinite(lse)[..., None], lse, empty_o, empty_l)
    assert not torch.isnan(out).any() and not torch.isnan(got).any()
    assert torch.equal(got, lse)  # merging nothing changes nothing, also at lse 1e4
    assert torch.equal(out[..., 1, :], torch.zeros(1, 1, 4, dtype=torch.float64))
    assert torch.allclose(out[..., [0, 2], :], o[..., [0, 2], :], rtol=0, atol=0)
    both, both_l = merge_partials(empty_o, empty_l, empty_o, empty_l)
    assert torch.equal(both, empty_o) and torch.equal(both_l, empty_l)


def test_merge_in_float32_of_large_lse_stays_finite():
    o = torch.ones(1, 1, 1, 2)
    out, lse = merge_partials(o, torch.tensor([[[1e30]]]), 2 * o, torch.tensor([[[1e30]]]))
    assert torch.allclose(out, 1.5 * o) and torch.isfinite(lse).all()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [1, 2])
def test_zigzag_round_trip(world, dim):
    x = torch.arange(2 * 6 * world * 5).reshape(2, 6 * world, 5) if dim == 1 else \
        torch.arange(3 * 2 * 4 * world * 2).reshape(3, 2, 4 * world, 2)
    parts = [shard_zigzag(x, r, world, dim) for r in range(world)]
    assert torch.equal(unshard_zigzag(parts, world, dim), x)
    n = x.shape[dim] // (2 * world)
    first = x.narrow(dim, 0, n)
    last = x.narrow(dim, x.shape[dim] - n, n)
    assert torch.equal(parts[0], torch.cat([first, last], dim))


def test_zigzag_and_contiguous_errors_name_the_argument():
    with pytest.raises(ValueError, match="x: length 6 .* 2\\*world = 4"):
        shard_zigzag(torch.zeros(1, 1, 6), 0, 2)
    with pytest.raises(ValueError, match="rank must be in"):
        shard_zigzag(torch.zeros(1, 1, 8), 2, 2)
    with pytest.raises(ValueError, match="parts: expected 2"):
        unshard_zigzag([torch.zeros(1, 1, 2)], 2)
    with pytest.raises(ValueError, match="lengths sum to 5"):
        shard_contiguous(torch.zeros(1, 1, 6), [2, 3], 0)
    x = torch.arange(10).reshape(1, 1, 10)
    assert torch.equal(torch.cat([shard_contiguous(x, [3, 0, 7], r) for r in range(3)], 2), x)


def test_shard_checks():
    check_shards(Shards([3, 5], [3, 5]), "contiguous", causal=True)
    check_shards(Shards([3, 5], [4, 1]), "contiguous", causal=False)
    with pytest.raises(ValueError, match="causal: q and k must be sharded alike"):
        check_shards(Shards([3, 5], [4, 4]), "contiguous", causal=True)
    with pytest.raises(ValueError, match="layout='zigzag'"):
        check_shards(Shards([4, 6], [4, 6]), "zigzag", causal=False)
    with pytest.raises(ValueError, match="layout must be one of"):
        check_shards(Shards([4], [4]), "striped", causal=False)


def _positions(layout: str, world: int, lengths: list[int]) -> list[torch.Tensor]:
    if layout == "zigzag":
        return [shard_zigzag(torch.arange(sum(lengths))[None, None], r, world)[0, 0]
                for r in range(world)]
    return list(torch.arange(sum(lengths)).split(lengths))


@pytest.mark.parametrize("layout,world,lengths", [
    ("contiguous", 3, [4, 0, 7]), ("contiguous", 2, [5, 5]), ("zigzag", 2, [4, 4]),
    ("zigzag", 4, [6, 6, 6, 6]), ("zigzag", 1, [2]),
])
def test_block_plans_cover_exactly_the_causal_mask(layout, world, lengths):
    """Over all (rank, src) pairs, the blocks a plan computes show each query exactly the keys
    at or before it: skipped blocks hide nothing visible, full blocks show nothing hidden."""
    pos = _positions(layout, world, lengths)
    for rank in range(world):
        for src in range(world):
            qp, kp = pos[rank], pos[src]
            want = kp[None, :] <= qp[:, None]
            seen = torch.zeros_like(want)
            for blk in plan_blocks(layout, True, rank, src, len(qp), len(kp)):
                sub = torch.ones(len(qp), len(kp), dtype=torch.bool)[blk.q, blk.k]
                if blk.causal:
                    sub = torch.ones_like(sub).tril()
                assert not seen[blk.q, blk.k].any(), "a key seen twice"
                seen[blk.q, blk.k] = sub
            assert torch.equal(seen, want), (layout, rank, src)
