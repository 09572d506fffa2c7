"""Packed (THD) against padded (BSHD) training steps of the same samples: step time and the
fraction of the FLOPs spent that are useful (real tokens), on a realistic length mix.

    python -m examples.multimodal_dev.benchmarks.bench_packing [--variant tiny --micro-batch 8 --reps 5]

Samples are text conversations with lengths drawn uniformly from 200..2000 tokens, and every
eighth one a long outlier of 3000..4000; or, with ``--mix realistic``, conversations of the
``mock_mix`` provider (log-normal lengths, 0-4 images of 224^2..1344^2 pixels). Each step is a forward and
backward pass of the model on one micro-batch, fp32 on the host; packed and padded steps run
alternately and the median of each is reported. Both must give the same loss (checked).
"""

from __future__ import annotations

import argparse

import torch


def sample_lengths(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(200, 2001, (n,), generator=gen)
    outliers = torch.randint(3000, 4001, (n,), generator=gen)
    return [int(outliers[i]) if i % 8 == 7 else int(lengths[i]) for i in range(n)]


def text_samples(lengths, vocab: int, seed: int = 0) -> list[dict]:
    from examples.multimodal_dev.data.sample import build_sft_sample

    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(16, vocab, (n,), generator=gen)
        answer = n // 4
        out.append(build_sft_sample(ids[: n - answer], ids[n - answer :], torch.zeros(0, 1), torch.zeros(0, 3)))
    return out


def realistic_samples(shape, n: int, seq_length: int = 2048) -> list[dict]:
    from examples.multimodal_dev.data import mock_mix
    from examples.multimodal_dev.data.sample import VisionTokens

    dataset = mock_mix.build_datasets(
        tokens=VisionTokens.from_shape(shape),
        vocab_size=shape.text.vocab_size,
        patch_dim=shape.vision.patch_dim,
        seq_length=seq_length,
        num_samples=(n, 0, 0),
    )[0]
    return [dataset[i] for i in range(n)]


def run(variant: str, lengths: list[int] | None, reps: int, mix: str = "text", micro_batch: int = 8) -> dict:
    """Packed and padded training steps of text samples of these lengths (or ``micro_batch``
    realistic-mix conversations): median seconds, loss (which must agree: the same samples),
    tokens processed and FLOPs (useful and spent)."""
    from examples.multimodal_dev.benchmarks.timing import alternating_medians
    from examples.multimodal_dev.data.collate import pack_thd, pad_bshd
    from examples.multimodal_dev.data.sample import VisionTokens
    from examples.multimodal_dev.forward_step import batch_loss
    from examples.multimodal_dev.models import default_model
    from megatron.cpu.single_process import init_single_process

    get_variant = default_model().shape_fn
    build_model = default_model().build_fn
    micro_batch_flops = default_model().micro_batch_flops
    init_single_process()
    shape = get_variant(variant, mtp=False)
    model = build_model(shape)
    tokens = VisionTokens.from_shape(shape)
    if mix == "realistic":
        samples = realistic_samples(shape, micro_batch)
        lengths = [s["input_ids"].numel() for s in samples]
    else:
        samples = text_samples(lengths, min(shape.text.vocab_size, 4000))
    grids = [g for s in samples for g in s["image_grid_thw"].tolist()]
    batches = {"packed (THD)": pack_thd(samples, tokens), "padded (BSHD)": pad_bshd(samples, tokens)}

    def step(batch):
        model.zero_grad(set_to_none=True)
        loss, n, _ = batch_loss(model, batch)
        (loss / n).backward()
        return loss.item() / int(n)

    times, losses = alternating_medians({name: (lambda b=batch: step(b)) for name, batch in batches.items()}, reps)
    useful = micro_batch_flops(shape, lengths, grids).training
    return {
        "times": times,
        "losses": losses,
        "tokens": {name: b.tokens.numel() for name, b in batches.items()},
        "useful_flops": useful,
        "lengths": lengths,
        # the packed row holds only real tokens; the padded rows are all as long as the longest
        "spent_flops": {
            "packed (THD)": useful,
            "padded (BSHD)": micro_batch_flops(shape, [max(lengths)] * len(lengths), grids).training,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="tiny")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mix", choices=("text", "realistic"), default="text")
    args = parser.parse_args()
    if args.micro_batch < 1:
        parser.error(f"--micro-batch {args.micro_batch}: need at least one sample")
    result = run(
        args.variant,
        sample_lengths(args.micro_batch) if args.mix == "text" else None,
        args.reps,
        args.mix,
        args.micro_batch,
    )
    lengths = result["lengths"]
    packed, padded = result["losses"]["packed (THD)"], result["losses"]["padded (BSHD)"]
    if abs(packed - padded) > 1e-4 * abs(padded):
        raise SystemExit(f"packed loss {packed:.6f} differs from padded {padded:.6f}: not the same step")
    useful = result["useful_flops"]
    print(
        f"{args.variant}, {args.mix} mix, micro-batch of {len(lengths)} samples, lengths {lengths} "
        f"({sum(lengths)} tokens), "
        f"fp32 CPU, {torch.get_num_threads()} threads, median of {args.reps}; loss {packed:.6f} both"
    )
    print("| layout | tokens processed | step time (s) | useful FLOPs fraction | useful TFLOP/s |")
    print("|---|---|---|---|---|")
    for name, t in result["times"].items():
        print(
            f"| {name} | {result['tokens'][name]} | {t:.3f} | {useful / result['spent_flops'][name]:.2f} "
            f"| {useful / t / 1e12:.4f} |"
        )
    ratio = result["times"]["padded (BSHD)"] / result["times"]["packed (THD)"]
    print(f"packed is {ratio:.2f}x faster than padded")


if __name__ == "__main__":
    main()
