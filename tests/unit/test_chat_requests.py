"""The chat-completions server's request checks and streamed answer text (examples/multimodal_dev/serving):
a valid request becomes the record and parameters written out here by hand, every refusal has its
status, ``param`` and a one-line message naming the field, and an answer's deltas never show half a
character or any part of a stop string. Images are drawn here; the tokenizers are the tiny processor's
(one token a character) and a byte-level BPE built here (one token a byte), so nothing is downloaded."""

import base64
import io
import json
import random

import pytest
from PIL import Image
from tiny_processor import build_processor, png_bytes  # pyrefly: ignore[missing-import] (tests/conftest.py adds it)

from examples.multimodal_dev.serving.answer_text import AnswerText
from examples.multimodal_dev.serving.chat_request import ChatRequest, Limits, RequestError, parse_chat_request

MODEL = "qwen35-tiny"
DROP = object()  # a field left out of the request


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PNG = png_bytes((8, 6), (200, 10, 10))
PNG_URL = data_url(PNG)


def body(**fields) -> bytes:
    """A minimal valid request with ``fields`` laid over it (``DROP`` removes one)."""
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    request.update(fields)
    return json.dumps({k: v for k, v in request.items() if v is not DROP}).encode()


def user_image(url, text="What is this?"):
    return {
        "role": "user",
        "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}],
    }


def refusal(raw: bytes, limits: Limits = Limits()) -> RequestError:
    with pytest.raises(RequestError) as caught:
        parse_chat_request(raw, MODEL, limits)
    error = caught.value
    assert "\n" not in error.message and error.message.strip() == error.message
    assert error.body() == {
        "error": {"message": error.message, "type": "invalid_request_error", "param": error.param, "code": error.code}
    }
    return error


# --- valid requests ---------------------------------------------------------------------------------


def test_a_full_request_becomes_its_record_and_parameters():
    raw = body(
        messages=[
            {"role": "system", "content": "You read receipts."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Total?"},
                    {"type": "image_url", "image_url": {"url": PNG_URL, "detail": "high"}},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "12.50"}]},
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": PNG_URL}, {"type": "text", "text": "And?"}],
            },
        ],
        max_completion_tokens=64,
        temperature=0.5,
        top_p=0.9,
        top_k=-1,
        seed=7,
        stop="END",
        stream=True,
        stream_options={"include_usage": True},
        user="someone",
        frequency_penalty=0,
        presence_penalty=0.0,
        metadata={"k": "v"},
        n=1,
        logprobs=False,
        response_format={"type": "text"},
    )
    expected_record = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "You read receipts."}]},
            {"role": "user", "content": [{"type": "text", "text": "Total?"}, {"type": "image", "image": PNG_URL}]},
            {"role": "assistant", "content": [{"type": "text", "text": "12.50"}]},
            {"role": "user", "content": [{"type": "image", "image": PNG_URL}, {"type": "text", "text": "And?"}]},
        ]
    }
    assert parse_chat_request(raw, MODEL, Limits()) == ChatRequest(
        model=MODEL,
        record=expected_record,
        max_tokens=64,
        temperature=0.5,
        top_p=0.9,
        top_k=0,
        seed=7,
        stop=["END"],
        stream=True,
        include_usage=True,
        images=2,
    )


def test_defaults():
    request = parse_chat_request(body(), MODEL, Limits(max_tokens=300))
    assert request == ChatRequest(
        model=MODEL,
        record={"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        max_tokens=300,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        seed=None,
        stop=[],
        stream=False,
        include_usage=False,
        images=0,
    )
    nulls = {f: None for f in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "n", "tools")}
    assert parse_chat_request(body(**nulls), MODEL, Limits(max_tokens=300)) == request


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"max_tokens": 10, "max_completion_tokens": 10}, {"max_tokens": 10}),
        ({"max_tokens": 1024}, {"max_tokens": 1024}),
        ({"max_tokens": 1}, {"max_tokens": 1}),
        ({"temperature": 0}, {"temperature": 0.0}),
        ({"temperature": 2}, {"temperature": 2.0}),
        ({"top_p": 1}, {"top_p": 1.0}),
        ({"top_k": 20}, {"top_k": 20}),
        ({"seed": -3}, {"seed": -3}),
        ({"stop": ["a", "bc", "\n", "d"]}, {"stop": ["a", "bc", "\n", "d"]}),
        ({"stream": True, "stream_options": {}}, {"stream": True, "include_usage": False}),
        ({"stream": True, "stream_options": None}, {"stream": True, "include_usage": False}),
        ({"tool_choice": "none", "tools": []}, {}),
    ],
)
def test_accepted_values(fields, expected):
    request = parse_chat_request(body(**fields), MODEL, Limits())
    for name, value in expected.items():
        assert getattr(request, name) == value
        assert type(getattr(request, name)) is type(value)


