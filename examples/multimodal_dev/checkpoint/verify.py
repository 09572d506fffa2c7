"""``tools/convert_checkpoint.py verify``: the Megatron checkpoint and the Hugging Face model, both on
the CPU in fp32, on the same inputs; one summary line, exit status from ``--atol``.

Built-in inputs (deterministic, no files needed): a text-only row of 48 token ids and an
image+text row with one 4x6-patch image of seeded random pixels. ``--prompt`` (and ``--image``)
run real text through the checkpoint's processor instead.

``--hf-path`` and ``--hf-processor-path`` follow the project's path rule (``data/sources.py``): a
local path must exist, and only ``hf://NAME`` reaches the Hugging Face Hub. Before either model is
built, the shape of the HF config is compared with the checkpoint's (a pair of different vocabulary
sizes is one line naming it, not a size-mismatch traceback), and a local folder of pickled weights
(``pytorch_model.bin``) is refused: verify reads safetensors only.

NaN or inf makes every difference NaN, which says nothing about where it came from: verify names the
weights that hold them (either model), else the logits that came out non-finite, and fails.
"""

from __future__ import annotations

import glob
import os

import torch

from examples.multimodal_dev.data.sources import resolve
from examples.multimodal_dev.models import model_of

from . import hf_conversion
from .hf_safetensors import read_config
from .run_shape import NOT_WEIGHTS, shape_differences


# Shape fields verify does not compare: the MTP head is in neither forward pass, and the router's
# auxiliary-loss weight is a training setting, not part of the logits.
class HFSource:
    """Where ``--hf-path`` (or ``--hf-processor-path``) points: a local folder, or a Hub name when
    given as ``hf://NAME``; transformers is told which (``local_files_only``), so a typo never
    turns into minutes of Hub retries."""

    def __init__(self, value: str, flag: str):
        self.flag, self.value = flag, value
        self.path, self.hub = resolve(value, flag)

    def load_kwargs(self) -> dict:
        return {"local_files_only": not self.hub}


def _local_hf_dir(src: HFSource) -> None:
    """A local model folder has a config.json and safetensors weights; pickled ``*.bin`` weights
    could run code on load, so they are refused by name instead of handed to transformers."""
    if src.hub:
        return
    if not os.path.isdir(src.path) or not os.path.isfile(os.path.join(src.path, "config.json")):
        raise FileNotFoundError(f"{src.flag} {src.value}: no config.json (not a Hugging Face model folder)")
    if not glob.glob(os.path.join(src.path, "*.safetensors")):
        pickled = sorted(
            os.path.basename(p) for ext in ("*.bin", "*.pt", "*.pth") for p in glob.glob(os.path.join(src.path, ext))
        )
        what = f"pickled weights ({', '.join(pickled)})" if pickled else "no weights"
        raise ValueError(
            f"{src.flag} {src.value}: {what}, no *.safetensors; verify reads safetensors only "
            "(save the model with safe_serialization)"
        )


def _hf_config(src: HFSource) -> dict:
    if not src.hub:
        return read_config(os.path.join(src.path, "config.json"))
    import transformers

    return transformers.AutoConfig.from_pretrained(src.path).to_dict()


def check_same_model(src: HFSource, megatron_path: str):
    """The checkpoint's shape and the HF config's shape agree, field by field; else one line
    naming each field that differs. Returns the checkpoint's shape."""
    config_path = src.value if src.hub else os.path.join(src.path, "config.json")
    hf_shape = hf_conversion.config_shape(_hf_config(src), config_path)
    mg_shape, _ = hf_conversion.checkpoint_shape(megatron_path)
    differ = shape_differences(mg_shape, hf_shape, labels=("checkpoint", "HF"), skip=NOT_WEIGHTS)
    if differ:
        more = f" and {len(differ) - 5} more" if len(differ) > 5 else ""
        raise ValueError(
            f"--megatron-path {megatron_path} and {src.flag} {src.value} are different models: "
            + "; ".join(differ[:5])
            + more
        )
    return mg_shape


def _hf_model(src: HFSource):
    import transformers

    from .hf_models import hf_classes

    config = transformers.AutoConfig.from_pretrained(src.path, **src.load_kwargs())
    try:
        _, model_cls = hf_classes(config.model_type)
    except ValueError as err:
        raise ValueError(f"{src.flag} {src.value}: {err}") from None
    return model_cls.from_pretrained(
        src.path, dtype=torch.float32, attn_implementation="sdpa", use_safetensors=True, **src.load_kwargs()
    ).eval()


