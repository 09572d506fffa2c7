"""The jsonl provider against the processor and its chat template: every format gives what
qwen_vl_utils + ``apply_chat_template`` + the processor give for the same conversation (ids,
pixels, grids), every assistant turn and nothing else is trained, ``describe`` equals the sample,
and the sources blend, split and read as documented. JSONL files and PIL images are written here;
the processor is the tiny one with a template that behaves as Qwen3.5's."""

import json
import os

import numpy as np
import pytest
import torch
from tiny_processor import CHAT_TEMPLATE, QWEN35_CHAT_TEMPLATE, build_processor, png_bytes

from examples.multimodal_dev.data import get_dataset_provider
from examples.multimodal_dev.data.jsonl import build_datasets
from examples.multimodal_dev.data.jsonl_source import Blend, Records, index_lines, quotas
from examples.multimodal_dev.data.processor import load_processor

BUDGET = {"min_pixels": 32 * 32, "max_pixels": 128 * 128}
IMAGES = {
    "red.png": ((96, 64), (200, 10, 10)),
    "green.png": ((64, 96), (10, 200, 10)),
    "pics/blue.png": ((250, 120), (10, 10, 200)),
}
SYSTEM = "You read pictures."
# One conversation: (role, text with <image> placeholders); images in order red, green.
TURNS = [
    ("system", SYSTEM),
    ("user", "<image>What colour is this?"),
    ("assistant", "Red."),
    ("user", "And this one? <image>"),
    ("assistant", "Green, and taller than wide."),
]
TURN_IMAGES = ["red.png", "green.png"]


def as_placeholder(turns=TURNS, images=TURN_IMAGES):
    return {"messages": [{"role": r, "content": t} for r, t in turns], "images": images}


def as_sharegpt(turns=TURNS, images=TURN_IMAGES):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[r], "value": t} for r, t in turns], "image": images}


def as_parts(turns=TURNS, images=TURN_IMAGES, root=None, **image_options):
    """The transformers / qwen_vl_utils form; with ``root``, absolute paths (the reference's input)."""
    queue, messages = iter(images), []
    for role, text in turns:
        pieces = [p for p in text.replace("<image>", "\0<image>\0").split("\0") if p]
        if "<image>" not in pieces:
            messages.append({"role": role, "content": text})
            continue
        messages.append(
            {
                "role": role,
                "content": [
                    {
                        "type": "image",
                        "image": os.path.join(root, next(queue)) if root else next(queue),
                        **image_options,
                    }
                    if p == "<image>"
                    else {"type": "text", "text": p}
                    for p in pieces
                ],
            }
        )
    return {"messages": messages}


FORMATS = {"placeholder": as_placeholder, "sharegpt": as_sharegpt, "parts": as_parts}


def write_images(folder):
    for name, (size, colour) in IMAGES.items():
        os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
        with open(os.path.join(folder, name), "wb") as f:
            f.write(png_bytes(size, colour))


def write_jsonl(path, records):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    root = tmp_path_factory.mktemp("processors")
    return {
        "qwen35": build_processor(str(root / "qwen35"), chat_template=QWEN35_CHAT_TEMPLATE),
        "plain": build_processor(str(root / "plain"), chat_template=CHAT_TEMPLATE),
    }


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    write_images(str(folder))
    return str(folder)


def train_split(processor_path, data_path, n=None, seq_length=600, **options):
    train, _, _ = build_datasets(
        seq_length=seq_length,
        num_samples=(n or 8, 0, 0),
        data_path=data_path,
        hf_processor_path=processor_path,
        **BUDGET,
        **options,
    )
    return train


def reference(processor, record_parts):
    """What qwen_vl_utils, the chat template and the processor give for a parts-format record."""
    from qwen_vl_utils import process_vision_info

    messages = record_parts["messages"]
    images, _ = process_vision_info(messages, image_patch_size=processor.image_processor.patch_size)
    text = processor.apply_chat_template(messages, tokenize=False)
    return processor(text=[text], images=images, return_tensors="pt")


