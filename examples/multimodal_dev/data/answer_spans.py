"""Which tokens of a rendered conversation are the assistant's: found through the chat template
itself, with no template strings written here.

The conversation is rendered once, as the model will read it. For each assistant turn the
template renders the conversation again with that turn's content replaced by a sentinel
character; the two texts agree up to where the turn's content starts and again from where it
ends. That region is the turn's answer text, however the template wraps it (role header, an empty
think block on the last answer, trimmed whitespace). Rendering prefix by prefix would not do:
Qwen3.5's template writes an earlier assistant turn without the think block it gives the last
one, so a conversation's prefix is not a prefix of the conversation.

A turn is refused (``BadSample("template_layout")``) unless its variant differs from the
conversation in one region holding the sentinel exactly once, after the previous answer: a
template that drops a turn, repeats it, or lets it move other text is caught, not trained on.

The trained tokens of a turn run from its first content token through the end-of-turn token
that follows it (``ProcessorInfo.end_of_turn_id``), so whatever the template writes between the
two (tool-call markup) is trained too; the tokens before it are context.
"""

from __future__ import annotations

import torch

from .conversations import Turn, chat_messages
from .sample import BadSample, build_conversation_sample

SENTINEL = "\ue000"  # a private-use character: no record's text, no template's markup
# Training renders every answer as the template renders a finished turn; Qwen3.5's template puts an
# empty think block before the last one. The matching prompt for generation is its generation prompt
# with thinking off (with thinking on it ends in an open ``<think>``, a format never trained).
THINKING = False


def render(processor, messages: list[dict]) -> str:
    try:
        return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception as err:  # jinja's TemplateError and the template's own raise_exception
        raise BadSample("template_error", f"the chat template refused the conversation: {err}") from err


def answer_char_spans(processor, turns: list[Turn], rewrite=None) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the [start, end) characters of each assistant turn's content).
    ``rewrite(text)``: applied to every rendering (a change of media markup, never of answers)."""
    rewrite = rewrite or (lambda text: text)
    text = rewrite(render(processor, chat_messages(turns)))
    spans = []
    for index, turn in enumerate(turns):
        if turn.role != "assistant":
            continue
        variant = rewrite(render(processor, chat_messages(turns, replace={index: SENTINEL})))
        start = _common_prefix(text, variant)
        tail = _common_suffix(text, variant, min(len(text), len(variant)) - start)
        end = len(text) - tail
        region = variant[start : len(variant) - tail]
        if region.count(SENTINEL) != 1 or (spans and start < spans[-1][1]):
            raise BadSample(
                "template_layout",
                f"the chat template does not place assistant turn {index} once, "
                "in order; cannot tell which tokens to train",
            )
        if end <= start:
            raise BadSample("empty_answer", f"assistant turn {index} renders no text")
        spans.append((start, end))
    return text, spans


def generation_prompt(processor, turns: list[Turn]) -> str:
    """The text that asks for the next assistant turn in the format training gave answers: every
    character of a trained conversation before an answer's first character, for the turns before it."""
    return processor.apply_chat_template(
        chat_messages(turns), tokenize=False, add_generation_prompt=True, enable_thinking=THINKING
    )


def trained_sample(
    info, input_ids, offsets, replacements, spans, pixels=None, grids=None, video_pixels=None, video_grids=None
) -> dict:
    """The contract sample of a rendered conversation (``answer_char_spans``) as the processor
    encoded it, with offsets: every assistant turn's tokens trained."""
    tokens = info.tokens
    is_answer = answer_token_mask(
        input_ids,
        offsets,
        spans,
        replacements,
        info.end_of_turn_id,
        (*tokens.vision_ids, tokens.vision_start, tokens.vision_end),
    )
    if pixels is None:
        pixels, grids = torch.zeros(0, info.patch_dim), torch.zeros(0, 3, dtype=torch.long)
    return build_conversation_sample(input_ids, is_answer, pixels, grids, video_pixels, video_grids)


def encoded_sample(processor, info, text: str, spans, **media) -> dict:
    """The processor's encoding of a rendered conversation (``media``: its images / videos and
    their settings, expanded in the text), trained on its answers."""
    enc = processor(
        text=[text], **media, return_tensors="pt", return_offsets_mapping=True, return_text_replacement_offsets=True
    )
    vision = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    return trained_sample(
        info,
        enc["input_ids"][0],
        enc["offset_mapping"][0],
        enc["text_replacement_offsets"][0],
        spans,
        *(enc.get(key) for key in vision),
    )


def answer_token_mask(
    input_ids: torch.Tensor,
    offsets: torch.Tensor,
    char_spans: list[tuple[int, int]],
    replacements: list[dict],
    end_of_turn_id: int,
    vision_ids,
) -> torch.Tensor:
    """``is_answer`` over ``input_ids`` (tokens of the text with every media placeholder expanded;
    ``offsets`` [L, 2] their characters in it, ``replacements`` the processor's expansions)."""
    is_answer = torch.zeros_like(input_ids, dtype=torch.bool)
    is_vision = torch.isin(input_ids, torch.as_tensor(list(vision_ids)))
    starts, ends = offsets[:, 0], offsets[:, 1]
    for number, (start, end) in enumerate(char_spans):
        start, end = _expanded(start, replacements), _expanded(end, replacements)
        inside = torch.nonzero((starts < end) & (ends > start) & (ends > starts)).flatten()
        if inside.numel() == 0 or bool(is_vision[inside[0] : inside[-1] + 1].any()):
            raise BadSample("template_layout", f"answer {number} has no text tokens of its own")
        after = torch.nonzero(input_ids[inside[-1] + 1 :] == end_of_turn_id).flatten()
        if after.numel() == 0:
            raise BadSample("template_layout", f"answer {number} is not followed by an end-of-turn token")
        last = int(inside[-1]) + 1 + int(after[0])
        if bool(is_vision[inside[-1] : last].any()) or (
            number + 1 < len(char_spans) and ends[last] > _expanded(char_spans[number + 1][0], replacements)
        ):
            raise BadSample("template_layout", f"answer {number} has no end-of-turn token before what follows it")
        is_answer[inside[0] : last + 1] = True
    return is_answer


def _expanded(position: int, replacements: list[dict]) -> int:
    """A character position of the rendered text, in the text with media placeholders expanded."""
    shift = 0
    for rep in replacements:
        (old_start, old_end), (new_start, new_end) = rep["span"], rep["new_span"]
        if old_end <= position:
            shift += (new_end - new_start) - (old_end - old_start)
        elif old_start < position:
            raise BadSample("template_layout", "an answer overlaps an image or video placeholder")
    return position + shift


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix, by bisection on slice comparisons (C speed on long texts)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def _common_suffix(a: str, b: str, limit: int) -> int:
    low, high = 0, max(limit, 0)
    while low < high:
        mid = (low + high + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            low = mid
        else:
            high = mid - 1
    return low
