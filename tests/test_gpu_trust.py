"""GPU trust properties: any view of the inputs gives the right numbers; tables that lie never
make a kernel read or write outside its tensors; ``out=`` is checked in every entry point; grids
are folded where a batch outgrows a grid dimension; quantisers refuse non-finite input."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flashcore import reference
from flashcore.ops import attention, attention_paged, attention_varlen
from flashcore.ops.fp8 import attention_fp8, quantize_fp8, quantize_paged_cache
from tests.gpu_utils import allowed_error, max_abs, requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
GUARD = 4096  # elements of sentinel after an output


def _sdpa_error(q, k, v, causal, ref):
    """SDPA's own error against the float64 reference (the bound's yardstick)."""
    group = q.shape[1] // k.shape[1]
    # fresh copies: contiguous() keeps a misaligned base, on which SDPA's kernels fault
    qq, kk, vv = (t.repeat_interleave(n, dim=1).clone(memory_format=torch.contiguous_format)
                  for t, n in ((q, 1), (k, group), (v, group)))
    base = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
    return max_abs(base, ref)


def _check(out, q, k, v, causal, what):
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), f"{what}: NaN or unwritten elements"
    ref = reference.attention(q, k, v, causal=causal, device=q.device)
    err, allowed = max_abs(out, ref), allowed_error(_sdpa_error(q, k, v, causal, ref), ref, q.dtype,
                                               q, k, v)
    assert err <= allowed, f"{what}: max err {err:.3g}, allowed {allowed:.3g}"


def _view(base_shape, kind: str, offset: int, dtype, gen) -> torch.Tensor:
    """A (B, H, S, D) tensor as a ``kind`` of view over fresh random memory."""
    B, H, S, D = base_shape
    dev = "cuda"

    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device=dev, generator=gen)

    if kind == "offset":  # contiguous, at ``offset`` elements past an aligned base
        n = B * H * S * D
        return randn(n + offset)[offset:].view(B, H, S, D)
    if kind == "row_stride":  # rows padded by ``offset`` elements (an odd row stride)
        return randn(B, H, S, D + offset)[..., :D]
    if kind == "transposed":  # (B, S, H, D) memory seen as (B, H, S, D)
        return randn(B, S, H, D).transpose(1, 2)
    if kind == "expanded":  # one batch broadcast (stride 0)
        return randn(1, H, S, D).expand(B, H, S, D)
    if kind == "packed_projection":  # q, k, v side by side in one (B, S, 3H, D) projection
        return randn(B, S, 3 * H, D)[:, :, H:2 * H].transpose(1, 2)
    if kind == "last_dim_stride":  # every other element of the last dim
        return randn(B, H, S, 2 * D)[..., ::2]
    if kind == "offset_transposed":  # a transposed view starting ``offset`` elements in
        n = B * S * H * D
        return randn(n + offset)[offset:].view(B, S, H, D).transpose(1, 2)
    raise AssertionError(kind)


VIEW_KINDS = ["offset", "row_stride", "transposed", "expanded", "packed_projection",
              "last_dim_stride", "offset_transposed"]


@settings(settings.get_profile("gpu"))
@given(kinds=st.tuples(*(st.sampled_from(VIEW_KINDS),) * 3), offset=st.integers(1, 9),
       b=st.integers(1, 3), h=st.sampled_from([1, 2, 4]), sq=st.integers(1, 200),
       sk=st.integers(1, 200), d=st.sampled_from([64, 128]),
       dtype=st.sampled_from(["float16", "bfloat16"]), causal=st.booleans(),
       tile=st.sampled_from([None, (64, 64)]), seed=st.integers(0, 2**31 - 1))
@example(kinds=("row_stride", "offset", "offset"), offset=1, b=2, h=4, sq=100, sk=100, d=64,
         dtype="float16", causal=False, tile=(64, 64), seed=0)
@example(kinds=("offset", "offset", "offset"), offset=1, b=2, h=4, sq=100, sk=100, d=64,
         dtype="float16", causal=True, tile=None, seed=1)
def test_any_view_gives_the_right_numbers(kinds, offset, b, h, sq, sk, d, dtype, causal, tile,
                                          seed):
    """Misaligned bases, odd row strides, transposes, expands and slices of packed projections
    read as the tensors they are (the kernels' alignment assumptions never meet such a view:
    they are copied first)."""
    gen = torch.Generator("cuda").manual_seed(seed)
    dt = DTYPES[dtype]
    q = _view((b, h, sq, d), kinds[0], offset, dt, gen)
    k = _view((b, h, sk, d), kinds[1], offset, dt, gen)
    v = _view((b, h, sk, d), kinds[2], offset, dt, gen)
    out = attention(q, k, v, tile=tile, causal=causal)
    _check(out, q, k, v, causal, f"views {kinds}")


def test_misaligned_output_is_refused_with_a_clear_error():
    q = torch.randn(1, 2, 64, 64, dtype=torch.float16, device="cuda")
    out = torch.empty(q.numel() + 1, dtype=torch.float16, device="cuda")[1:].view(q.shape)
    with pytest.raises(ValueError, match="out needs .*16-byte aligned"):
        attention(q, q, q, out=out)


def _guarded(shape, dtype, fill=float("nan")):
    """(out, guard): ``out`` of ``shape`` followed in memory by GUARD sentinel elements."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.full((n + GUARD,), fill, dtype=dtype, device="cuda")
    buf[n:] = 7.0
    return buf[:n].view(shape), buf[n:]


