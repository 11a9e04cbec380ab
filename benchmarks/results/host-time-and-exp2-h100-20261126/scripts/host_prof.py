"""Where an eager FP8 call's host time goes at 1,8,512,64: the old mma_sync tile against the
wgmma_ws one (explicit configs, same process, alternating). Whole call, time inside the driver's
launch call, time in descriptor encoding, and raw launch loops of each kernel."""
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
for n, f in fns.items():
    f()
torch.cuda.synchronize()

# 1. whole call, alternating
for rnd in range(2):
    for n in (list(fns) if rnd == 0 else list(fns)[::-1]):
        print(f"whole call  {n:24s} {per_call_us(fns[n], calls=1000, reps=9):6.2f} us", flush=True)

# 2. inside: driver launch call, descriptor encode, LoadedKernel.launch
acc = {}
def wrap(obj, name, key):
    orig = getattr(obj, name)
    def w(*a, **kw):
        t0 = time.perf_counter_ns(); r = orig(*a, **kw); acc[key] = acc.get(key, 0) + time.perf_counter_ns() - t0; return r
    setattr(obj, name, w); return orig
o1 = wrap(cu, "cuLaunchKernelEx", "driver cuLaunchKernelEx")
o2 = wrap(cu, "cuLaunchKernel", "driver cuLaunchKernel")
o3 = wrap(tensor_map, "encode", "tensor_map.encode")
o4 = wrap(loader.LoadedKernel, "launch", "LoadedKernel.launch")
last = {}
orig_launch = launcher.launch
def spy(kern, grid, args, dev):
    last["k"] = (kern, grid, sum(args, ()))
    return orig_launch(kern, grid, args, dev)
launcher.launch = spy
for n, f in fns.items():
    acc.clear(); N = 3000
    for _ in range(200): f()
    torch.cuda.synchronize(); acc.clear()
    t0 = time.perf_counter_ns()
    for _ in range(N): f()
    torch.cuda.synchronize(); tot = (time.perf_counter_ns() - t0) / N / 1e3
    print(f"instrumented {n:24s} total {tot:6.2f} us/call; " + "; ".join(f"{kk} {vv / N / 1e3:5.2f}" for kk, vv in acc.items()), flush=True)
    kern, grid, values = last["k"]
    print(f"   kernel {kern.artifact.entry} grid {grid} block {kern._block} smem {kern._smem} params {len(kern.params)} bytes {kern._struct.size} programmatic {kern.programmatic}", flush=True)
    last[n] = (kern, grid, values)
cu.cuLaunchKernelEx, cu.cuLaunchKernel = o1, o2
tensor_map.encode = o3; loader.LoadedKernel.launch = o4; launcher.launch = orig_launch

# 3. raw launch loops of each kernel (pack + driver call), and the driver call alone
stream = torch._C._cuda_getCurrentRawStream(0)
for rnd in range(2):
    for n in (list(fns) if rnd == 0 else list(fns)[::-1]):
        kern, grid, values = last[n]
        print(f"raw LoadedKernel._launch {n:24s} {per_call_us(lambda: kern._launch(grid, values, stream), calls=2000, reps=9):6.2f} us", flush=True)
        if kern.programmatic:
            cfg = kern._config(grid, stream)
            print(f"raw cuLaunchKernelEx     {n:24s} {per_call_us(lambda: cu.cuLaunchKernelEx(cfg, kern.function, kern._argv_addr, 0), calls=2000, reps=9):6.2f} us", flush=True)
        bx, by, bz = kern._block
        print(f"raw cuLaunchKernel       {n:24s} {per_call_us(lambda: cu.cuLaunchKernel(kern.function, *grid, bx, by, bz, kern._smem, stream, kern._argv_addr, 0), calls=2000, reps=9):6.2f} us", flush=True)
# 4. GPU time per call (events), eager back to back
for n, f in fns.items():
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(1000): f()
    e.record(); torch.cuda.synchronize()
    print(f"events over 1000 eager calls {n:24s} {s.elapsed_time(e):7.2f} us per call", flush=True)
