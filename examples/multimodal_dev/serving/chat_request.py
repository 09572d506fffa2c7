"""The JSON body of an OpenAI ``POST /v1/chat/completions`` request, checked and turned into what the
server needs: a conversation record in the playground's ``parts`` form (what the data path reads) and
the sampling parameters.

Everything a request may ask is checked here, before the model sees it, so that a bad request costs
a 4xx answer naming the field instead of a failed batch: sizes are bounded (``Limits``, the server's
flags), an image is read as far as its header (its size, not its pixels), and a request never makes
the server read a local file. A field this server cannot honour (tools, logprobs, penalties, several
answers) is refused rather than silently ignored, so a client never reads an answer made under
settings it did not ask for.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 4  # OpenAI's limit
REMOTE_SCHEMES = ("http://", "https://")  # lower case, as the data path matches them
# Formats whose headers are read here; the data path decodes the same bytes later. A request comes
# from the network, so PIL's rarer readers (EPS runs Ghostscript) are not offered to it.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
INT64 = (-(2**63), 2**63 - 1)  # a seed beyond these does not fit a torch generator
# The fields this server reads (``parse_chat_request``); return_token_ids and top_k are vLLM's
READ_FIELDS = (
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "return_token_ids",
    "n",
    "frequency_penalty",
    "presence_penalty",
)
# OpenAI's fields that would change what an answer is, each with the values that ask for nothing
NEUTRAL = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
}
IGNORED = ("user", "metadata")  # the caller's own tags (its end user, its key-values): no bearing on the answer
KNOWN_FIELDS = (*READ_FIELDS, *NEUTRAL, *IGNORED)


@dataclass(frozen=True)
class Limits:
    """What one request may ask (the server's ``--max-*`` / ``--allow-remote-media`` flags)."""

    max_body_bytes: int = 20 * 2**20
    max_tokens: int = 1024  # the most max_tokens a request may ask; also its default
    max_images: int = 8  # images in one request
    max_image_pixels: int = 4096 * 4096  # width * height of one image, read from its header
    allow_remote_media: bool = False  # http(s) image URLs fetched by the server


class RequestError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": "invalid_request_error", "param": self.param, "code": self.code}
        }


@dataclass
class ChatRequest:
    model: str
    record: dict  # {"messages": [...]}, every content a list of {"type": "text" | "image", ...} parts
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # 0: every token (a vLLM extension field, optional in the request)
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool  # stream_options.include_usage (only allowed with stream true)
    images: int  # how many images the record holds
    # vLLM's extension: the answer's token ids beside its text (``choices[0].token_ids``)
    return_token_ids: bool = False


def parse_chat_request(body: bytes, served_model: str, limits: Limits) -> ChatRequest:
    """The request in ``body``, for a server of ``served_model``; ``RequestError`` names what is wrong."""
    request = _load_object(body, limits)
    _refuse_unknown(request)
    model = _model(request, served_model)
    _refuse_unsupported(request)
    record, images = _record(request.get("messages"), limits)
    stream = _optional_bool(request, "stream", False)
    return ChatRequest(
        model=model,
        record=record,
        max_tokens=_max_tokens(request, limits),
        temperature=_number(request, "temperature", 1.0, lambda x: 0 <= x <= 2, "a number from 0 to 2"),
        top_p=_number(request, "top_p", 1.0, lambda x: 0 < x <= 1, "a number above 0 and at most 1"),
        top_k=_top_k(request),
        seed=_seed(request),
        stop=_stop(request),
        stream=stream,
        include_usage=_include_usage(request, stream),
        images=images,
        return_token_ids=_optional_bool(request, "return_token_ids", False),
    )


def _fail(param: str | None, message: str, status: int = 400, code: str | None = None) -> RequestError:
    return RequestError(status, message, param=param, code=code)


def _show(value) -> str:
    """A value as a message quotes it: one line (repr escapes newlines), short (a data: URL is long)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not 1 here


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- the body ---------------------------------------------------------------------------------------


def _load_object(body: bytes, limits: Limits) -> dict:
    if len(body) > limits.max_body_bytes:
        raise _fail(
            None,
            f"request body {len(body)} bytes: at most {limits.max_body_bytes} (the server's --max-request-bytes)",
            status=413,
        )
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _fail(None, f"the body is not JSON: not UTF-8 ({err})") from err
    try:
        request = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError as err:  # "[[[[..." a million deep fits the size limit
        raise _fail(None, "the body is not JSON: nested too deeply") from err
    except ValueError as err:  # JSONDecodeError, and the two parse hooks' refusals
        raise _fail(None, f"the body is not JSON: {err}") from err
    if not isinstance(request, dict):
        raise _fail(None, f"the body is a JSON {type(request).__name__}: expected an object")
    return request


def _refuse_constant(name: str):
    """NaN and Infinity are Python's extensions, not JSON: no sampling parameter may be one."""
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf
        raise ValueError(f"{text[:40]} is too large a number")
    return value


