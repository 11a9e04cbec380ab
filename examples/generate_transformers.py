"""Greedy generation with a random-init Llama-style transformers model, on torch's SDPA and on
flashcore, with tokens/s and the prompt's prefill time for each (needs a CUDA GPU and
``pip install flashcore[transformers]``).

    python examples/generate_transformers.py --layers 4 --batch 8 --prompt 512 --new 128
    python examples/generate_transformers.py --compile   # a static cache: generate compiles
                                                         # the decode step
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from flashcore.integrations import transformers as fc_transformers


def build(args: argparse.Namespace, name: str) -> transformers.PreTrainedModel:
    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.heads * 128, intermediate_size=args.heads * 128 * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.prompt + args.new)
    torch.manual_seed(0)  # the same weights for both backends
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    model.set_attn_implementation(name)
    return model


def generate_seconds(model, ids: torch.Tensor, new: int, compiled: bool = False,
                     warm: bool = False) -> tuple[float, torch.Tensor]:
    """Seconds of one greedy ``generate`` of ``new`` tokens (``warm``: a short one first; a
    compiled step traces once per cache length, so its warm-up is the whole length)."""
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    if compiled:  # transformers compiles the decode step of a static cache itself
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        if warm:
            n = new if compiled else 4
            model.generate(ids, **{**kw, "max_new_tokens": n, "min_new_tokens": n})
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def prefill_ms(model, ids: torch.Tensor, reps: int = 10) -> float:
    """Median time of the forward over the whole prompt (no cache kept), CUDA events."""
    times = []
    with torch.no_grad():
        for i in range(reps + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(ids, use_cache=False)
            end.record()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reverse", action="store_true",
                   help="run flashcore first (the order's effect on the timings)")
    p.add_argument("--rounds", type=int, default=3,
                   help="generate calls a backend, in turn with the other's (median kept)")
    p.add_argument("--compile", action="store_true",
                   help="a static cache, whose decode step transformers compiles")
    args = p.parse_args()
    ids = torch.randint(0, 32000, (args.batch, args.prompt), device="cuda")
    name = fc_transformers.register()
    order = (name, "sdpa") if args.reverse else ("sdpa", name)
    models = {backend: build(args, backend) for backend in order}
    results, seconds = {}, {backend: [] for backend in order}
    for backend, model in models.items():
        generate_seconds(model, ids, args.new, args.compile, warm=True)
    for _ in range(args.rounds):  # the backends in turn: a host's drift hits both alike
        for backend, model in models.items():
            t, results[backend] = generate_seconds(model, ids, args.new, args.compile)
            seconds[backend].append(t)
    for backend, model in models.items():
        rate = args.batch * args.new / statistics.median(seconds[backend])
        print(f"{backend:>16}: {rate:9.1f} tokens/s (median of {args.rounds}), prefill "
              f"{prefill_ms(model, ids):7.2f} ms")
    same = (results["sdpa"] == results[name]).float().mean().item()
    print(f"tokens equal to SDPA's: {same:.1%}; torch fallbacks: "
          f"{fc_transformers.fallback_reasons() or 'none'}")


if __name__ == "__main__":
    main()