def trained_runs(sample, tokenizer) -> list[str]:
    """The trained targets, decoded run by run; labels must be the next input token there."""
    mask = sample["loss_mask"] > 0
    assert torch.equal(sample["labels"][:-1][mask[:-1]], sample["input_ids"][1:][mask[:-1]])
    positions = torch.nonzero(mask).flatten().tolist()
    runs, current = [], []
    for p in positions:
        if current and p != current[-1] + 1:
            runs.append(current)
            current = []
        current.append(p)
    runs.append(current)
    return [tokenizer.decode(sample["labels"][r]) for r in runs if r]


def assert_describe_matches(dataset, n):
    """describe(i) == (tokens, grids of the images, then of the videos) of dataset[i]."""
    for i in range(n):
        sample = dataset[i]
        grids = sample["image_grid_thw"].tolist() + sample["video_grid_thw"].tolist()
        assert dataset.describe(i) == (sample["input_ids"].numel(), grids), i


# --- a JSONL video conversation and its reference (shared with test_jsonl_faults / test_video / test_collate)

VIDEO_OPTIONS = dict(video_min_pixels=32 * 32, video_max_pixels=64 * 64)
# A video then an image, in two user turns; the clip is 8 frames at 4 a second: 2 s, so 4 sampled
# frames at qwen-vl-utils' 2 a second, 2 temporal patches.
VIDEO_TURNS = [
    ("user", "<video>What moves?"),
    ("assistant", "A white bar."),
    ("user", "<image>And here?"),
    ("assistant", "Red."),
]


def video_conversation(processor_path, folder):
    """(train split, reference, processor, info) for a JSONL file of two video records: record 0 is
    ``VIDEO_TURNS`` (placeholder format, the video by absolute path), record 1 a parts-format video
    whose own ``nframes`` 8 overrides the flags. The reference is record 0 as
    ``apply_chat_template`` writes it (``<|vision_start|><|video_pad|><|vision_end|>`` as is) through
    the processor with ``PROCESSOR_VIDEO_KWARGS``, for qwen_vl_utils' image and load_video's frames
    (test_video holds those to qwen-vl-utils' fetch_video)."""
    from qwen_vl_utils import process_vision_info
    from tiny_media import write_video

    from examples.multimodal_dev.data.video import PROCESSOR_VIDEO_KWARGS, VideoSettings, load_video

    folder = str(folder)
    write_images(folder)
    clip = write_video(os.path.join(folder, "clip.mp4"), 8, 64, 48, fps=4)
    record = {**as_placeholder(VIDEO_TURNS, ["red.png"]), "videos": [clip]}
    parts = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "video", "video": clip, "nframes": 8}, {"type": "text", "text": "Count."}],
            },
            {"role": "assistant", "content": "Two."},
        ]
    }
    data = write_jsonl(os.path.join(folder, "videos.jsonl"), [record, parts])
    train = train_split(processor_path, data, seq_length=2000, **VIDEO_OPTIONS)
    processor, info = load_processor(processor_path, **BUDGET)
    settings = VideoSettings.from_processor(
        processor, min_pixels=VIDEO_OPTIONS["video_min_pixels"], max_pixels=VIDEO_OPTIONS["video_max_pixels"]
    )
    frames, metadata = load_video(clip, settings)
    messages = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]},
        {"role": "assistant", "content": "A white bar."},
    ]
    messages += as_parts(VIDEO_TURNS[2:], ["red.png"], root=folder, **BUDGET)["messages"]
    images, _ = process_vision_info(messages[2:], image_patch_size=processor.image_processor.patch_size)
    text = processor.apply_chat_template(messages, tokenize=False)
    assert text.count("<|vision_start|><|video_pad|><|vision_end|>") == 1
    expected = processor(
        text=[text],
        images=images,
        videos=[frames],
        video_metadata=[metadata],
        videos_kwargs=dict(PROCESSOR_VIDEO_KWARGS),
        return_tensors="pt",
    )
    return train, expected, processor, info