def _model(request: dict, served_model: str) -> str:
    model = request.get("model")
    if not isinstance(model, str):
        raise _fail("model", f"model {_show(model)}: expected a string, the served model's name {served_model!r}")
    if model != served_model:
        raise _fail(
            "model",
            f"model {_show(model)}: not served here; this server serves {served_model!r}",
            status=404,
            code="model_not_found",
        )
    return model


def _refuse_unknown(request: dict) -> None:
    """A field this server does not know, most often a misspelt one: answering without it would
    answer a question other than the one asked."""
    import difflib

    for field in request:
        if field not in KNOWN_FIELDS:
            near = difflib.get_close_matches(str(field), KNOWN_FIELDS, n=1, cutoff=0.75)
            hint = f"; did you mean {near[0]!r}?" if near else f"; the fields read are {', '.join(READ_FIELDS)}"
            raise _fail(str(field), f"unknown field {_show(field)}{hint}")


def _refuse_unsupported(request: dict) -> None:
    """Fields that would change what an answer is; an empty or neutral value asks for nothing."""
    n = request.get("n")
    if n is not None and not (_is_int(n) and n == 1):
        raise _fail("n", f"n {_show(n)}: this server gives one answer a request (n 1)")
    user = request.get("user")
    if user is not None and not isinstance(user, str):
        raise _fail("user", f"user {_show(user)}: expected a string")
    for field, allowed in NEUTRAL.items():
        value = request.get(field)
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise _fail(field, f"{field} {_show(value)}: not supported by this server")
    for field in ("frequency_penalty", "presence_penalty"):
        value = request.get(field)
        if value is not None and not (_is_number(value) and value == 0):
            raise _fail(field, f"{field} {_show(value)}: not supported by this server (only 0)")


# --- the conversation -------------------------------------------------------------------------------


@dataclass
class _ImageRef:
    param: str  # where the request holds it, for messages
    url: str
    part: dict  # the record's part, given its image once the URL is checked


def _record(messages, limits: Limits) -> tuple[dict, int]:
    if not isinstance(messages, list) or not messages:
        raise _fail("messages", f"messages {_show(messages)}: expected a non-empty list of messages")
    turns, images = [], []
    for i, message in enumerate(messages):
        turns.append(_message(message, f"messages[{i}]", first=i == 0, images=images))
    if turns[-1]["role"] != "user":
        raise _fail("messages", f"messages: the last is the {turns[-1]['role']}'s; the server answers a user's turn")
    if len(images) > limits.max_images:
        raise _fail(
            "messages", f"messages hold {len(images)} images: at most {limits.max_images} (the server's --max-images)"
        )
    for image in images:  # after counting: a request of a thousand images is refused unread
        image.part["image"] = _checked_image_url(image.url, image.param, limits)
    return {"messages": turns}, len(images)


