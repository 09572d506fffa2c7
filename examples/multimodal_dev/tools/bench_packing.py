"""Packed (THD) against padded (BSHD) training steps of the same samples: step time and the
fraction of the FLOPs spent that are useful (real tokens), on a realistic length mix.

    python examples/multimodal_dev/tools/bench_packing.py [--variant tiny --micro-batch 8 --reps 5]

Samples are text conversations with lengths drawn uniformly from 200..2000 tokens, and every
eighth one a long outlier of 3000..4000 (as in a real SFT mix). Each step is a forward and
backward pass of the model on one micro-batch, fp32 on the host; packed and padded steps run
alternately and the median of each is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(_HERE), os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def sample_lengths(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(200, 2001, (n,), generator=gen)
    outliers = torch.randint(3000, 4001, (n,), generator=gen)
    return [int(outliers[i]) if i % 8 == 7 else int(lengths[i]) for i in range(n)]


def text_samples(lengths, vocab: int, seed: int = 0) -> list[dict]:
    from data.sample import build_sft_sample

    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(16, vocab, (n,), generator=gen)
        answer = n // 4
        out.append(build_sft_sample(ids[: n - answer], ids[n - answer:], torch.zeros(0, 1), torch.zeros(0, 3)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="tiny")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    from megatron.cpu.single_process import init_single_process

    from data.collate import pack_thd, pad_bshd
    from data.sample import VisionTokens
    from flops import micro_batch_flops
    from forward_step import batch_loss
    from models.qwen35_vl.configuration import get_variant
    from models.qwen35_vl.factory import build_model

    init_single_process()
    shape = get_variant(args.variant, mtp=False)
    model = build_model(shape)
    tokens = VisionTokens.from_shape(shape)
    lengths = sample_lengths(args.micro_batch)
    samples = text_samples(lengths, min(shape.text.vocab_size, 4000))
    batches = {"packed (THD)": pack_thd(samples, tokens), "padded (BSHD)": pad_bshd(samples, tokens)}

    def step(batch):
        model.zero_grad(set_to_none=True)
        loss, n, _ = batch_loss(model, batch)
        (loss / n).backward()

    times = {name: [] for name in batches}
    for name, batch in batches.items():
        step(batch)  # warm-up
    for _ in range(args.reps):
        for name, batch in batches.items():
            start = time.perf_counter()
            step(batch)
            times[name].append(time.perf_counter() - start)

    useful = micro_batch_flops(shape, lengths).training
    padded_len = max(lengths)
    spent = {"packed (THD)": useful,  # the packed row holds only real tokens
             "padded (BSHD)": micro_batch_flops(shape, [padded_len] * len(lengths)).training}
    print(f"{args.variant}, micro-batch of {len(lengths)} samples, lengths {lengths} ({sum(lengths)} tokens), "
          f"fp32 CPU, {torch.get_num_threads()} threads, median of {args.reps}")
    print("| layout | tokens processed | step time (s) | useful FLOPs fraction | useful TFLOP/s |")
    print("|---|---|---|---|---|")
    for name, batch in batches.items():
        t = statistics.median(times[name])
        print(f"| {name} | {batch['tokens'].numel()} | {t:.3f} | {useful / spent[name]:.2f} | {useful / t / 1e12:.4f} |")
    ratio = statistics.median(times["padded (BSHD)"]) / statistics.median(times["packed (THD)"])
    print(f"packed is {ratio:.2f}x faster than padded")


if __name__ == "__main__":
    main()
