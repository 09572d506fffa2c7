"""Videos read from files (``data/video.py``) against Qwen3.5's reference, file by file.

The reference is qwen-vl-utils' ``fetch_video`` (sampling, per-frame pixel budget, resize,
metadata) followed by the Qwen3-VL processor with ``do_sample_frames=False, do_resize=False``.
qwen-vl-utils cannot read a file on this machine by itself: torchcodec and decord are not
installed, and its last backend, ``torchvision.io.read_video``, is gone from torchvision 0.26 on.
That backend was PyAV underneath, so the reference runs qwen-vl-utils' own torchvision reader
with only ``read_video`` replaced by a PyAV decode of every frame in its output layout
(``tiny_media.decode_all_tchw``); everything after it is qwen-vl-utils' and the processor's code.

Compared for each container (mp4 h264 and mpeg4, webm vp8 and vp9, mkv, gif) and for per-item
overrides: input_ids of ``<|vision_start|><|video_pad|><|vision_end|>`` expanded with per-frame
timestamps, video_grid_thw, pixel_values_videos (exactly: the same uint8 frames go through the
same resize and normalisation) and MRoPE positions (ours vs transformers' Qwen3.5
``get_rope_index``); ``video_header`` against ``load_video`` and the processor. Both sides turn a
decoded frame into RGB with PyAV's ``to_ndarray("rgb24")``, so that step is shared, not tested:
the pixels check the sampled indices, the target size and the resize.

A sample made by the JSONL provider (a video then an image, the chat template's pair kept around
the video's frames) has transformers' ``get_rope_index`` positions, and ``validate_sample`` takes
a video with or without that pair and refuses any other vision_start count.
"""

import io
import logging

import pytest
import torch
from qwen_vl_utils import vision_process as qvu
from tiny_media import decode_all_tchw, write_video
from tiny_processor import QWEN35_CHAT_TEMPLATE, SPECIALS, build_processor

from examples.multimodal_dev.data.sample import BadSample, validate_sample
from examples.multimodal_dev.data.video import (
    PROCESSOR_VIDEO_KWARGS,
    VideoSettings,
    load_video,
    sampled_frame_count,
    video_header,
)
from examples.multimodal_dev.models.qwen35_vl.mrope import run_grids, sample_position_ids, split_video_frames