def _message(message, where: str, first: bool, images: list[_ImageRef]) -> dict:
    if not isinstance(message, dict):
        raise _fail(where, f"{where} {_show(message)}: expected an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        raise _fail(f"{where}.role", f"{where}.role {_show(role)}: not supported; roles are {', '.join(ROLES)}")
    if role == "system" and not first:  # Qwen's chat templates refuse a system turn anywhere else
        raise _fail(f"{where}.role", f"{where}.role 'system': a system message comes first only")
    content = message.get("content")
    if isinstance(content, str):
        return {"role": role, "content": [{"type": "text", "text": content}]}
    if not isinstance(content, list) or not content:
        raise _fail(f"{where}.content", f"{where}.content {_show(content)}: expected a string or a non-empty list")
    parts = [_part(part, f"{where}.content[{j}]", role, images) for j, part in enumerate(content)]
    return {"role": role, "content": parts}


def _part(part, where: str, role: str, images: list[_ImageRef]) -> dict:
    if not isinstance(part, dict):
        raise _fail(where, f"{where} {_show(part)}: expected an object with a type")
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise _fail(f"{where}.text", f"{where}.text {_show(text)}: expected a string")
        return {"type": "text", "text": text}
    if kind != "image_url":
        raise _fail(f"{where}.type", f"{where}.type {_show(kind)}: not supported; parts are text or image_url")
    if role != "user":
        raise _fail(f"{where}.type", f"{where}.type 'image_url': images belong in user messages, not {role}'s")
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url  # also a bare URL string
    if not isinstance(url, str):
        raise _fail(f"{where}.image_url.url", f"{where}.image_url.url {_show(url)}: expected a URL string")
    record_part = {"type": "image", "image": url}
    images.append(_ImageRef(f"{where}.image_url.url", url, record_part))
    return record_part


# --- images -----------------------------------------------------------------------------------------


def _checked_image_url(url: str, param: str, limits: Limits) -> str:
    """The URL the record gives the data path: a data: URL in one canonical spelling (its header
    checked, as far as the image's size), or an http(s) URL where remote media are on."""
    if url[:5].lower() == "data:":
        return _checked_data_url(url, param, limits)
    for scheme in REMOTE_SCHEMES:
        if url[: len(scheme)].lower() == scheme:
            if not limits.allow_remote_media:
                raise _fail(
                    param,
                    f"{param} {_show(url)}: remote media are off (the server's --allow-remote-media turns them on)",
                )
            return scheme + url[len(scheme) :]  # the data path matches the scheme in lower case
    raise _fail(param, f"{param} {_show(url)}: a local path is never read; send the image as a data: URL")


def _checked_data_url(url: str, param: str, limits: Limits) -> str:
    header, comma, payload = url[5:].partition(",")
    media_type, *options = [piece.strip().lower() for piece in header.split(";")]
    if not comma or "base64" not in options:
        raise _fail(param, f"{param} {_show(url)}: expected data:image/<type>;base64,<payload>")
    if not media_type.startswith("image/"):
        raise _fail(param, f"{param} media type {_show(media_type)}: expected an image/* data: URL")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise _fail(param, f"{param}: the payload is not base64 ({err})") from err
    width, height = _image_size(data, param, limits.max_image_pixels)
    if width * height > limits.max_image_pixels:
        raise _fail(
            param,
            f"{param}: an image of {width}x{height} = {width * height} pixels; at most {limits.max_image_pixels} "
            "(the server's --max-image-pixels)",
        )
    return f"data:{media_type};base64,{payload}"


def _image_size(data: bytes, param: str, max_pixels: int) -> tuple[int, int]:
    """Width and height from the header; the pixels are decoded later, by the data path."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            return image.size
    except Image.DecompressionBombError as err:  # PIL's own ceiling, refused on opening, before ours
        raise _fail(param, f"{param}: {err}; at most {max_pixels} pixels (the server's --max-image-pixels)") from err
    except Image.UnidentifiedImageError as err:  # its message names only the BytesIO object
        raise _fail(param, f"{param}: not an image: the bytes are none of {', '.join(IMAGE_FORMATS)}") from err
    except Exception as err:  # PIL raises many types for a header it cannot read
        raise _fail(param, f"{param}: not an image: {type(err).__name__}: {err}") from err


# --- sampling ---------------------------------------------------------------------------------------


def _max_tokens(request: dict, limits: Limits) -> int:
    given = {f: request[f] for f in ("max_tokens", "max_completion_tokens") if request.get(f) is not None}
    for field, value in given.items():
        if not _is_int(value) or value < 1:
            raise _fail(field, f"{field} {_show(value)}: expected an integer of at least 1")
        if value > limits.max_tokens:
            raise _fail(field, f"{field} {value}: at most {limits.max_tokens} (the server's --max-tokens)")
    if len(set(given.values())) > 1:
        raise _fail(
            "max_completion_tokens",
            f"max_completion_tokens {given['max_completion_tokens']} differs from max_tokens {given['max_tokens']}",
        )
    return next(iter(given.values()), limits.max_tokens)


def _number(request: dict, field: str, default: float, valid: Callable[[float], bool], expected: str) -> float:
    value = request.get(field)
    if value is None:
        return default
    if not _is_number(value) or not valid(value):
        raise _fail(field, f"{field} {_show(value)}: {expected}")
    return float(value)


def _top_k(request: dict) -> int:
    value = request.get("top_k")
    if value is None or (_is_int(value) and value == -1):  # vLLM's -1: every token, our 0
        return 0
    if not _is_int(value) or value < 0:
        raise _fail("top_k", f"top_k {_show(value)}: expected an integer of at least 0 (0 or -1: every token)")
    return value


def _seed(request: dict) -> int | None:
    value = request.get("seed")
    if value is not None and not (_is_int(value) and INT64[0] <= value <= INT64[1]):
        raise _fail("seed", f"seed {_show(value)}: expected null or a 64-bit integer")
    return value


def _stop(request: dict) -> list[str]:
    value = request.get("stop")
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stops):
        raise _fail(
            "stop", f"stop {_show(value)}: expected null, a string or up to {MAX_STOP_STRINGS} non-empty strings"
        )
    return list(stops)


def _optional_bool(request: dict, field: str, default: bool) -> bool:
    value = request.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _fail(field, f"{field} {_show(value)}: expected true or false")
    return value


def _include_usage(request: dict, stream: bool) -> bool:
    options = request.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise _fail("stream_options", f"stream_options {_show(options)}: only with stream true")
    if not isinstance(options, dict):
        raise _fail("stream_options", f"stream_options {_show(options)}: expected an object")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise _fail("stream_options", f"stream_options.include_usage {_show(include)}: expected true or false")
    return bool(include)
