"""``tools/convert_checkpoint.py verify``: the Megatron checkpoint and the Hugging Face model, both on
the CPU in fp32, on the same inputs; one summary line, exit status from ``--atol``.

Neither model is held whole: each is built weightless and runs with one decoder layer's weights in
at a time (``streamed_forward.py``; the vision tower and the embedding throughout), read from the
files as the layer runs, so a process holds about a layer of each in fp32 at any size. The HF model
runs every input first, then the Megatron model; the checkpoint's files are read once per input.

Built-in inputs (deterministic, no files needed): a text-only row of 48 token ids and an
image+text row with one 4x6-patch image of seeded random pixels. ``--prompt`` (and ``--image``)
run real text through the checkpoint's processor instead.

``--hf-path`` and ``--hf-processor-path`` follow the project's path rule (``data/sources.py``): a
local path must exist, and only ``hf://NAME`` reaches the Hugging Face Hub. Before either model is
built, the shape of the HF config is compared with the checkpoint's (a pair of different vocabulary
sizes is one line naming it, not a size-mismatch traceback), and a local folder of pickled weights
(``pytorch_model.bin``) is refused: verify reads safetensors only.

NaN or inf makes every difference NaN, which says nothing about where it came from: verify names the
weights that hold them (either model, as they are read), else the logits that came out non-finite,
and fails.
"""

from __future__ import annotations

import glob
import os

import torch

from examples.multimodal_dev.data.sources import resolve
from examples.multimodal_dev.models import model_of

from ..progress import Progress
from . import hf_conversion
from .hf_export import READ_BYTES
from .hf_safetensors import HFTensorSource, read_config
from .run_shape import NOT_WEIGHTS, shape_differences
from .streamed_forward import StreamedWeights, hf_units, hf_weightless, megatron_units


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


def check_same_model(src: HFSource, megatron_path: str, lora_base: str | None = None):
    """The checkpoint's shape and the HF config's shape agree, field by field; else one line
    naming each field that differs. Returns the checkpoint's shape."""
    config_path = src.value if src.hub else os.path.join(src.path, "config.json")
    hf_shape = hf_conversion.config_shape(_hf_config(src), config_path)
    mg_shape, _ = hf_conversion.checkpoint_shape(megatron_path, lora_base=lora_base)
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
    """transformers' model of ``src``, weightless (``streamed_forward.hf_weightless``)."""
    import transformers

    from .hf_models import hf_classes

    config = transformers.AutoConfig.from_pretrained(src.path, **src.load_kwargs())
    try:
        hf_classes(config.model_type)
    except ValueError as err:
        raise ValueError(f"{src.flag} {src.value}: {err}") from None
    config._attn_implementation = "sdpa"
    return hf_weightless(config)


def _hf_files(src: HFSource) -> str:
    """The local folder of ``src``'s safetensors: the folder itself, or the Hub's files of ``hf://NAME``
    fetched into the Hub's cache (weights and configs only)."""
    if not src.hub:
        return src.path
    from huggingface_hub import snapshot_download

    return snapshot_download(src.path, allow_patterns=["*.safetensors", "*.json"])


def _nonfinite(name: str, tensor: torch.Tensor, found: list[str]) -> None:
    # the sum is finite when every element is, and allocates nothing the size of the tensor
    if tensor.is_floating_point() and not torch.isfinite(tensor.sum()):
        nan, inf = int(tensor.isnan().sum()), int(tensor.isinf().sum())
        if nan or inf:
            found.append(f"{name} ({nan} NaN, {inf} inf)")


def _hf_loader(source: HFTensorSource, found: list[str]):
    """``load(names)`` of transformers' weights from the files, in fp32; a tied head reads the embedding."""
    embedding = "model.language_model.embed_tokens.weight"

    def load(names):
        out = {}
        for name in names:
            stored = name if name in source or name != "lm_head.weight" else embedding
            out[name] = source.get(stored, torch.float32)
            _nonfinite(name, out[name], found)
        return out

    return load


def _batches(reader, names: list[str]) -> list[list[str]]:
    """``names`` in runs of at most ``READ_BYTES`` (a larger tensor alone)."""
    batches: list[list[str]] = [[]]
    size = 0
    for name in names:
        need = reader.nbytes([name])
        if batches[-1] and size + need > READ_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(name)
        size += need
    return batches