def hf_rope_positions(input_ids, image_grid_thw, video_grid_thw, tokens):
    """transformers' Qwen3.5 ``get_rope_index`` for one unpadded sample: [3, L]."""
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    model = Qwen3_5Model.__new__(Qwen3_5Model)  # get_rope_index reads only the config
    torch.nn.Module.__init__(model)
    model.config = Qwen3_5Config(
        image_token_id=tokens.image,
        video_token_id=tokens.video,
        vision_start_token_id=tokens.vision_start,
        vision_end_token_id=tokens.vision_end,
    )
    ids = input_ids.reshape(1, -1)
    types = (ids == tokens.image).int() + 2 * (ids == tokens.video).int()
    grids = {
        k: g.clone() if g is not None and g.numel() else None
        for k, g in (("image_grid_thw", image_grid_thw), ("video_grid_thw", video_grid_thw))
    }
    return model.get_rope_index(ids, mm_token_type_ids=types, **grids)[0][:, 0]


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_equals_processor_and_template(name, processors, media, tmp_path):
    """The same conversation in each format: ids, pixels and grids as the processor makes them from
    qwen_vl_utils' images and the template's text; the two answers trained, nothing else."""
    data = write_jsonl(str(tmp_path / "d.jsonl"), [FORMATS[name]()])
    train = train_split(processors["qwen35"], data, media_root=media)
    processor, _ = load_processor(processors["qwen35"], **BUDGET)
    expected = reference(processor, as_parts(root=media, **BUDGET))
    sample = train[0]
    assert torch.equal(sample["input_ids"], expected["input_ids"][0])
    assert torch.equal(sample["pixel_values"], expected["pixel_values"])
    assert torch.equal(sample["image_grid_thw"], expected["image_grid_thw"])
    assert trained_runs(sample, processor.tokenizer) == ["Red.<|im_end|>", "Green, and taller than wide.<|im_end|>"]
    text = processor.tokenizer.decode(sample["input_ids"])
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>")  # the system turn is kept, untrained
    assert sample["loss_mask"].sum() == len("Red.") + len("Green, and taller than wide.") + 2
    assert_describe_matches(train, 1)


def test_why_spans_are_not_found_prefix_by_prefix(processors):
    """Qwen3.5's template writes an earlier answer without the think block it gives the last one:
    a conversation's first turns, rendered alone, are not a prefix of the whole conversation."""
    processor, _ = load_processor(processors["qwen35"])
    messages = [{"role": r, "content": t.replace("<image>", "")} for r, t in TURNS]
    whole = processor.apply_chat_template(messages, tokenize=False)
    first = processor.apply_chat_template(messages[:3], tokenize=False)
    assert not whole.startswith(first) and "<think>" in first


@pytest.mark.parametrize("template", ["qwen35", "plain"])
def test_multi_turn_trains_every_answer(template, processors, media, tmp_path):
    """Three answers, images in two user turns, a text-only user turn: each answer and its
    end-of-turn token trained, under either template; a reasoning trace in the last answer is
    trained with it (the template moves it into the think block)."""
    turns = [
        ("user", "<image>Name the colour."),
        ("assistant", " Red. "),
        ("user", "Bigger?"),
        ("assistant", "It is 96 by 64."),
        ("user", "<image>Now this."),
        ("assistant", "<think>tall, green</think>Green."),
    ]
    data = write_jsonl(str(tmp_path / "d.jsonl"), [as_placeholder(turns, ["red.png", "pics/blue.png"])])
    train = train_split(processors[template], data, media_root=media)
    processor, _ = load_processor(processors[template], **BUDGET)
    expected = reference(processor, as_parts(turns, ["red.png", "pics/blue.png"], root=media, **BUDGET))
    sample = train[0]
    assert torch.equal(sample["input_ids"], expected["input_ids"][0])
    assert torch.equal(sample["image_grid_thw"], expected["image_grid_thw"])
    last = "tall, green\n</think>\n\nGreen." if template == "qwen35" else "<think>tall, green</think>Green."
    first = "Red." if template == "qwen35" else " Red. "  # Qwen3.5 trims what it renders
    assert trained_runs(sample, processor.tokenizer) == [
        f"{first}<|im_end|>",
        "It is 96 by 64.<|im_end|>",
        f"{last}<|im_end|>",
    ]
    assert_describe_matches(train, 1)


