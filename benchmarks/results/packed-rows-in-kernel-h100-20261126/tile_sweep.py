"""Packed multi-token GQA decode: the tuned 16-row tile against 32- and 64-row tiles (one tile
per K/V head streams its cache once). Graph us (time_kernel), errors against float64."""
import json

import torch

from flashcore import reference
from flashcore.ops import attention
from flashcore.spec import TileConfig
from flashcore.tuning.timing import n_sets, time_kernel

CONFIGS = [TileConfig((16, 64), warps=1, stages=2),
           TileConfig((32, 64), warps=2, stages=2), TileConfig((64, 64), warps=4, stages=2)]
SHAPES = [(1, 32, 8, 4, 8192), (1, 32, 8, 8, 8192), (1, 32, 8, 16, 8192), (16, 32, 8, 8, 4096),
          (16, 32, 8, 16, 4096), (1, 64, 8, 4, 32768), (1, 32, 1, 4, 8192), (4, 32, 8, 8, 8192)]
if __name__ == "__main__":
    torch.manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for b, hq, hkv, sq, sk in SHAPES:
        mk = lambda b=b, hq=hq, hkv=hkv, sq=sq, sk=sk: (torch.randn(b, hq, sq, 128, device="cuda", dtype=torch.float16),
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
        print(f"{b},{hq}/{hkv},{sq}x{sk}", json.dumps(row), flush=True)
        del sets
