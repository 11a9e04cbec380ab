"""Serving layouts without a GPU: the spec fields and their ABI, the float64 references of a
packed batch and of a paged cache (against the dense reference), and real compiles of the
varlen and paged kernels (ABI against the PTX, 16-byte gathers, no spills)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcore import reference
from flashcore.compiler.abi import params_for, varlen_grid
from flashcore.errors import SpecError
from flashcore.specs import AttentionSpec, TileConfig, family
from tests.device_stub import stubbed_device
from tests.kernels import assert_no_spills_in_loops, compiled_in_fresh_cache


def test_spec_fields_name_validate_and_shape_the_abi():
    base = AttentionSpec(arch="sm_89", causal=True, mask_align="bottom_right")
    varlen = base.replace(varlen=True)
    paged = base.replace(paged_kv=True, split_kv=True)
    both = base.replace(varlen=True, paged_kv=True)
    assert varlen.name.endswith("_br_varlen") and paged.name.endswith("_split_br_paged")
    for s in (varlen, paged, both):
        assert AttentionSpec.from_json(s.to_json()) == s
    tail = {s: [p.name for p in params_for(s)][-4:] for s in (varlen, paged, both)}
    assert tail[varlen][-2:] == ["cu_seqlens_q", "cu_seqlens_k"]
    assert tail[paged][-2:] == ["block_table", "seqlens_k"]
    assert tail[both][-3:] == ["cu_seqlens_q", "block_table", "seqlens_k"]
    for bad, what in (({"varlen": True, "split_kv": True}, "split"),
                      ({"varlen": True, "kv_fp8": True}, "kv_fp8"),
                      ({"varlen": True, "precision": "fp8"}, "fp8"),
                      ({"paged_kv": "yes"}, "bool"),
                      ({"page_size": 16}, "needs paged_kv"),
                      ({"paged_kv": True, "page_size": -16}, "needs paged_kv"),
                      ({"paged_kv": True, "page_size": 16.0}, "int"),
                      # four warps copy 16 rows a pass: a page of 8 splits a pass
                      ({"paged_kv": True, "page_size": 8}, "rows per copy pass"),
                      ({"paged_kv": True, "page_size": 48}, "divide or be a multiple of tile_n")):
        with pytest.raises(SpecError, match=what):
            AttentionSpec(arch="sm_89", **bad)
    fp8_cache = AttentionSpec(arch="sm_89", paged_kv=True, kv_fp8=True)
    assert "_kvfp8" in fp8_cache.name and fp8_cache.name.endswith("_paged")
    params = {p.name: p for p in params_for(fp8_cache)}
    # (pages, heads, page_size) descales with every stride a parameter: any user layout
    assert (params["k_descale"].dynamic_shapes, params["k_descale"].dynamic_strides) == (3, 3)
    assert AttentionSpec.from_json(fp8_cache.to_json()) == fp8_cache
    with pytest.raises(SpecError, match="kv_fp8"):
        AttentionSpec(arch="sm_80", paged_kv=True, kv_fp8=True)
    whole = AttentionSpec(arch="sm_89", paged_kv=True, page_size=16)
    assert whole.name.endswith("_paged16") and AttentionSpec.from_json(whole.to_json()) == whole
    one_warp = TileConfig((16, 64), warps=1)  # 4 rows a pass: pages of 4 and 8 copy whole too
    for ps, ok in ((4, True), (8, True), (2, False), (16, True), (64, True), (192, True),
                   (96, False), (24, False)):
        fam = family("mma_sync")
        assert fam.copies_whole_pages(whole.replace(config=one_warp, page_size=0), ps) == ok, ps
    # an e4m3 cache is copied as bytes: 64-byte rows of d=64 make a pass of one warp 8 rows
    e4m3_64 = fp8_cache.replace(config=one_warp)
    for ps, ok in ((4, False), (8, True), (16, True)):
        assert fam.copies_whole_pages(e4m3_64, ps) == ok, ps


def test_varlen_grid_covers_the_longest_sequence_per_head():
    assert varlen_grid(300, 8, 5, 128) == (3 * 8, 1, 5)
    with pytest.raises(ValueError, match="grid"):
        varlen_grid(64, 1, 70000, 64)


def _packed(batch: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) -> (B * S, H, D), sequences one after another."""
    return batch.transpose(1, 2).reshape(-1, batch.shape[1], batch.shape[3])


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 3), s=st.integers(1, 9), causal=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_varlen_reference_of_equal_lengths_is_the_dense_batch(b, s, causal, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.arange(b + 1, dtype=torch.int32) * s
    out, lse = reference.attention_varlen(_packed(q), _packed(k), _packed(v), cu, cu,
                                          causal=causal, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    torch.testing.assert_close(out, _packed(ref))
    torch.testing.assert_close(lse, ref_lse.transpose(0, 1).reshape(4, -1))


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(0, 40), min_size=1, max_size=4),
       page_size=st.sampled_from([1, 3, 16]), causal=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_paged_reference_reads_the_pages_the_table_names(lens, page_size, causal, seed):
    """Sequences laid into shuffled pages: the paged reference equals the dense reference of
    each sequence's own keys."""
    g = torch.Generator().manual_seed(seed)
    b, hkv, d = len(lens), 2, 8
    max_pages = max(1, -(-max(lens) // page_size))
    pages = b * max_pages + 2
    order = torch.randperm(pages, generator=g)
    table = order[:b * max_pages].reshape(b, max_pages).to(torch.int32)
    k_cache, v_cache = (torch.randn(pages, page_size, hkv, d, generator=g, dtype=torch.float64)
                        for _ in range(2))
    q = torch.randn(b, 4, 1, d, generator=g, dtype=torch.float64)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out = reference.attention_paged(q, k_cache, v_cache, table, seqlens, causal=causal,
                                    mask_align="bottom_right")
    for i, n in enumerate(lens):
        keys = [int(table[i, j // page_size]) * page_size + j % page_size for j in range(n)]
        k = k_cache.reshape(-1, hkv, d)[keys].transpose(0, 1)[None]
        v = v_cache.reshape(-1, hkv, d)[keys].transpose(0, 1)[None]
        ref = reference.attention(q[i:i + 1], k, v, causal=causal, mask_align="bottom_right")
        torch.testing.assert_close(out[i:i + 1], ref)


SERVING_SPECS = [
    AttentionSpec(arch="sm_89", head_dim=128, causal=True, mask_align="bottom_right",
                  return_lse=True, varlen=True, config=TileConfig((64, 64))),
    AttentionSpec(arch="sm_89", dtype="bfloat16", head_dim=128, split_kv=True, paged_kv=True,
                  config=TileConfig((16, 64), warps=1, stages=2)),
    AttentionSpec(arch="sm_89", dtype="bfloat16", head_dim=128, split_kv=True, paged_kv=True,
                  page_size=16, config=TileConfig((16, 64), warps=1, stages=2)),
    AttentionSpec(arch="sm_90", head_dim=64, causal=True, mask_align="bottom_right",
                  varlen=True, paged_kv=True, window=True, config=TileConfig((64, 64))),
    # an e4m3 paged cache (the FP8 KV decode kernel): whole pages, and gathered rows
    AttentionSpec(arch="sm_89", head_dim=128, split_kv=True, paged_kv=True, kv_fp8=True,
                  page_size=16, config=TileConfig((16, 32), warps=1)),
    AttentionSpec(arch="sm_89", head_dim=128, split_kv=True, paged_kv=True, kv_fp8=True,
                  config=TileConfig((16, 32), warps=1)),
]


@pytest.fixture(scope="module")
def serving_artifacts(tmp_path_factory):
    return compiled_in_fresh_cache(SERVING_SPECS, tmp_path_factory)


@pytest.mark.parametrize("spec", SERVING_SPECS, ids=lambda s: s.name)
def test_serving_kernels_compile_with_their_abi_and_no_spills(serving_artifacts, spec):
    art = serving_artifacts[spec]
    assert len(art.params) == len(params_for(spec))  # checked against the PTX .entry
    assert_no_spills_in_loops(art, spec.name)
    body = art.ptx[art.ptx.index(".entry"):]
    sizes = set(re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*, (\d+)(?:, \d+)?;", body))
    # rows in 16-byte copies; an e4m3 cache's per-key descales one float at a time
    want = {"16", "4"} if spec.kv_fp8 else {"16"}
    assert sizes == want, f"K/V and Q rows move in 16-byte copies, got sizes {sizes}"
    if spec.varlen:  # batch from the grid's z, tiles per head from its x
        assert "%ctaid.z" in body and "%nctaid.x" in body
    if spec.paged_kv:  # block-table entries: 32-bit global loads
        assert _table_reads(art) > 0


def _table_reads(art) -> int:
    body = art.ptx[art.ptx.index(".entry"):]
    return len(re.findall(r"ld\.global(?:\.[a-z0-9]+)*\.[bsu]32", body))


def test_whole_pages_read_the_table_once_a_page(serving_artifacts):
    """A page size compiled in copies a 64-key block as four 16-key pages, each looked up once
    for K and once for V (8 reads a block); the gathering kernel looks each key's page up once
    for K and V together (64). The PTX holds each copy path once, so its counts differ less:
    at least 3x fewer reads, and fewer run-time divisions."""
    gather, whole = SERVING_SPECS[1], SERVING_SPECS[2]
    assert whole == gather.replace(page_size=16)
    reads = {s.page_size: _table_reads(serving_artifacts[s]) for s in (gather, whole)}
    assert 0 < 3 * reads[16] <= reads[0], reads
    divisions = {s.page_size: serving_artifacts[s].ptx.count("div.s32") for s in (gather, whole)}
    assert divisions[16] * 4 < divisions[0], divisions


def test_gathered_rows_look_their_page_up_once_for_k_and_v(serving_artifacts):
    """Without a compiled page size each row's page costs a table read and a division: V's
    block reuses what K's looked up. One read per copy pass of the block (two copy paths:
    ragged and whole) plus the sequence's length, not one each for K and V."""
    spec = SERVING_SPECS[1]
    c = spec.config
    passes = c.tile_n * spec.head_dim * 2 // 16 // (32 * c.warps)  # 16-byte copies
    reads = _table_reads(serving_artifacts[spec])
    assert reads <= 2 * passes + 2, (reads, passes)
    assert serving_artifacts[spec].ptx.count("div.s32") <= 2 * passes + 8


def test_registered_ops_trace_with_the_shapes_they_return():
    """Under tracing (fake tensors here, torch.compile on a GPU) the serving functions go
    through ``torch.ops.flashcore.attention_varlen`` / ``attention_paged``, whose fake
    implementations give the outputs' shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from flashcore.ops import attention_paged, attention_varlen

    def i32(*shape):
        return torch.empty(shape, dtype=torch.int32, device="cuda")

    with FakeTensorMode():
        q = torch.empty(10, 8, 64, device="cuda", dtype=torch.float16)
        k = torch.empty(12, 2, 64, device="cuda", dtype=torch.float16)
        out, lse = attention_varlen(q, k, k, i32(4), i32(4), 5, 6, causal=True, return_lse=True,
                                    mask_align="bottom_right", window=(3, 0))
        assert out.shape == q.shape and lse.shape == (8, 10) and lse.dtype == torch.float32
        cache = torch.empty(20, 16, 2, 64, device="cuda", dtype=torch.float16)
        qd = torch.empty(3, 8, 1, 64, device="cuda", dtype=torch.float16)
        out, lse = attention_paged(qd, cache, cache, i32(3, 4), i32(3), return_lse=True)
        assert out.shape == qd.shape and lse.shape == (3, 8, 1)
        out, lse = attention_paged(q, cache, cache, i32(3, 4), i32(3), return_lse=True,
                                   cu_seqlens_q=i32(4), max_seqlen_q=5)
        assert out.shape == q.shape and lse.shape == (8, 10)
        assert attention_varlen(q, k, k, i32(4), i32(4), 5, 6).shape == q.shape
        cache8 = torch.empty(20, 16, 2, 64, device="cuda", dtype=torch.float8_e4m3fn)
        scales = torch.empty(20, 16, 2, device="cuda")
        out = attention_paged(qd, cache8, cache8, i32(3, 4), i32(3), k_descale=scales,
                              v_descale=scales)
        assert out.shape == qd.shape and out.dtype == qd.dtype

    def f(q, k, cu, cache, table, lens):
        return (attention_varlen(q, k, k, cu, cu, 5, 6, tile=(64, 64)),
                attention_paged(q, cache, cache, table, lens, cu_seqlens_q=cu, max_seqlen_q=5))

    args = (torch.empty(10, 8, 64, dtype=torch.float16), torch.empty(12, 2, 64, dtype=torch.float16),
            torch.zeros(4, dtype=torch.int32), torch.empty(20, 16, 2, 64, dtype=torch.float16),
            torch.zeros(3, 4, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    code = make_fx(f, tracing_mode="fake")(*args).code
    assert "flashcore.attention_varlen" in code and "flashcore.attention_paged" in code


def _fault(faults):
    """The message the serving functions would raise for these checks (None: all pass)."""
    from flashcore.ops.table_checks import raise_faults

    try:
        raise_faults("op", faults)
    except ValueError as e:
        return str(e)
    return None


def test_offsets_and_tables_are_checked_as_documented():
    """The device-side checks of ``check_lengths`` (torch ops, run here on CPU tensors)."""
    from flashcore.ops.table_checks import cu_seqlens_faults, table_faults

    def cu(*xs):
        return torch.tensor(xs, dtype=torch.int32)

    assert _fault(cu_seqlens_faults("cu", cu(0, 3, 3, 7), 7, 4)) is None
    assert _fault(cu_seqlens_faults("cu", cu(0), 0, 0)) is None  # an empty batch
    assert _fault([]) is None  # no check asked for
    for bad, what in ((cu(1, 3), "cu\\[0\\] must be 0"), (cu(0, 4, 3), "must not decrease"),
                      (cu(0, 3, 9), "past the packed tensor's 7 rows"),
                      (cu(0, 5, 7), "longer than its max_seqlen \\(4\\)")):
        assert re.search(what, _fault(cu_seqlens_faults("cu", bad, 7, 4)) or ""), what
    table = torch.tensor([[3, 0, -1], [1, 2, 9]], dtype=torch.int32)  # 4 pages of 16
    assert _fault(table_faults(cu(20, 32), table, 4, 16)) is None  # -1 and 9 never reached
    assert _fault(table_faults(cu(0, 0), table, 4, 16)) is None
    for lens, what in ((cu(-1, 3), ">= 0"), (cu(49, 1), "over the block table's 3 pages x 16"),
                       (cu(33, 1), "outside 0..3"), (cu(1, 33), "outside 0..3")):
        assert re.search(what, _fault(table_faults(lens, table, 4, 16)) or ""), what
    edge = torch.tensor([[4]], dtype=torch.int32)  # one past the last page
    assert "outside 0..3" in (_fault(table_faults(cu(1), edge, 4, 16)) or "")
    assert _fault(table_faults(cu(1), edge - 1, 4, 16)) is None



def test_a_repeated_paged_call_is_checked_once_and_launches_as_the_general_path():
    """A decode-layout paged call repeated with the same layouts (a serving loop's layers) runs
    the shape checks and the config once, launches exactly what the unmemoised path launches,
    and still checks each call's tables with check_lengths; a negative scale still negates q."""
    from unittest import mock

    from flashcore.ops import serving

    launched, work, arrivals = [], torch.empty(1 << 20), torch.zeros(64, dtype=torch.int32)
    b, h, hkv, d, ps = 3, 8, 2, 64, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, 1, d, generator=g).half()
    kc, vc = (torch.randn(24, ps, hkv, d, generator=g).half() for _ in range(2))
    table = torch.randperm(24, generator=g).to(torch.int32)[:18].view(3, 6)
    lens = torch.tensor([5, 96, 40], dtype=torch.int32)
    out = torch.empty_like(q)
    with (stubbed_device(launched, scratch=lambda like, n, c=0: (work, arrivals) if c else work),
          mock.patch.object(serving, "checking", side_effect=lambda op, check: check),
          mock.patch.object(serving, "check_heads", wraps=serving.check_heads) as checks):
        serving._paged_calls.clear()

        def call(tile=(64, 64), lengths=lens, scale=None, check=False):
            return serving.run_paged(q, kc, vc, table, lengths, True, scale, tile=tile,
                                     out=out, check_lengths=check)

        for _ in range(3):
            assert call() is out
        assert checks.call_count == 1
        memoised = launched[-len(launched) // 3:]  # the last call's launches
        launched.clear()
        call(tile=[64, 64])  # a list is not a memo key: the general path, every check
        assert checks.call_count == 2 and launched == memoised
        call(check=True)
        with pytest.raises(ValueError, match="block table"):
            call(lengths=torch.tensor([5, 200, 40], dtype=torch.int32), check=True)
        for _ in range(2):  # checked, then memoised: q negated both times
            launched.clear()
            call(scale=-0.125)
            assert launched[0][1][0][0] != q.data_ptr()
        serving._paged_calls.clear()


def test_alibi_slopes_follow_a_packed_batch_split_over_launches():
    """A packed batch with more sequences than the grid's z holds launches in slices; each
    slice's (batch, heads) ALiBi slopes start at its first sequence's row (per-head slopes stay
    one row with batch stride 0)."""
    from flashcore.compiler.abi import MAX_GRID_Z
    from flashcore.ops import serving

    h, n = 4, MAX_GRID_Z + 3
    q = torch.randn(n, h, 64).half()
    cu = torch.arange(n + 1, dtype=torch.int32)
    for slopes, stride in ((torch.rand(n, h), h), (torch.rand(h), 0)):
        launched: list = []
        with stubbed_device(launched):
            serving.run_varlen(q, q, q, cu, cu, 1, 1, True, mask_align="bottom_right",
                               alibi_slopes=slopes, check_lengths=False,
                               config=TileConfig((64, 64)))
        bias = [next(a for a in args if len(a) == 4 and a[0] >= slopes.data_ptr()
                     and a[0] < slopes.data_ptr() + 4 * slopes.numel())
                for _, args in launched]
        assert [grid[2] for grid, _ in launched] == [MAX_GRID_Z, 3]
        assert bias == [(slopes.data_ptr(), MAX_GRID_Z, h, stride),
                        (slopes.data_ptr() + 4 * MAX_GRID_Z * stride, 3, h, stride)]
    with (stubbed_device([]),
          pytest.raises(ValueError, match=r"alibi_slopes must be float32 of shape \(4,\)")):
        serving.run_varlen(q, q, q, cu, cu, 1, 1, alibi_slopes=torch.rand(2, h),
                           check_lengths=False)


def test_a_paged_kernel_compiles_its_page_size_in_where_its_family_copies_such_pages():
    """``launcher.loaded_kernel``: mma_sync compiles pages of 16 in and gathers pages of 24; the
    Hopper family compiles pages of whole key blocks in, and pages a block holds a whole number
    of in boxes of 16 rows or more, and refuses the others by name."""
    from unittest import mock

    from flashcore.ops import launcher
    from flashcore.ops.masks import NO_MASK

    def key(config, page_size):
        return launcher.KernelKey("float16", 128, config, True, False, "fp16", "token", False,
                                  False, False, NO_MASK.spec_fields, False, page_size, False)

    ws = TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws")
    with (mock.patch.object(launcher, "arch_of", return_value="sm_90"),
          mock.patch.object(launcher, "kernel_for", side_effect=lambda spec, dev: spec)):
        assert launcher.loaded_kernel(0, key(TileConfig((64, 64)), 16)).page_size == 16
        gathered = launcher.loaded_kernel(0, key(TileConfig((64, 64)), 24))
        assert gathered.paged_kv and gathered.page_size == 0
        for page_size in (256, 128, 64, 16):
            assert launcher.loaded_kernel(0, key(ws, page_size)).page_size == page_size
        for page_size in (24, 8):
            with pytest.raises(SpecError, match="page size compiled in, a multiple of tile_n"):
                launcher.loaded_kernel(0, key(ws, page_size))
