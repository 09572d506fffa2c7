"""The jsonl provider on bad input: every fault is a counted skip whose message names the file and
line, ``--strict-data`` turns the first into one line, remote media are refused unless allowed
(then fetched), and a --data-path that cannot be read is one line naming the flag. Also the
example files under ``data/examples`` (their images and video drawn here) and videos through
``video.py``, against the processor."""

import functools
import http.server
import json
import os
import re
import shutil
import threading

import pytest
import torch
from test_jsonl import (
    BUDGET,
    VIDEO_OPTIONS,
    as_parts,
    as_placeholder,
    assert_describe_matches,
    reference,
    train_split,
    trained_runs,
    video_conversation,
    write_images,
    write_jsonl,
)
from tiny_media import write_example_media
from tiny_processor import QWEN35_CHAT_TEMPLATE, build_processor

from examples.multimodal_dev.data.jsonl import build_datasets
from examples.multimodal_dev.data.jsonl_source import check_data_path
from examples.multimodal_dev.data.processor import load_processor
from examples.multimodal_dev.data.sample import BadSample, DataError

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "multimodal_dev", "data", "examples")
GOOD = as_placeholder([("user", "<image>Colour?"), ("assistant", "Red.")], ["red.png"])


def qa(user, answer, **media):
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}], **media}


# (reason, the bad line as written): each line's fault, in file order
FAULTS = [
    ("missing_image", qa("<image>Colour?", "Red.", images=["nowhere.png"])),
    ("bad_image", qa("<image>Colour?", "Red.", images=["broken.png"])),
    ("placeholder_mismatch", qa("<image><image>Both?", "Red.", images=["red.png"])),
    ("placeholder_mismatch", qa("Colour?", "Red.", images=["red.png"])),
    ("bad_json", '{"messages": [{"role": "user", "content": "Hi"}'),
    ("no_assistant_turn", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("over_budget", qa("Long. " * 40 + "<image>", "Red.", images=["red.png"])),
    ("remote_media", qa("<image>Colour?", "Red.", images=["https://example.com/red.png"])),
    ("bad_role", {"messages": [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "Ok."}]}),
    ("bad_record", {"prompt": "Hi", "response": "Hello"}),
    ("empty_answer", qa("Hi", "   ")),
    ("special_token_in_text", qa("What is <|image_pad|>?", "A token.")),
    (
        "template_error",
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "system", "content": "Late."},
                {"role": "assistant", "content": "Hello"},
            ]
        },
    ),
    ("missing_video", qa("<video>What moves?", "A bar.", videos=["nowhere.mp4"])),
    ("bad_video", qa("<video>What moves?", "A bar.", videos=["broken.mp4"])),
    ("media_in_answer", as_parts([("user", "Draw it."), ("assistant", "Here: <image>")], ["red.png"])),
    ("media_outside_root", qa("<image>Colour?", "Red.", images=["../red.png"])),
    ("media_outside_root", qa("<image>Colour?", "Red.", images=["/etc/hostname"])),
    (
        "bad_record",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": "red.png", "min_pixels": float("inf")}]},
                {"role": "assistant", "content": "Red."},
            ]
        },
    ),
    (
        "bad_record",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": "red.png", "min_pixels": 4e10}]},
                {"role": "assistant", "content": "Red."},
            ]
        },
    ),
    (
        "video_options",
        {
            "messages": [
                {"role": "user", "content": [{"type": "video", "video": "broken.mp4", "total_pixels": 1e300}]},
                {"role": "assistant", "content": "A bar."},
            ]
        },
    ),
    ("bad_json", "[" * 100_000 + "]" * 100_000),
    ("line_too_long", json.dumps(qa("Long? " + "x" * (8 << 20), "Yes."))),
]


