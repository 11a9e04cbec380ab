"""Eager µs per call of FP8 at the mission shape (back-to-back calls: the host's time), with the
table FLASHCORE_TUNED names (or the tree's). Run from the repository root, alternating processes:
    FLASHCORE_TUNED=old_table_dir python host_fp8.py; python host_fp8.py
"""

import os
import sys
import warnings

import torch

sys.path.insert(0, os.getcwd())
from flashcore.ops import attention
from flashcore.ops.fp8 import attention_fp8, quantize_fp8
from scripts.host_overhead import per_call_us

q, k, v = (torch.randn(1, 8, 512, 64, device="cuda", dtype=torch.float16) for _ in range(3))
q8, qd = quantize_fp8(q, granularity="token")
k8, kd = quantize_fp8(k)
vt8, vd = quantize_fp8(v, transpose=True)
tag = "old" if os.environ.get("FLASHCORE_TUNED") else "new"
warnings.simplefilter("ignore")
calls = {"attention_fp8 (K per head)": lambda: attention_fp8(q8, k8, vt8, qd, kd, vd),
         "attention(precision='fp8')": lambda: attention(q, k, v, precision="fp8"),
         "attention fp16": lambda: attention(q, k, v)}
for name, fn in calls.items():
    print(f"{tag} {name:30s} {per_call_us(fn, calls=500, reps=9):6.2f} us per call", flush=True)
