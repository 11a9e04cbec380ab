"""How one attention call is run: the tile config, whether the query heads of a K/V head are
packed into one tile's rows, and how many CTAs share each row's keys (split-KV).

Decode (at most ``DECODE_MAX_Q`` query tokens per sequence) has too few query tiles to fill the
GPU: its keys are split over CTAs (flash-decoding), each writing an fp32 partial result that a
second kernel combines. With grouped-query attention and one query token, the query heads that
share a K/V head become the rows of one tile (they share every K/V load): a (B, Hq, 1, D) tensor
is viewed as (B, Hkv, Hq / Hkv, D), for any strides. With a few tokens, each K/V head's (token,
head) pairs are its tiles' rows, token-major, which the kernel gathers and scatters itself
(``packs_tokens``); the combine writes the caller's (B, Hq, S_q) rows either way.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from ..errors import SpecError
from ..specs import MAX_SPLITS, AttentionSpec, TileConfig
from ..tuned.table import BUCKETS, bucket_of, lookup

DECODE_MAX_Q = BUCKETS[0][1]  # the decode bucket's bound
SHARE_OVERHEAD = 2  # key blocks' worth of time a share costs beyond its blocks
# An eager call (no CUDA graph being captured) whose unsplit grid would take at most this many
# key blocks' time (~0.5 us each) runs unsplit: one launch instead of the shares' and the
# combine's, whose host time (a few microseconds each) is what such a call costs; a graph
# replays launches for ~1 us, so there the GPU time decides
EAGER_ONE_LAUNCH_BLOCKS = int(os.environ.get("FLASHCORE_EAGER_ONE_LAUNCH_BLOCKS", "16"))  # 0: off
# An eager split call whose modelled time (``share_cost``, in key blocks of head_dim 128) is at
# most this many blocks merges its shares in the split kernel's last CTA: one launch, the
# combine's host time saved (5-6 us a call on an H100 host), 2-3 us of GPU time paid; a longer
# call is bound by the GPU and keeps the combine kernel (so does every graph: there a launch
# costs about a microsecond)
EAGER_MERGE_BLOCKS = int(os.environ.get("FLASHCORE_EAGER_MERGE_BLOCKS", "24"))  # 0: off
_CUDA_BUILT = torch.backends.cuda.is_built()  # a CPU-only torch captures nothing


def capturing() -> bool:
    """Whether torch's current stream is capturing a CUDA graph (every eager call asks: the
    binding itself, not its Python wrapper)."""
    return _CUDA_BUILT and torch._C._cuda_isCurrentStreamCapturing()


_sm_count: dict[int, int] = {}


def sm_count(device: int) -> int:
    n = _sm_count.get(device)
    if n is None:
        n = _sm_count[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


# The short bucket's winners are small tiles (16 or 32 rows, two key groups a CTA) timed on a
# small grid (1,8,512), which they fill where larger tiles leave SMs idle. With more sequences
# or heads the mid bucket's larger tile wins. On an H200 (bf16, S_q = S_k of 512 and 1024,
# 8 to 32 heads, batch 1 to 8), in waves of the mid tile's CTAs: at 0.36 or less it took
# 1.00-1.17x the short config's time, at 0.48 0.90-1.03x, from 0.73 up 0.36-0.99x. A call of
# fewer query tokens than one mid tile keeps the short tile: the mid one would be mostly padding.
SHORT_TO_MID_WAVES = 0.45


def tuned_config(arch: str, head_dim: int, causal: bool, seqlen_q: int, precision: str,
                 features: tuple = (), pairs: int = 0, slots: int = 0) -> TileConfig:
    """The tuned table's config for a call; ``features``: its other spec fields as (name, value)
    pairs (a winner whose kernel family does not build them gives way to the entry's
    fallback). Decode calls ask for a family that splits keys. A 16-bit call of the short
    bucket over ``pairs`` (sequence, query head) pairs takes the mid bucket's config where
    its query rows fill one of that config's tiles and those tiles make at least
    ``SHORT_TO_MID_WAVES`` waves on ``slots`` SMs."""
    if seqlen_q <= DECODE_MAX_Q:
        features += (("split_kv", True),)
    bucket = bucket_of(seqlen_q)
    if bucket == "short" and precision == "fp16" and pairs:
        wide = lookup(arch, head_dim, causal, "mid", precision, features)
        if (seqlen_q >= wide.tile_m
                and pairs * -(-seqlen_q // wide.tile_m) >= SHORT_TO_MID_WAVES * slots):
            return wide
    return lookup(arch, head_dim, causal, bucket, precision, features)


def packs_heads(seqlen_q: int, heads_q: int, heads_kv: int) -> bool:
    """One query token and several query heads per K/V head: pack them into rows."""
    return seqlen_q == 1 and heads_q > heads_kv


def packs_tokens(seqlen_q: int, heads_q: int, heads_kv: int, tile_m: int, tile_n: int,
                 fixed_diagonal: bool) -> bool:
    """A few query tokens (multi-token decode: speculative drafts, short chunks) and several
    query heads per K/V head: pack each K/V head's (token, head) pairs into the rows of its
    tiles, token-major (``AttentionSpec.packed_tokens``: the kernel gathers them from q and
    scatters its results, no copies) where that takes fewer tiles than a head each, so fewer
    CTAs stream the same keys. Under a top-left causal mask (``fixed_diagonal``) the tokens must
    see no more than the first key block: packed rows of several tokens start their diagonal
    anywhere in a block, which only the shifted masks' step count allows for
    (``block_info.masked_steps``)."""
    group = heads_q // heads_kv
    return (1 < seqlen_q <= DECODE_MAX_Q and group > 1
            and not (fixed_diagonal and seqlen_q > tile_n)
            and -(-group * seqlen_q // tile_m) < group)


# The tile rows a decode call's tuned one-warp tile grows to where a K/V head's packed rows (one
# token's query heads, or a few tokens' (token, head) pairs) exceed its 16: 32 for 17-32 rows,
# 64 for 33-64, and 32-row tiles beyond (each tile of a K/V head streams its whole cache, so one
# tile over all its rows reads it once; with several tiles a head either way, more CTAs of fewer
# rows won on the H100's decode shapes: one tile of 64 rows reads a K/V head's cache once where
# 16-row tiles read it up to four times; at 16 rows or fewer the tile sizes are level; an FP8 KV
# cache's 64-row tile of two key groups loses to 32 rows past 32 packed rows, on its registers).


def packed_rows_config(config: TileConfig, seqlen_q: int, group: int, arch: str | None = None,
                       head_dim: int = 128, kv_fp8: bool = False) -> TileConfig:
    """The tuned decode ``config`` (a one-warp 16-row tile, with any in-CTA key groups) for a
    call of ``seqlen_q`` tokens (at most ``DECODE_MAX_Q``) and ``group`` query heads a K/V
    head, whose heads (one token, ``packs_heads``) or (token, head) pairs (``packs_tokens``)
    are packed into rows: past 16 rows its tile grows to 32 or 64 rows (the measurements
    above), to 32 where 64 rows do not fit ``arch``'s shared memory (an FP8 KV cache's 64-row
    tile of two key groups at head_dim 128 needs 115 KB, over an L4's 99 KB). Anything else
    is returned as it is. Every eager decode call asks: 16 rows or fewer return at once, the
    rest is memoised."""
    rows = seqlen_q * group
    if (rows <= 16 or group < 2 or seqlen_q > DECODE_MAX_Q
            or (config.tile_m, config.warps) != (16, 1)):
        return config
    return _grown(config, rows, arch, head_dim, kv_fp8)


@functools.lru_cache(maxsize=1024)
def _grown(config: TileConfig, rows: int, arch: str | None, head_dim: int,
           kv_fp8: bool) -> TileConfig:
    for tile_m in ((64, 32) if 32 < rows <= 64 else (32,)):
        grown = config.replace(tile=(tile_m, config.tile_n), warps=tile_m // 16)
        if arch is None or _fits(arch, head_dim, grown, kv_fp8):
            return grown
    return config


def _fits(arch: str, head_dim: int, config: TileConfig, kv_fp8: bool) -> bool:
    """Whether a split decode kernel of ``config`` is a valid spec on ``arch`` (its shared
    memory within the budget, its copies shared evenly)."""
    try:
        AttentionSpec(arch=arch, head_dim=head_dim, config=config, kv_fp8=kv_fp8,
                      split_kv=True)
    except SpecError:
        return False
    return True


def packed(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """(B, Hq, 1, ...) -> (B, Hkv, Hq / Hkv, ...): the query heads of each K/V head as rows."""
    b, hq = t.shape[:2]
    g = hq // heads_kv
    st = t.stride()
    return t.as_strided((b, heads_kv, g, *t.shape[3:]), (st[0], g * st[1], st[1], *st[3:]))


def packed_arg(arg: tuple, heads_kv: int) -> tuple:
    """The kernel argument of ``packed(t, heads_kv)`` from t's: ``inputs.tensor_arg`` (pointer,
    B, Hq, 1, three strides) or ``rows_arg`` (pointer, B, Hq, 1, two strides) -> the same
    pointer, extents (B, Hkv, Hq / Hkv), strides (sb, g * sh, sh). No view is made."""
    ptr, b, hq, _, sb, sh = arg[:6]
    g = hq // heads_kv
    if len(arg) == 7:
        return (ptr, b, heads_kv, g, sb, g * sh, sh)
    return (ptr, b, heads_kv, g, sb, g * sh)


FP8KV_WARPS_PER_SM = 2
# The fp32 partial results (written by the shares, read back by the combine) that cost the time
# of one key block of a share: a lone CTA's 64-key block takes ~0.5 us, in which the GPU moves
# ~2 TB/s; fitted to the H100's share sweeps of one CTA of 32 and of 64 rows over 128 and 256
# key blocks (``tests/test_ops_plan.py`` holds the choices it makes).
PARTIAL_BYTES_PER_BLOCK = 2**20


def share_cost(s: int, ctas: int, n_blocks: int, slots: int, rows: int, head_dim: int) -> float:
    """The modelled time of ``s`` shares, in key blocks (``num_splits``)."""
    partials = s * ctas * rows * head_dim * 8  # fp32, written and read back
    return (math.ceil(ctas * s / slots) * (math.ceil(n_blocks / s) + SHARE_OVERHEAD)
            + partials / PARTIAL_BYTES_PER_BLOCK)


def merges_shares(splits: int, ctas: int, n_blocks: int, slots: int, rows: int,
                  head_dim: int) -> bool:
    """Whether an eager call of ``splits`` shares merges them in its last CTA (one launch)
    rather than in the combine kernel: where its modelled time, its blocks counted at their
    bytes (a head_dim-64 block is half a 128 one), is at most ``EAGER_MERGE_BLOCKS``, so that
    the host's work, not the GPU's, is what it costs."""
    cost = share_cost(splits, ctas, n_blocks, slots, rows, head_dim) * head_dim / 128
    return cost <= EAGER_MERGE_BLOCKS


@functools.lru_cache(maxsize=4096)
def num_splits(ctas: int, n_blocks: int, slots: int, kv_fp8: bool = False,
               groups: int = 1, rows: int = 16, head_dim: int = 128,
               host_bound: bool = False) -> int:
    """How many CTAs share each row's ``n_blocks`` key blocks, when ``ctas`` CTAs (one per query
    tile of ``rows`` rows, each of ``groups`` warp groups over their own keys) would run on a
    GPU of ``slots`` SMs. One 16-bit decode CTA a SM keeps the SM's memory pipe full (its K/V
    stages are in flight); more only add partial results to combine (on the H100, 1,8/8,32768 at
    d128 is fastest with 16 shares and slower with 32 or 64).

    Time is modelled as waves x (blocks per share + ``SHARE_OVERHEAD``) plus the partial
    results' traffic (``PARTIAL_BYTES_PER_BLOCK``): a share's CTA first waits for Q and its
    first blocks, and every share's rows are written in fp32 and read again by the combine, so
    a few CTAs of many rows stop splitting before their shares are a block or two each. The
    fewest shares of the least modelled time win. A grid that already fills the GPU is not
    split (its combine would cost more than a fuller last wave gains).

    An FP8 KV cache's warps convert their e4m3 K/V in registers as well: about
    ``FP8KV_WARPS_PER_SM`` warp groups a SM, no more, keep it busy (on the H100, 16x64 tiles of
    two groups a CTA: fewer shares leave SMs idle, more only add partials to combine).

    ``host_bound`` (an eager call): one share where the unsplit grid takes at most
    ``EAGER_ONE_LAUNCH_BLOCKS`` (one launch, no combine)."""
    if host_bound and (share_cost(1, ctas, n_blocks, slots, rows, head_dim)
                       <= EAGER_ONE_LAUNCH_BLOCKS):
        return 1
    if kv_fp8:
        want = round(FP8KV_WARPS_PER_SM * slots / (ctas * groups))
        return max(1, min(MAX_SPLITS, want, -(-n_blocks // groups)))
    if ctas >= slots:
        return 1
    best, choice = None, 1
    for s in range(1, min(MAX_SPLITS, n_blocks) + 1):
        cost = share_cost(s, ctas, n_blocks, slots, rows, head_dim)
        if best is None or cost < best:
            best, choice = cost, s
    return choice