@pytest.fixture(scope="module")
def processor_path(tmp_path_factory):
    return build_processor(str(tmp_path_factory.mktemp("processor")), chat_template=QWEN35_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """A JSONL with one fault a line (a blank line between each) and a good record last."""
    folder = tmp_path_factory.mktemp("faults")
    write_images(str(folder))
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not a video")
    lines = []
    for _, record in FAULTS:
        lines += [record, ""]
    return write_jsonl(str(folder / "data.jsonl"), lines + [GOOD])


def test_each_fault_is_a_skip_naming_its_file_and_line(processor_path, faults, caplog):
    train = train_split(processor_path, faults, n=len(FAULTS) + 1, seq_length=120)
    for i, (reason, _) in enumerate(FAULTS):
        with pytest.raises(BadSample) as bad:
            train.produce(i)
        assert bad.value.reason == reason and str(bad.value).startswith(f"{reason}: {faults}:{2 * i + 1}: "), i
        with pytest.raises(BadSample) as planned:
            train.produce.describe(i)
        assert str(planned.value) == str(bad.value), i  # planning skips it with the same message
    # The dataset hands the good record in place of every bad one and logs each skip with its line.
    good = train.produce(len(FAULTS))
    assert torch.equal(train[0]["input_ids"], good["input_ids"])
    assert sum(train.skip_counts.values()) == len(FAULTS)
    assert f"(over_budget: {faults}:13: " in caplog.text and "--seq-length 120" in caplog.text
    refusal = "'https://example.com/red.png' is a URL; pass --allow-remote-media"
    assert f"(remote_media: {faults}:15: {refusal}" in caplog.text


def test_strict_data_stops_at_the_first_bad_record_in_one_line(processor_path, faults):
    train = train_split(processor_path, faults, n=4, seq_length=120, strict_data=True)
    with pytest.raises(DataError) as err:
        train[0]
    assert str(err.value) == (
        f"--data-path {faults!r}: {faults}:1: missing_image: no such image file "
        f"{os.path.join(os.path.dirname(faults), 'nowhere.png')!r} (--strict-data stops at the "
        "first bad record)"
    )
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)


def test_an_all_bad_file_stops_in_one_line(processor_path, tmp_path):
    data = write_jsonl(str(tmp_path / "d.jsonl"), ["not json", qa("Hi", "")])
    train = train_split(processor_path, data, n=2)
    with pytest.raises(
        DataError,
        match=rf"^--data-path '{data}': every one of the 2 rows of jsonl\[train\] was "
        r"skipped \(bad_json=1, empty_answer=1\); check the data and --seq-length$",
    ):
        train[0]


def test_remote_media_are_fetched_only_when_allowed(processor_path, tmp_path):
    """A URL is refused by default; with allow_remote_media it is fetched (a local HTTP server here)
    and gives the sample the file gives."""
    write_images(str(tmp_path))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/red.png"
        data = write_jsonl(str(tmp_path / "d.jsonl"), [qa("<image>Colour?", "Red.", images=[url]), GOOD])
        refused = train_split(processor_path, data)
        with pytest.raises(BadSample, match="remote_media"):
            refused.produce(0)
        fetched = train_split(processor_path, data, allow_remote_media=True)
        assert torch.equal(fetched.produce(0)["pixel_values"], fetched.produce(1)["pixel_values"])
        assert fetched.describe(0) == fetched.describe(1)
        missing = write_jsonl(str(tmp_path / "m.jsonl"), [qa("<image>?", "Red.", images=[url + ".gone"])])
        with pytest.raises(BadSample, match=r"missing_image: .*m.jsonl:1: cannot fetch .*404"):
            train_split(processor_path, missing, allow_remote_media=True).produce(0)
    finally:
        server.shutdown()


