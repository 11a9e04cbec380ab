"""Where eager generation's time goes, backend by backend: each round's tokens/s of SDPA,
flashcore and a model without attention (the example's models, in turn), then a profile of a
short ``generate`` of SDPA and of flashcore (``torch.profiler``: host and GPU time by op) and
a Python profile of flashcore's (``cProfile``: the calls under flashcore's functions).

    python scripts/generation_profile.py [--batch 1] [--layers 16] [--new 32] [--padded]

Needs a CUDA GPU and transformers; the models, prompts and their arguments are
``examples/generate_transformers.py``'s (``--compile``, ``--bound`` and ``--reverse`` do not
apply: the three models are always timed, eagerly).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import generate_transformers as example

from flashcore.integrations import transformers as fc_transformers


def main() -> None:
    p = example.parser()  # the example's model and prompt arguments, other defaults
    p.description = __doc__.splitlines()[0]
    p.set_defaults(batch=1, layers=16, new=32)
    args = p.parse_args()
    ids, mask = example.prompts(args)
    name = fc_transformers.register()
    models = {b: example.build(args, b)
              for b in ("sdpa", name, example.register_no_attention())}
    for model in models.values():
        example.generate_seconds(model, ids, args.new, warm=True, mask=mask)
    for r in range(args.rounds):
        rates = {b: args.batch * args.new
                 / example.generate_seconds(m, ids, args.new, mask=mask)[0]
                 for b, m in models.items()}
        print(f"round {r}: " + "  ".join(f"{b} {v:.1f}" for b, v in rates.items()), flush=True)
    steps = 8
    for backend in ("sdpa", name):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            example.generate_seconds(models[backend], ids, steps, mask=mask)
        print(f"===== {backend}: {steps} new tokens")
        for order in ("self_cpu_time_total", "self_device_time_total"):  # host, then GPU
            print(prof.key_averages().table(sort_by=order, row_limit=20,
                                            max_name_column_width=60))
    pr = cProfile.Profile()
    pr.enable()
    example.generate_seconds(models[name], ids, steps, mask=mask)
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("cumtime").print_stats("flashcore", 25)
    print(f"===== {name}: Python time under flashcore's functions")
    print(out.getvalue())


if __name__ == "__main__":
    main()
