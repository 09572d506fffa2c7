"""Hugging Face processor loading and start-up checks for the real-data providers.

A processor is usable when its tokenizer knows the vision tokens, has a pad or eos token and
a chat template, and its image processor reports patch and merge sizes. Anything missing is
reported in one error at start-up, never as a crash in the middle of a run.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sample import VisionTokens

VISION_TOKEN_TEXT = {
    "image": "<|image_pad|>",
    "video": "<|video_pad|>",
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
}
END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class ProcessorInfo:
    tokens: VisionTokens
    end_of_turn_id: int  # trained after every answer
    patch_size: int
    patch_dim: int  # values per flattened patch (C * t * p * p)


def _token_id(tokenizer, text: str):
    token_id = tokenizer.convert_tokens_to_ids(text)
    return None if token_id is None or token_id == tokenizer.unk_token_id and text != tokenizer.unk_token else token_id


def inspect_processor(processor) -> ProcessorInfo:
    tok = processor.tokenizer
    problems, ids = [], {}
    for name, text in VISION_TOKEN_TEXT.items():
        ids[name] = _token_id(tok, text)
        if ids[name] is None:
            problems.append(f"the tokenizer has no {name} token {text!r}")
    end_id = _token_id(tok, END_OF_TURN)
    if end_id is None:
        end_id = tok.eos_token_id
    if end_id is None:
        problems.append(f"the tokenizer has neither {END_OF_TURN!r} nor an eos token to end the answer")
    if tok.pad_token_id is None and tok.eos_token_id is None:
        problems.append("the tokenizer has neither a pad nor an eos token")
    if not getattr(processor, "chat_template", None) and not getattr(tok, "chat_template", None):
        problems.append("the processor has no chat template")
    image_processor = getattr(processor, "image_processor", None)
    patch, merge, temporal = (
        getattr(image_processor, k, None) for k in ("patch_size", "merge_size", "temporal_patch_size")
    )
    if None in (patch, merge, temporal):
        problems.append("the image processor does not report patch_size / merge_size / temporal_patch_size")
    if problems:
        raise ValueError("unusable --hf-processor-path: " + "; ".join(problems))
    tokens = VisionTokens(ids["image"], ids["video"], ids["vision_start"], ids["vision_end"], merge)
    return ProcessorInfo(tokens, end_id, patch, 3 * temporal * patch * patch)


def load_processor(path: str | None, min_pixels: int | None = None, max_pixels: int | None = None):
    if not path:
        raise ValueError(
            "--hf-processor-path is required for this dataset (a directory with the tokenizer, "
            "chat template and image processor, e.g. a Qwen3.5 checkpoint)"
        )
    from transformers import AutoProcessor

    from .sources import resolve

    source, from_hub = resolve(path, "--hf-processor-path")
    try:  # a local directory never falls through to the Hub
        processor = AutoProcessor.from_pretrained(source, local_files_only=not from_hub)
    except (OSError, ValueError) as err:
        raise ValueError(f"--hf-processor-path {path!r} could not be loaded: {err}") from err
    info = inspect_processor(processor)
    # The image processor resizes again after qwen_vl_utils; give both the same pixel budget.
    size = processor.image_processor.size
    if min_pixels is not None:
        size.shortest_edge = min_pixels
    if max_pixels is not None:
        size.longest_edge = max_pixels
    if size.shortest_edge > size.longest_edge:
        raise ValueError(f"--min-pixels {size.shortest_edge} is larger than --max-pixels {size.longest_edge}")
    return processor, info


def answer_end_ids(processor, info: ProcessorInfo) -> list[int]:
    """The tokens that end a generated answer: the end of turn training puts after every answer, and
    the tokenizer's end of text."""
    return sorted({info.end_of_turn_id, processor.tokenizer.eos_token_id} - {None})


def answer_text(processor, tokens: list[int]) -> str:
    """A generated answer's text, its special tokens (the end of turn) left out."""
    return processor.tokenizer.decode(tokens, skip_special_tokens=True).strip()


def processor_differences(processor, info: ProcessorInfo, shape) -> list[str]:
    """What of the processor disagrees with the model ``shape`` (its vocabulary, vision token ids and
    patch sizes): a prompt built by it would place its vision features wrong or reach past the
    embedding, and the model would fail deep inside its forward, or answer from the wrong tokens."""
    vision, image = shape.vision, processor.image_processor
    pairs = [
        ("image_token_id", info.tokens.image, shape.image_token_id),
        ("video_token_id", info.tokens.video, shape.video_token_id),
        ("vision_start_token_id", info.tokens.vision_start, shape.vision_start_token_id),
        ("vision_end_token_id", info.tokens.vision_end, shape.vision_end_token_id),
    ]
    # videos go through a processor of their own, which carries its own sizes
    for name, part in (("image", image), ("video", getattr(processor, "video_processor", None))):
        for key, want in (
            ("patch_size", vision.patch_size),
            ("merge_size", vision.spatial_merge_size),
            ("temporal_patch_size", vision.temporal_patch_size),
        ):
            if getattr(part, key, None) is not None:
                pairs.append((f"{name} {key}", getattr(part, key), want))
    differ = [f"{what} {got} (processor) vs {want} (checkpoint)" for what, got, want in pairs if got != want]
    size = len(processor.tokenizer)
    if size > shape.text.vocab_size:
        differ.append(f"a vocabulary of {size} tokens (processor) > {shape.text.vocab_size} (checkpoint)")
    return differ
