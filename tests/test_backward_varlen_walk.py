"""The packed batch's backward replayed on the CPU in float64, block by block as the main
kernel walks it (``mma_sync_bwd``): the grid sized by the longest sequence (the batch in z),
each key block's walk (``block_info.query_blocks_seeing``, nothing past a sequence's keys),
query blocks read through the offsets and running past their sequence into the next one's rows
(rows there get log2 LSE +inf: no probability), dQ added into the packed rows (padding rows
after the last), dK and dV stored for the sequence's keys, and with ``deterministic`` the adds
into each query block in ``block_info.dq_turn`` order. Checked against autograd of the float64
reference, sequence by sequence; a plan that walked too little, too much or into the wrong rows
fails here."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from flashcore import reference
from flashcore.kernels.common.block_info import (
    ceil_div,
    dq_turn,
    query_blocks_seeing,
    token_keys,
)
from tests.test_backward_masks import _bounds  # as BackwardCta.key_bounds builds them


def _replay(q, k, v, dout, out, lse, cu_q, cu_k, max_k, causal, align, window, scale, tm, tn,
            deterministic):
    """(dq, dk, dv) of the packed batch as the kernels compute them (float64, no rounding)."""
    total_q, H, D = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    batch = len(cu_q) - 1
    rows = ceil_div(total_q + tm, 128) * 128  # the workspace's padded rows
    pad = rows - total_q
    # pre kernel: log2 LSE (+inf past the rows and for rows that saw no key) and D
    lse2 = torch.full((H, rows), math.inf, dtype=torch.float64)
    seen = torch.isfinite(lse)
    lse2[:, :total_q] = torch.where(seen, lse * math.log2(math.e), torch.full_like(lse, math.inf))
    dpsum = torch.zeros(H, rows, dtype=torch.float64)
    dpsum[:, :total_q] = (dout * out).sum(-1).t()
    dq_acc = torch.zeros(H, rows, D, dtype=torch.float64)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    qp = torch.cat([q, q.new_zeros(pad, H, D)])  # memory past the last row reads as anything
    dop = torch.cat([dout, dout.new_zeros(pad, H, D)])
    adds = []  # (head, query block start row, key block, sequence) in the order they happen
    n_blocks_max = ceil_div(max_k, tn)
    for b in range(batch):
        q0, sq = cu_q[b], cu_q[b + 1] - cu_q[b]
        k0, sk = cu_k[b], cu_k[b + 1] - cu_k[b]
        bounds = _bounds(causal, align, window, sq, sk)
        for kh in range(Hkv):
            for n in range(n_blocks_max):
                lo, hi = query_blocks_seeing(n, tm, tn, sq, sk, bounds)
                if n * tn >= sk:
                    hi = lo
                keys = torch.arange(n * tn, (n + 1) * tn)
                valid_k = keys < sk
                kb = torch.zeros(tn, D, dtype=torch.float64)
                vb = torch.zeros(tn, D, dtype=torch.float64)
                kb[valid_k] = k[k0 + keys[valid_k], kh]
                vb[valid_k] = v[k0 + keys[valid_k], kh]
                acc_dk = torch.zeros(tn, D, dtype=torch.float64)
                acc_dv = torch.zeros(tn, D, dtype=torch.float64)
                for h in range(kh * group, (kh + 1) * group):
                    for m in range(lo, max(hi, lo)):
                        r = torch.arange(m * tm, (m + 1) * tm)  # rows of this sequence
                        inside = r < sq
                        qb = torch.where(inside[:, None], qp[q0 + r, h], 0.0)
                        dob = torch.where(inside[:, None], dop[q0 + r, h], 0.0)
                        l2 = torch.where(inside, lse2[h, q0 + r], math.inf)
                        dd = dpsum[h, q0 + r]
                        s = qb @ kb.t()
                        lo_k, hi_k = zip(*(token_keys(bounds, int(t), sk) for t in r))
                        lo_k, hi_k = torch.tensor(lo_k), torch.tensor(hi_k)
                        hidden = (keys[None] < lo_k[:, None]) | (keys[None] >= hi_k[:, None])
                        s = s.masked_fill(hidden, -math.inf)
                        p = torch.exp2(s * scale * math.log2(math.e) - l2[:, None])
                        acc_dv += p.t() @ dob
                        ds = p * (dob @ vb.t() - dd[:, None])
                        acc_dk += ds.t() @ qb
                        dq_acc[h, q0 + m * tm:q0 + (m + 1) * tm] += ds @ kb
                        adds.append((h, q0 + m * tm, n, b))
                keep = valid_k
                dk[k0 + keys[keep], kh] = acc_dk[keep] * scale
                dv[k0 + keys[keep], kh] = acc_dv[keep]
    if deterministic:  # each query block's adds: key blocks from the highest, in dq_turn order
        by_block: dict = {}
        for h, row, n, b in adds:
            by_block.setdefault((h, row, b), []).append(n)
        for (h, row, b), ns in by_block.items():
            sq, sk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
            bounds = _bounds(causal, align, window, sq, sk)
            m = (row - cu_q[b]) // tm
            turns = [dq_turn(m, n, tm, tn, sq, sk, bounds) for n in ns]
            assert sorted(turns) == list(range(len(ns))), (h, row, ns, turns)
    return dq_acc[:, :total_q].transpose(0, 1) * scale, dk, dv


@pytest.mark.parametrize("causal, align, window", [
    (False, "top_left", None), (True, "bottom_right", None), (True, "top_left", None),
    (True, "bottom_right", (9, 0)), (False, "bottom_right", (6, 11))])
@pytest.mark.parametrize("tm, tn", [(16, 32), (32, 16)])
def test_the_packed_walk_gives_each_sequences_gradients(causal, align, window, tm, tn):
    g = torch.Generator().manual_seed(tm + tn)
    lengths = [(37, 50), (0, 9), (20, 0), (1, 1), (45, 33), (16, 70)]
    cu_q = [0, *itertools.accumulate(a for a, _ in lengths)]
    cu_k = [0, *itertools.accumulate(b for _, b in lengths)]
    H, Hkv, D = 4, 2, 8
    q = torch.randn(cu_q[-1], H, D, generator=g, dtype=torch.float64)
    k = torch.randn(cu_k[-1] + 3, Hkv, D, generator=g, dtype=torch.float64)  # 3 rows in none
    v = torch.randn(cu_k[-1] + 3, Hkv, D, generator=g, dtype=torch.float64)
    dout = torch.randn_like(q)
    scale = 0.4
    kw = {"causal": causal, "softmax_scale": scale, "mask_align": align, "window": window}
    out = torch.zeros_like(q)
    lse = torch.full((H, cu_q[-1]), -math.inf, dtype=torch.float64)
    want = [torch.zeros_like(t) for t in (q, k, v)]
    for b in range(len(lengths)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if qs.stop == qs.start:
            continue
        parts = [t[s].transpose(0, 1)[None].clone().requires_grad_()
                 for t, s in ((q, qs), (k, ks), (v, ks))]
        o, l_ = reference.attention(*parts, return_lse=True, **kw)
        out[qs], lse[:, qs] = o[0].transpose(0, 1).detach(), l_[0].detach()
        if ks.stop > ks.start:
            o.backward(dout[qs].transpose(0, 1)[None])
            for w, p, s in zip(want, parts, (qs, ks, ks)):
                w[s] = p.grad[0].transpose(0, 1)
    max_k = max(b for _, b in lengths)
    for deterministic in (False, True):
        got = _replay(q, k, v, dout, out, lse, cu_q, cu_k, max_k, causal, align, window, scale,
                      tm, tn, deterministic)
        for name, a, w in zip(("dq", "dk", "dv"), got, want):
            assert torch.allclose(a, w, atol=1e-9, rtol=1e-7), name
