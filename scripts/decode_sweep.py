"""Decode on the GPU: flashcore's decode configs and split counts against SDPA's backends (and
FlashAttention-4 when importable), kernel time in a CUDA graph, one table. Writes JSON to $OUT.

    python scripts/decode_sweep.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from flashcore.ops import attention
from flashcore.ops.fp8 import quantize_fp8
from flashcore.spec import TileConfig
from flashcore.tuning.bench import DECODE, _fa4, _sdpa
from flashcore.tuning.timing import n_sets, time_kernel

CONFIGS = [TileConfig((16, t), warps=1, stages=s) for t in (32, 64, 128) for s in (1, 2, 3)]
SPLITS = [None, 8, 16, 32, 64, 128]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    from torch.nn.attention import SDPBackend

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    peers = {"sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION),
             "sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
             "sdpa-efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION)}
    fa4 = _fa4()
    if fa4 is not None:
        peers["fa4"] = fa4
    rows = []
    for shape in DECODE:
        sets = [shape.inputs() for _ in range(n_sets(int(shape.min_bytes()), l2))]
        floor = shape.min_bytes() / 3.0e6  # µs at 3.0 TB/s
        results = {}
        for name, fn in peers.items():
            try:
                with fn.context() if hasattr(fn, "context") else torch.no_grad():
                    results[name] = time_kernel(lambda q, k, v, fn=fn: fn(q, k, v, False), sets)
            except Exception as e:  # noqa: BLE001 - a peer without support: recorded
                results[name] = f"{type(e).__name__}"
        configs = CONFIGS[:3] if a.quick else CONFIGS
        for cfg in configs:
            for splits in SPLITS:
                try:
                    us = time_kernel(lambda q, k, v, c=cfg, s=splits: attention(
                        q, k, v, config=c, num_splits=s), sets)
                except Exception as e:  # noqa: BLE001
                    us = f"{type(e).__name__}: {str(e)[:80]}"
                results[f"fc {cfg.tag} splits={splits}"] = us
        kv8 = [(q, *quantize_fp8(k, granularity="token"), *quantize_fp8(v, granularity="token"))
               for q, k, v in sets]
        for cfg in configs:
            try:
                us = time_kernel(lambda q, k8, kd, v8, vd, c=cfg: attention(
                    q, k8, v8, config=c, k_descale=kd, v_descale=vd), kv8)
            except Exception as e:  # noqa: BLE001
                us = f"{type(e).__name__}: {str(e)[:80]}"
            results[f"fc-fp8kv {cfg.tag}"] = us
        best_peer = min(v for k, v in results.items() if not k.startswith("fc")
                        and isinstance(v, float))
        print(f"\n{shape.label}: floor {floor:.1f} us (3.0 TB/s), best peer {best_peer:.1f} us")
        for k, v in sorted(results.items(), key=lambda kv: kv[1] if isinstance(kv[1], float)
                           else 1e9):
            if isinstance(v, float):
                print(f"  {k:36s} {v:8.1f} us  {floor / v:5.0%} of floor  x{best_peer / v:.2f}")
            else:
                print(f"  {k:36s} {v}")
        rows.append({"shape": shape.label, "floor_us": floor, "results": results})
    out = Path(os.environ.get("OUT", "."))
    (out / "decode-sweep.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
