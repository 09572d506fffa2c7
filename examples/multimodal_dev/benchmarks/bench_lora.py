"""LoRA against full training: what a GPU holds at a released variant's layout, and a training step.

    python -m examples.multimodal_dev.benchmarks.bench_lora [--variant 35b_a3b --lora-rank 16]
                                                           [--step-variant 0.8b --reps 3]

Memory: the variant's recommended layout, its representative ranks built on the meta device twice
(``planner/meta_builds.py``), without and with adapters on the default targets: trainable
parameters, gradient and optimizer bytes a rank (bf16 weights, fp32 gradients, the distributed
optimizer's fp32 state). Step: a forward, backward and AdamW step on the host (fp32) of the
``--step-variant``'s widths with a few layers, on one packed micro-batch of mock conversations,
the full model against the same weights with adapters (B = 0, so both start from the same loss,
which is checked before times count); the contenders take turns, median of ``--reps``.
"""

from __future__ import annotations

import argparse
import logging

import torch

from examples.multimodal_dev.benchmarks.bench_step import bench_shape, mock_samples
from examples.multimodal_dev.benchmarks.timing import alternating_medians

GIB = 2**30


def memory(variant: str, rank: int, layout=None) -> list[dict]:
    """Per representative rank: {rank, label, full, lora}, each (trainable, grad bytes, optimizer bytes)."""
    from examples.multimodal_dev.lora.targets import LoraSettings
    from examples.multimodal_dev.models import default_model
    from examples.multimodal_dev.planner.meta_builds import Layout, rank_build, rank_memory, representative_ranks

    shape, layout = default_model().variants[variant], layout or Layout.recommended(variant)
    rows = []
    for label, r in representative_ranks(layout).items():
        row = dict(rank=r, label=label, layout=layout.describe())
        for name, lora in (("full", None), ("lora", LoraSettings(rank))):
            build = rank_build(shape, layout, r, shards=False, lora=lora)
            mem = rank_memory(build, layout)
            row[name] = (sum(p.numel for p in build.params if p.trainable), mem.grad_bytes, mem.optimizer_bytes)
        rows.append(row)
    return rows


def step(variant: str, rank: int, layers: int, samples: int, reps: int) -> dict:
    """{"times": {name: median s}, "losses": {name: first loss}, "trainable": {name: parameters}}."""
    from examples.multimodal_dev.data.collate import pack_thd
    from examples.multimodal_dev.data.sample import VisionTokens
    from examples.multimodal_dev.forward_step import batch_loss
    from examples.multimodal_dev.lora import apply as lora
    from examples.multimodal_dev.lora.targets import DEFAULT_TARGETS
    from examples.multimodal_dev.models import default_model
    from megatron.cpu.single_process import init_single_process

    init_single_process()
    shape = bench_shape(variant, num_layers=layers, vocab_size=32768, vision_depth=2)
    torch.manual_seed(0)
    full = default_model().build_fn(shape)
    adapted = default_model().build_fn(shape)
    adapted.load_state_dict(full.state_dict())
    lora.apply(adapted, rank, float(rank), 0.0, DEFAULT_TARGETS, seed=0)
    batch = pack_thd(mock_samples(shape, samples, mean_text_tokens=160), VisionTokens.from_shape(shape))
    models = {"full": full, f"LoRA rank {rank}": adapted}
    optimizers = {
        name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-5) for name, m in models.items()
    }

    def train(name):
        model, optimizer = models[name], optimizers[name]
        optimizer.zero_grad(set_to_none=True)
        loss, n, _ = batch_loss(model, batch)
        (loss / n).backward()
        optimizer.step()
        return loss.item() / int(n)

    with torch.no_grad():  # the same weights, the adapters at B = 0: the same loss (per token)
        losses = {name: (lambda loss, n, _: loss.item() / int(n))(*batch_loss(m, batch)) for name, m in models.items()}
    times, _ = alternating_medians({name: (lambda n=name: train(n)) for name in models}, reps)
    trainable = {name: sum(p.numel() for p in m.parameters() if p.requires_grad) for name, m in models.items()}
    return dict(times=times, losses=losses, trainable=trainable, tokens=batch.tokens.numel())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="35b_a3b", help="released variant for the memory table")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--step-variant", default="0.8b", help="widths of the model the step runs")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="conversations in the micro-batch")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    # megatron-core logs a deprecation warning for every GPTModel built; a dozen builds here
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    if args.lora_rank < 1:
        parser.error(f"--lora-rank {args.lora_rank}: need a positive rank")

    print(f"`{args.variant}`, LoRA rank {args.lora_rank} on the default targets (meta-device builds):")
    print("| rank | trainable parameters (full -> LoRA) | gradients GiB | optimizer GiB |")
    print("|---|---|---|---|")
    for row in memory(args.variant, args.lora_rank):
        (pf, gf, of), (pl, gl, ol) = row["full"], row["lora"]
        print(
            f"| {row['rank']} ({row['label']}) | {pf / 1e9:.2f} B -> {pl / 1e6:.1f} M ({pf / pl:.0f}x fewer) "
            f"| {gf / GIB:.2f} -> {gl / GIB:.2f} | {of / GIB:.2f} -> {ol / GIB:.2f} |"
        )
    result = step(args.step_variant, args.lora_rank, args.num_layers, args.samples, args.reps)
    (full_name, full_loss), (lora_name, lora_loss) = result["losses"].items()
    if abs(full_loss - lora_loss) > 1e-5 * abs(full_loss):
        raise SystemExit(f"the LoRA model's first loss {lora_loss} differs from the full model's {full_loss}")
    print(
        f"\nstep: `{args.step_variant}` widths, {args.num_layers} layers, vocabulary 32768, 2 vision blocks, "
        f"{result['tokens']} tokens packed, fp32 CPU, {torch.get_num_threads()} threads, median of {args.reps}; "
        f"first loss {full_loss:.6f} both"
    )
    print("| contender | trainable parameters | step time (s) |")
    print("|---|---|---|")
    for name, seconds in result["times"].items():
        print(f"| {name} | {result['trainable'][name] / 1e6:.2f} M | {seconds:.3f} |")
    print(f"LoRA's step takes {result['times'][lora_name] / result['times'][full_name]:.2f}x the full step's time")


if __name__ == "__main__":
    main()