def test_an_image_url_is_kept_in_one_spelling():
    payload = base64.b64encode(PNG).decode()
    raw = body(messages=[user_image("DATA:Image/PNG;BASE64," + payload)])
    request = parse_chat_request(raw, MODEL, Limits())
    assert request.record["messages"][0]["content"][1] == {"type": "image", "image": "data:image/png;base64," + payload}


# --- refusals ---------------------------------------------------------------------------------------

M0 = "messages[0]"
PART = "messages[0].content[0]"
URL = "messages[0].content[1].image_url.url"
TOOL = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
REFUSED = [
    # (fields, status, param)
    ({"model": DROP}, 400, "model"),
    ({"model": 5}, 400, "model"),
    ({"messages": DROP}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": ["hi"]}, 400, M0),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, f"{M0}.role"),
    ({"messages": [{"role": "function", "content": "x"}]}, 400, f"{M0}.role"),
    ({"messages": [{"role": "developer", "content": "x"}]}, 400, f"{M0}.role"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, f"{M0}.role"),
    ({"messages": [{"content": "x"}]}, 400, f"{M0}.role"),
    (
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "system", "content": "b"},
                {"role": "user", "content": "c"},
            ]
        },
        400,
        "messages[1].role",
    ),
    ({"messages": [{"role": "user"}]}, 400, f"{M0}.content"),
    ({"messages": [{"role": "user", "content": None}]}, 400, f"{M0}.content"),
    ({"messages": [{"role": "user", "content": []}]}, 400, f"{M0}.content"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, f"{M0}.content"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, 400, "messages"),
    ({"messages": [{"role": "system", "content": "a"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, 400, PART),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, 400, f"{PART}.type"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]}, 400, f"{PART}.type"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]}, 400, f"{PART}.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": PNG_URL}]}]}, 400, f"{PART}.type"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, 400, f"{PART}.type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, f"{PART}.text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, f"{PART}.text"),
    (
        {
            "messages": [
                {"role": "system", "content": [{"type": "image_url", "image_url": {"url": PNG_URL}}]},
                {"role": "user", "content": "x"},
            ]
        },
        400,
        f"{PART}.type",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": PNG_URL}}]},
                {"role": "user", "content": "y"},
            ]
        },
        400,
        "messages[1].content[0].type",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, f"{PART}.image_url.url"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        f"{PART}.image_url.url",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}]},
        400,
        f"{PART}.image_url.url",
    ),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": -5}, 400, "max_tokens"),
    ({"max_tokens": 1025}, 400, "max_tokens"),
    ({"max_tokens": 10.0}, 400, "max_tokens"),
    ({"max_tokens": True}, 400, "max_tokens"),
    ({"max_tokens": "10"}, 400, "max_tokens"),
    ({"max_completion_tokens": 5000}, 400, "max_completion_tokens"),
    ({"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"max_tokens": 10, "max_completion_tokens": 20}, 400, "max_completion_tokens"),
    ({"temperature": -0.1}, 400, "temperature"),
    ({"temperature": 2.01}, 400, "temperature"),
    ({"temperature": "1"}, 400, "temperature"),
    ({"temperature": True}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"top_p": False}, 400, "top_p"),
    ({"top_k": -2}, 400, "top_k"),
    ({"top_k": 1.5}, 400, "top_k"),
    ({"top_k": True}, 400, "top_k"),
    ({"top_k": "5"}, 400, "top_k"),
    ({"seed": 1.5}, 400, "seed"),
    ({"seed": "7"}, 400, "seed"),
    ({"seed": True}, 400, "seed"),
    ({"seed": 2**64}, 400, "seed"),
    ({"stop": ""}, 400, "stop"),
    ({"stop": ["a", ""]}, 400, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"stop": 5}, 400, "stop"),
    ({"stop": [5]}, 400, "stop"),
    ({"stop": {"a": 1}}, 400, "stop"),
    ({"stream": "yes"}, 400, "stream"),
    ({"stream": 1}, 400, "stream"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"stream": True, "stream_options": 5}, 400, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, 400, "stream_options"),
    ({"n": 2}, 400, "n"),
    ({"n": 0}, 400, "n"),
    ({"n": True}, 400, "n"),
    ({"n": "1"}, 400, "n"),
    ({"logprobs": True}, 400, "logprobs"),
    ({"tools": TOOL}, 400, "tools"),
    ({"tool_choice": "auto"}, 400, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"response_format": "text"}, 400, "response_format"),
    ({"frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"presence_penalty": -1}, 400, "presence_penalty"),
    ({"presence_penalty": "0"}, 400, "presence_penalty"),
    ({"logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"top_logprobs": 3}, 400, "top_logprobs"),
    ({"store": True}, 400, "store"),
    ({"user": 5}, 400, "user"),
]


@pytest.mark.parametrize("fields, status, param", REFUSED)
def test_refused_fields(fields, status, param):
    error = refusal(body(**fields))
    assert (error.status, error.param, error.code) == (status, param, None)
    assert param in error.message


@pytest.mark.parametrize(
    "field, hint",
    [
        ("max_token", "; did you mean 'max_tokens'?"),
        ("temprature", "; did you mean 'temperature'?"),
        ("Stream", "; did you mean 'stream'?"),
        ("guided_json", "; the fields read are model, messages, max_tokens,"),
    ],
)
def test_an_unknown_field_is_refused_by_name_with_the_near_one(field, hint):
    error = refusal(body(**{field: 2}))
    assert (error.status, error.param) == (400, field)
    assert error.message.startswith(f"unknown field {field!r}{hint}"), error.message


def test_neutral_values_of_unsupported_fields_ask_for_nothing():
    neutral = dict(logit_bias={}, top_logprobs=0, store=False, parallel_tool_calls=True, modalities=["text"])
    assert parse_chat_request(body(**neutral), MODEL, Limits()).max_tokens == Limits().max_tokens


@pytest.mark.parametrize("role", ["tool", "function", "developer"])
def test_a_refused_role_is_named(role):
    assert repr(role) in refusal(body(messages=[{"role": role, "content": "x"}])).message


def test_a_request_over_the_limit_asks_for_less():
    error = refusal(body(max_tokens=5000))
    assert error.message == "max_tokens 5000: at most 1024 (the server's --max-tokens)"


def test_an_unknown_model_is_not_found():
    error = refusal(body(model="gpt-4o"))
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
    assert "gpt-4o" in error.message and MODEL in error.message


def test_an_oversized_body():
    raw = body(messages=[{"role": "user", "content": "x" * 200}])
    error = refusal(raw, Limits(max_body_bytes=len(raw) - 1))
    assert (error.status, error.param) == (413, None)
    assert str(len(raw)) in error.message and str(len(raw) - 1) in error.message
    assert "--max-request-bytes" in error.message
    assert parse_chat_request(raw, MODEL, Limits(max_body_bytes=len(raw))).images == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"{'model': 'x'}",
        b"\xff\xfe{}",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "qwen35-tiny", "messages": [], "temperature": NaN}',
        b'{"model": "qwen35-tiny", "messages": [], "temperature": Infinity}',
        b'{"model": "qwen35-tiny", "messages": [], "temperature": -Infinity}',
        b'{"model": "qwen35-tiny", "messages": [], "temperature": 1e400}',
    ],
)
def test_not_json(raw):
    error = refusal(raw)
    assert (error.status, error.param) == (400, None)
    assert error.message.startswith("the body is not JSON")


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"hi"', b"null", b"3"])
def test_not_an_object(raw):
    error = refusal(raw)
    assert (error.status, error.param) == (400, None)
    assert "object" in error.message