def test_media_outside_the_folder_are_read_only_when_allowed(processor_path, tmp_path):
    """A record may name only media inside its JSONL's folder (or --media-root); ``allow_media_anywhere``
    lifts that, and a path that is no regular file (``/dev/zero``) is then a bad image, not a missing one."""
    write_images(str(tmp_path))
    data = write_jsonl(
        str(tmp_path / "sub" / "d.jsonl"),
        [qa("<image>Colour?", "Red.", images=["../red.png"]), qa("<image>Colour?", "Red.", images=["/dev/zero"])],
    )
    with pytest.raises(
        BadSample,
        match=r"media_outside_root: .*d.jsonl:1: '../red.png' lies outside .*sub'.*"
        "--allow-media-anywhere",
    ):
        train_split(processor_path, data).produce(0)
    anywhere = train_split(processor_path, data, allow_media_anywhere=True)
    assert anywhere.produce(0)["pixel_values"].numel()
    with pytest.raises(BadSample, match="bad_image: .*d.jsonl:2: '/dev/zero' is not a regular file"):
        anywhere.produce(1)
    rooted = train_split(processor_path, data, media_root=str(tmp_path / "sub" / ".."))  # "../red.png" now leaves it
    with pytest.raises(BadSample, match="media_outside_root"):
        rooted.produce(0)


def test_a_folder_counts_each_file_once_through_symlinks(tmp_path):
    """Links to the folder itself or its parent (a cycle) are walked once: no file counts twice, and
    the walk ends."""
    data = tmp_path / "data"
    write_jsonl(str(data / "a.jsonl"), [GOOD])
    write_jsonl(str(data / "sub" / "b.jsonl"), [GOOD])
    os.symlink("..", data / "sub" / "up")
    os.symlink(".", data / "here")
    os.symlink(".", data / "again")
    (spec,) = check_data_path(str(data))
    assert [os.path.relpath(f, data) for f in spec.files] == ["a.jsonl", "sub/b.jsonl"]


def test_data_path_errors_are_one_line_naming_the_flag(processor_path, tmp_path):
    good = write_jsonl(str(tmp_path / "good.jsonl"), [GOOD])
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "notes.json").write_text("[]")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    cases = {
        "missing.jsonl": r"^--data-path 'missing.jsonl': 'missing.jsonl': no such file or directory$",
        str(tmp_path / "empty_folder"): r"^--data-path '.*empty_folder': the folder '.*' holds no \.jsonl files$",
        str(tmp_path / "notes.json"): r"^--data-path '.*notes.json': '.*' is not a \.jsonl file",
        f"{good}:0": r"^--data-path '.*good.jsonl:0': the weight of '.*good.jsonl' must be a positive number, got '0'$",
        f"{good}:3,{good}": r"^--data-path '.*': give a weight to every source or to none",
        " ": r"^--data-path is required for --dataset-provider jsonl",
    }
    for value, message in cases.items():
        with pytest.raises(ValueError, match=message):
            check_data_path(value)
        with pytest.raises(ValueError, match=message):
            build_datasets(seq_length=64, num_samples=(1, 0, 0), data_path=value, hf_processor_path=processor_path)
    with pytest.raises(ValueError, match=r"^--eval-data-path 'nope': 'nope': no such file"):
        check_data_path("nope", "--eval-data-path")
    with pytest.raises(
        ValueError,
        match=r"^--data-path '.*blank.jsonl': no records to train on \(every line is "
        r"blank\)$",
    ):
        build_datasets(
            seq_length=64,
            num_samples=(1, 0, 0),
            data_path=str(tmp_path / "blank.jsonl"),
            hf_processor_path=processor_path,
        )
    with pytest.raises(ValueError, match=r"^--media-root 'no/such/dir': no such directory$"):
        build_datasets(
            seq_length=64,
            num_samples=(1, 0, 0),
            data_path=good,
            hf_processor_path=processor_path,
            media_root="no/such/dir",
        )
    assert [s.weight for s in check_data_path(f"{good}:3,{good}:0.5")] == [3.0, 0.5]


@pytest.mark.parametrize(
    "option, value",
    [("video_fps", 0.0), ("video_max_frames", -2), ("video_min_pixels", 0), ("video_total_pixels", 1e300)],
)
def test_a_video_flag_that_cannot_work_is_one_line_naming_it(processor_path, tmp_path, option, value):
    good = write_jsonl(str(tmp_path / "good.jsonl"), [GOOD])
    flag = "--" + option.replace("_", "-")
    with pytest.raises(DataError, match=rf"^{flag} {re.escape(str(value))}: must be a positive number up to \d+$"):
        train_split(processor_path, good, **{option: value})


