"""Every kernel family on ragged shapes, small enough for compute-sanitizer (run by
scripts/sanitize.sh under memcheck, racecheck and synccheck). Each case checks its result against
the float64 reference, so a kernel that misbehaves only under the sanitizer shows too.

    python scripts/sanitize_cases.py [all|splits-equal|splits-unequal|fp8-kv|masks|varlen|paged|
                                      fp8-paged|wgmma|wgmma-fp8|wgmma-masks|wgmma-head-dims|
                                      wgmma-varlen|wgmma-paged|wgmma-tile-n|
                                      fp8-khead|serving|
                                      hostile|backward|backward-deterministic|
                                      backward-varlen|backward-hopper|kv-splits|
                                      head-dims]

``hostile``: misaligned and strided views, and serving tables that lie with their checks off
(offsets past the tensors, wrapped and decreasing; pages outside the cache, lengths past the
table): memcheck must see no access outside the tensors, and each output stays finite.
``backward``: the backward kernels on ragged shapes, against float64 autograd;
``backward-deterministic``: the same and more key blocks per query block, dQ's adds in turns;
``backward-varlen``: a packed batch's backward (empty sequences, blocks past a sequence's end).
``backward-hopper``: the three above on the Hopper backward (sm_90).
``head-dims``: the head dims only the 16-bit forward builds (32, 80, 96, 256) on ragged shapes:
prefill (tuned and explicit tiles), GQA decode split over CTAs and its combine, masks, varlen
and paged.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from flashcore import reference
from flashcore.ops import attention, attention_paged, attention_varlen
from flashcore.ops.fp8 import attention_fp8, quantize_fp8
from flashcore.runtime.device import arch_of
from flashcore.specs import TileConfig


def qkv(b, hq, hkv, sq, sk, d, dtype=torch.float16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=g)
                 for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))


def check(name, out, q, k, v, causal, tol=2e-2, **masks):
    ref = reference.attention(q, k, v, causal=causal, device=q.device, **masks)
    if out.numel() == 0:
        print(f"ok  {name}: empty", flush=True)
        return True
    err = (out.double() - ref).abs().max().item()
    ok = torch.isfinite(out).all().item() and err < tol * max(1.0, ref.abs().max().item())
    print(f"{'ok ' if ok else 'BAD'} {name}: max err {err:.2e}", flush=True)
    return ok


def split_cases(equal: bool):
    # key splits inside a CTA: 2 groups; 256 keys = 4 blocks of 64 split 2 + 2 (equal), or
    # 200 keys = 4 blocks, and causal rows whose groups walk 1 and 0 blocks (unequal)
    sk = 256 if equal else 200
    for causal in ((False,) if equal else (False, True)):
        for tile, warps in (((64, 64), 4), ((32, 64), 1)):
            q, k, v = qkv(1, 2, 2, 64 if equal else 77, sk, 64)
            out = attention(q, k, v, causal=causal, tile=tile, warps=warps, kv_splits=2,
                            return_lse=True)[0]
            yield check(f"kv_splits=2 {tile} w{warps} sk={sk} causal={causal}", out, q, k, v,
                        causal)


def fp8_kv_cases(causal: bool, shapes):
    # FP8 KV cache decode with the default config (one warp, short shares, combine)
    for shape in shapes:
        q, k, v = qkv(*shape)
        k8, kd = quantize_fp8(k, granularity="token")
        v8, vd = quantize_fp8(v, granularity="token")
        kq, vq = k8.double() * kd.double()[..., None], v8.double() * vd.double()[..., None]
        out = attention(q, k8, v8, causal=causal, k_descale=kd, v_descale=vd)
        yield check(f"fp8 kv cache {shape} causal={causal}", out, q, kq, vq, causal)


def decode_cases():
    # the combine over many shares (more than its 128 threads, up to MAX_SPLITS, passes that
    # run past the last share, shares that see no key), and the FP8 KV cache read in registers
    # in each kind of config (ring depth, key tile, warps, in-CTA key split); ragged, GQA
    for d, sk, splits, causal in ((64, 300, 201, False), (128, 70, 256, True),
                                  (128, 64 * 130 - 5, 130, False)):
        q, k, v = qkv(1, 8, 2, 1, sk, d, torch.bfloat16, seed=splits)
        out, _ = attention(q, k, v, causal=causal, num_splits=splits, return_lse=True,
                           config=TileConfig((16, 64), warps=1, stages=2))
        yield check(f"combine d{d} sk={sk} splits={splits} causal={causal}", out, q, k, v,
                    causal)
    for config in (TileConfig((16, 32), warps=1), TileConfig((16, 64), warps=1, stages=3),
                   TileConfig((16, 128), warps=1, stages=2),
                   TileConfig((32, 64), warps=2, stages=2, kv_splits=2),
                   TileConfig((64, 64), warps=4, stages=2)):
        for b, hq, hkv, sq, sk, d, causal, dtype in ((1, 8, 2, 1, 333, 128, False, torch.float16),
                                                     (1, 2, 1, 37, 150, 64, True, torch.bfloat16)):
            q, k, v = qkv(b, hq, hkv, sq, sk, d, dtype, seed=sk)
            k8, kd = quantize_fp8(k, granularity="token")
            v8, vd = quantize_fp8(v, granularity="token")
            kq, vq = k8.double() * kd.double()[..., None], v8.double() * vd.double()[..., None]
            out, _ = attention(q, k8, v8, causal=causal, k_descale=kd, v_descale=vd,
                               config=config, return_lse=True)  # the GPU tests' kernels
            yield check(f"fp8 kv {config.tag} {(b, hq, hkv, sq, sk, d)} causal={causal}", out,
                        q, kq, vq, causal)


def packed_tokens_cases():
    # GQA decode with a K/V head's rows packed: multi-token (token, head) rows token-major
    # (ops.plan.packs_tokens, gathered and scattered by the kernel) and one token's heads past
    # 16: ragged keys, bottom-right causal, a window, top-left causal, split and not, FP8 KV;
    # tiles of 16, 32 (17-32 rows, and past 64) and 64 rows (ops.plan.packed_rows_config),
    # ragged in rows too
    for b, hq, hkv, sq, sk, d, causal, align, window, splits in (
            (1, 8, 2, 3, 777, 128, True, "bottom_right", None, None),
            (2, 12, 4, 5, 301, 64, True, "bottom_right", (60, 0), 3),
            (1, 16, 2, 2, 1000, 128, True, "top_left", None, None),
            (1, 32, 8, 4, 4093, 128, False, "top_left", None, 1),
            (2, 16, 4, 7, 999, 64, True, "bottom_right", None, None),
            (1, 32, 4, 6, 3001, 128, False, "top_left", None, None),
            (3, 6, 2, 15, 45, 128, True, "bottom_right", (20, 0), 1),
            (1, 24, 1, 4, 1500, 128, False, "top_left", None, None),  # 96 rows: 3 of 32
            (1, 64, 2, 1, 3001, 128, False, "top_left", None, None),  # one token, 32 heads
            (1, 48, 1, 1, 2000, 64, True, "bottom_right", None, None)):  # 48 heads, 64 rows
        q, k, v = qkv(b, hq, hkv, sq, sk, d, torch.bfloat16, seed=sk)
        masks = {"mask_align": align, "window": window}
        out, _ = attention(q, k, v, causal=causal, num_splits=splits, return_lse=True, **masks)
        yield check(f"packed tokens {(b, hq, hkv, sq, sk, d)} causal={causal} {align} "
                    f"window={window} splits={splits}", out, q, k, v, causal, **masks)
    # FP8 KV: 12 rows (16-row tile), 32 (32), 64 (64, d64) and one token's 32 heads (32)
    for shape in ((1, 8, 2, 3, 555, 128), (1, 16, 2, 4, 777, 128), (1, 8, 1, 8, 999, 64),
                  (1, 32, 1, 1, 555, 128)):
        q, k, v = qkv(*shape, seed=5)
        k8, kd = quantize_fp8(k, granularity="token")
        v8, vd = quantize_fp8(v, granularity="token")
        kq, vq = k8.double() * kd.double()[..., None], v8.double() * vd.double()[..., None]
        out = attention(q, k8, v8, causal=True, mask_align="bottom_right", k_descale=kd,
                        v_descale=vd)
        yield check(f"packed tokens fp8 kv {shape} bottom_right", out, q, kq, vq, True,
                    mask_align="bottom_right")


def mask_cases():
    # bottom-right causal, windows, soft-capping: prefill (rows that see no key included) and
    # decode (packed GQA rows, split-KV), ragged everywhere; LSE on (the built kernels)
    for b, hq, hkv, sq, sk, d, causal, masks in (
            (2, 2, 2, 77, 300, 64, True, {"mask_align": "bottom_right", "window": (50, 0),
                                           "softcap": 20.0}),
            (1, 4, 2, 300, 77, 128, True, {"mask_align": "bottom_right"}),
            (1, 2, 1, 100, 130, 64, False, {"window": (20, 30)}),
            (1, 2, 2, 65, 65, 128, False, {"softcap": 5.0}),
            (2, 8, 2, 1, 1000, 128, True, {"mask_align": "bottom_right", "window": (300, 0)}),
            (1, 4, 4, 1, 517, 64, False, {"window": (100, -1), "softcap": 30.0})):
        q, k, v = qkv(b, hq, hkv, sq, sk, d, torch.bfloat16 if d == 128 else torch.float16)
        out, _ = attention(q, k, v, causal=causal, return_lse=True, **masks)
        yield check(f"masks {(b, hq, hkv, sq, sk, d)} causal={causal} {masks}", out, q, k, v,
                    causal, **masks)


def varlen_cases(tile=None):
    # packed batches: empty and one-token sequences, queries without keys, chunked-prefill
    # lengths; bottom-right causal, and a two-sided window with soft-capping ((64, 64) kernels,
    # or the Hopper family's ``config``)
    from flashcore.errors import SpecError

    tile = tile or {"tile": (64, 64)}
    g = torch.Generator(device="cuda").manual_seed(0)
    lq, lk = [0, 1, 77, 130, 5], [3, 1, 200, 130, 0]
    cq, ck = ([0, *torch.tensor(x).cumsum(0).tolist()] for x in (lq, lk))
    q = torch.randn(cq[-1], 4, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(ck[-1], 2, 128, device="cuda", generator=g, dtype=torch.bfloat16)
            for _ in range(2))
    cu = [torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cq, ck)]
    for causal, masks in ((True, {"mask_align": "bottom_right"}),
                          (False, {"window": (20, 10), "softcap": 10.0})):
        try:
            out, _ = attention_varlen(q, k, v, *cu, max(lq), max(lk), causal=causal,
                                      return_lse=True, **masks, **tile)
        except SpecError:  # a soft-cap beside a mask on the Hopper family's 192x128 at d128
            print(f"skip varlen {tile} causal={causal} {masks}: not built", flush=True)
            continue
        ok = True
        for b in range(len(lq)):
            rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            ok &= check(f"varlen seq {b} ({lq[b]}x{lk[b]}) causal={causal} {masks}",
                        *(t[r].transpose(0, 1)[None] for t, r in ((out, rq), (q, rq), (k, rk),
                                                                  (v, rk))), causal, **masks)
        yield ok


def paged_cases():
    # a paged cache with shuffled pages: decode split over CTAs with packed GQA rows (tuned
    # kernels), prefill ((64, 64) kernels); pages copied whole (16: four a block; 128: a block
    # inside one) and gathered (24 and 8 fit no copy pass), an empty sequence
    tile = {"tile": (64, 64)}
    g = torch.Generator(device="cuda").manual_seed(1)
    for page, sq, lens, extra in ((16, 1, [300, 1, 0, 129], {}), (24, 1, [517], {"num_splits": 3}),
                                  (128, 70, [200, 70], tile), (8, 33, [100, 40], tile)):
        n = max(1, -(-max(lens) // page))
        pages = len(lens) * n + 1
        table = torch.randperm(pages, device="cuda", generator=g)[:len(lens) * n]
        table = table.view(len(lens), n).to(torch.int32)
        kc, vc = (torch.randn(pages, page, 2, 64, device="cuda", generator=g, dtype=torch.float16)
                  for _ in range(2))
        q = torch.randn(len(lens), 8, sq, 64, device="cuda", generator=g, dtype=torch.float16)
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        out, _ = attention_paged(q, kc, vc, table, seqlens, causal=True, return_lse=True,
                                 mask_align="bottom_right", **extra)
        ok = True
        for b, length in enumerate(lens):
            kb, vb = (reference.gather_pages(c, table, length, b) for c in (kc, vc))
            ok &= check(f"paged page {page} sq={sq} len {length}", out[b:b + 1], q[b:b + 1], kb,
                        vb, True, mask_align="bottom_right")
        yield ok
    # chunked prefill: each sequence's new tokens packed, against its pages (copied whole)
    lq, lens, page = [5, 0, 64, 1], [70, 0, 64, 300], 16
    n = -(-max(lens) // page)
    table = torch.randperm(4 * n, device="cuda", generator=g).view(4, n).to(torch.int32)
    kc, vc = (torch.randn(4 * n, page, 2, 64, device="cuda", generator=g, dtype=torch.float16)
              for _ in range(2))
    cq = [0, *torch.tensor(lq).cumsum(0).tolist()]
    q = torch.randn(cq[-1], 8, 64, device="cuda", generator=g, dtype=torch.float16)
    out, _ = attention_paged(q, kc, vc, table, torch.tensor(lens, dtype=torch.int32,
                                                           device="cuda"),
                             causal=True, return_lse=True, mask_align="bottom_right",
                             cu_seqlens_q=torch.tensor(cq, dtype=torch.int32, device="cuda"),
                             max_seqlen_q=max(lq), **tile)
    ok = True
    for b, length in enumerate(lens):
        kb, vb = (reference.gather_pages(c, table, length, b) for c in (kc, vc))
        rows = slice(cq[b], cq[b + 1])
        ok &= check(f"packed chunk {lq[b]} of {length}, page {page}",
                    out[rows].transpose(0, 1)[None], q[rows].transpose(0, 1)[None], kb, vb, True,
                    mask_align="bottom_right")
    yield ok


def fp8_paged_cases():
    # an e4m3 paged cache (the FP8 KV decode config): pages copied whole (16, 128) and gathered
    # (24), decode split over CTAs with packed GQA rows, a ragged prefill chunk, an empty sequence
    from flashcore.ops.fp8 import quantize_paged_cache

    g = torch.Generator(device="cuda").manual_seed(2)
    for page, sq, lens, d in ((16, 1, [300, 1, 0, 129], 128), (128, 1, [517, 33], 64),
                              (24, 19, [100, 40], 64), (16, 5, [37], 128)):
        n = max(1, -(-max(lens) // page))
        pages = len(lens) * n + 1
        table = torch.randperm(pages, device="cuda", generator=g)[:len(lens) * n]
        table = table.view(len(lens), n).to(torch.int32)
        (kc, kd), (vc, vd) = (quantize_paged_cache(torch.randn(
            pages, page, 2, d, device="cuda", generator=g, dtype=torch.float16)) for _ in range(2))
        q = torch.randn(len(lens), 8, sq, d, device="cuda", generator=g, dtype=torch.float16)
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        out = attention_paged(q, kc, vc, table, seqlens, causal=True, mask_align="bottom_right",
                              k_descale=kd, v_descale=vd)
        ok = True
        for b, length in enumerate(lens):
            kb, vb = (reference.gather_pages(c.double() * s.double()[..., None], table, length, b)
                      for c, s in ((kc, kd), (vc, vd)))
            ok &= check(f"fp8 paged page {page} d{d} sq={sq} len {length}", out[b:b + 1],
                        q[b:b + 1], kb, vb, True, mask_align="bottom_right")
        yield ok


def wgmma_cases():
    yield from wgmma_16bit_cases()
    yield from wgmma_fp8_cases()


def wgmma_16bit_cases():
    # the Hopper family (sm_90): ragged lengths (S_q != S_k, not multiples of the tile, 1),
    # GQA, causal rows with no key, 2- and 3-block rings wrapping around (700 keys: 6-11 blocks)
    from flashcore.specs import TileConfig

    for tile, warps, stages in (((128, 128), 8, 2), ((64, 128), 4, 3), ((128, 64), 8, 3),
                                ((64, 64), 4, 3), ((192, 64), 12, 2), ((192, 128), 12, 2)):
        config = TileConfig(tile, warps=warps, stages=stages, family="wgmma_ws")
        for sq, sk, d, causal in ((77, 200, 64, True), (300, 45, 128, True), (1, 1, 128, False),
                                  (130, 257, 128, False), (200, 700, 64, False),
                                  (500, 500, 64, True)):  # masked steps, then unmasked ones
            q, k, v = qkv(1, 4, 2, sq, sk, d, seed=sq + sk)
            out = attention(q, k, v, causal=causal, config=config)
            yield check(f"wgmma {config} sq={sq} sk={sk} d{d} causal={causal}", out, q, k, v,
                        causal)
        q, k, v = qkv(2, 9, 3, 100, 130, 64, seed=9)  # 18 (batch, head) pairs: 3 grid sections
        out = attention(q, k, v, causal=True, config=config)
        yield check(f"wgmma {config} 2x9 heads causal", out, q, k, v, True)


def wgmma_fp8_cases():
    # FP8 operands in the warp-specialised family (e4m3 wgmma): 128- and 64-key Vᵀ tiles,
    # three consumers taking turns; ragged, GQA, S = 1, causal rows with no key
    from flashcore.specs import TileConfig

    for tile, warps, stages in (((128, 128), 8, 2), ((128, 64), 8, 3), ((192, 128), 12, 2),
                                ((192, 64), 12, 3), ((64, 64), 4, 2)):  # 64x64: short and d64 mid
        config = TileConfig(tile, warps=warps, stages=stages, family="wgmma_ws")
        for sq, sk, d, causal in ((77, 200, 64, True), (1, 1, 128, False),
                                  (130, 257, 128, False), (200, 700, 64, True),
                                  (500, 500, 64, True)):
            q, k, v = qkv(1, 4, 2, sq, sk, d, seed=sq + sk)
            out = attention(q, k, v, causal=causal, config=config, precision="fp8")
            yield check(f"wgmma fp8 {config} sq={sq} sk={sk} d{d} causal={causal}", out, q, k,
                        v, causal, tol=0.1)


def launched_families(fn, *args, **kwargs) -> tuple:
    """(what ``fn(*args, **kwargs)`` returns, the kernel families it launched)."""
    from unittest import mock

    from flashcore.ops import launcher

    seen, real = [], launcher.launch

    def record(kern, grid, args, device):
        seen.append(kern.artifact.spec.family)
        return real(kern, grid, args, device)

    with mock.patch.object(launcher, "launch", side_effect=record):
        result = fn(*args, **kwargs)
    return result, seen


def wgmma_head_dim_cases():
    # the warp-specialised family at head dims 32, 80, 96 and 256 (swizzles of 64, 32, 64 and
    # 128 bytes): ragged S_q and S_k, GQA, causal and every mask, each config that builds there
    from flashcore.errors import SpecError
    from tests.gpu_utils import WGMMA_HEAD_DIM_CONFIGS

    cases = ((1, 4, 2, 77, 300, False, {}),
             (2, 2, 1, 300, 77, True, {"mask_align": "bottom_right"}),
             (1, 4, 2, 200, 333, True, {"mask_align": "bottom_right", "window": (50, 0),
                                        "softcap": 20.0}))
    for config, d, (b, hq, hkv, sq, sk, causal, masks) in itertools.product(
            WGMMA_HEAD_DIM_CONFIGS, (32, 80, 96, 256), cases):
        q, k, v = qkv(b, hq, hkv, sq, sk, d, torch.bfloat16 if d == 96 else torch.float16,
                      seed=sq + sk + d)
        name = f"wgmma_ws d{d} {config} {(b, hq, hkv, sq, sk)} causal={causal} {masks}"
        try:
            (out, _), families = launched_families(attention, q, k, v, causal=causal,
                                                   config=config, return_lse=True, **masks)
        except SpecError:  # a config this head dim does not build
            print(f"skip {name}: not built", flush=True)
            continue
        yield families == ["wgmma_ws"] and check(name, out, q, k, v, causal, **masks)


def wgmma_tile_n_cases():
    # key blocks other than 64 and 128 keys on the Hopper family (sm_90): ragged lengths above
    # and below a block, causal top-left and bottom-right, GQA, at the head dims each builds
    from flashcore.errors import SpecError
    from tests.gpu_utils import WGMMA_TILE_N_CONFIGS

    shapes = ((1, 4, 2, 77, 300, True, {}), (2, 2, 1, 333, 170, True,
                                             {"mask_align": "bottom_right"}),
              (1, 2, 2, 190, 401, False, {}))
    c80, c176, c192, c144, c112, c96 = WGMMA_TILE_N_CONFIGS  # each at the dims it is for
    pairs = ((c80, 256), (c80, 128), (c176, 128), (c192, 64), (c144, 96), (c112, 128),
             (c96, 64), (c96, 256))
    for (config, d), (b, hq, hkv, sq, sk, causal, masks) in itertools.product(pairs, shapes):
        q, k, v = qkv(b, hq, hkv, sq, sk, d, torch.bfloat16, seed=sq + d)
        name = f"wgmma_ws {config} d{d} {(b, hq, hkv, sq, sk)} causal={causal} {masks}"
        try:
            out, families = launched_families(attention, q, k, v, causal=causal,
                                              config=config, **masks)
        except SpecError:  # a block this head dim does not build (shared memory)
            print(f"skip {name}: not built", flush=True)
            continue
        yield families == ["wgmma_ws"] and check(name, out, q, k, v, causal, **masks)


def wgmma_varlen_cases():
    # packed batches on the Hopper family (sm_90): ``varlen_cases`` on two consumers and three
    from flashcore.specs import TileConfig

    for config in (TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws"),
                   TileConfig((192, 128), warps=12, stages=2, family="wgmma_ws")):
        yield from varlen_cases({"config": config})


def wgmma_paged_cases():
    # a paged cache on the Hopper family (sm_90): pages of one and two key blocks, half a
    # block and 16 rows (a box a page), shuffled, NaN past each sequence's keys (the first
    # block's V rows there are zeroed in shared memory: the consumers' barrier), an empty
    # sequence; q dense (queries that see no key) and packed (chunked prefill); a lying table
    # with its checks off stays inside the cache
    from tests.gpu_utils import WGMMA_PAGED_CONFIGS, wgmma_page_sizes

    g = torch.Generator(device="cuda").manual_seed(3)
    lens, lq = [300, 0, 129, 1], [40, 0, 129, 1]
    pages = [(c, page) for c in WGMMA_PAGED_CONFIGS for page in wgmma_page_sizes(c).values()]
    for config, page in pages:
        n = -(-max(lens) // page)
        table = torch.randperm(4 * n + 1, device="cuda", generator=g)[:4 * n]
        table = table.view(4, n).to(torch.int32)
        kc, vc = (torch.randn(4 * n + 1, page, 2, 128, device="cuda", generator=g,
                              dtype=torch.float16) for _ in range(2))
        for b, length in enumerate(lens):
            last = max(length - 1, 0) // page  # the page of its last key (empty: its first)
            for c in (kc, vc):
                c[table[b, last], length - last * page:] = float("nan")
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        name = f"wgmma_ws paged {config} page {page}"
        q = torch.randn(4, 8, 50, 128, device="cuda", generator=g, dtype=torch.float16)
        (out, _), families = launched_families(
            attention_paged, q, kc, vc, table, seqlens, causal=True, return_lse=True,
            mask_align="bottom_right", config=config)
        ok = families == ["wgmma_ws"]
        for b, length in enumerate(lens):
            kb, vb = (reference.gather_pages(c, table, length, b) for c in (kc, vc))
            ok &= check(f"{name} dense len {length}", out[b:b + 1], q[b:b + 1], kb, vb, True,
                        mask_align="bottom_right")
        cq = [0, *torch.tensor(lq).cumsum(0).tolist()]
        qp = torch.randn(cq[-1], 8, 128, device="cuda", generator=g, dtype=torch.float16)
        masks = {"mask_align": "bottom_right", "window": (100, 0), "softcap": 20.0}
        if config.warps == 12:  # a soft-cap beside a mask is not built on 192x128 at d128
            masks = {"mask_align": "bottom_right", "window": (100, 0)}
        out, _ = attention_paged(qp, kc, vc, table, seqlens, causal=True, return_lse=True,
                                 cu_seqlens_q=torch.tensor(cq, dtype=torch.int32, device="cuda"),
                                 max_seqlen_q=max(lq), config=config, **masks)
        for b, length in enumerate(lens):
            kb, vb = (reference.gather_pages(c, table, length, b) for c in (kc, vc))
            rows = slice(cq[b], cq[b + 1])
            ok &= check(f"{name} packed chunk {lq[b]} of {length} {masks}",
                        out[rows].transpose(0, 1)[None], qp[rows].transpose(0, 1)[None], kb, vb,
                        True, **masks)
        # pages past the cache and lengths past the table, unchecked: no access outside
        bad = table.clone()
        bad[0, 0], bad[2, -1] = 10**6, -5
        attention_paged(q, kc, vc, bad, seqlens + 10**4, causal=True, config=config,
                        mask_align="bottom_right", check_lengths=False)
        torch.cuda.synchronize()
        yield ok


def wgmma_masks_cases():
    # masks on the warp-specialised family (sm_90): ragged S_q above and below S_k, bottom-right
    # causal (rows that see no key), windows with both edges and unbounded sides, soft-caps,
    # GQA, decode with packed heads, FP8; each must launch wgmma_ws, explicit or tuned
    from flashcore.errors import SpecError
    from tests.gpu_utils import WGMMA_FP8_MASK_CONFIGS, WGMMA_MASK_CONFIGS

    cases = ((1, 4, 2, 77, 300, 64, True, {"mask_align": "bottom_right", "window": (50, 0),
                                           "softcap": 20.0}),
             (1, 4, 2, 300, 77, 128, True, {"mask_align": "bottom_right"}),
             (1, 2, 1, 100, 130, 64, False, {"window": (20, 30)}),
             (1, 2, 1, 200, 333, 64, False, {"window": (-1, 40), "mask_align": "bottom_right"}),
             (1, 2, 2, 65, 65, 128, False, {"softcap": 5.0}),
             (1, 2, 2, 500, 700, 128, True, {"window": (130, 0), "softcap": 30.0}),
             (2, 8, 2, 1, 1000, 128, True, {"mask_align": "bottom_right", "window": (300, 0)}))
    for config, (b, hq, hkv, sq, sk, d, causal, masks) in itertools.product(WGMMA_MASK_CONFIGS,
                                                                            cases):
        q, k, v = qkv(b, hq, hkv, sq, sk, d, torch.bfloat16 if d == 64 else torch.float16,
                      seed=sq + sk)
        name = f"wgmma_ws masks {config} {(b, hq, hkv, sq, sk, d)} causal={causal} {masks}"
        try:
            (out, _), families = launched_families(attention, q, k, v, causal=causal,
                                                   config=config, return_lse=True, **masks)
        except SpecError:  # a soft-cap beside a mask on 192x128 at d128
            print(f"skip {name}: not built", flush=True)
            continue
        yield families == ["wgmma_ws"] and check(name, out, q, k, v, causal, **masks)
    for config, (b, hq, hkv, sq, sk, d, causal, masks) in itertools.product(
            WGMMA_FP8_MASK_CONFIGS, [c for c in cases if "softcap" not in c[-1]]):
        q, k, v = qkv(b, hq, hkv, sq, sk, d, seed=sq + sk)
        (out, _), families = launched_families(attention, q, k, v, causal=causal,
                                               config=config, return_lse=True,
                                               precision="fp8", **masks)
        yield families == ["wgmma_ws"] and check(
            f"wgmma_ws fp8 masks {config} {(b, hq, hkv, sq, sk, d)} causal={causal} {masks}",
            out, q, k, v, causal, tol=0.1, **masks)
    # tile=None on a mid-bucket prefill: the tuned wgmma_ws winner runs each mask
    q, k, v = qkv(1, 2, 1, 1100, 1230, 128, seed=5)
    for masks in ({"window": (300, 0)}, {"mask_align": "bottom_right"}, {"softcap": 30.0}):
        out, families = launched_families(attention, q, k, v, causal=True, **masks)
        yield families == ["wgmma_ws"] and check(f"wgmma_ws masks tuned causal {masks}", out, q,
                                                 k, v, True, **masks)


def fp8_khead_cases():
    # FP8 operands with K descaled per (batch, head) (folded into the rows' exp2 scales): the
    # warp-specialised family's tuned tiles on sm_90, the mma_sync family's prefill and split
    # decode everywhere; ragged, GQA, S = 1, causal rows with no key
    from flashcore.specs import TileConfig

    configs = [TileConfig((64, 64)), TileConfig((16, 64), warps=1)]
    if arch_of(torch.cuda.current_device()) == "sm_90":
        configs += [TileConfig((128, 128), warps=8, stages=2, family="wgmma_ws"),
                    TileConfig((192, 128), warps=12, stages=2, family="wgmma_ws"),
                    TileConfig((192, 128), warps=12, stages=4, family="wgmma_ws"),
                    TileConfig((64, 64), warps=4, stages=2, family="wgmma_ws")]
    for config in configs:
        for sq, sk, d, causal in ((77, 200, 64, True), (1, 1, 128, False),
                                  (130, 257, 128, False), (1, 700, 128, True),
                                  (500, 500, 64, True)):
            q, k, v = qkv(1, 4, 2, sq, sk, d, seed=sq + sk + d)
            q8, qd = quantize_fp8(q, granularity="token")
            k8, kd = quantize_fp8(k)
            vt8, vd = quantize_fp8(v, transpose=True)
            out = attention_fp8(q8, k8, vt8, qd, kd, vd, causal=causal, config=config,
                                num_splits=3 if config.tile == (16, 64) else None)
            yield check(f"fp8 khead {config} sq={sq} sk={sk} d{d} causal={causal}", out, q, k,
                        v, causal, tol=0.1)
        if config.family == "wgmma_ws":
            yield fp8_khead_both_key_loops(config)


def fp8_khead_both_key_loops(config):
    # one warp's queries 1000x larger: its warpgroup walks the keys in the exact softmax form,
    # the other in the rounded one (logits of thousands: checked against the replay)
    q, k, v = qkv(1, 4, 2, 300, 700, 128, seed=5)
    q[:, :, 64:80] *= 1000.0
    q8, qd = quantize_fp8(q, granularity="token")
    k8, kd = quantize_fp8(k)
    vt8, vd = quantize_fp8(v, transpose=True)
    out = attention_fp8(q8, k8, vt8, qd, kd, vd, config=config)
    kx, vx = (t.repeat_interleave(2, dim=1) for t in (k, v))
    sim = reference.attention_fp8(q, kx, vx, tile=config.tile, device=q.device, k_scale="head")
    err = ((out.double() - sim).norm() / sim.norm()).item()
    ok = torch.isfinite(out).all().item() and err < 0.1
    print(f"{'ok ' if ok else 'BAD'} fp8 khead {config} both key loops: rel L2 {err:.2e}",
          flush=True)
    return ok


def causal_order_cases():
    # causal grids of 18 (batch, head) pairs: two full sections of 8 and a tail of 2
    # (kernels/common/tile_order.py), ragged, GQA; every family whose grid takes that order.
    # The grids have more CTAs than SMs (the sectioned order), but for one Hopper shape (one
    # wave: the per-head order)
    from flashcore.specs import TileConfig

    for tile, knobs in (((64, 64), {}), ((32, 64), {"warps": 2, "kv_splits": 2}),
                        ((64, 64), {"stages": 2})):
        q, k, v = qkv(2, 9, 3, 555, 600, 64, seed=21)
        out, _ = attention(q, k, v, causal=True, tile=tile, return_lse=True, **knobs)
        yield check(f"mma_sync {tile} {knobs} 2x9 heads causal", out, q, k, v, True)
    if arch_of(torch.cuda.current_device()) != "sm_90":
        return
    for tile, warps, stages, fam, prec in (((128, 128), 8, 2, "wgmma_ws", "fp16"),
                                           ((128, 128), 8, 3, "wgmma_ws", "fp16"),
                                           ((192, 128), 12, 2, "wgmma_ws", "fp16"),
                                           ((128, 128), 8, 2, "wgmma_ws", "fp8"),
                                           ((192, 64), 12, 3, "wgmma_ws", "fp8")):
        config = TileConfig(tile, warps=warps, stages=stages, family=fam)
        for sq, sk, d in ((1600, 1650, 64), (200, 130, 128)):
            q, k, v = qkv(2, 9, 3, sq, sk, d, seed=sq + d)
            out = attention(q, k, v, causal=True, config=config, precision=prec)
            yield check(f"{prec} {config} sq={sq} sk={sk} d{d} 2x9 heads causal", out, q, k, v,
                        True, tol=0.1 if prec == "fp8" else 2e-2)


WIDE_HEAD_DIMS = (32, 80, 96, 256)


def head_dim_cases():
    # swizzle lines of 64 (d32, d96) and 32 bytes (d80) a row, and d256's 128 output registers
    # a thread: ragged prefill (tuned, and (64, 64) with two stages, one at d256), GQA decode
    # split over CTAs (the combine with idle threads at d96), masks, varlen and a paged cache
    for d in WIDE_HEAD_DIMS:
        dtype = torch.bfloat16 if d in (96, 256) else torch.float16
        for causal in (False, True):
            q, k, v = qkv(2, 4, 2, 77, 145, d, dtype, seed=d)
            yield check(f"prefill d{d} causal={causal}", attention(q, k, v, causal=causal),
                        q, k, v, causal)
            stages = 1 if d == 256 else 2  # d256 at two stages needs 160 KB: not an L4's
            yield check(f"(64, 64) stages={stages} d{d} causal={causal}",
                        attention(q, k, v, causal=causal, tile=(64, 64), stages=stages), q, k,
                        v, causal)
        q, k, v = qkv(1, 8, 2, 1, 64 * 40 - 3, d, dtype, seed=d + 1)
        out, _ = attention(q, k, v, num_splits=7, return_lse=True)
        yield check(f"decode d{d} split 7", out, q, k, v, False)
        masks = {"mask_align": "bottom_right", "window": (60, 0), "softcap": 20.0}
        q, k, v = qkv(1, 4, 2, 70, 333, d, dtype, seed=d + 2)
        out, _ = attention(q, k, v, causal=True, return_lse=True, **masks)
        yield check(f"masks d{d}", out, q, k, v, True, **masks)
        yield from _varlen_case(d, dtype)
        yield from _paged_case(d, dtype)


def _varlen_case(d, dtype):
    g = torch.Generator(device="cuda").manual_seed(d)
    lq, lk = [0, 1, 77, 130], [3, 1, 200, 130]
    cq, ck = ([0, *torch.tensor(x).cumsum(0).tolist()] for x in (lq, lk))
    q = torch.randn(cq[-1], 4, d, device="cuda", generator=g, dtype=dtype)
    k, v = (torch.randn(ck[-1], 2, d, device="cuda", generator=g, dtype=dtype) for _ in range(2))
    cu = [torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cq, ck)]
    out = attention_varlen(q, k, v, *cu, max(lq), max(lk), causal=True,
                           mask_align="bottom_right")
    ok = True
    for b in range(len(lq)):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        ok &= check(f"varlen d{d} seq {b} ({lq[b]}x{lk[b]})",
                    *(t[r].transpose(0, 1)[None] for t, r in ((out, rq), (q, rq), (k, rk),
                                                              (v, rk))), True,
                    mask_align="bottom_right")
    yield ok


def _paged_case(d, dtype):
    g = torch.Generator(device="cuda").manual_seed(d + 3)
    for page, sq, lens in ((16, 1, [300, 1, 0, 129]), (24, 5, [517, 40])):
        n = max(1, -(-max(lens) // page))
        pages = len(lens) * n + 1
        table = torch.randperm(pages, device="cuda", generator=g)[:len(lens) * n]
        table = table.view(len(lens), n).to(torch.int32)
        kc, vc = (torch.randn(pages, page, 2, d, device="cuda", generator=g, dtype=dtype)
                  for _ in range(2))
        q = torch.randn(len(lens), 8, sq, d, device="cuda", generator=g, dtype=dtype)
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        out = attention_paged(q, kc, vc, table, seqlens, causal=True, mask_align="bottom_right")
        ok = True
        for b, length in enumerate(lens):
            kb, vb = (reference.gather_pages(c, table, length, b) for c in (kc, vc))
            ok &= check(f"paged d{d} page {page} sq={sq} len {length}", out[b:b + 1],
                        q[b:b + 1], kb, vb, True, mask_align="bottom_right")
        yield ok


def all_cases():
    arch = arch_of(torch.cuda.current_device())
    for causal in (False, True):
        for d in (64, 128):  # prefill, ragged, the tuned config and a few explicit ones
            q, k, v = qkv(2, 2, 2, 77, 45, d, seed=d)
            yield check(f"prefill d{d} causal={causal}", attention(q, k, v, causal=causal),
                        q, k, v, causal)
            yield check(f"stages=2 d{d} causal={causal}",
                        attention(q, k, v, causal=causal, tile=(64, 64), stages=2), q, k, v,
                        causal)
        q, k, v = qkv(2, 9, 3, 77, 45, 64, seed=9)  # 18 (batch, head) pairs: 3 grid sections
        yield check(f"2x9 heads causal={causal}", attention(q, k, v, causal=causal, tile=(32, 64)),
                    q, k, v, causal)
        q, k, v = qkv(1, 8, 2, 33, 130, 64, torch.bfloat16)  # GQA prefill
        yield check(f"gqa prefill causal={causal}", attention(q, k, v, causal=causal),
                    q, k, v, causal)
        for group, sk, splits in ((4, 300, None), (1, 129, 5), (8, 1, 3)):  # decode, split-KV
            q, k, v = qkv(2, 2 * group, 2, 1, sk, 128)
            out, _ = attention(q, k, v, causal=causal, num_splits=splits, return_lse=True)
            yield check(f"decode g{group} sk={sk} splits={splits} causal={causal}", out, q, k,
                        v, causal)
        if arch in ("sm_89", "sm_90"):
            yield from fp8_kv_cases(causal, ((1, 4, 2, 1, 150, 64),))
            q, k, v = qkv(1, 2, 2, 70, 90, 64)  # FP8 operands, and its quantisers
            q8, qd = quantize_fp8(q, granularity="token")
            k8, kd = quantize_fp8(k, granularity="token")
            vt8, vdh = quantize_fp8(v, transpose=True)
            out = attention_fp8(q8, k8, vt8, qd, kd, vdh, causal=causal)
            yield check(f"fp8 operands causal={causal}", out, q, k, v, causal, tol=0.1)
    yield from split_cases(equal=False)


def hostile_cases():
    n = 2 * 4 * 100 * 64
    base = torch.randn(3 * n + 8, device="cuda", dtype=torch.float16)
    q, k, v = (base[1 + i * n:1 + (i + 1) * n].view(2, 4, 100, 64) for i in range(3))
    yield check("misaligned contiguous views", attention(q, k, v), q, k, v, False)
    q = torch.randn(2, 4, 100, 65, device="cuda", dtype=torch.float16)[..., :64]
    yield check("odd row stride q", attention(q, k, v, tile=(64, 64)), q, k, v, False)
    H, D, total = 4, 64, 300
    qp, kp, vp = (torch.randn(total, H, D, device="cuda", dtype=torch.float16) for _ in range(3))
    for cu in ([0, 100, 400], [0, 2**31 - 1, -2**31 + 5], [0, 200, 100, 300]):
        t = torch.tensor(cu, dtype=torch.int32, device="cuda")
        out = attention_varlen(qp, kp, vp, t, t, 300, 300, check_lengths=False)
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(out).all())
        print(f"{'ok ' if ok else 'BAD'} varlen unchecked cu={cu}", flush=True)
        yield ok
    cache = torch.randn(8, 16, 2, 128, device="cuda", dtype=torch.float16)
    table = torch.tensor([[0, 1, 99, -5], [7, 2**31 - 1, 3, 3], [1, 1, 1, 1]], dtype=torch.int32,
                         device="cuda")
    lens = torch.tensor([64, 2**31 - 1, -7], dtype=torch.int32, device="cuda")
    qd = torch.randn(3, 8, 1, 128, device="cuda", dtype=torch.float16)
    for splits in (None, 1, 3):
        out = attention_paged(qd, cache, cache, table, lens, num_splits=splits,
                              check_lengths=False)
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(out).all())
        print(f"{'ok ' if ok else 'BAD'} paged unchecked splits={splits}", flush=True)
        yield ok
    for page_size in (24, 16):  # gathered rows, whole pages
        c = torch.randn(8, page_size, 2, 128, device="cuda", dtype=torch.float16)
        qs = torch.randn(10, 8, 128, device="cuda", dtype=torch.float16)
        cu = torch.tensor([0, 4, 2**31 - 1, 3], dtype=torch.int32, device="cuda")
        out = attention_paged(qs, c, c, table, lens, cu_seqlens_q=cu, max_seqlen_q=4,
                              check_lengths=False)
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(out).all())
        print(f"{'ok ' if ok else 'BAD'} packed paged unchecked page_size={page_size}",
              flush=True)
        yield ok


def kv_split_cases():
    # one CTA's two warp groups merging through shared memory (kv_splits=2), on legal inputs:
    # key blocks that split evenly between the groups (256 keys) and unevenly (300: 3 and 2,
    # so the groups pass different numbers of their own named barriers before the merge)
    config = TileConfig((32, 64), warps=2, kv_splits=2)
    g = torch.Generator(device="cuda").manual_seed(2)
    for sk in (256, 300, 65):
        q, k, v = qkv(2, 4, 4, 300, sk, 64, seed=sk)
        yield check(f"dense kv_splits=2 300x{sk}", attention(q, k, v, config=config), q, k, v,
                    False)
        qp, kp, vp = (torch.randn(2 * sk, 4, 64, device="cuda", generator=g,
                                  dtype=torch.float16) for _ in range(3))
        cu = torch.tensor([0, sk, 2 * sk], dtype=torch.int32, device="cuda")
        out = attention_varlen(qp, kp, vp, cu, cu, sk, sk, config=config)
        ok = True
        for b in range(2):
            r = slice(b * sk, (b + 1) * sk)
            ok &= check(f"varlen kv_splits=2 seq {b} {sk}x{sk}",
                        *(t[r].transpose(0, 1)[None] for t in (out, qp, kp, vp)), False)
        yield ok


def backward_cases(deterministic: bool = False, head_dims: bool = False, only_dim: int = 0):
    """Ragged shapes through the backward against float64 autograd (``only_dim``: those of
    that head dim alone)."""
    from flashcore.ops.backward import attention_backward

    shapes = ((1, 2, 2, 77, 45, 64), (2, 4, 2, 33, 130, 128), (1, 4, 1, 150, 1, 64))
    masks = ({},)
    if head_dims:  # each dim's own tile, lines and copy passes over ragged blocks
        shapes = tuple((1, 4, 2, 77, 145, d) for d in (32, 80, 96, 256))
    if deterministic:  # several key blocks per query block, and a window's later first turn
        shapes += ((1, 6, 2, 300, 390, 128),)
        masks += ({"mask_align": "bottom_right", "window": (100, 0)},)
    for (b, hq, hkv, sq, sk, d), causal, mask in itertools.product(shapes, (False, True), masks):
        if (mask and not causal) or only_dim not in (0, d):
            continue
        q, k, v = qkv(b, hq, hkv, sq, sk, d, seed=sq)
        out, lse = attention(q, k, v, causal=causal, return_lse=True, **mask)
        dout = torch.randn_like(out)
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal,
                                        deterministic=deterministic, **mask)
        qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
        ref = reference.attention(qq, kk, vv, causal=causal, device=q.device, **mask)
        ref.backward(dout.double())
        worst = max(((g.double() - r.grad).abs().max() / max(1.0, r.grad.abs().max())).item()
                    for g, r in ((dq, qq), (dk, kk), (dv, vv)))
        ok = bool(all(torch.isfinite(g).all() for g in (dq, dk, dv))) and worst < 5e-2
        print(f"{'ok ' if ok else 'BAD'} backward {(b, hq, hkv, sq, sk, d)} causal={causal} "
              f"{mask} deterministic={deterministic}: rel err {worst:.2e}", flush=True)
        yield ok


def backward_hopper_cases():
    """The Hopper backward (sm_90: the d64, d96 and d128 default there): the backward cases' ragged
    shapes, free dQ adds and in turns (more key blocks per query block, a window), and a
    packed batch's, at 64 query rows; then d64's default, 128-row blocks, the same three."""
    from flashcore.ops.backward import backward_choices_override

    with backward_choices_override("64x128w8s2-hopper"):
        yield from backward_cases()
        yield from backward_cases(deterministic=True)
        yield from backward_varlen_cases()
    with backward_choices_override("96:64x128w8s2-hopper"):  # d96's one-warpgroup dQ
        yield from backward_cases(head_dims=True)
    with backward_choices_override("64:128x128w8s2-hopper"):  # d64's 128-row blocks
        yield from backward_cases(only_dim=64)
        yield from backward_cases(deterministic=True, only_dim=64)
        yield from backward_varlen_cases()


def backward_varlen_cases():
    """The packed batch's backward through autograd: sequences empty on either side, a query
    block running past its sequence into the next, GQA, bottom-right causal and a window."""
    lengths = [(77, 145), (0, 30), (130, 130), (1, 0), (45, 20)]
    for d, causal, window in ((64, True, None), (128, True, (40, 0)), (128, False, None)):
        cu_q = torch.tensor([0, *itertools.accumulate(a for a, _ in lengths)], dtype=torch.int32,
                            device="cuda")
        cu_k = torch.tensor([0, *itertools.accumulate(b for _, b in lengths)], dtype=torch.int32,
                            device="cuda")
        hq, hkv = 4, 2
        q = torch.randn(int(cu_q[-1]), hq, d, device="cuda", dtype=torch.float16)
        k = torch.randn(int(cu_k[-1]), hkv, d, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        dout = torch.randn_like(q)
        mask = {"mask_align": "bottom_right" if causal else "top_left", "window": window}
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention_varlen(*leaves, cu_q, cu_k, 130, 145, causal, **mask).backward(dout)
        worst = 0.0
        for b in range(len(lengths)):
            qs = slice(int(cu_q[b]), int(cu_q[b + 1]))
            ks = slice(int(cu_k[b]), int(cu_k[b + 1]))
            if qs.start == qs.stop or ks.start == ks.stop:
                continue
            parts = [t[s].transpose(0, 1)[None].double().requires_grad_()
                     for t, s in ((q, qs), (k, ks), (v, ks))]
            ref = reference.attention(*parts, causal=causal, device=q.device, **mask)
            ref.backward(dout[qs].transpose(0, 1)[None].double())
            for leaf, s, r in zip(leaves, (qs, ks, ks), parts):
                g = leaf.grad[s].transpose(0, 1)[None].double()
                worst = max(worst, ((g - r.grad).abs().max() / max(1.0, r.grad.abs().max()))
                            .item())
        ok = bool(all(torch.isfinite(t.grad).all() for t in leaves)) and worst < 5e-2
        print(f"{'ok ' if ok else 'BAD'} backward varlen d={d} causal={causal} window={window}: "
              f"rel err {worst:.2e}", flush=True)
        yield ok


def alibi_cases():
    # ALiBi on ragged tiles: a bottom-right prefill with its LSE, a GQA decode split over CTAs
    # (a row per head: nothing packed), two key groups a CTA beside a soft-cap, slopes per
    # (batch, head)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device="cuda")
    q, k, v = qkv(2, 4, 2, 77, 145, 64, seed=31)
    masks = {"mask_align": "bottom_right", "alibi_slopes": slopes}
    out, _ = attention(q, k, v, causal=True, return_lse=True, **masks)
    yield check("alibi prefill bottom-right d64", out, q, k, v, True, **masks)
    q, k, v = qkv(2, 4, 2, 1, 64 * 30 - 5, 128, torch.bfloat16, seed=32)
    out = attention(q, k, v, num_splits=5, alibi_slopes=slopes)
    yield check("alibi decode split 5 d128", out, q, k, v, False, alibi_slopes=slopes)
    per_batch = torch.rand(2, 4, device="cuda")
    q, k, v = qkv(2, 4, 4, 70, 200, 64, seed=33)
    out = attention(q, k, v, tile=(64, 64), warps=4, kv_splits=2, softcap=20.0,
                    alibi_slopes=per_batch)
    yield check("alibi kv_splits=2 softcap d64", out, q, k, v, False, softcap=20.0,
                alibi_slopes=per_batch)
    # the serving layouts: a ragged packed batch (an empty sequence, a slope row a sequence)
    # and a paged cache's split decode, each sequence measured from its own last key
    g = torch.Generator(device="cuda").manual_seed(34)
    lq, lk = [77, 0, 1, 130], [145, 3, 0, 130]
    cq, ck = ([0, *torch.tensor(n).cumsum(0).tolist()] for n in (lq, lk))
    q = torch.randn(cq[-1], 4, 64, device="cuda", generator=g, dtype=torch.float16)
    k, v = (torch.randn(ck[-1], 2, 64, device="cuda", generator=g, dtype=torch.float16)
            for _ in range(2))
    rows = torch.rand(4, 4, device="cuda", generator=g)
    out = attention_varlen(q, k, v, *(torch.tensor(c, dtype=torch.int32, device="cuda")
                                      for c in (cq, ck)), max(lq), max(lk), causal=True,
                           mask_align="bottom_right", alibi_slopes=rows, tile=(64, 64))
    ok = True
    for b in range(4):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        ok &= check(f"alibi varlen seq {b} {lq[b]}x{lk[b]}",
                    *(t[r].transpose(0, 1)[None] for t, r in ((out, qs), (q, qs), (k, ks),
                                                              (v, ks))),
                    True, mask_align="bottom_right", alibi_slopes=rows[b])
    yield ok
    lens, page = [517, 0, 33], 16
    n = -(-max(lens) // page)
    table = torch.randperm(3 * n, device="cuda", generator=g).view(3, n).to(torch.int32)
    kc, vc = (torch.randn(3 * n, page, 2, 128, device="cuda", generator=g, dtype=torch.bfloat16)
              for _ in range(2))
    q = torch.randn(3, 8, 1, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    per_head = (2.0 ** -torch.arange(1, 9, device="cuda")).float()
    out = attention_paged(q, kc, vc, table, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                          num_splits=3, mask_align="bottom_right", alibi_slopes=per_head)
    ok = True
    for b, length in enumerate(lens):
        kb, vb = (reference.gather_pages(c, table, length, b) for c in (kc, vc))
        ok &= check(f"alibi paged decode split 3 len {length}", out[b:b + 1], q[b:b + 1], kb, vb,
                    False, mask_align="bottom_right", alibi_slopes=per_head)
    yield ok


def kv_append_cases():
    # the KV-cache append kernel: a dense cache read as its rows' pages (rows picked out of
    # order) and a paged one, rotary half-split and interleaved, GQA, a length at the cache's
    # end; the result against the torch formula, the cache outside the new slots untouched
    from flashcore.integrations import kv_cache
    from flashcore.ops.kv_append import append_kv

    g = torch.Generator(device="cuda").manual_seed(35)
    for paged, rotary_dim, interleaved in ((False, 64, False), (True, 128, True), (True, 0, False)):
        b, sq, new, h, hkv, d, cap, ps = 3, 3, 4, 8, 2, 128, 160, 16
        lens = torch.tensor([0, 77, cap - new], dtype=torch.int32, device="cuda")
        q = torch.randn(b, sq, h, d, device="cuda", generator=g, dtype=torch.float16)
        k, v = (torch.randn(b, new, hkv, d, device="cuda", generator=g, dtype=torch.float16)
                for _ in range(2))
        if paged:
            kc, vc = (torch.randn(b * cap // ps, ps, hkv, d, device="cuda", generator=g,
                                  dtype=torch.float16) for _ in range(2))
            table = torch.randperm(b * cap // ps, device="cuda", generator=g).view(b, -1)
            table = table.to(torch.int32)
            kp, vp = kc, vc
            slots = kv_cache.paged_slots(table, lens, new, ps)
        else:
            kc, vc = (torch.randn(b, cap, hkv, d, device="cuda", generator=g,
                                  dtype=torch.float16) for _ in range(2))
            rows = torch.tensor([1, 2, 0], dtype=torch.int32, device="cuda")
            (kp, table), (vp, _) = (kv_cache.dense_as_pages(c, rows) for c in (kc, vc))
            slots = kv_cache.dense_slots(rows, lens, new)
        k0 = kc.clone()
        cos = sin = None
        if rotary_dim:
            ang = torch.rand(cap, rotary_dim // 2, device="cuda", generator=g) * 6.3
            cos, sin = ang.cos(), ang.sin()
        turned = append_kv(k, v, kp, vp, table, lens, q=q, cos=cos, sin=sin,
                           interleaved=interleaved)
        want = k if not rotary_dim else kv_cache.apply_rotary(
            k, cos, sin, kv_cache.positions(lens, new), interleaved)
        moved = torch.zeros(kc.shape[:2], dtype=torch.bool, device="cuda")
        moved[slots] = True
        err = (kc[slots].float() - want.float()).abs().max().item()
        ok = (err < 4e-3 and torch.equal(vc[slots], v) and torch.equal(kc[~moved], k0[~moved])
              and (turned is None) == (rotary_dim == 0))
        print(f"{'ok ' if ok else 'BAD'} kv append paged={paged} rotary={rotary_dim} "
              f"interleaved={interleaved}: max err {err:.2e}", flush=True)
        yield ok


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "all"
    cases = {"all": all_cases, "splits-equal": lambda: split_cases(True),
             "splits-unequal": lambda: split_cases(False),
             "fp8-kv": lambda: fp8_kv_cases(False, ((1, 4, 2, 1, 150, 64), (2, 8, 2, 1, 700, 128),
                                                    (1, 32, 8, 1, 2049, 128))),
             "decode": decode_cases, "packed-tokens": packed_tokens_cases, "masks": mask_cases, "varlen": varlen_cases, "paged": paged_cases,
             "fp8-paged": fp8_paged_cases, "wgmma": wgmma_cases, "wgmma-16bit": wgmma_16bit_cases,
             "wgmma-fp8": wgmma_fp8_cases, "wgmma-masks": wgmma_masks_cases,
             "wgmma-head-dims": wgmma_head_dim_cases, "wgmma-varlen": wgmma_varlen_cases,
             "wgmma-paged": wgmma_paged_cases,
             "wgmma-tile-n": wgmma_tile_n_cases,
             "fp8-khead": fp8_khead_cases,
             "causal-order": causal_order_cases,
             "serving": lambda: itertools.chain(varlen_cases(), paged_cases()),
             "hostile": hostile_cases, "backward": backward_cases,
             "backward-deterministic": lambda: backward_cases(True),
             "backward-varlen": backward_varlen_cases,
             "backward-hopper": backward_hopper_cases,
             "backward-head-dims": lambda: backward_cases(head_dims=True),
             "kv-splits": kv_split_cases, "head-dims": head_dim_cases,
             "alibi": alibi_cases, "kv-append": kv_append_cases}[mode]
    results = list(cases())
    torch.cuda.synchronize()
    print(f"{sum(results)}/{len(results)} cases ok", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
