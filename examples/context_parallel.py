"""Context-parallel attention across GPUs: each rank holds a slice of the sequence.

    torchrun --nproc-per-node N examples/context_parallel.py [--seq 32768] [--causal]

Prints, per method, the time of one forward step on N GPUs (each with 1/N of the sequence)
next to flashcore's time for the whole sequence on one GPU, and the sharded result's largest
difference from the one-GPU output; and the ring's local work alone (its attention calls and
merges without the exchange), which the ring's step time should hide its communication behind.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from flashcore.distributed import (
    all_gather_attention,
    context_parallel_attention,
    ring_attention,
    shard_zigzag,
    unshard_zigzag,
)
from flashcore.distributed.layout import plan_blocks
from flashcore.distributed.merge import Partial
from flashcore.ops import attention


def timed(fn, iters: int) -> float:
    """Milliseconds per call, after a warm-up call (which also compiles or loads kernels)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def ring_compute_only(q, k, v, causal: bool, rank: int, world: int) -> torch.Tensor:
    """The ring's local work on this rank (every step's attention calls and LSE merges) on
    its own K/V shard, without the exchange: what communication would add to is this."""
    acc = Partial.empty(q, v.shape[-1], torch.float32)
    for step in range(world):
        for blk in plan_blocks("zigzag", causal, rank, (rank - step) % world, q.shape[2],
                               k.shape[2]):
            out, lse = attention(q[:, :, blk.q], k[:, :, blk.k], v[:, :, blk.k],
                                 causal=blk.causal, return_lse=True)
            acc.add(blk.q, out, lse)
    return acc.out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)  # before NCCL binds a device
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device="cuda").manual_seed(0)  # the same full inputs on every rank
    def make(h: int) -> torch.Tensor:
        return torch.randn(args.batch, h, args.seq, args.head_dim, device="cuda", generator=g,
                           dtype=torch.bfloat16)

    q, k, v = make(args.heads), make(args.kv_heads), make(args.kv_heads)
    ql, kl, vl = (shard_zigzag(t, rank, world) for t in (q, k, v))  # causal load balance

    single_ms = timed(lambda: attention(q, k, v, causal=args.causal), args.iters)
    single = attention(q, k, v, causal=args.causal)
    compute_ms = timed(lambda: ring_compute_only(ql, kl, vl, args.causal, rank, world),
                       args.iters)
    # a step ends with its slowest rank: that rank's local work is what the exchange must hide in
    slowest = torch.tensor([compute_ms], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    compute_ms = slowest.item()
    if rank == 0:
        print(f"ring compute alone (no exchange), slowest rank: {compute_ms:8.3f} ms/step",
              flush=True)
    methods = {"ring": ring_attention, "all_gather": all_gather_attention,
               "auto": context_parallel_attention}
    for name, fn in methods.items():
        def step(fn=fn):
            return fn(ql, kl, vl, causal=args.causal, layout="zigzag")

        ms = timed(step, args.iters)
        parts = [torch.empty_like(ql) for _ in range(world)]
        dist.all_gather(parts, step().contiguous())
        diff = (unshard_zigzag(parts, world) - single).abs().max().item()
        if rank == 0:
            print(f"{name:>10}: {ms:8.3f} ms/step on {world} GPUs vs {single_ms:8.3f} ms on one "
                  f"({single_ms / ms:5.2f}x; {ms / compute_ms - 1:+.1%} over the local work), "
                  f"max |diff| vs one GPU {diff:.3e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