def test_a_template_that_repeats_an_answer_is_refused(media, tmp_path, caplog):
    """A template that writes the last answer twice leaves no single place to train: a skip."""
    echo = CHAT_TEMPLATE + (
        "{% if messages[-1]['role'] == 'assistant' %}(echo: {{ messages[-1]['content'] }}){% endif %}"
    )
    processor_path = build_processor(str(tmp_path / "echo"), chat_template=echo)
    good = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
        ]
    }
    data = write_jsonl(str(tmp_path / "d.jsonl"), [as_placeholder(), good])
    train = train_split(processor_path, data, media_root=media)
    processor, _ = load_processor(processor_path)
    assert trained_runs(train[0], processor.tokenizer) == ["Hello<|im_end|>"]
    assert dict(train.skip_counts) == {"template_layout": 1}
    assert f"{data}:1: the chat template does not place assistant turn" in caplog.text


def test_registered_and_text_only_records(processors, tmp_path):
    """``--dataset-provider jsonl`` is registered; a record without media has empty vision fields."""
    assert get_dataset_provider("jsonl") is build_datasets
    data = write_jsonl(
        str(tmp_path / "d.jsonl"),
        [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}],
    )
    sample = train_split(processors["qwen35"], data)[0]
    assert sample["pixel_values"].shape[0] == 0 and sample["image_grid_thw"].shape == (0, 3)
    assert sample["loss_mask"].sum() == 2


def _answers(dataset, n):
    return [dataset.produce(i)["input_ids"] for i in range(n)]


def _text_records(prefix, n):
    return [
        {"messages": [{"role": "user", "content": f"{prefix}{i}?"}, {"role": "assistant", "content": f"{prefix}{i}"}]}
        for i in range(n)
    ]


def test_weights_blend_by_a_documented_interleave(processors, tmp_path):
    a = write_jsonl(str(tmp_path / "a.jsonl"), _text_records("a", 5))
    b = write_jsonl(str(tmp_path / "b.jsonl"), _text_records("b", 2))
    blend = Blend([Records.of([a]), Records.of([b])], [3, 1])
    order = [(os.path.basename(part.files[0])[0], i) for part, i in (blend[j] for j in range(len(blend)))]
    # 3:1 -- a at 1/6, 3/6, 5/6 of each period of 4 rows, b at 1/2 (after a's 3/6: ties go to the earlier source)
    assert order[:8] == [("a", 0), ("a", 1), ("b", 0), ("a", 2), ("a", 3), ("a", 4), ("b", 1), ("a", 0)]
    assert len(blend) == 8  # two periods: every record of a (5) used once; b wraps
    assert quotas([0.75, 0.25]) == [3, 1] and quotas([2, 4]) == [1, 2] and quotas([1, 2.5]) == [2857, 7143]
    # Without weights each record appears once per pass, interleaved by size.
    unweighted = Blend([Records.of([a]), Records.of([b])])
    assert len(unweighted) == 7 and sorted((p.files[0], i) for p, i in (unweighted[j] for j in range(7))) == sorted(
        [(a, i) for i in range(5)] + [(b, i) for i in range(2)]
    )
    # Through the provider: the rows are those records, in that order.
    train = train_split(processors["qwen35"], f"{a}:3,{b}:1", n=8)
    processor, _ = load_processor(processors["qwen35"])
    answers = [trained_runs(train[j], processor.tokenizer)[0] for j in range(8)]
    assert answers == [f"{s}{i}<|im_end|>" for s, i in order]