# --- images -----------------------------------------------------------------------------------------


def image_refusal(url: str, limits: Limits = Limits()) -> RequestError:
    error = refusal(body(messages=[user_image(url)]), limits)
    assert (error.status, error.param) == (400, URL)
    assert URL in error.message
    return error


@pytest.mark.parametrize(
    "url", ["/etc/passwd", "file:///etc/passwd", "images/cat.png", "~/cat.png", "ftp://host/cat.png", ""]
)
def test_a_local_path_is_never_read(url):
    assert "a local path is never read; send the image as a data: URL" in image_refusal(url).message


def test_a_data_url_that_is_not_an_image_type():
    assert "text/plain" in image_refusal(data_url(b"hello", "text/plain")).message


def test_a_data_url_that_is_not_base64():
    image_refusal("data:image/png;base64,@@not base64@@")
    image_refusal("data:image/png," + PNG.decode("latin-1"))  # raw, not base64
    image_refusal("data:image/png;base64")  # no payload at all


def test_bytes_that_are_not_an_image():
    assert "not an image" in image_refusal(data_url(b"just some text, not pixels")).message
    assert "not an image" in image_refusal(data_url(PNG[:20])).message  # a header cut short


def test_an_image_format_not_read_from_requests():
    ppm = io.BytesIO()
    Image.new("RGB", (4, 4)).save(ppm, format="PPM")
    assert "not an image" in image_refusal(data_url(ppm.getvalue(), "image/x-portable-pixmap")).message


