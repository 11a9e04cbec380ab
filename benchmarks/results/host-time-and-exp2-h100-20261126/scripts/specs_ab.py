"""The kernels of the row-sums A/B: #13's tuned fp16 and FP8 (K per head) wgmma_ws tiles, the
quantisers, and the other tuned FP8/fp16 Hopper tiles the checks use."""
from flashcore.spec import AttentionSpec, TileConfig
from flashcore.spec.quantize import QuantizeSpec

W = lambda t, w, s: TileConfig(t, warps=w, stages=s, family="wgmma_ws")
# (label, B, H, S, D, causal, fp16 config, fp8 K/head config, fp8 K/token config)
CASES = [
    ("4,16,4096,64", 4, 16, 4096, 64, False, W((192, 128), 12, 3), W((192, 128), 12, 2), W((192, 128), 12, 2)),
    ("4,16,4096,128", 4, 16, 4096, 128, False, W((128, 128), 8, 3), W((192, 128), 12, 4), W((128, 128), 8, 2)),
    ("2,16,8192,128", 2, 16, 8192, 128, False, W((128, 128), 8, 3), W((192, 128), 12, 4), W((128, 128), 8, 2)),
    ("4,16,4096,64 causal", 4, 16, 4096, 64, True, W((128, 128), 8, 4), W((192, 128), 12, 2), W((192, 64), 12, 3)),
    ("4,16,4096,128 causal", 4, 16, 4096, 128, True, W((128, 128), 8, 3), W((128, 128), 8, 2), W((128, 128), 8, 2)),
]


def specs():
    out = []
    for _, b, h, s, d, causal, c16, c8, c8t in CASES:
        out.append(AttentionSpec(arch="sm_90", head_dim=d, causal=causal, config=c16))
        out.append(AttentionSpec(arch="sm_90", head_dim=d, causal=causal, config=c8,
                                 precision="fp8", k_scale="head"))
        out.append(AttentionSpec(arch="sm_90", head_dim=d, causal=causal, config=c8t,
                                 precision="fp8"))
    for d in (64, 128):
        for kw in ({"part": "amax"}, {"transpose": False}, {"transpose": True},
                   {"granularity": "token"}):
            out.append(QuantizeSpec(arch="sm_90", dtype="float16", head_dim=d, **kw))
    return list(dict.fromkeys(out))
