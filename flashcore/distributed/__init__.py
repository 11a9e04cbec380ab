"""Context parallelism: attention over a ``torch.distributed`` group for q, k, v sharded along
the sequence, forward and backward."""

from .attention import all_gather_attention, context_parallel_attention, ring_attention
from .gather import prefers_all_gather
from .layout import shard_contiguous, shard_zigzag, unshard_zigzag
from .merge import merge_partials

__all__ = [
    "all_gather_attention",
    "context_parallel_attention",
    "merge_partials",
    "prefers_all_gather",
    "ring_attention",
    "shard_contiguous",
    "shard_zigzag",
    "unshard_zigzag",
]
