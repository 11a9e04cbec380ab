from flashcore.spec import AttentionSpec, TileConfig
W = lambda t, w, s: TileConfig(t, warps=w, stages=s, family="wgmma_ws")
CFGS = {"128x128 s4": W((128, 128), 8, 4), "128x128 s3": W((128, 128), 8, 3), "192x128 s2": W((192, 128), 12, 2),
        "192x128 s3": W((192, 128), 12, 3), "64x128 s2": W((64, 128), 4, 2), "64x128 s3": W((64, 128), 4, 3),
        "64x128 s4": W((64, 128), 4, 4), "64x64 s3": W((64, 64), 4, 3)}
SHAPES = [("4,16,4096,64 causal", 4, 16, 4096, 64, True), ("4,16,4096,64", 4, 16, 4096, 64, False),
          ("4,16,4096,128 causal", 4, 16, 4096, 128, True)]
PER_SHAPE = {"4,16,4096,64 causal": ["128x128 s4", "192x128 s2", "192x128 s3", "64x128 s2", "64x128 s3", "64x128 s4", "64x64 s3"],
             "4,16,4096,64": ["192x128 s3", "64x128 s2", "64x128 s3", "64x128 s4"],
             "4,16,4096,128 causal": ["128x128 s3", "64x128 s2", "64x128 s3"]}

def specs():
    out = []
    for label, b, h, s, d, causal in SHAPES:
        for n in PER_SHAPE[label]:
            out.append(AttentionSpec(arch="sm_90", head_dim=d, causal=causal, config=CFGS[n]))
    return list(dict.fromkeys(out))