def _megatron_loader(reader, found: list[str]):
    def load(names):
        out = {}
        # a few MB at a time, in the stored dtype (the reader's copies are of that size), then each in fp32
        for batch in _batches(reader, names):
            for name, tensor in reader.read(batch).items():
                out[name] = tensor.float()
                _nonfinite(name, out[name], found)
        return out

    return load


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

    loaded = AutoProcessor.from_pretrained(processor.path, **processor.load_kwargs())
    content = ([{"type": "image"}] if image else []) + [{"type": "text", "text": prompt}]
    text = loaded.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [Image.open(image).convert("RGB")] if image else None
    batch = loaded(text=[text], images=images, return_tensors="pt")
    case = {"input_ids": batch["input_ids"]}
    if image:
        case.update(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    return [("prompt", case)]


@torch.no_grad()
def _hf_logits(hf, case: dict, image_token_id: int) -> torch.Tensor:
    ids = case["input_ids"]
    return (
        hf(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=(ids == image_token_id).long(),
            pixel_values=case.get("pixel_values"),
            image_grid_thw=case.get("image_grid_thw"),
        )
        .logits.float()
        .flatten(0, 1)
    )


@torch.no_grad()
def _megatron_logits(mg, shape, case: dict) -> torch.Tensor:
    ids, grid = case["input_ids"], case.get("image_grid_thw")
    position_ids = model_of(shape).padded_position_ids(
        ids,
        torch.ones_like(ids),
        grid,
        None,
        shape.image_token_id,
        shape.video_token_id,
        shape.vision.spatial_merge_size,
    )
    return mg(ids, position_ids, None, pixel_values=case.get("pixel_values"), image_grid_thw=grid).float().flatten(0, 1)


def _streamed_logits(what: str, model, units, load, cases, logits) -> list[torch.Tensor]:
    """Each case's logits from ``model``, run with its weights streamed in (a progress line for each
    pass over the weights: the resident units once, the streamed ones once a case)."""
    streamed, resident = units
    sizes = {n: p.numel() * 4 for n, p in model.named_parameters()}  # read as fp32
    once = [n for n in sizes if n.startswith(tuple(u + "." for u in resident))]
    again = len(cases) - 1  # the streamed units are read once a case, the resident ones once
    tensors = len(sizes) * len(cases) - len(once) * again
    total = sum(sizes.values()) * len(cases) - sum(sizes[n] for n in once) * again
    with Progress(f"verify ({what})", tensors, total) as progress:

        def counted(names):
            out = load(names)
            progress.advance(sum(t.numel() * 4 for t in out.values()), len(out))
            return out

        with StreamedWeights(model, streamed, resident, counted):
            return [logits(model, case) for _, case in cases]


def _stats(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (ours - ref).abs()
    cosine = torch.nn.functional.cosine_similarity(ours.double().flatten(), ref.double().flatten(), dim=0).item()
    return {
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
        "cosine": cosine,
        "tokens": ours.shape[0],
    }


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
    # Every path and shape is checked before either model runs (minutes on a large model).
    hf_src = HFSource(args.hf_path, "--hf-path")
    processor = HFSource(args.hf_processor_path, "--hf-processor-path") if args.hf_processor_path else hf_src
    if args.image and not args.prompt:
        raise ValueError("--image needs --prompt")
    if args.image and not os.path.isfile(args.image):
        raise FileNotFoundError(f"--image {args.image}: no such file")
    _local_hf_dir(hf_src)
    hf_conversion.check_checkpoint_dir(args.megatron_path)
    check_same_model(hf_src, args.megatron_path, getattr(args, "lora_base", None))
    opened = hf_conversion.open_megatron(args.megatron_path, lora_base=getattr(args, "lora_base", None))
    shape = opened.shape
    hf = _hf_model(hf_src)
    cases = prompt_case(processor, args.prompt, args.image) if args.prompt else builtin_cases(shape)
    bad_hf, bad_mg = [], []
    source = HFTensorSource(_hf_files(hf_src))
    refs = _streamed_logits(
        "transformers",
        hf,
        hf_units(hf),
        _hf_loader(source, bad_hf),
        cases,
        lambda m, c: _hf_logits(m, c, shape.image_token_id),
    )
    with opened.tensors() as reader:
        ours = _streamed_logits(
            "Megatron",
            opened.model,
            megatron_units(opened.model),
            _megatron_loader(reader, bad_mg),
            cases,
            lambda m, c: _megatron_logits(m, shape, c),
        )
    reasons = [
        f"{label} weights hold NaN/inf: {', '.join(bad[:5])}" + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        for label, bad in (("Megatron", bad_mg), ("HF", bad_hf))
        if bad
    ]
    if reasons:
        print("verify: FAIL: " + "; ".join(reasons))
        return False
    for (name, _), mine, ref in zip(cases, ours, refs):
        print(_line(f"  {name}: ", _stats(mine, ref)))
        reasons += _nonfinite_logits(name, mine, ref)
    total = _stats(torch.cat(ours), torch.cat(refs))
    ok = total["max_abs_diff"] <= args.atol and not reasons
    print(
        _line("verify: ", total)
        + f" atol={args.atol:g} {'PASS' if ok else 'FAIL'}"
        + (": " + "; ".join(reasons) if reasons else "")
    )
    return ok
