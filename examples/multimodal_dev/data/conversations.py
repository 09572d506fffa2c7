"""Conversation records in the formats users bring, normalised to one form: a list of turns
``Turn(role, parts)``, a part being text (``str``) or a ``Media`` (image or video) in reading order.

The format is detected per record, so one file may mix them:

    "conversations" key                  -> sharegpt: LLaVA / ShareGPT turns ``{"from", "value"}``
                                            (human / gpt / system); media in ``image`` / ``images``
                                            and ``video`` / ``videos`` (a string or a list),
                                            placed at ``<image>`` / ``<video>`` in the text
    "messages", some content is a list   -> parts: transformers / Qwen chat messages whose content
                                            lists ``{"type": "text" | "image" | "video", ...}`` (the
                                            input of qwen_vl_utils.process_vision_info); an image or
                                            video part may carry its own settings (``min_pixels``,
                                            ``max_pixels``, ``fps``, ``nframes``, ...)
    "messages", every content a string   -> placeholder: ms-swift / LLaMA-Factory messages
                                            ``{"role", "content"}`` with ``images`` / ``videos``
                                            lists placed at ``<image>`` / ``<video>``

Roles: system, user (or human), assistant (or gpt); a turn may name its role with ``role`` or
``from`` and its text with ``content`` or ``value`` in every format. A placeholder takes the next
media of its kind in list order; their counts must match. Anything else is a ``BadSample``
whose reason names the fault; the provider adds the file and line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .sample import BadSample

ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}
KINDS = ("image", "video")
PLACEHOLDERS = {"<image>": "image", "<video>": "video"}
_PLACEHOLDER_RE = re.compile("(" + "|".join(re.escape(p) for p in PLACEHOLDERS) + ")")
# Keys that may name a part's media; the rest of an image or video part are its settings.
_REF_KEYS = {"image": ("image", "image_url", "url", "path"), "video": ("video", "url", "path")}
# A part's own image settings and their largest values: an image of 8192 x 8192 pixels, a side of
# 32768. Past them a record asks for more memory than any image needs (min_pixels 4e10 ended in a
# MemoryError, Infinity in an OverflowError).
IMAGE_OPTIONS = {"min_pixels": 1 << 26, "max_pixels": 1 << 26, "resized_height": 1 << 15, "resized_width": 1 << 15}


@dataclass(frozen=True)
class Media:
    kind: str  # "image" or "video"
    ref: str  # as written: a path (relative, absolute, file://), a URL or a data: URI
    options: dict = field(default_factory=dict)  # per-item settings (parts format only)


@dataclass(frozen=True)
class Turn:
    role: str  # system, user or assistant
    parts: tuple  # str | Media, in reading order

    @property
    def media(self) -> list[Media]:
        return [p for p in self.parts if isinstance(p, Media)]

    @property
    def text(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))


def detect_format(record) -> str:
    if not isinstance(record, dict):
        raise BadSample("bad_record", f"a record must be a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        return "sharegpt"
    if "messages" in record:
        messages = record["messages"]
        if isinstance(messages, list) and any(isinstance(m, dict) and isinstance(_content(m), list) for m in messages):
            return "parts"
        return "placeholder"
    raise BadSample("bad_record", f"expected a 'messages' or 'conversations' list, found keys {sorted(record)[:8]}")


def normalise(record, answered: bool = True) -> list[Turn]:
    """The record's turns; raises ``BadSample`` for anything that cannot be one conversation (to train
    on: with an assistant turn, unless not ``answered``: a prompt for generation)."""
    kind = detect_format(record)
    messages = record["conversations" if kind == "sharegpt" else "messages"]
    if not isinstance(messages, list) or not messages:
        raise BadSample(
            "bad_record", f"'{'conversations' if kind == 'sharegpt' else 'messages'}' must be a non-empty list of turns"
        )
    if kind == "parts":
        if any(_media_list(record, k) for k in KINDS):
            raise BadSample("bad_record", "media given both as content parts and in a top-level images/videos list")
        turns = [Turn(_role(m), _parts(_content(m))) for m in messages]
    else:
        media = {k: _media_list(record, k) for k in KINDS}
        turns = [Turn(_role(m), _split_placeholders(_text_content(m))) for m in messages]
        turns = _place_media(turns, media)
    if answered and not any(t.role == "assistant" for t in turns):
        raise BadSample("no_assistant_turn", "the conversation has no assistant turn to train on")
    for turn in turns:
        if turn.role == "assistant" and turn.media:
            raise BadSample("media_in_answer", "an assistant turn holds an image or video; answers are text")
        if turn.role == "assistant" and not turn.text.strip():
            raise BadSample("empty_answer", "an assistant turn has no text")
    return turns


def chat_messages(turns: list[Turn], replace: dict | None = None) -> list[dict]:
    """The turns as the chat template takes them. ``replace`` maps a turn's index to the text that
    stands in for its content (the trained-span search renders such variants)."""
    messages = []
    for i, turn in enumerate(turns):
        if replace and i in replace:
            messages.append({"role": turn.role, "content": replace[i]})
        elif turn.media:
            messages.append(
                {
                    "role": turn.role,
                    "content": [
                        {"type": p.kind} if isinstance(p, Media) else {"type": "text", "text": p} for p in turn.parts
                    ],
                }
            )
        else:
            messages.append({"role": turn.role, "content": turn.text})
    return messages


def _role(message) -> str:
    if not isinstance(message, dict):
        raise BadSample("bad_record", f"a turn must be a JSON object, got {type(message).__name__}")
    role = message.get("role", message.get("from"))
    if role not in ROLES:
        raise BadSample("bad_role", f"turn role {role!r}; expected one of {', '.join(ROLES)}")
    return ROLES[role]


def _content(message):
    return message.get("content", message.get("value"))


def _text_content(message) -> str:
    content = _content(message) if isinstance(message, dict) else None
    if content is None:
        return ""
    if not isinstance(content, str):
        raise BadSample("bad_record", f"turn content must be a string here, got {type(content).__name__}")
    return content


@dataclass(frozen=True)
class _Slot:  # a placeholder waiting for its media
    kind: str


def _split_placeholders(text: str) -> tuple:
    return tuple(
        _Slot(PLACEHOLDERS[piece]) if piece in PLACEHOLDERS else piece for piece in _PLACEHOLDER_RE.split(text) if piece
    )


def _media_list(record: dict, kind: str) -> list[str]:
    singular, plural = record.get(kind), record.get(f"{kind}s")
    if singular is not None and plural is not None:
        raise BadSample("bad_record", f"both '{kind}' and '{kind}s' are given")
    items = singular if singular is not None else plural
    if items is None:
        return []
    items = [items] if isinstance(items, (str, dict)) else items
    if not isinstance(items, list):
        raise BadSample("bad_record", f"'{kind}s' must be a string or a list, got {type(items).__name__}")
    return [_ref(item, kind) for item in items]


def _ref(item, kind: str) -> str:
    if isinstance(item, dict):  # e.g. ms-swift's {"path": ...}
        item = next((item[k] for k in _REF_KEYS[kind] if isinstance(item.get(k), str)), None)
    if not isinstance(item, str) or not item:
        raise BadSample("bad_record", f"a {kind} must be a path or URL string, got {item!r}")
    return item


def _place_media(turns: list[Turn], media: dict) -> list[Turn]:
    """Replace each placeholder by the next media of its kind; the counts must match."""
    for kind in KINDS:
        n_placeholders = sum(p == _Slot(kind) for t in turns for p in t.parts)
        if n_placeholders != len(media[kind]):
            raise BadSample(
                "placeholder_mismatch", f"{n_placeholders} <{kind}> placeholder(s) for {len(media[kind])} {kind}(s)"
            )
    queues = {k: iter(media[k]) for k in KINDS}
    return [
        Turn(t.role, tuple(Media(p.kind, next(queues[p.kind])) if isinstance(p, _Slot) else p for p in t.parts))
        for t in turns
    ]


def _parts(content) -> tuple:
    if content is None:
        return ()
    if isinstance(content, str):
        return (content,) if content else ()
    if not isinstance(content, list):
        raise BadSample("bad_record", f"turn content must be a string or a list of parts, got {type(content).__name__}")
    return tuple(p for p in (_part(item) for item in content) if p != "")


def _part(item):
    if not isinstance(item, dict):
        raise BadSample("bad_record", f"a content part must be a JSON object, got {type(item).__name__}")
    kind = item.get("type") or next((k for k in ("text", "image", "video") if k in item), None)
    kind = "image" if kind == "image_url" else kind
    if kind == "text":
        text = item.get("text")
        if not isinstance(text, str):
            raise BadSample("bad_record", f"a text part needs a string 'text', got {text!r}")
        return text
    if kind not in KINDS:
        raise BadSample("bad_record", f"content part type {item.get('type')!r}; expected text, image or video")
    key = next((k for k in _REF_KEYS[kind] if k in item), None)
    ref = item.get(key)
    if isinstance(ref, dict) and isinstance(ref.get("url"), str):  # OpenAI's {"image_url": {"url": ...}}
        ref = ref["url"]
    if isinstance(ref, list):
        raise BadSample("bad_record", f"a {kind} given as a list of frames is not supported; give a video file")
    if not isinstance(ref, str) or not ref:
        raise BadSample("bad_record", f"a {kind} part needs a path or URL in one of {list(_REF_KEYS[kind])}")
    options = {k: v for k, v in item.items() if k not in ("type", key)}
    if kind == "image":
        _check_image_options(options)
    return Media(kind, ref, options)


def _check_image_options(options: dict) -> None:
    if set(options) - set(IMAGE_OPTIONS):
        raise BadSample(
            "bad_record",
            f"unknown image setting(s) {sorted(set(options) - set(IMAGE_OPTIONS))}; "
            f"an image part takes {list(IMAGE_OPTIONS)}",
        )
    for name, value in options.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 < value <= IMAGE_OPTIONS[name]
            or value != int(value)
        ):
            raise BadSample(
                "bad_record", f"image setting {name} {value!r}: expected a whole number from 1 to {IMAGE_OPTIONS[name]}"
            )