# --- videos (data/video.py) and the example files -------------------------------------------


def test_videos_equal_apply_chat_template_and_the_processor(processor_path, tmp_path, caplog):
    """A video (absolute path) and an image in a multi-turn conversation: ids, pixels and grids
    exactly as ``apply_chat_template`` + the processor give them for load_video's frames, the
    template's vision_start / vision_end pair kept around the per-frame runs (transformers 5.x);
    a part's nframes overrides the flags; describe() reads the container's header only; no
    transformers notice is logged for the video processor call."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()  # a notice already logged in this process would hide a new one
    with caplog.at_level(logging.WARNING):
        hf_logging.enable_propagation()
        try:
            train, expected, processor, info = video_conversation(processor_path, tmp_path)
            caplog.clear()  # the reference's own call (PROCESSOR_VIDEO_KWARGS alone) may log it
            hf_logging.warning_once.cache_clear()
            train.produce(0)  # made now, whatever the dataset holds
            notices = [r.getMessage() for r in caplog.records if "cap_pixels_per_frame" in r.getMessage()]
        finally:
            hf_logging.disable_propagation()
    assert not notices, notices
    sample = train[0]
    assert torch.equal(sample["input_ids"], expected["input_ids"][0])
    for field in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        assert torch.equal(sample[field], expected[field]), field
    t = info.tokens
    patches = int(sample["video_grid_thw"][0, 0])  # temporal patches: 2 s at 2 frames a second, 2 frames a patch
    # a vision_start per frame, the template's one around the video, and the image's
    assert patches == 2 and int((sample["input_ids"] == t.vision_start).sum()) == patches + 2
    ids = sample["input_ids"].tolist()
    outer = ids.index(t.vision_start)
    assert ids[outer + 1] != t.vision_start and ids[outer + 1] not in t.vision_ids  # a timestamp follows it
    assert int((sample["input_ids"] == t.vision_end).sum()) == patches + 2
    assert trained_runs(sample, processor.tokenizer) == ["A white bar.<|im_end|>", "Red.<|im_end|>"]
    assert train.produce(1)["video_grid_thw"][0, 0] == 4  # the part's nframes 8: four temporal patches
    assert_describe_matches(train, 2)


def test_a_video_over_the_budget_is_skipped_from_its_header(processor_path, tmp_path, monkeypatch):
    """The header counts the video's tokens: over --seq-length, it is skipped without a frame decoded."""
    from examples.multimodal_dev.data import video

    video_conversation(processor_path, tmp_path)  # writes the clip and videos.jsonl
    train = train_split(processor_path, str(tmp_path / "videos.jsonl"), seq_length=6, **VIDEO_OPTIONS)
    decoded = []
    monkeypatch.setattr(video, "load_video", lambda *a: decoded.append(a))
    with pytest.raises(
        BadSample,
        match=r"over_budget: .*videos.jsonl:1: its videos alone are \d+ tokens > "
        "--seq-length 6",
    ):
        train.produce(0)
    assert not decoded


def test_the_video_processor_notice_is_silenced_by_the_call_not_globally(processor_path, caplog):
    """The notice exists (PROCESSOR_VIDEO_KWARGS alone logs it, so the test above can fail) and the
    provider's ``videos_kwargs`` avoid it without touching the processor or the logger."""
    import logging

    from transformers.utils import logging as hf_logging
    from transformers.video_utils import VideoMetadata

    from examples.multimodal_dev.data.jsonl_media import VideoOptions
    from examples.multimodal_dev.data.video import PROCESSOR_VIDEO_KWARGS

    processor, _ = load_processor(processor_path, **BUDGET)
    frames = torch.zeros(4, 3, 64, 64, dtype=torch.uint8)
    metadata = VideoMetadata(total_num_frames=4, fps=2.0, frames_indices=[0, 1, 2, 3])
    logged = {}
    hf_logging.enable_propagation()
    try:
        for name, kwargs in (("bare", PROCESSOR_VIDEO_KWARGS), ("provider", VideoOptions(processor).call_kwargs)):
            hf_logging.warning_once.cache_clear()
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                out = processor(
                    text=["<|video_pad|>"],
                    videos=[frames],
                    video_metadata=[metadata],
                    videos_kwargs=dict(kwargs),
                    return_tensors="pt",
                )
            logged[name] = (any("cap_pixels_per_frame" in r.getMessage() for r in caplog.records), out["input_ids"])
    finally:
        hf_logging.disable_propagation()
    assert logged["bare"][0] and not logged["provider"][0]
    assert torch.equal(logged["bare"][1], logged["provider"][1])
    assert processor.video_processor.cap_pixels_per_frame is None  # the processor is left as loaded


