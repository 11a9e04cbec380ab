"""Run by tests/test_gpu_torch.py under torch.distributed.run: each rank drives one GPU through
flashcore with a shared cache directory, and the ranks compare an all-reduced checksum."""

import os

import torch
import torch.distributed as dist

from flashcore.ops import attention


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    g = torch.Generator(device="cuda").manual_seed(7)  # the same inputs on every rank
    q, k, v = (torch.randn(2, 8, 300, 64, device="cuda", dtype=torch.float16, generator=g)
               for _ in range(3))
    out = attention(q, k, v, causal=True)
    total = out.float().sum().reshape(1)
    gathered = [torch.zeros_like(total) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, total)
    assert all(torch.equal(x, total) for x in gathered), gathered
    print(f"rank ok {rank} {os.environ.get('FLASHCORE_CACHE_DIR')}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
