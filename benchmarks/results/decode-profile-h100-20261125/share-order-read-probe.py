"""Does the order in which split-KV shares walk the cache matter to a bare read?
Triton reads with the decode's access pattern: one program per (head, share), K and V
blocks of 64 keys x 128 d (16 KB each), contiguous shares vs interleaved blocks."""
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())
import torch
import triton
import triton.language as tl

from flashcore.tuning.read_floor import streaming_read
from flashcore.tuning.timing import time_kernel


@triton.jit
def rd(k_ptr, v_ptr, out_ptr, nblk, S: tl.constexpr, INTERLEAVE: tl.constexpr, W: tl.constexpr):
    pid = tl.program_id(0)
    h = pid // S
    j = pid % S
    per = nblk // S
    acc = tl.zeros([W], dtype=tl.int32)
    for i in range(per):
        if INTERLEAVE:
            blk = i * S + j
        else:
            blk = j * per + i
        base = (h * nblk + blk).to(tl.int64) * 4096
        for u in tl.static_range(4096 // W):
            acc ^= tl.load(k_ptr + base + u * W + tl.arange(0, W), cache_modifier=".cg")
            acc ^= tl.load(v_ptr + base + u * W + tl.arange(0, W), cache_modifier=".cg")
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))

H, SK = 8, 32768
nblk = SK // 64
l2 = torch.cuda.get_device_properties(0).L2_cache_size
words = H * SK * 128 // 2
sets = [(torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device="cuda"),
         torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device="cuda")) for _ in range(3)]
out = torch.empty(4096, dtype=torch.int32, device="cuda")
impls = {}
for S in (16, 32):
    for inter in (0, 1):
        for warps, W, st in ((1, 1024, 2), (1, 1024, 3), (1, 512, 3), (2, 1024, 2), (4, 1024, 2), (4, 4096, 2)):
            name = f"S={S} {'inter' if inter else 'contig'} w{warps} W{W} st{st}"
            impls[name] = lambda k, v, S=S, inter=inter, warps=warps, W=W, st=st: rd[(H * S,)](
                k, v, out, nblk, S=S, INTERLEAVE=inter, W=W, num_warps=warps, num_stages=st)
flat = streaming_read()
impls["grid-stride read (K+V as one)"] = None
big = [torch.cat([a, b]) for a, b in sets]
names = list(impls)
res = {n: [] for n in names}
for r in range(3):
    for n in (names if r % 2 == 0 else names[::-1]):
        if impls[n] is None:
            res[n].append(time_kernel(lambda x: flat(x), [(x,) for x in big]))
        else:
            res[n].append(time_kernel(impls[n], sets))
for n in names:
    print(f"{n:40s} {statistics.median(res[n]):7.1f}  " + " ".join(f"{x:6.1f}" for x in res[n]), flush=True)
