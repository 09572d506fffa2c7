"""A Qwen-style processor and CORD-V2-format dataset built in-process (no downloads).

The tokenizer is character level with the Qwen special tokens; the image processor is the
real ``transformers`` Qwen2-VL one (patch 16, merge 2, temporal 2), so placeholder expansion
and grids are exactly what a released Qwen3.5 processor produces.

``QWEN35_CHAT_TEMPLATE`` behaves as Qwen3.5's template does where the trained spans depend on it:
no default system turn, a system turn only first and text only, every turn's content trimmed,
an assistant turn after the last user turn opening with a think block (empty unless its content
holds ``</think>``) while earlier ones do not, and a generation prompt that opens thinking
(``<think>\n``, or an empty think block with ``enable_thinking=False``).
"""

from __future__ import annotations

import io
import json

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN35_CHAT_TEMPLATE = r"""
{%- macro body(content, in_system) -%}
  {%- if content is string -%}{{- content -}}
  {%- else -%}{%- for part in content -%}
    {%- if part.type == 'text' -%}{{- part.text -}}
    {%- elif part.type in ('image', 'video') -%}
      {%- if in_system -%}{{- raise_exception('a system turn holds text only') -}}{%- endif -%}
      {{- '<|vision_start|><|' ~ part.type ~ '_pad|><|vision_end|>' -}}
    {%- endif -%}
  {%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- set state = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set state.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if state.last_user < 0 -%}{{- raise_exception('no user turn') -}}{%- endif -%}
{%- for m in messages -%}
  {%- set text = body(m.content, m.role == 'system') | trim -%}
  {%- if m.role == 'system' -%}
    {%- if not loop.first -%}{{- raise_exception('the system turn must come first') -}}{%- endif -%}
    {{- '<|im_start|>system
' ~ text ~ '<|im_end|>
' -}}
  {%- elif m.role == 'user' -%}
    {{- '<|im_start|>user
' ~ text ~ '<|im_end|>
' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set thought = '' -%}
    {%- if '</think>' in text -%}
      {%- set thought = text.split('</think>')[0].split('<think>')[-1] | trim -%}
      {%- set text = text.split('</think>')[-1] | trim -%}
    {%- endif -%}
    {{- '<|im_start|>assistant
' -}}
    {%- if loop.index0 > state.last_user -%}{{- '<think>
' ~ thought ~ '
</think>

' -}}{%- endif -%}
    {{- text ~ '<|im_end|>
' -}}
  {%- else -%}{{- raise_exception('unknown role ' ~ m.role) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant
' -}}
  {{- '<think>

</think>

' if enable_thinking is defined and enable_thinking is false else '<think>
' -}}
{%- endif -%}
"""


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
    image_processor = Qwen2VLImageProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256}
    )
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=fast,
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=chat_template,
    )
    processor.save_pretrained(out_dir)
    return out_dir


def tiny_shape_for(processor_dir: str, moe: bool = False):
    """The ``tiny`` variant (dense unless ``moe``, no MTP head) with the processor's vision token ids: a
    model and the processor that feeds it must agree on them."""
    from dataclasses import replace

    from examples.multimodal_dev.data.processor import load_processor
    from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant

    t = load_processor(processor_dir)[1].tokens
    return replace(
        get_variant("tiny", moe=moe, mtp=False),
        image_token_id=t.image,
        video_token_id=t.video,
        vision_start_token_id=t.vision_start,
        vision_end_token_id=t.vision_end,
    )


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
