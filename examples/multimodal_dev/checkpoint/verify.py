"""``tools/convert_checkpoint.py verify``: the Megatron checkpoint and the Hugging Face model, both on
the CPU in fp32, on the same inputs; one summary line, exit status from ``--atol``.

Built-in inputs (deterministic, no files needed): a text-only row of 48 token ids and an
image+text row with one 4x6-patch image of seeded random pixels. ``--prompt`` (and ``--image``)
run real text through the checkpoint's processor instead.

NaN or inf makes every difference NaN, which says nothing about where it came from: verify names the
weights that hold them (either model), else the logits that came out non-finite, and fails.
"""

from __future__ import annotations

import torch

from examples.multimodal_dev.models.qwen35_vl.mrope import padded_batch_position_ids

from . import hf_conversion


def _hf_model(hf_path: str):
    import transformers

    from .hf_models import hf_classes

    config = transformers.AutoConfig.from_pretrained(hf_path)
    try:
        _, model_cls = hf_classes(config.model_type)
    except ValueError as err:
        raise ValueError(f"--hf-path {hf_path}: {err}") from None
    return model_cls.from_pretrained(hf_path, dtype=torch.float32, attn_implementation="sdpa").eval()


def _text_ids(shape, n: int, generator) -> list[int]:
    special = {shape.image_token_id, shape.video_token_id, shape.vision_start_token_id, shape.vision_end_token_id}
    ids = torch.randint(0, min(shape.text.vocab_size, 30000), (2 * n,), generator=generator).tolist()
    return [i for i in ids if i not in special][:n]


def builtin_cases(shape) -> list[tuple[str, dict]]:
    gen = torch.Generator().manual_seed(0)
    merge = shape.vision.spatial_merge_size
    grid = (1, 2 * merge, 3 * merge)
    n_image = grid[1] * grid[2] // merge ** 2
    image_row = (_text_ids(shape, 12, gen) + [shape.vision_start_token_id] + [shape.image_token_id] * n_image
                 + [shape.vision_end_token_id] + _text_ids(shape, 12, gen))
    pixels = torch.randn(grid[0] * grid[1] * grid[2], shape.vision.patch_dim, generator=gen)
    return [("text-only", {"input_ids": torch.tensor([_text_ids(shape, 48, gen)])}),
            ("image+text", {"input_ids": torch.tensor([image_row]), "pixel_values": pixels,
                            "image_grid_thw": torch.tensor([grid])})]


def prompt_case(processor_path: str, prompt: str, image: str | None) -> list[tuple[str, dict]]:
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(processor_path)
    content = ([{"type": "image"}] if image else []) + [{"type": "text", "text": prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    images = [Image.open(image).convert("RGB")] if image else None
    batch = processor(text=[text], images=images, return_tensors="pt")
    case = {"input_ids": batch["input_ids"]}
    if image:
        case.update(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    return [("prompt", case)]


@torch.no_grad()
def _logits_pair(hf, mg, shape, case: dict):
    ids = case["input_ids"]
    mask = torch.ones_like(ids)
    grid = case.get("image_grid_thw")
    hf_out = hf(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == shape.image_token_id).long(),
                pixel_values=case.get("pixel_values"), image_grid_thw=grid).logits
    position_ids = padded_batch_position_ids(ids, mask, grid, None, shape.image_token_id, shape.video_token_id,
                                             shape.vision.spatial_merge_size)
    mg_out = mg(ids, position_ids, None, pixel_values=case.get("pixel_values"), image_grid_thw=grid)
    return mg_out.float().flatten(0, 1), hf_out.float().flatten(0, 1)


def _stats(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (ours - ref).abs()
    cosine = torch.nn.functional.cosine_similarity(ours.double().flatten(), ref.double().flatten(), dim=0).item()
    return {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(), "cosine": cosine,
            "tokens": ours.shape[0]}


def _nonfinite_weights(model, label: str) -> list[str]:
    bad = []
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            bad.append(f"{name} ({int(p.isnan().sum())} NaN, {int(p.isinf().sum())} inf)")
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    return [f"{label} weights hold NaN/inf: {', '.join(bad[:5])}{more}"] if bad else []


def _nonfinite_logits(case: str, ours: torch.Tensor, ref: torch.Tensor) -> list[str]:
    return [f"{label} logits are NaN/inf on {case} ({int((~torch.isfinite(t)).sum())} values)"
            for label, t in (("Megatron", ours), ("HF", ref)) if not torch.isfinite(t).all()]


def _line(prefix: str, s: dict) -> str:
    return (f"{prefix}max_abs_diff={s['max_abs_diff']:.3e} mean_abs_diff={s['mean_abs_diff']:.3e} "
            f"cosine={s['cosine']:.8f} tokens={s['tokens']}")


def verify(args) -> bool:
    mg, shape, _, _ = hf_conversion.load_megatron(args.megatron_path)
    hf = _hf_model(args.hf_path)
    reasons = _nonfinite_weights(mg, "Megatron") + _nonfinite_weights(hf, "HF")
    if reasons:
        print("verify: FAIL: " + "; ".join(reasons))
        return False
    if args.prompt:
        cases = prompt_case(args.hf_processor_path or args.hf_path, args.prompt, args.image)
    elif args.image:
        raise ValueError("--image needs --prompt")
    else:
        cases = builtin_cases(shape)
    all_ours, all_ref = [], []
    for name, case in cases:
        ours, ref = _logits_pair(hf, mg, shape, case)
        print(_line(f"  {name}: ", _stats(ours, ref)))
        reasons += _nonfinite_logits(name, ours, ref)
        all_ours.append(ours)
        all_ref.append(ref)
    total = _stats(torch.cat(all_ours), torch.cat(all_ref))
    ok = total["max_abs_diff"] <= args.atol and not reasons
    print(_line("verify: ", total) + f" atol={args.atol:g} {'PASS' if ok else 'FAIL'}"
          + (": " + "; ".join(reasons) if reasons else ""))
    return ok