def _text_ids(shape, n: int, generator) -> list[int]:
    special = {shape.image_token_id, shape.video_token_id, shape.vision_start_token_id, shape.vision_end_token_id}
    ids = torch.randint(0, min(shape.text.vocab_size, 30000), (2 * n,), generator=generator).tolist()
    return [i for i in ids if i not in special][:n]


def builtin_cases(shape) -> list[tuple[str, dict]]:
    gen = torch.Generator().manual_seed(0)
    merge = shape.vision.spatial_merge_size
    grid = (1, 2 * merge, 3 * merge)
    n_image = grid[1] * grid[2] // merge**2
    image_row = (
        _text_ids(shape, 12, gen)
        + [shape.vision_start_token_id]
        + [shape.image_token_id] * n_image
        + [shape.vision_end_token_id]
        + _text_ids(shape, 12, gen)
    )
    pixels = torch.randn(grid[0] * grid[1] * grid[2], shape.vision.patch_dim, generator=gen)
    return [
        ("text-only", {"input_ids": torch.tensor([_text_ids(shape, 48, gen)])}),
        (
            "image+text",
            {"input_ids": torch.tensor([image_row]), "pixel_values": pixels, "image_grid_thw": torch.tensor([grid])},
        ),
    ]


def prompt_case(processor: HFSource, prompt: str, image: str | None) -> list[tuple[str, dict]]:
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(processor.path, **processor.load_kwargs())
    content = ([{"type": "image"}] if image else []) + [{"type": "text", "text": prompt}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
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
    hf_out = hf(
        input_ids=ids,
        attention_mask=mask,
        mm_token_type_ids=(ids == shape.image_token_id).long(),
        pixel_values=case.get("pixel_values"),
        image_grid_thw=grid,
    ).logits
    position_ids = model_of(shape).padded_position_ids(
        ids, mask, grid, None, shape.image_token_id, shape.video_token_id, shape.vision.spatial_merge_size
    )
    mg_out = mg(ids, position_ids, None, pixel_values=case.get("pixel_values"), image_grid_thw=grid)
    return mg_out.float().flatten(0, 1), hf_out.float().flatten(0, 1)


def _stats(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (ours - ref).abs()
    cosine = torch.nn.functional.cosine_similarity(ours.double().flatten(), ref.double().flatten(), dim=0).item()
    return {
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
        "cosine": cosine,
        "tokens": ours.shape[0],
    }


def _nonfinite_weights(model, label: str) -> list[str]:
    bad = []
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            bad.append(f"{name} ({int(p.isnan().sum())} NaN, {int(p.isinf().sum())} inf)")
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    return [f"{label} weights hold NaN/inf: {', '.join(bad[:5])}{more}"] if bad else []


def _nonfinite_logits(case: str, ours: torch.Tensor, ref: torch.Tensor) -> list[str]:
    return [
        f"{label} logits are NaN/inf on {case} ({int((~torch.isfinite(t)).sum())} values)"
        for label, t in (("Megatron", ours), ("HF", ref))
        if not torch.isfinite(t).all()
    ]


def _line(prefix: str, s: dict) -> str:
    return (
        f"{prefix}max_abs_diff={s['max_abs_diff']:.3e} mean_abs_diff={s['mean_abs_diff']:.3e} "
        f"cosine={s['cosine']:.8f} tokens={s['tokens']}"
    )


def verify(args) -> bool:
    # Every path and shape is checked before either model is built (minutes on a large model).
    hf_src = HFSource(args.hf_path, "--hf-path")
    processor = HFSource(args.hf_processor_path, "--hf-processor-path") if args.hf_processor_path else hf_src
    if args.image and not args.prompt:
        raise ValueError("--image needs --prompt")
    if args.image and not os.path.isfile(args.image):
        raise FileNotFoundError(f"--image {args.image}: no such file")
    _local_hf_dir(hf_src)
    hf_conversion.check_checkpoint_dir(args.megatron_path)
    check_same_model(hf_src, args.megatron_path)
    mg, shape, _, _ = hf_conversion.load_megatron(args.megatron_path, lora_base=getattr(args, "lora_base", None))
    hf = _hf_model(hf_src)
    reasons = _nonfinite_weights(mg, "Megatron") + _nonfinite_weights(hf, "HF")
    if reasons:
        print("verify: FAIL: " + "; ".join(reasons))
        return False
    if args.prompt:
        cases = prompt_case(processor, args.prompt, args.image)
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
    print(
        _line("verify: ", total)
        + f" atol={args.atol:g} {'PASS' if ok else 'FAIL'}"
        + (": " + "; ".join(reasons) if reasons else "")
    )
    return ok
