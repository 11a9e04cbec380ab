"""Discriminate: Python cost with the launch stubbed (no GPU work), and the driver call's own
cost when host-bound (a busy wait between raw launches)."""
import statistics, sys, time, os
import torch
sys.path.insert(0, os.getcwd())
from flashcore.ops.fp8 import attention_fp8, quantize_fp8
from flashcore.ops import launcher
from flashcore.runtime import loader, tensor_map
from flashcore.runtime.driver import cu
from flashcore.spec import TileConfig
from scripts.host_overhead import per_call_us
import warnings; warnings.simplefilter("ignore")
torch.manual_seed(0)
q, k, v = (torch.randn(1, 8, 512, 64, device="cuda", dtype=torch.float16) for _ in range(3))
q8, qd = quantize_fp8(q, granularity="token"); k8, kd = quantize_fp8(k); vt8, vd = quantize_fp8(v, transpose=True)
CFG = {"old mma_sync 64x64 s1": TileConfig((64, 64), warps=4, stages=1, kv_splits=1),
       "new wgmma_ws 64x64 s2": TileConfig((64, 64), warps=4, stages=2, family="wgmma_ws")}
fns = {n: (lambda c=c: attention_fp8(q8, k8, vt8, qd, kd, vd, config=c)) for n, c in CFG.items()}
last = {}
orig_launch = launcher.launch
def spy(kern, grid, args, dev):
    last["k"] = (kern, grid, sum(args, ()))
    return orig_launch(kern, grid, args, dev)
launcher.launch = spy
for n, f in fns.items():
    f(); last[n] = last["k"]
launcher.launch = orig_launch
torch.cuda.synchronize()
for rnd in range(2):
    for n in (list(fns) if rnd == 0 else list(fns)[::-1]):
        print(f"whole call        {n:24s} {per_call_us(fns[n], calls=1000, reps=9):6.2f} us", flush=True)
# 1. the launch stubbed: Python only
orig = loader.LoadedKernel._launch
loader.LoadedKernel._launch = lambda self, grid, values, stream: ((cu.CUresult.CUDA_SUCCESS,), "stub")
for rnd in range(2):
    for n in (list(fns) if rnd == 0 else list(fns)[::-1]):
        print(f"launch stubbed    {n:24s} {per_call_us(fns[n], calls=2000, reps=9):6.2f} us", flush=True)
loader.LoadedKernel._launch = orig
# 2. raw launches paced like an eager loop (a busy wait of W us between launches)
stream = torch._C._cuda_getCurrentRawStream(0)
def paced(kern, grid, values, wait_us):
    def f():
        t = time.perf_counter() + wait_us * 1e-6
        kern._launch(grid, values, stream)
        while time.perf_counter() < t:
            pass
    return f
for W in (25.0, 40.0):
    for rnd in range(2):
        for n in (list(fns) if rnd == 0 else list(fns)[::-1]):
            kern, grid, values = last[n]
            print(f"paced {W:4.0f} us      {n:24s} {per_call_us(paced(kern, grid, values, W), calls=1000, reps=7):6.2f} us", flush=True)
# 3. time inside _launch when paced at 25 us
for n in fns:
    kern, grid, values = last[n]
    ts = []
    for i in range(3000):
        t = time.perf_counter() + 25e-6
        t0 = time.perf_counter_ns(); kern._launch(grid, values, stream); ts.append(time.perf_counter_ns() - t0)
        while time.perf_counter() < t:
            pass
    torch.cuda.synchronize()
    ts = sorted(ts[500:])
    print(f"_launch when paced at 25 us {n:24s} median {ts[len(ts)//2]/1e3:5.2f} p90 {ts[int(len(ts)*.9)]/1e3:5.2f} us", flush=True)
# 4. PDL off for both: whole call
loader._pdl_enabled[0] = False
for n in fns:
    print(f"whole call, PDL off {n:24s} {per_call_us(fns[n], calls=1000, reps=9):6.2f} us", flush=True)