def test_varlen_tables_that_lie_never_write_past_out():
    """Unchecked offsets past the packed tensor, wrapped int32 offsets and a max_seqlen_q below
    a real length: no fault, nothing written past out, no stale row."""
    H, D = 4, 64
    total = 300
    q, k, v = (torch.randn(total, H, D, dtype=torch.float16, device="cuda") for _ in range(3))
    bad_tables = [
        [0, 100, 400],                     # past the end
        [0, 2**31 - 1, -2**31 + 5],        # wrapped
        [0, 200, 100, 300],                # decreasing
    ]
    for cu_list in bad_tables:
        cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
        out, guard = _guarded((total, H, D), torch.float16)
        attention_varlen(q, k, v, cu, cu, 300, 300, out=out, check_lengths=False)
        torch.cuda.synchronize()
        assert torch.equal(guard, torch.full_like(guard, 7.0)), f"{cu_list}: wrote past out"
        assert torch.isfinite(out).all(), f"{cu_list}: rows left unwritten (stale)"
    # max_seqlen_q below a real length: rows past it are computed by no CTA, and read 0
    cu = torch.tensor([0, 200, 300], dtype=torch.int32, device="cuda")
    out, _ = _guarded((total, H, D), torch.float16)
    attention_varlen(q, k, v, cu, cu, 64, 300, out=out, check_lengths=False)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "rows past max_seqlen_q were left stale"
    assert not out[64:200].any(), "rows no CTA computes read 0"