def test_a_seeded_shuffle_keeps_passes_and_shares_and_repeats_by_index(tmp_path):
    """Shuffled: each pass over a source reads every record once, in an order of its own; each blend
    period keeps its 3:1 shares; the same seed gives the same rows from any index on (every rank, a
    resumed run); another seed, or none (file order), others."""
    a = write_jsonl(str(tmp_path / "a.jsonl"), _text_records("a", 40))
    b = write_jsonl(str(tmp_path / "b.jsonl"), _text_records("b", 8))

    def rows(blend, start, stop):
        return [(os.path.basename(p.files[0])[0], i) for p, i in (blend[j] for j in range(start, stop))]

    single = Blend([Records.of([a])], seed=7)
    first, second = rows(single, 0, 40), rows(single, 40, 80)
    assert sorted(first) == sorted(second) == [("a", i) for i in range(40)]
    assert first != second and first != sorted(first)
    assert rows(Blend([Records.of([a])], seed=7), 55, 80) == rows(single, 55, 80)  # a fresh reader, mid-way
    assert rows(Blend([Records.of([a])], seed=8), 0, 40) != first
    assert rows(Blend([Records.of([a])]), 0, 40) == sorted(first)  # no seed: file order

    blend = Blend([Records.of([a]), Records.of([b])], [3, 1], seed=7)
    periods = [rows(blend, 4 * k, 4 * k + 4) for k in range(20)]
    assert all(sum(s == "a" for s, _ in period) == 3 for period in periods)
    assert len({tuple(s for s, _ in period) for period in periods}) > 1  # the rows of a period are dealt anew
    assert sorted(i for period in periods[:8] for s, i in period if s == "b") == list(range(8))  # b's first pass


def test_folder_and_line_index(processors, tmp_path):
    """A folder is its .jsonl files in sorted order; blank lines, CRLF, a byte-order mark and a
    missing final newline are read as the lines they are, with their line numbers."""
    folder = tmp_path / "chats"
    write_jsonl(str(folder / "b" / "two.jsonl"), _text_records("y", 1))
    first = json.dumps(_text_records("x", 2)[0])
    (folder / "a.jsonl").write_bytes(
        b"\xef\xbb\xbf" + first.encode() + b"\r\n\r\n   \n" + json.dumps(_text_records("x", 2)[1]).encode()
    )
    (folder / "notes.txt").write_text("not data")
    offsets, lines = index_lines(str(folder / "a.jsonl"))
    assert lines.tolist() == [1, 4] and offsets[0] == 0
    train = train_split(processors["qwen35"], str(folder), n=3)
    processor, _ = load_processor(processors["qwen35"])
    assert [trained_runs(train[j], processor.tokenizer)[0] for j in range(3)] == [
        "x0<|im_end|>",
        "x1<|im_end|>",
        "y0<|im_end|>",
    ]
    assert train.produce.rows[1][0].where(1) == (str(folder / "a.jsonl"), 4)


def test_validation_by_path_and_by_fraction(processors, tmp_path):
    train_path = write_jsonl(str(tmp_path / "train.jsonl"), _text_records("t", 10))
    valid_path = write_jsonl(str(tmp_path / "valid.jsonl"), _text_records("v", 3))
    processor, _ = load_processor(processors["qwen35"])

    def answer(ds, j):
        return trained_runs(ds[j], processor.tokenizer)[0].removesuffix("<|im_end|>")

    common = dict(seq_length=300, data_path=train_path, hf_processor_path=processors["qwen35"])
    train, valid, test = build_datasets(num_samples=(10, 3, 2), valid_data_path=valid_path, **common)
    assert test is None and [answer(valid, j) for j in range(3)] == ["v0", "v1", "v2"]
    assert [answer(train, j) for j in range(10)] == [f"t{i}" for i in range(10)]
    # A fifth held out: the last of every five records, and the train split keeps the rest.
    train, valid, _ = build_datasets(num_samples=(8, 2, 0), valid_fraction=0.2, **common)
    assert [answer(valid, j) for j in range(2)] == ["t4", "t9"]
    assert [answer(train, j) for j in range(8)] == [f"t{i}" for i in (0, 1, 2, 3, 5, 6, 7, 8)]
    assert build_datasets(num_samples=(8, 2, 0), **common)[1] is None  # no validation unless asked
    with pytest.raises(ValueError, match=r"--valid-fraction 0.05 of the 10 records .* holds out none"):
        build_datasets(num_samples=(8, 2, 0), valid_fraction=0.05, **common)
    with pytest.raises(ValueError, match="give one"):
        build_datasets(num_samples=(8, 2, 0), valid_fraction=0.2, valid_data_path=valid_path, **common)


