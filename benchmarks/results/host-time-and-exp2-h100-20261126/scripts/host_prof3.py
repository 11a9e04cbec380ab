"""cProfile of the eager FP8 call with the launch stubbed: which functions the wgmma_ws path adds."""
import cProfile, pstats, io, sys, os, time
import torch
sys.path.insert(0, os.getcwd())
from flashcore.ops.fp8 import attention_fp8, quantize_fp8
from flashcore.runtime import loader
from flashcore.runtime.driver import cu
from flashcore.spec import TileConfig
import warnings; warnings.simplefilter("ignore")
q, k, v = (torch.randn(1, 8, 512, 64, device="cuda", dtype=torch.float16) for _ in range(3))
q8, qd = quantize_fp8(q, granularity="token"); k8, kd = quantize_fp8(k); vt8, vd = quantize_fp8(v, transpose=True)
CFG = {"old": TileConfig((64, 64), warps=4, stages=1, kv_splits=1),
       "new": TileConfig((64, 64), warps=4, stages=2, family="wgmma_ws")}
for c in CFG.values():
    attention_fp8(q8, k8, vt8, qd, kd, vd, config=c)
torch.cuda.synchronize()
loader.LoadedKernel._launch = lambda self, grid, values, stream: ((cu.CUresult.CUDA_SUCCESS,), "stub")
N = 20000
for name, c in CFG.items():
    f = lambda: attention_fp8(q8, k8, vt8, qd, kd, vd, config=c)
    for _ in range(1000): f()
    t0 = time.perf_counter()
    for _ in range(N): f()
    print(name, "plain", round((time.perf_counter() - t0) / N * 1e6, 2), "us", flush=True)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(N): f()
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    print("=====", name); print(s.getvalue()[:6000], flush=True)