def test_an_image_over_the_pixel_limit():
    error = image_refusal(data_url(png_bytes((20, 20), (1, 2, 3))), Limits(max_image_pixels=100))
    assert "400" in error.message and "100" in error.message and "--max-image-pixels" in error.message
    at_limit = body(messages=[user_image(data_url(png_bytes((10, 10), (1, 2, 3))))])
    assert parse_chat_request(at_limit, MODEL, Limits(max_image_pixels=100)).images == 1


def test_too_many_images():
    limits = Limits(max_images=2)
    two = user_image(PNG_URL)
    two["content"].append({"type": "image_url", "image_url": {"url": PNG_URL}})
    assert parse_chat_request(body(messages=[two]), MODEL, limits).images == 2
    three = {"role": "user", "content": two["content"] + [{"type": "image_url", "image_url": "not even checked"}]}
    error = refusal(body(messages=[three]), limits)
    assert (error.status, error.param) == (400, "messages")
    assert "3" in error.message and "--max-images" in error.message


@pytest.mark.parametrize("url", ["http://example.com/cat.png", "https://example.com/cat.png?x=1"])
def test_remote_images_only_when_allowed(url):
    assert "--allow-remote-media" in image_refusal(url).message
    request = parse_chat_request(body(messages=[user_image(url)]), MODEL, Limits(allow_remote_media=True))
    assert request.record["messages"][0]["content"][1] == {"type": "image", "image": url}
    assert request.images == 1


# --- answer text ------------------------------------------------------------------------------------


def fake_decode(pieces):
    """A decode as the server's: the whole text at once, stripped."""
    return lambda tokens: "".join(pieces[t] for t in tokens).strip()


def stream(answer: AnswerText, tokens) -> list[str]:
    deltas = []
    for token in tokens:
        deltas.append(answer.add(token))
        assert "\ufffd" not in deltas[-1]
        if answer.stopped:
            break
    return deltas


def run_pieces(pieces, stop=()):
    answer = AnswerText(fake_decode(pieces), stop)
    deltas = stream(answer, range(len(pieces)))
    return answer, deltas


@pytest.mark.parametrize(
    "pieces, stop, deltas, text, stopped",
    [
        (["Hello", ",", " ", "world", "!"], (), ["Hello", ",", "", " world", "!"], "Hello, world!", False),
        (["ab", "cE", "ND", "zz"], ["END"], ["ab", "c", ""], "abc", True),  # the stop spans two tokens
        (["a", "bcENDd"], ["END"], ["a", "bc"], "abc", True),
        (["x", "E", "N", "o", "!"], ["END"], ["x", "", "", "ENo", "!"], "xENo!", False),  # a stop's start, then not
        (["z", "a", "b"], ["abc", "bx"], ["z", "", ""], "zab", False),  # held to the end, given by finish
        (["xb", "bz"], ["bb", "a"], ["x", ""], "x", True),  # "b" is held, then is a stop's start
        (["x", "abb"], ["bb", "a"], ["x", ""], "x", True),  # the earliest stop in the text cuts, not the first listed
        ([" ", "Hi", " ", " ", "there"], (), ["", "Hi", "", "", "  there"], "Hi  there", False),
    ],
)
def test_deltas_with_a_fake_decode(pieces, stop, deltas, text, stopped):
    answer, got = run_pieces(pieces, stop)
    assert got == deltas
    assert (answer.text, answer.stopped) == (text, stopped)
    rest = answer.finish()
    assert "".join(got) + rest == text == answer.text
    assert answer.tokens == list(range(len(deltas)))


def test_text_while_held():
    answer = AnswerText(fake_decode(["x", "E", "N"]), ["END"])
    assert [answer.add(t) for t in range(3)] == ["x", "", ""]
    assert answer.text == "xEN"
    assert answer.finish() == "EN"
    assert answer.text == "xEN"


def test_text_that_changes_behind_what_was_sent():
    """A tokenizer's clean-up ("do n't" -> "don't") rewrites sent text: nothing more is sent, and
    finish gives the final text past the length already sent (what a client holds cannot be rewritten)."""
    pieces = ["do", " n", "'t", " go"]
    answer = AnswerText(lambda tokens: "".join(pieces[t] for t in tokens).replace(" n't", "n't"))
    assert [answer.add(t) for t in range(4)] == ["do", " n", "", ""]
    assert answer.finish() == "don't go"[len("do n") :] == "t go"
    assert answer.text == "do nt go"