def test_describe_matches_the_sample_through_skips_and_truncation(processors, media, tmp_path):
    """Per-image settings, images in several turns, a corrupt image (skipped by both), a record
    cut to the budget after its last image: describe() agrees with the sample at every index.
    (A file whose header reads but whose pixels do not is caught by the sample only: documented.)"""
    records = [
        as_placeholder(),
        as_parts(max_pixels=48 * 48),
        as_sharegpt(TURNS[1:3], ["pics/blue.png"]),
        as_placeholder(TURNS[:3], ["broken.png"]),  # no image header: a skip for both
        as_placeholder(
            [("user", "<image>" + "Long question. " * 4), ("assistant", "Long answer. " * 12)], ["green.png"]
        ),
        as_parts(TURNS[1:3], ["pics/blue.png"], resized_height=64, resized_width=96),
    ]
    with open(os.path.join(media, "broken.png"), "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n not an image")
    data = write_jsonl(str(tmp_path / "d.jsonl"), records)
    for max_pixels in (128 * 128, 64 * 64):
        train, _, _ = build_datasets(
            seq_length=150,
            num_samples=(len(records), 0, 0),
            data_path=data,
            hf_processor_path=processors["qwen35"],
            media_root=media,
            min_pixels=32 * 32,
            max_pixels=max_pixels,
        )
        assert_describe_matches(train, len(records))
        assert train.produce.describe(1)["image_grid_thw"].prod(-1).max() * 16**2 <= 48 * 48
        # resized_height/width are qwen_vl_utils' resize; the image processor's budget still bounds them
        expected = [1, 4, 6] if max_pixels > 64 * 96 else [1, 2, 4]
        assert train.produce.describe(5)["image_grid_thw"].tolist() == [expected]
        assert train[4]["input_ids"].numel() == 150
    assert dict(train.skip_counts) == {"bad_image": 1}  # counted by the sample, not by describe()


def test_packed_equals_padded_on_jsonl_batches(processors, media, tmp_path, mcore):
    """Multi-turn jsonl samples feed the model: a packed micro-batch gives the padded batch's
    per-token loss (1e-5 abs)."""
    from tiny_processor import tiny_shape_for

    from examples.multimodal_dev.data.collate import Collator
    from examples.multimodal_dev.forward_step import batch_loss
    from examples.multimodal_dev.models.qwen35_vl.factory import build_model

    data = write_jsonl(str(tmp_path / "d.jsonl"), [as_placeholder(), _text_records("q", 1)[0]])
    train = train_split(processors["qwen35"], data, media_root=media)
    t = load_processor(processors["qwen35"])[1].tokens
    shape = tiny_shape_for(processors["qwen35"])
    torch.manual_seed(0)
    model = build_model(shape).eval()
    samples = [train[j] for j in range(2)]
    losses = []
    with torch.no_grad():
        for collate in (Collator(t, packed=True, pad_multiple=4), Collator(t, packed=False)):
            loss_sum, n_tokens, _ = batch_loss(model, collate(samples))
            losses.append((loss_sum / n_tokens).item())
            assert int(n_tokens) == int(sum(s["loss_mask"].sum() for s in samples))
    assert abs(losses[0] - losses[1]) < 1e-5 and np.isfinite(losses[0])