PROMPT = "<|vision_start|><|video_pad|><|vision_end|>"
START, END, IMG, VID = (
    SPECIALS.index(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
)
# (file name, frames, width, height, fps, encoder): 12-40 frames, 64x48 .. 200x120
CLIPS = [
    ("h264.mp4", 25, 64, 48, 10, None),
    ("mpeg4.mp4", 13, 96, 64, 24, "mpeg4"),
    ("vp8.webm", 40, 96, 64, 12, "libvpx"),
    ("vp9.webm", 20, 80, 48, 12, "libvpx-vp9"),
    ("h264.mkv", 31, 200, 120, 8, None),
    ("anim.gif", 16, 64, 48, 10, None),
]
SMALL = {"min_pixels": 32 * 32 * 4, "max_pixels": 32 * 32 * 16}  # keeps frames small where size is not the point


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(build_processor(str(tmp_path_factory.mktemp("processor"))))
    processor.video_processor.cap_pixels_per_frame = False  # unused with do_resize=False; silences its notice
    return processor


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clips")
    return {name: write_video(str(folder / name), n, w, h, fps, codec) for name, n, w, h, fps, codec in CLIPS}


@pytest.fixture
def reference_reader(monkeypatch):
    """qwen-vl-utils' torchvision backend, its removed ``read_video`` replaced by PyAV."""

    def read_video(path, start_pts=0.0, end_pts=None, pts_unit="sec", output_format="TCHW"):
        assert start_pts == 0.0 and end_pts is None and output_format == "TCHW"
        frames, fps = decode_all_tchw(path)
        return frames, torch.zeros(1, 0), {"video_fps": fps}

    monkeypatch.setattr(qvu.io, "read_video", read_video, raising=False)
    monkeypatch.setattr(qvu, "get_video_reader_backend", lambda: "torchvision")


def _encode(processor, frames, metadata):
    return processor(
        text=[PROMPT],
        videos=[frames],
        video_metadata=[metadata],
        return_tensors="pt",
        videos_kwargs=dict(PROCESSOR_VIDEO_KWARGS),
    )


def _reference(processor, path, part):
    video, metadata = qvu.fetch_video(
        {"type": "video", "video": path, **part}, image_patch_size=16, return_video_metadata=True
    )
    return _encode(processor, video, metadata)


def _ours(processor, path, part):
    settings = VideoSettings.from_processor(processor).with_overrides(part)
    frames, metadata = load_video(path, settings)
    assert frames.dtype == torch.uint8 and frames.dim() == 4
    return _encode(processor, frames, metadata), video_header(path, settings), metadata


def _hf_positions(enc):
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    model = Qwen3_5Model.__new__(Qwen3_5Model)  # get_rope_index reads only the config
    torch.nn.Module.__init__(model)
    model.config = Qwen3_5Config(
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=START, vision_end_token_id=END
    )
    return model.get_rope_index(
        enc["input_ids"], mm_token_type_ids=enc["mm_token_type_ids"], video_grid_thw=enc["video_grid_thw"].clone()
    )[0][:, 0]


def _compare(processor, path, part):
    """Figures of ours vs the reference; asserts exact equality of everything."""
    ref = _reference(processor, path, part)
    ours, header, metadata = _ours(processor, path, part)
    assert torch.equal(ours["input_ids"], ref["input_ids"])
    assert torch.equal(ours["video_grid_thw"], ref["video_grid_thw"])
    diff = (ours["pixel_values_videos"] - ref["pixel_values_videos"]).abs().max().item()
    assert ours["pixel_values_videos"].shape == ref["pixel_values_videos"].shape and diff == 0.0
    positions = sample_position_ids(ours["input_ids"][0], split_video_frames(ours["video_grid_thw"]), (IMG, VID), 2)
    assert torch.equal(positions, _hf_positions(ref))
    # the header: same metadata and grid without decoding, and the same text through the processor
    assert header.metadata == metadata and list(header.grid_thw) == ref["video_grid_thw"][0].tolist()
    expanded = processor.replace_video_token(
        {"video_grid_thw": [torch.tensor(header.grid_thw)], "video_metadata": [header.metadata]}, 0
    )
    ids = processor.tokenizer(PROMPT.replace("<|video_pad|>", expanded), return_tensors="pt").input_ids
    assert torch.equal(ids, ref["input_ids"])
    return {
        "grid": tuple(header.grid_thw),
        "frames": metadata.frames_indices,
        "tokens": ref["input_ids"].shape[1],
        "vision_starts": int((ref["input_ids"] == START).sum()),
        "pixel_max_abs_diff": diff,
    }


def test_defaults_are_qwen_vl_utils_and_the_video_processors():
    from transformers import Qwen3VLVideoProcessor as P

    s = VideoSettings()
    assert (s.fps, s.nframes, s.min_frames, s.max_frames) == (qvu.FPS, None, qvu.FPS_MIN_FRAMES, qvu.FPS_MAX_FRAMES)
    assert (s.fps, s.min_frames, s.max_frames, s.patch_size) == (P.fps, P.min_frames, P.max_frames, P.patch_size)


@pytest.mark.parametrize("name", [c[0] for c in CLIPS])
def test_container_matches_reference(processor, clips, reference_reader, name):
    import av

    with av.open(clips[name]) as container:
        recorded = container.streams.video[0].frames
    figures = _compare(processor, clips[name], {})
    print(f"{name}: container frame count {recorded or 'absent (packets counted)'}, {figures}")
    assert figures["grid"][0] >= 2 and len(set(figures["frames"])) == len(figures["frames"])
    # transformers keeps the prompt's own vision_start / vision_end around the per-frame runs
    assert figures["vision_starts"] == figures["grid"][0] + 1
    if name.endswith((".webm", ".mkv")):
        assert recorded == 0  # so the packet count, not the container's figure, was compared


@pytest.mark.parametrize(
    "part",
    [
        {"fps": 4},
        {"fps": 0.5},
        {"nframes": 10},
        {"nframes": 7},
        {"max_frames": 4},
        {"min_frames": 9},
        SMALL,
        {"min_pixels": 32 * 32, "max_pixels": 32 * 32 * 2},
        {"min_pixels": 32 * 32, "total_pixels": 32 * 32 * 6},
        {**SMALL, "max_pixels": 32 * 32 * 6, "fps": 3},
    ],
)
def test_overrides_match_reference(processor, clips, reference_reader, part):
    path = clips["vp8.webm"]
    figures = _compare(processor, path, part)
    default = video_header(path, VideoSettings())
    print(f"{part}: {figures}; default grid {default.grid_thw}")
    # each override changes the frames or their size
    assert (figures["grid"], figures["frames"]) != (default.grid_thw, default.metadata.frames_indices)


def test_frame_count_is_smart_nframes(caplog):
    caplog.set_level(logging.ERROR, logger=qvu.__name__)  # it warns when fps asks for more frames than exist
    parts = [
        {},
        {"fps": 0.5},
        {"fps": 5.0},
        {"fps": 30.0},
        {"nframes": 3},
        {"nframes": 8},
        {"min_frames": 7},
        {"max_frames": 5},
        {"min_frames": 10, "max_frames": 6},
        {"fps": 1.0, "max_frames": 9},
    ]
    checked = 0
    for total in [*range(1, 50), 97, 300, 1001, 5000]:
        for video_fps in (1.0, 7.5, 10.0, 24.0, 29.97, 60.0):
            for part in parts:
                try:
                    expected = qvu.smart_nframes(dict(part), total_frames=total, video_fps=video_fps)
                except ValueError:
                    expected = None
                try:
                    got = sampled_frame_count(total, video_fps, VideoSettings().with_overrides(part))
                except BadSample as err:
                    assert err.reason == "bad_video"
                    got = None
                assert got == expected, (total, video_fps, part)
                checked += 1
    assert checked > 3000


def test_bad_files_are_bad_samples(tmp_path, clips):
    truncated = tmp_path / "truncated.mp4"
    data = open(clips["h264.mp4"], "rb").read()
    truncated.write_bytes(data[: len(data) // 2])
    text = tmp_path / "notes.mp4"
    text.write_text("not a video at all\n" * 20)
    empty = tmp_path / "empty.webm"
    empty.write_bytes(b"")
    for path in (str(tmp_path / "missing.mp4"), str(empty), str(truncated), str(text), io.BytesIO(b""), None):
        for read in (video_header, load_video):
            with pytest.raises(BadSample) as err:
                read(path, VideoSettings())
            name = "<in-memory video>" if isinstance(path, io.BytesIO) else str(path)
            assert err.value.reason == "bad_video" and f": {name}: " in str(err.value), str(err.value)


def test_file_objects_read_as_paths(clips):
    settings = VideoSettings(**SMALL)
    frames, metadata = load_video(clips["h264.mkv"], settings)
    with open(clips["h264.mkv"], "rb") as f:
        buffer = io.BytesIO(f.read())
    header = video_header(buffer, settings)
    again, again_meta = load_video(buffer, settings)  # after the header has read the buffer
    assert torch.equal(frames, again) and metadata == again_meta == header.metadata


def test_options_are_checked(clips, tmp_path):
    s = VideoSettings()
    assert s.with_overrides({"nframes": 8}).fps is None and s.with_overrides({"fps": 1}).nframes is None
    assert s.with_overrides({"type": "video", "video": "a.mp4"}) == s
    for part in (
        {"fps": 1, "nframes": 4},
        {"fps": -1},
        {"nframes": 2.5},
        {"max_pixels": "many"},
        {"video_start": 1.0},
        {"resized_height": 64, "resized_width": 64},
    ):
        with pytest.raises(BadSample) as err:
            s.with_overrides(part)
        assert err.value.reason == "video_options", part
    with pytest.raises(ValueError):
        VideoSettings(fps=2.0, nframes=4)
    # options that only a file can refute: a budget below its floor, too many frames, a 201:1 frame
    thin = write_video(str(tmp_path / "thin.gif"), 6, 402, 2)
    for path, part, reason in (
        (clips["h264.mp4"], {"min_pixels": 5000, "max_pixels": 1000}, "video_options"),
        (clips["h264.mp4"], {"nframes": 40}, "bad_video"),
        (thin, {}, "aspect_ratio"),
    ):
        with pytest.raises(BadSample) as err:
            video_header(path, s.with_overrides(part))
        assert err.value.reason == reason and path in str(err.value), str(err.value)


@pytest.fixture(scope="module")
def jsonl_video(tmp_path_factory):
    from test_jsonl import video_conversation

    path = build_processor(str(tmp_path_factory.mktemp("qwen35")), chat_template=QWEN35_CHAT_TEMPLATE)
    return video_conversation(path, tmp_path_factory.mktemp("jsonl_video"))


def test_jsonl_video_sample_positions_are_get_rope_index(jsonl_video):
    """MRoPE of the provider's sample (video frames inside the template's outer pair, then an
    image): ours, from the runs' grids as the collate finds them, equal transformers' positions."""
    from test_jsonl import hf_rope_positions

    train, expected, _, info = jsonl_video
    t = info.tokens
    for index in range(2):
        sample = train[index]
        ids = sample["input_ids"]
        grids, n_img, n_frames = run_grids(
            ids, sample["image_grid_thw"], split_video_frames(sample["video_grid_thw"]), t.image, t.video
        )
        assert (n_img, n_frames) == (sample["image_grid_thw"].shape[0], int(sample["video_grid_thw"][:, 0].sum()))
        ours = sample_position_ids(ids, grids, t.vision_ids, t.spatial_merge)
        reference = hf_rope_positions(ids, sample["image_grid_thw"], sample["video_grid_thw"], t)
        assert torch.equal(ours, reference), index
    # record 0 is the reference's ids, so these are the positions transformers gives the reference
    assert torch.equal(train[0]["input_ids"], expected["input_ids"][0])
    assert int((train[0]["input_ids"] == t.vision_start).sum()) == int(expected["video_grid_thw"][0, 0]) + 2


def test_validate_sample_takes_a_video_with_or_without_its_enclosing_pair(jsonl_video):
    """transformers 5.x keeps the template's vision_start / vision_end around a video's frames;
    4.57 and the mock write none. Both are valid samples; one vision_start more or less is not."""
    train, _, _, info = jsonl_video
    t = info.tokens
    sample = train[0]  # one video (2 frames), one image: vision_start 2 + 1 + the video's pair
    ids = sample["input_ids"]
    outer = int(torch.nonzero(ids == t.vision_start)[0])
    text_token = int(ids[outer - 1])  # the newline before it: any text token will do
    assert text_token not in (t.vision_start, t.vision_end, *t.vision_ids)

    def with_ids(new_ids):
        return {**sample, "input_ids": new_ids}

    validate_sample(sample, t)  # with the pair: 4 vision_starts
    without = ids.clone()
    without[outer] = text_token  # the pair's vision_start gone: one per image and frame, 3
    validate_sample(with_ids(without), t)
    extra = ids.clone()
    extra[outer - 1] = t.vision_start  # a second enclosing start for one video: 5
    too_few = without.clone()
    too_few[int(torch.nonzero(too_few == t.vision_start)[0])] = text_token  # a frame without its start: 2
    for bad, count in ((extra, 5), (too_few, 2)):
        with pytest.raises(ValueError, match=f"has {count} vision_start tokens for 1 images and 2 video frames"):
            validate_sample(with_ids(bad), t)
    # without a video no extra vision_start is allowed
    image_only = {
        **sample,
        "pixel_values_videos": sample["pixel_values_videos"][:0],
        "video_grid_thw": sample["video_grid_thw"][:0],
        "input_ids": torch.where(ids == t.video, text_token, without),
    }
    n_starts = int((image_only["input_ids"] == t.vision_start).sum())
    assert n_starts == 3  # the image's and the two frames' (now text runs): 2 more than one image allows
    with pytest.raises(ValueError, match="has 3 vision_start tokens for 1 images and 0 video frames: expected 1$"):
        validate_sample(image_only, t)


class _Decoding(torch.utils.data.Dataset):
    def __init__(self, path):
        self.path = path

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return load_video(self.path, VideoSettings())[0].shape[0]


def test_a_loader_worker_decodes_after_its_parent_did(tmp_path):
    """PyAV keeps its frame scaler; one with a slice-thread pool, made when the parent process
    decoded (a run with --num-workers 0 for one split, a benchmark), left a forked DataLoader
    worker waiting forever on threads it never had. Decoding uses one scaler thread."""
    path = write_video(str(tmp_path / "clip.mp4"), 24, 640, 360, fps=24)
    assert load_video(path, VideoSettings())[0].shape[0] > 0
    loader = torch.utils.data.DataLoader(_Decoding(path), batch_size=1, num_workers=1, timeout=20)
    assert next(iter(loader)).item() > 0  # a RuntimeError "timed out" before the fix


@pytest.mark.parametrize(
    "flags, said",
    [
        (dict(video_min_frames=10, video_max_frames=4), "--video-min-frames 10 is above --video-max-frames 4 (VIDEO"),
        (dict(video_max_frames=2), "--video-min-frames 4 (its default) is above --video-max-frames 2 (VIDEO"),
        (dict(video_min_frames=1000), "--video-min-frames 1000 is above --video-max-frames 768 (its default)"),
        (dict(video_fps=float("inf")), "--video-fps inf: expected frames a second above 0, at most 240"),
        (dict(video_min_frames=0), "--video-min-frames 0: expected a frame count from 1 to 16384"),
        (dict(video_min_pixels=10, video_max_pixels=5), "--video-min-pixels 10 is above --video-max-pixels 5"),
    ],
)
def test_video_flags_that_cannot_hold_together_are_refused_by_name(flags, said):
    from types import SimpleNamespace

    from examples.multimodal_dev.data.video import check_video_flags

    unset = dict.fromkeys(("video_fps", "video_min_frames", "video_max_frames", "video_min_pixels", "video_max_pixels"))
    with pytest.raises(ValueError) as refused:
        check_video_flags(SimpleNamespace(**{**unset, **flags}))
    assert str(refused.value).startswith(said), str(refused.value)
    check_video_flags(SimpleNamespace(**unset))  # the defaults hold together