def test_the_end_of_an_answer():
    answer, _ = run_pieces(["a", "END"], ["END"])
    with pytest.raises(RuntimeError):
        answer.add(0)
    answer.finish()
    with pytest.raises(RuntimeError):
        answer.finish()
    fresh = AnswerText(fake_decode(["a"]))
    fresh.finish()
    with pytest.raises(RuntimeError):
        fresh.add(0)
    with pytest.raises(ValueError):
        AnswerText(fake_decode(["a"]), ["x", ""])


def test_multibyte_characters_with_a_fake_decode():
    pieces = [b"caf", b"\xc3", b"\xa9", b" ", b"\xe6\x97", b"\xa5\xe6\x9c\xac"]  # café 日本, bytes split
    answer = AnswerText(lambda tokens: b"".join(pieces[t] for t in tokens).decode("utf-8", "replace").strip())
    assert stream(answer, range(len(pieces))) == ["caf", "", "é", "", " ", "日本"]
    assert answer.finish() == "" and answer.text == "café 日本"


def test_random_answers_end_at_their_first_stop():
    """Against a reference written from the rule itself: the answer ends at the first token after which
    the decode holds a stop string, cut at its earliest one; no sent text ever holds a stop."""
    alphabet = ["a", "b", "E", "N", "D", " ", "é", "EN", "ba"]
    stops = ["END", "ba", "N D"]
    rng = random.Random(0)
    for _ in range(500):
        pieces = [rng.choice(alphabet) for _ in range(rng.randint(1, 12))]
        decode = fake_decode(pieces)
        expected = (len(pieces), decode(list(range(len(pieces)))), False)  # tokens read, text, stopped
        for k in range(1, len(pieces) + 1):
            full = decode(list(range(k)))
            hits = [full.find(s) for s in stops if s in full]
            if hits:
                expected = (k, full[: min(hits)], True)
                break
        answer = AnswerText(decode, stops)
        sent = ""
        for token in range(len(pieces)):
            sent += answer.add(token)
            assert not any(s in sent for s in stops)
            if answer.stopped:
                break
        assert (len(answer.tokens), answer.text, answer.stopped) == expected
        assert sent + answer.finish() == expected[1] == answer.text


# --- answer text with real tokenizers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    """The tiny processor's tokenizer: one token a character, Qwen's special tokens."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_processor(str(tmp_path_factory.mktemp("processor"))))


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level BPE without merges: one token a UTF-8 byte, so every multi-byte character splits."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def server_decode(tokenizer):
    return lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True).strip()


@pytest.mark.parametrize("name", ["char_tokenizer", "byte_tokenizer"])
@pytest.mark.parametrize(
    "text, stop, expected, stopped",
    [
        ("Hello world. The END is near", (), "Hello world. The END is near", False),
        ("Hello world. The END is near", ["END"], "Hello world. The ", True),
        ("Hello world. The ENd is near", ["END", "nearly"], "Hello world. The ENd is near", False),
        ("Hello world. The END is near", ["is", "The"], "Hello world. ", True),
    ],
)
def test_answers_from_a_tokenizer(request, name, text, stop, expected, stopped):
    tokenizer = request.getfixturevalue(name)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    answer = AnswerText(server_decode(tokenizer), stop)
    deltas = stream(answer, tokens)
    assert answer.stopped == stopped
    if not stopped:
        assert answer.text == tokenizer.decode(tokens, skip_special_tokens=True).strip()
    assert "".join(deltas) + answer.finish() == expected == answer.text


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        ("café 日本 ok", (), "café 日本 ok"),
        ("café 日本 ok", ["本 o"], "café 日"),
        ("naïve 日本語です。", ["す"], "naïve 日本語で"),
        ("é" * 5, ["éé"], ""),
    ],
)
def test_multibyte_characters_split_across_tokens(byte_tokenizer, text, stop, expected):
    tokens = byte_tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) == len(text.encode())  # one token a byte: every non-ASCII character is split
    answer = AnswerText(server_decode(byte_tokenizer), stop)
    deltas = stream(answer, tokens)
    assert "".join(deltas) + answer.finish() == expected == answer.text
    sent = ""
    for delta in deltas:  # every prefix sent reads as whole characters of the answer
        sent += delta
        assert expected.startswith(sent)
