"""A Qwen-style processor and CORD-V2-format dataset built in-process (no downloads).

The tokenizer is character level with the Qwen special tokens; the image processor is the
real ``transformers`` Qwen2-VL one (patch 16, merge 2, temporal 2), so placeholder expansion
and grids are exactly what a released Qwen3.5 processor produces.
"""

from __future__ import annotations

import io
import json

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_processor(out_dir: str, specials=SPECIALS, chat_template=CHAT_TEMPLATE) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen3VLVideoProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(list(specials) + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials[0], pad_token=specials[0])
    image_processor = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2,
                                            size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256})
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=fast,
                                 video_processor=Qwen3VLVideoProcessor(), chat_template=chat_template)
    processor.save_pretrained(out_dir)
    return out_dir


def png_bytes(size, color) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, color)
    ImageDraw.Draw(image).rectangle([2, 2, size[0] // 2, size[1] // 2], fill=(255 - color[0], 30, 90))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def receipt(menu: list[tuple[str, str]], total: str) -> str:
    parse = {"menu": [{"nm": n, "price": p} for n, p in menu], "total": {"total_price": total}} if menu else {}
    return json.dumps({"gt_parse": parse, "meta": {"version": "2.0.0"}})


def build_cord_dataset(out_dir: str, rows: list[tuple[bytes, str]], splits=("train", "validation")) -> str:
    """A ``save_to_disk`` DatasetDict with CORD-V2's columns (image, ground_truth)."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "ground_truth": datasets.Value("string")})
    table = {"image": [{"bytes": b, "path": None} for b, _ in rows], "ground_truth": [g for _, g in rows]}
    ds = datasets.Dataset.from_dict(table, features=features)
    datasets.DatasetDict({s: ds for s in splits}).save_to_disk(out_dir)
    return out_dir
