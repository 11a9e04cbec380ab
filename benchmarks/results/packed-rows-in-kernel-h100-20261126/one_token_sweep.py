"""One-token GQA/MQA decode (the query heads of a K/V head packed as rows, plan.packs_heads):
the tuned 16-row tile against 32- and 64-row tiles. Graph us, errors against float64."""
import json

import torch
from torch.nn.attention import SDPBackend

from flashcore import reference
from flashcore.ops import attention
from flashcore.spec import TileConfig
from flashcore.tuning.peers import _sdpa
from flashcore.tuning.timing import n_sets, time_kernel

CONFIGS = [TileConfig((16, 64), warps=1, stages=2), TileConfig((32, 64), warps=2, stages=2),
           TileConfig((64, 64), warps=4, stages=2)]
SHAPES = [(1, 32, 1, 8192), (1, 64, 1, 8192), (1, 32, 2, 8192), (8, 32, 1, 8192), (1, 64, 2, 32768), (1, 32, 8, 8192)]
if __name__ == "__main__":
    torch.manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION)
    for b, hq, hkv, sk in SHAPES:
        mk = lambda b=b, hq=hq, hkv=hkv, sk=sk: (torch.randn(b, hq, 1, 128, device="cuda", dtype=torch.float16),
                      torch.randn(b, hkv, sk, 128, device="cuda", dtype=torch.float16),
                      torch.randn(b, hkv, sk, 128, device="cuda", dtype=torch.float16))
        sets = [mk() for _ in range(n_sets(2 * b * hkv * sk * 128 * 2, l2))]
        q, k, v = sets[0]
        ref = reference.attention(q, k, v, device=q.device)
        row = {}
        for rnd in range(2):
            for cfg in (CONFIGS if rnd == 0 else CONFIGS[::-1]):
                try:
                    err = (attention(q, k, v, config=cfg).double() - ref).abs().max().item()
                    t = time_kernel(lambda q, k, v, cfg=cfg: attention(q, k, v, config=cfg), sets)
                except Exception as e:  # noqa: BLE001 - a config that fails is recorded
                    row[cfg.tag] = str(e)[:80]; continue
                row.setdefault(cfg.tag, []).append((round(t, 1), f"{err:.1e}"))
            row.setdefault("cudnn", []).append(round(time_kernel(lambda q, k, v: cudnn(q, k, v, False), sets), 1))
        print(f"{b},{hq}/{hkv},1x{sk}", json.dumps(row), flush=True)
        del sets
