"""Data pipeline throughput against what a training step consumes.

    python -m examples.multimodal_dev.benchmarks.bench_loader [--dataset mock_mix] [--workers 0 1 2]
    python -m examples.multimodal_dev.benchmarks.bench_loader --dataset cord_v2 --data-path DIR --hf-processor-path P
    python -m examples.multimodal_dev.benchmarks.bench_loader --dataset jsonl|energon --hf-processor-path P
                                                              [--data-path FILE_OR_SHARDS]

``jsonl`` and ``energon`` without ``--data-path`` read a mix written on the spot
(``media_mix.write_mix``: photo-sized JPEGs and 4 s mp4 clips, ``--mix-conversations`` of them;
for energon, converted to shards with ``tools/jsonl_to_energon.py``).

The pipeline is the engine's own (``data/loader.build_iterator``: the provider, the sampler or
token-budget plan, the collate, ``--num-workers`` DataLoader workers with persistent workers).
Its rate is conversations per second over ``--micro-batches`` micro-batches after the first (the
first pays for starting the workers). Consumption is conversations per second of the model's
forward and backward on the same micro-batches (one process, fp32 on the host; the optimizer
step is left out, so consumption is if anything overstated). The pipeline keeps up when the
ratio is above 1; the target is 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

import torch

from examples.multimodal_dev.data import get_dataset_provider
from examples.multimodal_dev.data.batch import PackedBatch
from examples.multimodal_dev.data.collate import Collator
from examples.multimodal_dev.data.loader import build_iterator
from examples.multimodal_dev.data.sample import VisionTokens
from examples.multimodal_dev.data.token_budget import plan_factory
from examples.multimodal_dev.models import default_model

get_variant = default_model().shape_fn

PROCESSED = ("cord_v2", "jsonl", "energon")  # read through the model's HF processor


def pipeline(args):
    """(shape, iterator factory ``workers -> iterator``) for the chosen dataset and packing."""
    shape = get_variant(args.variant, mtp=False)
    tokens = VisionTokens.from_shape(shape)
    if args.dataset in PROCESSED:
        from examples.multimodal_dev.data.processor import load_processor

        _, info = load_processor(args.hf_processor_path, args.min_pixels, args.max_pixels)
        tokens = info.tokens  # the model must read the processor's placeholder ids
        shape = dataclasses.replace(
            shape,
            image_token_id=tokens.image,
            video_token_id=tokens.video,
            vision_start_token_id=tokens.vision_start,
            vision_end_token_id=tokens.vision_end,
        )
    count = args.micro_batches + 2
    rows = count * (args.budget if args.packing == "tokens" else args.micro_batch)
    dataset = get_dataset_provider(args.dataset)(
        tokens=tokens,
        vocab_size=shape.text.vocab_size,
        patch_dim=shape.vision.patch_dim,
        seq_length=args.seq_length,
        num_samples=(rows, 0, 0),
        seed=1234,
        data_path=args.data_path,
        hf_processor_path=args.hf_processor_path,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
    )[0]
    plan_fn, mbs, budget = None, args.micro_batch, None
    if args.packing == "tokens":
        mbs, budget = 1, args.budget
        if hasattr(dataset, "pack_rows"):  # a stream (energon): each loader fills its own rows
            dataset.pack_rows(budget, 1)
        else:
            plan_fn = plan_factory(shape, budget, args.micro_batch, 1)
    collate = Collator(tokens, row_length=budget)
    return shape, lambda workers: build_iterator(dataset, 0, mbs, 0, 1, collate, num_workers=workers, plan_fn=plan_fn)


def written_mix(args, folder: str) -> str:
    """``--data-path`` for ``args.dataset`` when none was given: the mix, as JSONL or energon shards."""
    from examples.multimodal_dev.benchmarks.media_mix import write_mix

    path = write_mix(folder, args.mix_conversations)
    if args.dataset == "jsonl":
        return path
    from examples.multimodal_dev.tools.jsonl_to_energon import convert

    convert(path, os.path.join(folder, "shards"), log=lambda line: None)
    return os.path.join(folder, "shards")


def loader_rate(make_iterator, workers: int, micro_batches: int) -> tuple[float, list[PackedBatch]]:
    """(conversations per second, the batches) over ``micro_batches`` after the first."""
    iterator = make_iterator(workers)
    next(iterator)  # worker start-up
    start, batches = time.perf_counter(), []
    for _ in range(micro_batches):
        batches.append(next(iterator))
    seconds = time.perf_counter() - start
    return sum(b.stats.samples for b in batches) / seconds, batches


def consumption_rate(shape, batches: list[PackedBatch]) -> float:
    """Conversations per second of forward + backward on ``batches`` (after one warm-up step)."""
    from examples.multimodal_dev.forward_step import batch_loss
    from examples.multimodal_dev.models import default_model

    build_model = default_model().build_fn
    from megatron.cpu.single_process import init_single_process

    init_single_process()
    torch.manual_seed(0)
    model = build_model(shape)

    def step(batch):
        model.zero_grad(set_to_none=True)
        loss, n, _ = batch_loss(model, batch)
        (loss / n).backward()

    step(batches[0])
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    return sum(b.stats.samples for b in batches) / (time.perf_counter() - start)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="mock_mix", choices=("mock", "mock_mix", *PROCESSED))
    parser.add_argument("--data-path", default=None)
    parser.add_argument("--hf-processor-path", default=None)
    parser.add_argument("--min-pixels", type=int, default=None)
    parser.add_argument("--max-pixels", type=int, default=None)
    parser.add_argument("--variant", default="tiny")
    parser.add_argument("--packing", choices=("samples", "tokens"), default="tokens")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=2048, help="--packing tokens: tokens per row")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=4,
        help="conversations per micro-batch (samples), rows planned per step (tokens)",
    )
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--mix-conversations",
        type=int,
        default=96,
        help="jsonl / energon without --data-path: conversations in the mix written",
    )
    args = parser.parse_args(argv)
    for flag in ("seq_length", "budget", "micro_batch", "micro_batches"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be a positive integer")
    if any(w < 0 for w in args.workers):
        parser.error(f"--workers {args.workers}: counts must be >= 0")
    if args.dataset == "cord_v2" and not (args.data_path and args.hf_processor_path):
        parser.error("--dataset cord_v2 needs --data-path and --hf-processor-path")
    if args.dataset in PROCESSED and not args.hf_processor_path:
        parser.error(f"--dataset {args.dataset} needs --hf-processor-path (the model's processor)")
    with tempfile.TemporaryDirectory(prefix="bench_loader_") as folder:
        if args.dataset in ("jsonl", "energon") and not args.data_path:
            args.data_path = written_mix(args, folder)
        return measure(args)


def measure(args) -> list[dict]:
    shape, make_iterator = pipeline(args)
    rates, batches = {}, None
    for workers in args.workers:  # before the model exists: workers fork a small process
        rates[workers], batches = loader_rate(make_iterator, workers, args.micro_batches)
        print(f"  {workers} worker(s): {rates[workers]:.1f} conversations/s", file=sys.stderr, flush=True)
    consumed = consumption_rate(shape, batches)
    rows = [{"workers": w, "loader_per_s": r, "step_per_s": consumed, "ratio": r / consumed} for w, r in rates.items()]
    print(
        f"{args.dataset}, {args.variant}, packing {args.packing} "
        f"({args.budget if args.packing == 'tokens' else args.micro_batch} "
        f"{'tokens a row' if args.packing == 'tokens' else 'conversations a micro-batch'}), "
        f"{args.micro_batches} micro-batches, {os.cpu_count()} CPU cores, {torch.get_num_threads()} threads"
    )
    print("| workers | pipeline (conversations/s) | training step consumes (conversations/s) | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['loader_per_s']:.1f} | {r['step_per_s']:.1f} | {r['ratio']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
