"""Greedy generation with a random-init Llama-style transformers model, on torch's SDPA and on
flashcore, with tokens/s and the prompt's prefill time for each (needs a CUDA GPU and
``pip install flashcore[transformers]``).

    python examples/generate_transformers.py --layers 4 --batch 8 --prompt 512 --new 128
    python examples/generate_transformers.py --compile   # a static cache: generate compiles
                                                         # the decode step
    python examples/generate_transformers.py --padded    # prompts of different lengths
    python examples/generate_transformers.py --bound     # and a model without attention
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from flashcore.integrations import transformers as fc_transformers

NO_ATTENTION = "no_attention"


def no_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention that returns its query unchanged: a model with it takes the time of
    everything but attention, the bound on what any attention could gain."""
    return query.transpose(1, 2), None


def register_no_attention() -> str:
    """Register ``no_attention`` (with SDPA's mask function) with transformers; returns its
    name."""
    transformers.AttentionInterface.register(NO_ATTENTION, no_attention)
    AttentionMaskInterface.register(NO_ATTENTION, sdpa_mask)
    return NO_ATTENTION


def build(args: argparse.Namespace, name: str) -> transformers.PreTrainedModel:
    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.heads * 128, intermediate_size=args.heads * 128 * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.prompt + args.new)
    torch.manual_seed(0)  # the same weights for both backends
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    model.set_attn_implementation(name)
    return model


def prompts(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random token ids (never the pad id 0, whose presence would make generate infer a
    padding mask) and, with ``--padded``, a mask that left-pads row b by b / (2 * batch) of
    the prompt, as a batch of prompts of different lengths is."""
    ids = torch.randint(1, 32000, (args.batch, args.prompt), device="cuda")
    if not args.padded:
        return ids, None
    mask = torch.ones_like(ids)
    for b in range(args.batch):
        mask[b, :b * args.prompt // (2 * args.batch)] = 0
    return ids.masked_fill(mask == 0, 0), mask


def generate_seconds(model, ids: torch.Tensor, new: int, compiled: bool = False,
                     warm: bool = False, mask: torch.Tensor | None = None
                     ) -> tuple[float, torch.Tensor]:
    """Seconds of one greedy ``generate`` of ``new`` tokens (``warm``: a short one first; a
    compiled step traces once per cache length, so its warm-up is the whole length)."""
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0,
          "attention_mask": mask if mask is not None else torch.ones_like(ids)}
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


def prefill_ms(models: dict, ids: torch.Tensor, mask: torch.Tensor | None,
               reps: int = 15) -> dict:
    """Each model's median time of the forward over the whole prompt (no cache kept), CUDA
    events; the models in turn, one forward each a round (a host's drift hits all alike)."""
    times = {backend: [] for backend in models}
    with torch.no_grad():
        for i in range(reps + 2):
            for backend, model in models.items():
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                model(ids, attention_mask=mask, use_cache=False)
                end.record()
                torch.cuda.synchronize()
                if i >= 2:
                    times[backend].append(start.elapsed_time(end))
    return {backend: statistics.median(t) for backend, t in times.items()}


def parser() -> argparse.ArgumentParser:
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
    p.add_argument("--padded", action="store_true",
                   help="left-pad the rows by different amounts (prompts of different lengths)")
    p.add_argument("--bound", action="store_true",
                   help="also a model whose attention returns its query (no attention work)")
    return p


def main() -> None:
    args = parser().parse_args()
    ids, mask = prompts(args)
    name = fc_transformers.register()
    order = (name, "sdpa") if args.reverse else ("sdpa", name)
    if args.bound:
        order += (register_no_attention(),)
    models = {backend: build(args, backend) for backend in order}
    results, seconds = {}, {backend: [] for backend in order}
    for backend, model in models.items():
        generate_seconds(model, ids, args.new, args.compile, warm=True, mask=mask)
    for _ in range(args.rounds):  # the backends in turn: a host's drift hits both alike
        for backend, model in models.items():
            t, results[backend] = generate_seconds(model, ids, args.new, args.compile,
                                                   mask=mask)
            seconds[backend].append(t)
    prefill = prefill_ms(models, ids, mask)
    for backend in models:
        rates = [args.batch * args.new / t for t in seconds[backend]]
        print(f"{backend:>16}: {statistics.median(rates):9.1f} tokens/s (median of "
              f"{args.rounds}; {min(rates):.1f}-{max(rates):.1f}), prefill "
              f"{prefill[backend]:7.2f} ms")
    same = (results["sdpa"] == results[name]).float().mean().item()
    print(f"tokens equal to SDPA's: {same:.1%}; torch fallbacks: "
          f"{fc_transformers.fallback_reasons() or 'none'}")


if __name__ == "__main__":
    main()