def test_wrapped_int32_tables_are_caught_by_the_check():
    H, D = 2, 64
    q = torch.randn(16, H, D, dtype=torch.float16, device="cuda")
    cu = torch.tensor([0, 2**31 - 1, -2**31 + 5], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        attention_varlen(q, q, q, cu, cu, 16, 16)
    cache = torch.randn(8, 16, H, D, dtype=torch.float16, device="cuda")
    table = torch.zeros(1, 4, dtype=torch.int32, device="cuda")
    lens = torch.tensor([2**31 - 1], dtype=torch.int32, device="cuda")
    qd = torch.randn(1, H, 1, D, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="seqlens_k"):
        attention_paged(qd, cache, cache, table, lens)


def test_paged_tables_that_lie_never_fault():
    """Unchecked block-table entries outside the cache and key lengths past the table row:
    every read stays inside the cache (compute-sanitizer's memcheck runs this too)."""
    H, D, page_size = 2, 128, 16
    cache = torch.randn(8, page_size, H, D, dtype=torch.float16, device="cuda")
    q = torch.randn(3, 4 * H, 1, D, dtype=torch.float16, device="cuda")
    table = torch.tensor([[0, 1, 99, -5], [7, 2**31 - 1, 3, 3], [1, 1, 1, 1]],
                         dtype=torch.int32, device="cuda")
    lens = torch.tensor([64, 2**31 - 1, -7], dtype=torch.int32, device="cuda")
    out, guard = _guarded(tuple(q.shape), torch.float16)
    attention_paged(q, cache, cache, table, lens, out=out, check_lengths=False)
    attention_paged(q, cache, cache, table, lens, check_lengths=False, num_splits=3)
    qp = torch.randn(10, 4 * H, D, dtype=torch.float16, device="cuda")
    cu = torch.tensor([0, 4, 2**31 - 1, 3], dtype=torch.int32, device="cuda")
    outp, guardp = _guarded(tuple(qp.shape), torch.float16)
    attention_paged(qp, cache, cache, table, lens, cu_seqlens_q=cu, max_seqlen_q=4, out=outp,
                    check_lengths=False)
    torch.cuda.synchronize()
    assert torch.equal(guard, torch.full_like(guard, 7.0))
    assert torch.equal(guardp, torch.full_like(guardp, 7.0))
    assert torch.isfinite(outp).all(), "a packed q's rows no sequence owns were left stale"


def test_rows_no_sequence_owns_are_zero_when_checked():
    H, D = 2, 64
    q, k, v = (torch.randn(50, H, D, dtype=torch.float16, device="cuda") for _ in range(3))
    cu = torch.tensor([0, 10, 30], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    _, lse = attention_varlen(q, k, v, cu, cu, 20, 20, out=out, return_lse=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and not out[30:].any()
    assert torch.isneginf(lse[:, 30:]).all()


def test_graph_capture_says_once_what_it_trusts():
    import flashcore.ops.serving as serving

    H, D = 2, 64
    q, k, v = (torch.randn(40, H, D, dtype=torch.float16, device="cuda") for _ in range(3))
    cu = torch.tensor([0, 10, 40], dtype=torch.int32, device="cuda")
    attention_varlen(q, k, v, cu, cu, 30, 30)  # loads the kernel outside the capture
    serving._warned_capture.discard("attention_varlen")
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.cuda.graph(graph, stream=s):
            out = attention_varlen(q, k, v, cu, cu, 30, 30)
            attention_varlen(q, k, v, cu, cu, 30, 30)
    said = [w for w in seen if "trusted" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in seen]
    graph.replay()
    torch.cuda.synchronize()
    ref = attention_varlen(q, k, v, cu, cu, 30, 30)
    assert torch.equal(out, ref)


def test_serving_out_is_checked_and_bumps_the_version():
    H, D = 2, 64
    q, k, v = (torch.randn(40, H, D, dtype=torch.float16, device="cuda") for _ in range(3))
    cu = torch.tensor([0, 10, 40], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="shares memory with k"):
        attention_varlen(q, k, v, cu, cu, 30, 30, out=k)
    with pytest.raises(ValueError, match="float16"):
        attention_varlen(q, k, v, cu, cu, 30, 30, out=torch.empty_like(q, dtype=torch.float32))
    out = torch.empty_like(q)
    before = out._version
    attention_varlen(q, k, v, cu, cu, 30, 30, out=out)
    assert out._version > before
    cache = torch.randn(4, 16, H, D, dtype=torch.float16, device="cuda")
    table = torch.arange(4, dtype=torch.int32, device="cuda").view(1, 4)
    lens = torch.tensor([50], dtype=torch.int32, device="cuda")
    qd = torch.randn(1, H, 1, D, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="shares memory with k_cache"):
        attention_paged(qd, cache, cache, table, lens, out=cache[0, :1].view(1, H, 1, D))
    outd = torch.empty_like(qd)
    before = outd._version
    attention_paged(qd, cache, cache, table, lens, out=outd)
    assert outd._version > before


def test_attention_fp8_out_is_checked_and_its_operands_may_be_any_view():
    B, H, S, D = 1, 2, 96, 64
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float16, device="cuda") for _ in range(3))
    q8, qd = quantize_fp8(q, granularity="token")
    k8, kd = quantize_fp8(k, granularity="token")
    vt8, vd = quantize_fp8(v, transpose=True)
    ref = attention_fp8(q8, k8, vt8, qd, kd, vd)
    # a misaligned copy of each operand reads the same
    shifted = []
    for t in (q8, k8, vt8):
        buf = torch.empty(t.numel() + 3, dtype=t.dtype, device="cuda")
        view = buf[3:].view(t.shape)
        view.copy_(t)
        shifted.append(view)
    assert torch.equal(attention_fp8(*shifted, qd, kd, vd), ref)
    # an out whose bytes begin inside q8's
    n = q8.numel()
    buf = torch.empty(3 * n, dtype=torch.uint8, device="cuda")
    q8_in = buf[:n].view(torch.float8_e4m3fn).view(q8.shape)
    q8_in.copy_(q8)
    clash = buf[n // 2:n // 2 + 2 * n].view(torch.float16).view(B, H, S, D)
    with pytest.raises(ValueError, match="shares memory with q8"):
        attention_fp8(q8_in, k8, vt8, qd, kd, vd, out=clash)
    out = torch.empty_like(ref)
    before = out._version
    attention_fp8(q8, k8, vt8, qd, kd, vd, out=out)
    assert out._version > before and torch.equal(out, ref)


def test_quantisers_and_varlen_fold_grids_past_65535():
    # quantize_fp8: 70,000 batches of one token
    x = torch.randn(70_000, 1, 1, 64, dtype=torch.float16, device="cuda")
    for gran in ("head", "token"):
        x8, d = quantize_fp8(x, granularity=gran)
        back = x8.float() * (d if gran == "head" else d[..., None]).view(70_000, 1, -1, 1)
        assert (back - x.float()).abs().max() <= 0.07 * x.float().abs().max()
    cache = torch.randn(70_000, 1, 1, 64, dtype=torch.float16, device="cuda")
    c8, cd = quantize_paged_cache(cache)
    assert (c8.float() * cd[..., None] - cache.float()).abs().max() <= 0.07 * cache.abs().max()
    # 65,537 sequences, most of one token (their output is their one key's value)
    n = 65_537
    lens = [1] * (n - 2) + [0, 70]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    total = sum(lens)
    q, k, v = (torch.randn(total, 2, 64, dtype=torch.float16, device="cuda") for _ in range(3))
    out = attention_varlen(q, k, v, cu, cu, 70, 70)
    torch.cuda.synchronize()
    assert torch.equal(out[:n - 2], v[:n - 2])
    tail = reference.attention(q[-70:].transpose(0, 1)[None], k[-70:].transpose(0, 1)[None],
                               v[-70:].transpose(0, 1)[None], device=q.device)
    assert max_abs(out[-70:].transpose(0, 1)[None], tail) < 2e-3


@pytest.mark.parametrize("granularity,transpose", [("head", False), ("token", False),
                                                   ("head", True)])
def test_quantisers_refuse_non_finite_input(granularity, transpose):
    x = torch.randn(2, 3, 64, 64, dtype=torch.float16, device="cuda")
    x[1, 2, 5, 7] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_fp8(x, granularity=granularity, transpose=transpose)
    x[1, 2, 5, 7] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_fp8(x, granularity=granularity, transpose=transpose)
    cache = torch.randn(4, 16, 2, 64, dtype=torch.float16, device="cuda")
    cache[3, 1, 0, 0] = float("-inf")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_paged_cache(cache)