@pytest.mark.parametrize("name", ["messages", "sharegpt", "parts"])
def test_example_files_load(name, processor_path, tmp_path):
    """Every line of each example file is a trainable conversation; describe() agrees."""
    folder = str(tmp_path / "examples")
    shutil.copytree(EXAMPLES, folder)
    write_example_media(folder)
    path = os.path.join(folder, f"{name}.jsonl")
    with open(path) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 10
    train = train_split(processor_path, path, n=10, seq_length=1024, **VIDEO_OPTIONS)
    for i in range(10):
        sample = train[i]
        assert sample["loss_mask"].sum() > 0
    assert not train.skip_counts
    assert_describe_matches(train, 10)
    processor, _ = load_processor(processor_path, **BUDGET)
    first = reference(
        processor,
        as_parts(
            [("user", "<image>What shape is this?"), ("assistant", "A red circle.")],
            ["images/red_circle.png"],
            root=folder,
            **BUDGET,
        ),
    )
    if name != "sharegpt":  # the first record of both is this conversation
        assert torch.equal(train[0]["input_ids"], first["input_ids"][0])


def test_a_symlink_cannot_lead_media_out_of_the_folder(tmp_path):
    """``images/x.png -> a host file`` inside a downloaded dataset passes the check as written; where
    it leads is checked too, as ``..`` is: a link (to a file, or a folder on the way) out of the
    folder or ``--media-root`` is refused, one that stays inside is followed, and a Hugging Face
    cache's snapshot links into its repository's ``blobs`` still work."""
    from examples.multimodal_dev.data.jsonl_media import MediaAccess

    secret = tmp_path / "home" / "id_rsa"
    secret.parent.mkdir()
    secret.write_bytes(b"key")
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    (data / "images" / "real.png").write_bytes(b"png")
    os.symlink(secret, data / "images" / "x.png")
    os.symlink("real.png", data / "images" / "inside.png")
    os.symlink(secret.parent, data / "elsewhere")
    access = MediaAccess()
    for ref in ("images/x.png", "elsewhere/id_rsa", str(data / "images" / "x.png")):
        with pytest.raises(BadSample, match=rf"media_outside_root: .* is a symlink to '{secret}', outside '{data}'"):
            access.locate(ref, str(data))
    with pytest.raises(BadSample, match="is a symlink to"):
        MediaAccess(media_root=str(data)).locate("images/x.png", str(tmp_path))
    assert access.locate("images/inside.png", str(data)) == str(data / "images" / "inside.png")
    assert MediaAccess(anywhere=True).locate("images/x.png", str(data)) == str(data / "images" / "x.png")

    # the Hugging Face cache: REPO/snapshots/REV/FILE -> ../../blobs/HASH
    repo = tmp_path / "hub" / "datasets--user--set"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    (snapshot / "images").mkdir(parents=True)
    (repo / "blobs" / "f00d").write_bytes(b"png")
    os.symlink("../../../blobs/f00d", snapshot / "images" / "a.png")
    os.symlink(secret, repo / "blobs" / "bad")  # a blob that leads out of the repository
    os.symlink("../../../blobs/bad", snapshot / "images" / "b.png")
    assert access.locate("images/a.png", str(snapshot)) == str(snapshot / "images" / "a.png")
    with pytest.raises(BadSample, match=f"is a symlink to '{secret}'"):
        access.locate("images/b.png", str(snapshot))
