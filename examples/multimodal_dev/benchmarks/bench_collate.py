"""Collate throughput: THD packing with MRoPE positions vs transformers' per-sample get_rope_index.

    python -m examples.multimodal_dev.benchmarks.bench_collate [--samples 256] [--micro-batch 8] [--repeats 3]

Both sides get the same mock samples (every one with at least one image). Ours: ``pack_thd``
on micro-batches (tokens, labels, masks, cu_seqlens, and positions for the whole packed row).
Reference: ``Qwen3_5Model.get_rope_index`` called on each sample alone (positions only), which
is what a collate built on transformers would have to do. Prints samples/s for each and the ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from examples.multimodal_dev.data.collate import pack_thd
from examples.multimodal_dev.data.mock import MockConversations
from examples.multimodal_dev.data.sample import VisionTokens
from examples.multimodal_dev.models import default_model

get_variant = default_model().shape_fn
to_hf_config_dict = default_model().shape_to_hf


def hf_rope_index_fn(shape):
    """``positions(input_ids [B, S], attention_mask [B, S], image_grid_thw) -> [3, B, S]`` from
    transformers' ``get_rope_index`` for this shape's config (no weights are built)."""
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    model = Qwen3_5Model.__new__(Qwen3_5Model)  # get_rope_index reads only the config
    torch.nn.Module.__init__(model)
    model.config = transformers.Qwen3_5Config(
        **{k: v for k, v in to_hf_config_dict(shape).items() if k != "model_type"}
    )

    def positions(input_ids, attention_mask, image_grid_thw):
        types = (input_ids == shape.image_token_id).long()
        return model.get_rope_index(
            input_ids, mm_token_type_ids=types, image_grid_thw=image_grid_thw, attention_mask=attention_mask
        )[0]

    return positions


def timed(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8, help="samples packed per THD row")
    parser.add_argument("--pad-multiple", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="best of N timings")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # collates run in data-loader workers, one thread each
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)


def run(args):

    shape = get_variant("tiny")
    tokens = VisionTokens.from_shape(shape)
    mock = MockConversations(tokens, shape.text.vocab_size, shape.vision.patch_dim, seed=0)
    samples, index = [], 0
    while len(samples) < args.samples:
        sample = mock(index)
        index += 1
        if sample["image_grid_thw"].shape[0]:
            samples.append(sample)
    batches = [samples[i : i + args.micro_batch] for i in range(0, len(samples), args.micro_batch)]
    hf_positions = hf_rope_index_fn(shape)

    def reference(sample):
        ids = sample["input_ids"].unsqueeze(0)
        return hf_positions(ids, torch.ones_like(ids), sample["image_grid_thw"])

    # Both sides must compute the same positions, or the timing compares different work.
    for batch in batches:
        packed = pack_thd(batch, tokens, args.pad_multiple)
        for sample, start in zip(batch, packed.cu_seqlens_padded[:-1].tolist()):
            ours = packed.position_ids[:, 0, start : start + sample["input_ids"].numel()]
            if not torch.equal(ours, reference(sample)[:, 0]):
                raise RuntimeError("pack_thd positions differ from transformers' get_rope_index")

    ours_s = timed(lambda: [pack_thd(b, tokens, args.pad_multiple) for b in batches], args.repeats)
    ref_s = timed(lambda: [reference(s) for s in samples], args.repeats)
    n_images = sum(s["image_grid_thw"].shape[0] for s in samples)
    n_tokens = sum(s["input_ids"].numel() for s in samples)
    print(
        f"bench_collate: {len(samples)} samples, {n_images} images, {n_tokens} tokens, "
        f"micro-batch {args.micro_batch}, 1 thread, best of {args.repeats}"
    )
    print(f"  pack_thd (THD + MRoPE positions):          {len(samples) / ours_s:10.1f} samples/s")
    print(f"  transformers get_rope_index (per sample):  {len(samples) / ref_s:10.1f} samples/s")
    print(f"  ratio (ours / transformers): {ref_s / ours_s:.2f}x")
    return {"samples": len(samples), "ours_per_s": len(samples) / ours_s, "hf_per_s": len(samples) / ref_s}


if __name__ == "__main__":
    main()
