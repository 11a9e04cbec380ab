from flashcore.spec import AttentionSpec, TileConfig
W = lambda t, w, s: TileConfig(t, warps=w, stages=s, family="wgmma_ws")
CFGS = {"128x128 s3": W((128, 128), 8, 3), "192x128 s2": W((192, 128), 12, 2),
        "128x128 s2": W((128, 128), 8, 2)}
# (label, B, Hq, Hkv, S, D, causal)
SHAPES = [("4,16,4096,128", 4, 16, 16, 4096, 128, False), ("2,16,8192,128", 2, 16, 16, 8192, 128, False),
          ("4,16,4096,128 causal", 4, 16, 16, 4096, 128, True), ("4,32/8,4096,128 causal", 4, 32, 8, 4096, 128, True),
          ("4,16,2048,128", 4, 16, 16, 2048, 128, False), ("8,16,4096,128", 8, 16, 16, 4096, 128, False)]

def specs():
    out = []
    for c in CFGS.values():
        for causal in (False, True):
            for dt in ("float16", "bfloat16"):
                out.append(AttentionSpec(arch="sm_90", head_dim=128, causal=causal, config=c, dtype=dt))
            out.append(AttentionSpec(arch="sm_90", head_dim=128, causal=causal, config=c, return_lse=True))
    out.append(AttentionSpec(arch="sm_90", head_dim=128, precision="fp8", k_scale="head", config=W((192, 128), 12, 4)))
    return list(dict.fromkeys(out))
