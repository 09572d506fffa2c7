"""Training-step throughput of this model against ``transformers``' Qwen3.5-VL: the same
configuration, the same weights (copied from the reference) and the same image+text micro-batch;
forward + backward, real tokens per second.

    python -m examples.multimodal_dev.benchmarks.bench_step [--variant 0.8b --num-layers 4 --vocab-size 32768
        --vision-depth 2 --samples 8 --reps 5]

Without a GPU both run fp32 on the host: this model on its local backend (the torch chunked
gated-delta-rule kernel, SDPA per packed sample), ``transformers`` with SDPA and its torch GDN
fallback. With a GPU both run bf16: this model with Transformer Engine (and FLA when installed),
``transformers`` with flash_attention_2 when ``flash_attn`` is installed, else SDPA (its GDN uses
FLA when installed).

Contenders, timed in turns (median of ``--reps``):
    this model, packed THD        one row; attention and GDN per sample through cu_seqlens
    this model, padded BSHD       one row per sample, padded to the longest
    transformers, padded batch    one row per sample, padded to the longest, attention_mask
    transformers, per sample      one unpadded sample at a time (no padding work at all)
The headline ratio is this model as it trains (THD) against the faster transformers contender.
The loss of each contender is printed: same weights and batch must give the same loss, which is
checked before the times are reported. With an MoE shape this model also back-propagates the
router's load-balancing loss (megatron-core adds it in backward; transformers computes it only
with ``output_router_logits``), a small extra cost on this model's side.

The default configuration is the 0.8b variant's layer dimensions (hidden 1024, 16 GDN value heads
of 128, 8 attention heads of 256, MLP 3584, vision width 768) with fewer layers, a smaller
vocabulary and a shallower vision tower, so a CPU step takes seconds; every dimension can be
overridden.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

from examples.multimodal_dev.data.batch import PackedBatch
from examples.multimodal_dev.data.sample import IGNORE_INDEX

LOSS_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # same weights, same batch: same loss


def bench_shape(
    variant: str, num_layers: int | None, vocab_size: int | None, vision_depth: int | None, moe: bool = False
):
    """The variant's dimensions with optionally fewer layers, a smaller vocabulary (the four vision
    token ids move to its top) and a shallower vision tower; no MTP (transformers trains none)."""
    from examples.multimodal_dev.models import default_model

    get_variant = default_model().shape_fn

    shape = get_variant(variant, moe=True if moe else None, mtp=False)
    text, vision = shape.text, shape.vision
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"--num-layers {num_layers}: need at least one layer")
        text = replace(text, num_layers=num_layers, layer_types=())  # () : the default hybrid pattern
    if vision_depth is not None:
        if vision_depth < 1:
            raise ValueError(f"--vision-depth {vision_depth}: need at least one vision block")
        vision = replace(vision, depth=vision_depth)
    shape = replace(shape, text=text, vision=vision)
    if vocab_size is not None:
        if vocab_size < 1024:
            raise ValueError(f"--vocab-size {vocab_size}: use at least 1024 (text ids plus four vision ids)")
        top = vocab_size - 8
        shape = replace(
            shape,
            text=replace(text, vocab_size=vocab_size),
            image_token_id=top,
            video_token_id=top + 1,
            vision_start_token_id=top + 2,
            vision_end_token_id=top + 3,
        )
    return shape


def mock_samples(shape, count: int, mean_text_tokens: int, seed: int = 0) -> list[dict]:
    """``count`` conversations of the mock dataset (0..2 images each, non-square grids)."""
    from examples.multimodal_dev.data.mock import MockConversations
    from examples.multimodal_dev.data.sample import VisionTokens

    produce = MockConversations(
        VisionTokens.from_shape(shape),
        shape.text.vocab_size,
        shape.vision.patch_dim,
        seed=seed,
        mean_text_tokens=mean_text_tokens,
    )
    return [produce(i) for i in range(count)]


def hf_inputs(padded: PackedBatch, image_token_id: int) -> dict:
    """A padded (BSHD) collated batch as transformers takes it: attention_mask from the padding
    mask, and labels that the model shifts itself (position i carries our label of i - 1)."""
    ids = padded.tokens
    return {
        "input_ids": ids,
        "attention_mask": (~padded.padding_mask).long(),
        "labels": torch.nn.functional.pad(padded.labels[:, :-1], (1, 0), value=IGNORE_INDEX),
        "mm_token_type_ids": (ids == image_token_id).long(),
        "pixel_values": padded.pixel_values,
        "image_grid_thw": padded.image_grid_thw,
    }


def _to(inputs: dict, device, dtype) -> dict:
    return {
        k: (v.to(device, dtype) if k == "pixel_values" else v.to(device)) if isinstance(v, torch.Tensor) else v
        for k, v in inputs.items()
    }


def contenders(ours, hf, shape, samples, device, dtype) -> dict:
    """name -> a callable that runs one training step (zero grads, forward, backward) and returns
    its loss (mean over trained tokens)."""
    from examples.multimodal_dev.data.collate import pack_thd, pad_bshd
    from examples.multimodal_dev.data.sample import VisionTokens
    from examples.multimodal_dev.forward_step import batch_loss

    tokens = VisionTokens.from_shape(shape)
    bshd_host = pad_bshd(samples, tokens)
    thd = pack_thd(samples, tokens).to(device)
    bshd = bshd_host.to(device)
    for batch in (thd, bshd):
        if batch.pixel_values is not None:
            batch.pixel_values = batch.pixel_values.to(dtype)
    padded = _to(hf_inputs(bshd_host, shape.image_token_id), device, dtype)
    singles = [_to(hf_inputs(pad_bshd([s], tokens), shape.image_token_id), device, dtype) for s in samples]
    trained = sum(int(s["loss_mask"].sum()) for s in samples)

    def ours_step(batch):
        ours.zero_grad(set_to_none=True)
        loss_sum, n, _ = batch_loss(ours, batch)
        (loss_sum / n).backward()
        return loss_sum.item() / int(n)

    def hf_padded():
        hf.zero_grad(set_to_none=True)
        loss = hf(**padded).loss
        loss.backward()
        return loss.item()

    def hf_per_sample():
        # Each sample's mean loss weighted by its trained tokens: the batch's per-token mean,
        # with the same gradient as the padded batch.
        hf.zero_grad(set_to_none=True)
        total = 0.0
        for inputs in singles:
            n = int((inputs["labels"] != IGNORE_INDEX).sum())
            loss = hf(**inputs).loss * (n / trained)
            loss.backward()
            total += loss.item()
        return total

    return {
        "this model, packed THD": lambda: ours_step(thd),
        "this model, padded BSHD": lambda: ours_step(bshd),
        "transformers, padded batch": hf_padded,
        "transformers, per sample": hf_per_sample,
    }


def build_pair(shape, device, dtype, hf_attention: str):
    """(this model, transformers model) with the same weights, both in train mode."""
    from examples.multimodal_dev.checkpoint.hf_models import hf_model_for_shape
    from examples.multimodal_dev.models import default_model

    build_model = default_model().build_fn
    load_hf_into_model = default_model().load_hf_state

    hf = hf_model_for_shape(shape, attn_implementation=hf_attention)
    from examples.multimodal_dev.training.backend import te_importable

    te = device.type == "cuda" and te_importable()  # GPUs without Transformer Engine train on the local backend
    ours = build_model(shape, backend="te" if te else "local", params_dtype=dtype)
    load_hf_into_model(ours, hf.state_dict(), shape)
    return ours.to(device).train(), hf.to(device, dtype).train()


def fastest_hf_attention(device) -> str:
    if device.type != "cuda":
        return "sdpa"
    try:
        import flash_attn  # noqa: F401

        return "flash_attention_2"
    except ImportError:
        return "sdpa"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="0.8b")
    parser.add_argument("--moe", action="store_true", help="switch a dense variant to its MoE form (tiny)")
    parser.add_argument("--num-layers", type=int, default=4, help="decoder layers (every 4th full attention)")
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--vision-depth", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8, help="samples in the micro-batch")
    parser.add_argument("--mean-text-tokens", type=int, default=160, help="mock prompt / answer length scale")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    return parser


def _device(choice: str) -> torch.device:
    """``--device``; auto: the GPU when one is visible, else the host."""
    return torch.device(
        "cuda" if choice == "auto" and torch.cuda.is_available() else "cpu" if choice == "auto" else choice
    )


def _check_same_loss(losses: dict, dtype) -> None:
    """Times only mean something when every contender computes the same step."""
    reference_loss = losses["transformers, padded batch"]
    for name, loss in losses.items():
        if abs(loss - reference_loss) > LOSS_RTOL[dtype] * abs(reference_loss):
            raise SystemExit(
                f"{name}: loss {loss:.6f} differs from transformers' {reference_loss:.6f}; "
                "the contenders do not compute the same step"
            )


def _print_results(times: dict, losses: dict, real: int, useful: float) -> None:
    """The table of contenders, then the headline ratio of this model against the faster transformers."""
    print("| contender | step time (s) | tokens/s | model TFLOP/s | loss |")
    print("|---|---|---|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds:.3f} | {real / seconds:.0f} | {useful / seconds / 1e12:.4f} | {losses[name]:.6f} |")
    best_hf = min(("transformers, padded batch", "transformers, per sample"), key=times.get)
    ours_thd = times["this model, packed THD"]
    print(
        f"this model (packed THD) is {times[best_hf] / ours_thd:.2f}x the tokens/s of the faster transformers "
        f"contender ({best_hf}); same layout (padded BSHD vs padded batch): "
        f"{times['transformers, padded batch'] / times['this model, padded BSHD']:.2f}x"
    )


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.samples < 1:
        parser.error(f"--samples {args.samples}: need at least one sample")

    from examples.multimodal_dev.benchmarks.timing import alternating_medians
    from examples.multimodal_dev.models import default_model

    micro_batch_flops = default_model().micro_batch_flops
    from megatron.cpu.single_process import init_single_process

    device = _device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    init_single_process()
    shape = bench_shape(args.variant, args.num_layers, args.vocab_size, args.vision_depth, args.moe)
    samples = mock_samples(shape, args.samples, args.mean_text_tokens)
    lengths = [s["input_ids"].numel() for s in samples]
    grids = [tuple(g) for s in samples for g in s["image_grid_thw"].tolist()]
    hf_attention = fastest_hf_attention(device)
    ours, hf = build_pair(shape, device, dtype, hf_attention)
    runs = contenders(ours, hf, shape, samples, device, dtype)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timed = {name: (lambda fn=fn: (fn(), sync())[0]) for name, fn in runs.items()}
    print(f"timing {len(timed)} contenders, {args.reps} repetitions each after one warm-up", file=sys.stderr)
    times, losses = alternating_medians(timed, args.reps, progress=True)
    _check_same_loss(losses, dtype)

    real = sum(lengths)
    useful = micro_batch_flops(shape, lengths, grids).training
    t = shape.text
    print(
        f"{args.variant} dimensions, {t.num_layers} layers ({t.layer_types.count('full_attention')} full attention), "
        f"vocab {t.vocab_size}, vision depth {shape.vision.depth}{', MoE' if t.is_moe else ''}; "
        f"{device.type} {str(dtype).replace('torch.', '')}, {torch.get_num_threads()} threads; transformers "
        f"attention {hf_attention}; micro-batch of {len(samples)} samples, {real} tokens "
        f"({min(lengths)}..{max(lengths)}), {len(grids)} images; forward + backward, median of {args.reps}"
    )
    _print_results(times, losses, real, useful)


if __name__ == "__main__":
    main()
