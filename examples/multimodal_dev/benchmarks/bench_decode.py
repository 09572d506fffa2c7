"""Decode speed: cached decoding (``generation/decode.py``: one prefill, then one token a forward with
the KV cache and the Gated DeltaNet states) against recomputing the whole prefix for every new token
(Megatron-Bridge's VLM generator), greedy, the same model and prompt.

    python -m examples.multimodal_dev.benchmarks.bench_decode [--variant proxy --num-layers 4 \\
        --vocab-size 32768 --prompt-tokens 64 --new-tokens 256 --reps 1]

The model has the variant's widths (``proxy``: hidden 4096, 32 attention heads, 64 DeltaNet value
heads, 8 experts of 1024) with ``--num-layers`` layers and a ``--vocab-size`` vocabulary, fp32, on the
CPU unless ``--device cuda``. The prompt is text (vision runs once in both, before the first token).
Prints each contender's new tokens per second (median of ``--reps`` timed runs taking turns, after a
warm-up of a few tokens each), the ratio, and whether the two chose the same tokens: both are greedy on the same
weights, so they must, up to a near-tie in the last bits of a logit.
"""

from __future__ import annotations

import argparse
import functools

import torch


def contenders(model, shape, prompt: list[int], device):
    """{name: run(new_tokens) -> new tokens}: cached decoding and whole-prefix recomputation."""
    from examples.multimodal_dev.generation.decode import Prompt, generate
    from examples.multimodal_dev.models import model_of

    def cached(new_tokens):
        return generate(model, [Prompt(prompt)], new_tokens).tokens[0]

    @torch.no_grad()
    def recomputed(new_tokens):
        ids = torch.tensor([prompt], device=device)
        for _ in range(new_tokens):
            positions = model_of(shape).padded_position_ids(
                ids, None, None, None, shape.image_token_id, shape.video_token_id, shape.vision.spatial_merge_size
            )
            token = model(ids, positions, None)[0, -1].argmax()
            ids = torch.cat([ids, token.view(1, 1)], dim=1)
        return ids[0, len(prompt) :].tolist()

    return {"cached": cached, "recomputed": recomputed}


def run(
    variant: str = "proxy",
    num_layers: int = 4,
    vocab_size: int = 32768,
    prompt_tokens: int = 64,
    new_tokens: int = 256,
    reps: int = 1,
    device: str = "cpu",
    progress: bool = False,
) -> dict:
    import megatron.cpu
    from examples.multimodal_dev.benchmarks.bench_step import bench_shape
    from examples.multimodal_dev.benchmarks.timing import alternating_medians
    from examples.multimodal_dev.models import default_model

    build_model = default_model().build_fn
    from megatron.cpu.single_process import init_single_process

    for flag, value in (("--prompt-tokens", prompt_tokens), ("--new-tokens", new_tokens)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    if device == "cpu":
        megatron.cpu.activate()
    init_single_process()
    shape = bench_shape(variant, num_layers, vocab_size, vision_depth=1)
    torch.manual_seed(0)
    model = build_model(shape, use_cpu_initialization=True).to(device).eval()
    prompt = torch.randint(0, shape.text.vocab_size - 8, (prompt_tokens,), generator=torch.Generator().manual_seed(1))
    runs = contenders(model, shape, prompt.tolist(), torch.device(device))
    for warm_up in runs.values():  # a few tokens: the whole length would double a long benchmark
        warm_up(min(new_tokens, 4))
    seconds, tokens = alternating_medians(
        {name: functools.partial(fn, new_tokens) for name, fn in runs.items()}, reps, progress, warm_up=False
    )
    return {
        "shape": f"{variant} width, {num_layers} layers, vocabulary {vocab_size}",
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "tokens_per_s": {name: new_tokens / s for name, s in seconds.items()},
        "speedup": seconds["recomputed"] / seconds["cached"],
        "same_tokens": tokens["cached"] == tokens["recomputed"],
        "first_difference": next(
            (i for i, (a, b) in enumerate(zip(tokens["cached"], tokens["recomputed"])) if a != b), None
        ),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="proxy")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    try:
        result = run(
            args.variant,
            args.num_layers,
            args.vocab_size,
            args.prompt_tokens,
            args.new_tokens,
            args.reps,
            args.device,
            progress=True,
        )
    except ValueError as err:
        raise SystemExit(f"bench_decode: {err}") from None
    rates = result["tokens_per_s"]
    print(
        f"{result['shape']}, prompt {result['prompt_tokens']} tokens, {result['new_tokens']} new ({args.device}):\n"
        f"  cached decoding      {rates['cached']:9.2f} tokens/s\n"
        f"  recomputed prefix    {rates['recomputed']:9.2f} tokens/s\n"
        f"  cached / recomputed  {result['speedup']:9.1f}x; same tokens: {result['same_tokens']}"
        + (f" (first difference at {result['first_difference']})" if not result["same_tokens"] else "")
    )


if __name__ == "__main__":
    main()
