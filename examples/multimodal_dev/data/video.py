"""Videos from files, sampled and resized exactly as Qwen3.5's reference does, decoded with PyAV.

Public API (what a provider calls):

    VideoSettings(fps=2.0, nframes=None, min_frames=4, max_frames=768, min_pixels=None,
                  max_pixels=None, total_pixels=None, patch_size=16)
        .with_overrides(part) -> VideoSettings   a message part's own keys (OVERRIDE_KEYS)
        .from_processor(processor, **fields)     the patch size of a loaded processor
    load_video(path, settings) -> (frames_TCHW uint8, VideoMetadata)
    video_header(path, settings) -> VideoHeader(metadata, size, grid_thw): from the container's
        metadata only (nothing decoded), the same metadata as load_video and the processor's grid
    PROCESSOR_VIDEO_KWARGS: the processor call's ``videos_kwargs`` for these frames, e.g.
        processor(text=..., videos=[frames], video_metadata=[metadata], videos_kwargs=PROCESSOR_VIDEO_KWARGS)
    ``path`` is a file path or a seekable binary file object (a fetched URL's bytes).

The reference is qwen-vl-utils' ``fetch_video``, then the Qwen3-VL processor (Qwen3.5's) with
``do_sample_frames=False, do_resize=False``: the documented Qwen3-VL usage, and what
transformers' ``Qwen3VLVideoProcessor`` calls "the reference implementation". (The processor
alone, sampling with ``do_sample_frames=True``, differs: int(total / video_fps * fps) frames, not
always even, and one pixel budget for the whole clip unless ``cap_pixels_per_frame``.) Steps:
  1. frame count and fps: ``stream.frames`` where the container records it (mp4, gif), else the
     video packets counted by demuxing without decoding (webm and mkv record none), which is
     what torchcodec, qwen-vl-utils' first backend, counts in its default exact mode; fps is
     the stream's average rate, as every backend reports it.
  2. frames: ``sampled_frame_count`` (qwen-vl-utils' ``smart_nframes``: ``fps`` frames a second or
     ``nframes``, within [min_frames, max_frames], a multiple of 2, the temporal patch) at
     ``round(linspace(0, total - 1, n))``, as its readers index.
  3. size: qwen-vl-utils' ``smart_resize`` per frame within ``frame_pixel_budget`` (min_pixels;
     max_pixels capped by the frame's share of total_pixels), then torchvision's bicubic
     antialiased resize of the uint8 frames, as fetch_video.
  4. the processor only normalises, cuts 2x16x16 patches and writes each temporal patch's
     timestamp from the metadata (``frames_indices`` / ``fps``).
Defaults are qwen-vl-utils' constants (the same fps and frame bounds as ``Qwen3VLVideoProcessor``);
its ``MODEL_SEQ_LEN`` environment variable sets the default total_pixels there and so here.
transformers (5.23 here) expands only ``<|video_pad|>``: a template's
``<|vision_start|><|video_pad|><|vision_end|>`` keeps that outer pair around the per-frame
``<t seconds><|vision_start|>...<|vision_end|>`` runs. Not supported: ``video_start`` /
``video_end`` / ``resized_height`` / ``resized_width`` parts, frame lists as videos.

Every failure to read a file is ``BadSample("bad_video", "<path>: <reason>")``; unusable
per-item options are ``BadSample("video_options")``, an aspect ratio over 200 ``"aspect_ratio"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import av
import torch
from qwen_vl_utils import vision_process as qvu

from .sample import BadSample

if TYPE_CHECKING:
    from transformers.video_utils import VideoMetadata

# do_sample_frames: load_video sampled already; do_resize: a second, whole-clip Qwen3-VL
# smart_resize (size.longest_edge over all frames) would shrink the frames again.
PROCESSOR_VIDEO_KWARGS = {"do_sample_frames": False, "do_resize": False}
# A video part's own settings and their largest values: past them a record asks for more frames or
# pixels than any video needs (a frame of 8192 x 8192, 16384 frames, 2^34 pixels in all).
OVERRIDE_LIMITS = {
    "fps": 240,
    "nframes": 1 << 14,
    "min_frames": 1 << 14,
    "max_frames": 1 << 14,
    "min_pixels": 1 << 26,
    "max_pixels": 1 << 26,
    "total_pixels": 1 << 34,
}
OVERRIDE_KEYS = tuple(OVERRIDE_LIMITS)
UNSUPPORTED_KEYS = ("video_start", "video_end", "resized_height", "resized_width")


def _default_patch_size() -> int:
    from transformers import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor.patch_size


@dataclass(frozen=True)
class VideoSettings:
    """How videos are sampled and sized; None pixel fields take qwen-vl-utils' defaults for the
    patch size. ``fps`` and ``nframes`` exclude each other, as in qwen-vl-utils."""

    fps: float | None = qvu.FPS
    nframes: int | None = None
    min_frames: int = qvu.FPS_MIN_FRAMES
    max_frames: int = qvu.FPS_MAX_FRAMES
    min_pixels: int | None = None  # per frame
    max_pixels: int | None = None  # per frame; never above VIDEO_MAX_TOKEN_NUM tokens
    total_pixels: int | None = None  # shared by all sampled frames
    patch_size: int = dataclasses.field(default_factory=_default_patch_size)

    def __post_init__(self):
        if (self.fps is None) == (self.nframes is None):
            raise ValueError(f"VideoSettings needs exactly one of fps ({self.fps}) and nframes ({self.nframes})")

    @classmethod
    def from_processor(cls, processor, **fields) -> "VideoSettings":
        """Settings for a loaded Qwen3-VL-style processor (its video patch size)."""
        video = processor.video_processor
        # qwen-vl-utils fixes the merge and the frame factor at 2: another processor needs another reference
        if video.merge_size != qvu.SPATIAL_MERGE_SIZE or video.temporal_patch_size != qvu.FRAME_FACTOR:
            raise ValueError(
                f"the video processor's merge_size {video.merge_size} / temporal_patch_size "
                f"{video.temporal_patch_size} differ from qwen-vl-utils' {qvu.SPATIAL_MERGE_SIZE} / "
                f"{qvu.FRAME_FACTOR}"
            )
        return cls(patch_size=video.patch_size, **fields)

    def with_overrides(self, part: dict) -> "VideoSettings":
        """These settings with a message part's own keys (``OVERRIDE_KEYS``) laid over them."""
        unsupported = [k for k in UNSUPPORTED_KEYS if k in part]
        if unsupported:
            raise BadSample("video_options", f"video part keys {unsupported} are not supported")
        given = {k: part[k] for k in OVERRIDE_KEYS if part.get(k) is not None}
        if "fps" in given and "nframes" in given:
            raise BadSample("video_options", "a video part gives both fps and nframes; give one")
        for key, value in given.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= OVERRIDE_LIMITS[key]:
                raise BadSample(
                    "video_options",
                    f"video part key {key!r} must be a positive number up to {OVERRIDE_LIMITS[key]}, got {value!r}",
                )
            if key != "fps" and value != int(value):
                raise BadSample("video_options", f"video part key {key!r} must be a whole number, got {value!r}")
            given[key] = float(value) if key == "fps" else int(value)
        if "nframes" in given:
            given["fps"] = None
        elif "fps" in given:
            given["nframes"] = None
        return dataclasses.replace(self, **given)

    @property
    def factor(self) -> int:
        return self.patch_size * qvu.SPATIAL_MERGE_SIZE


@dataclass(frozen=True)
class VideoHeader:
    metadata: VideoMetadata  # equal to what load_video returns
    size: tuple[int, int]  # (height, width) of every sampled frame after the resize
    grid_thw: tuple[int, int, int]  # the processor's video_grid_thw row for these frames


def check_video_flags(args) -> None:
    """The training script's ``--video-*`` flags, one line naming the flags where they cannot hold
    together (each record's own keys are checked when it is read, ``with_overrides``)."""
    import math

    fps, low, high = args.video_fps, args.video_min_frames, args.video_max_frames
    if fps is not None and not (math.isfinite(fps) and 0 < fps <= OVERRIDE_LIMITS["fps"]):
        raise ValueError(f"--video-fps {fps}: expected frames a second above 0, at most {OVERRIDE_LIMITS['fps']}")
    for flag, value in (("--video-min-frames", low), ("--video-max-frames", high)):
        if value is not None and not 0 < value <= OVERRIDE_LIMITS["max_frames"]:
            raise ValueError(f"{flag} {value}: expected a frame count from 1 to {OVERRIDE_LIMITS['max_frames']}")
    low_is, high_is = low if low is not None else qvu.FPS_MIN_FRAMES, high if high is not None else qvu.FPS_MAX_FRAMES
    if low_is > high_is:
        named = lambda flag, value, given: f"{flag} {value}" + ("" if given else " (its default)")  # noqa: E731
        raise ValueError(
            f"{named('--video-min-frames', low_is, low is not None)} is above "
            f"{named('--video-max-frames', high_is, high is not None)} (VIDEO_MAX_FRAMES): no frame count is both"
        )
    small, large = args.video_min_pixels, args.video_max_pixels
    if small is not None and large is not None and small > large:
        raise ValueError(f"--video-min-pixels {small} is above --video-max-pixels {large} (VIDEO_MAX_PIXELS)")


def sampled_frame_count(total_frames: int, video_fps: float, settings: VideoSettings, where: str = "video") -> int:
    """qwen-vl-utils' ``smart_nframes`` (held to it by a test), raising BadSample instead of
    asserting or logging. Its default max_frames is min(FPS_MAX_FRAMES, total); taking
    min(max_frames, total) first gives the same count, floor being monotone."""
    ff = qvu.FRAME_FACTOR
    if settings.nframes is not None:
        n = qvu.round_by_factor(settings.nframes, ff)
    else:
        low = qvu.ceil_by_factor(settings.min_frames, ff)
        high = qvu.floor_by_factor(min(settings.max_frames, total_frames), ff)
        n = qvu.floor_by_factor(min(max(total_frames / video_fps * settings.fps, low), high, total_frames), ff)
    if not ff <= n <= total_frames:
        raise BadSample("bad_video", f"{where}: {total_frames} frames cannot give {n} sampled frames (at least {ff})")
    return n


def frame_indices(total_frames: int, n: int) -> list[int]:
    # float32 as qwen-vl-utils' readers get it from torch's default dtype: rounding depends on it
    return torch.linspace(0, total_frames - 1, n, dtype=torch.float32).round().long().tolist()


def frame_pixel_budget(n_frames: int, settings: VideoSettings, where: str = "video") -> tuple[int, float]:
    """(min, max) pixels a frame, as fetch_video derives them: the max is VIDEO_MAX_TOKEN_NUM
    tokens or the frame's share of total_pixels, never under 1.05 x min, and a part's
    max_pixels can only lower it."""
    f2 = settings.factor**2
    min_pixels = settings.min_pixels if settings.min_pixels is not None else qvu.VIDEO_MIN_TOKEN_NUM * f2
    total = settings.total_pixels if settings.total_pixels is not None else qvu.MODEL_SEQ_LEN * f2 * 0.9
    cap = max(min(qvu.VIDEO_MAX_TOKEN_NUM * f2, total / n_frames * qvu.FRAME_FACTOR), int(min_pixels * 1.05))
    max_pixels = min(settings.max_pixels, cap) if settings.max_pixels is not None else cap
    if max_pixels < min_pixels:
        raise BadSample("video_options", f"{where}: max_pixels {max_pixels} is below min_pixels {min_pixels}")
    return min_pixels, max_pixels


def resized_size(height: int, width: int, n_frames: int, settings: VideoSettings, where: str = "video"):
    """(height, width) of every sampled frame: qwen-vl-utils' smart_resize within the frame budget."""
    budget = frame_pixel_budget(n_frames, settings, where)
    try:
        return qvu.smart_resize(height, width, settings.factor, *budget)
    except ValueError as err:  # qwen-vl-utils refuses an aspect ratio over 200
        raise BadSample("aspect_ratio", f"{where}: {width}x{height}: {err}") from err


def _name(path) -> str:
    if hasattr(path, "read"):
        return str(getattr(path, "name", None) or "<in-memory video>")
    return str(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else repr(path)


@contextlib.contextmanager
def _container(path):
    """The opened file; any failure to read it (missing, empty, not a video, damaged) is
    BadSample("bad_video") naming the file. BadSamples raised inside pass through as they are."""
    name = _name(path)
    try:
        if hasattr(path, "read"):
            path.seek(0)  # read twice: the header, then the frames
        elif os.path.getsize(path) == 0:  # FileNotFoundError for a missing file
            raise BadSample("bad_video", f"{name}: empty file")
        with av.open(path if hasattr(path, "read") else name) as container:
            if not container.streams.video:
                raise BadSample("bad_video", f"{name}: no video stream")
            yield container
    except BadSample:
        raise
    except Exception as err:  # PyAV raises many FFmpegError types, OSError and ValueError
        raise BadSample("bad_video", f"{name}: {type(err).__name__}: {err}") from err


def _header(container, name: str, settings: VideoSettings) -> VideoHeader:
    from transformers.video_utils import VideoMetadata

    stream = container.streams.video[0]
    fps = float(stream.average_rate or stream.guessed_rate or 0)
    if fps <= 0 or not stream.width or not stream.height:
        raise BadSample("bad_video", f"{name}: the stream has no frame rate or frame size")
    # webm / mkv record no frame count: count packets (demuxed, not decoded), as torchcodec's exact scan
    total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
    if stream.duration:
        duration = float(stream.duration * stream.time_base)
    else:
        duration = container.duration / av.time_base if container.duration else total / fps
    n = sampled_frame_count(total, fps, settings, name)
    height, width = resized_size(stream.height, stream.width, n, settings, name)
    metadata = VideoMetadata(
        total_num_frames=total,
        fps=fps,
        width=stream.width,
        height=stream.height,
        duration=duration,
        video_backend="pyav",
        frames_indices=frame_indices(total, n),
    )
    grid = (n // qvu.FRAME_FACTOR, height // settings.patch_size, width // settings.patch_size)
    return VideoHeader(metadata, (height, width), grid)


def video_header(path, settings: VideoSettings) -> VideoHeader:
    """What ``load_video(path, settings)`` will give, from the container's metadata alone.
    ``path``: a file path, or a seekable binary file object (a fetched URL's bytes)."""
    with _container(path) as container:
        return _header(container, _name(path), settings)


def check_video(source, name: str) -> None:
    """``bad_video`` unless ``source`` (a path or a binary file object) holds a video stream whose
    first frame decodes."""
    with _container(source) as container:
        if next(container.decode(video=0), None) is None:
            raise BadSample("bad_video", f"{name}: no frame decodes")


def load_video(path, settings: VideoSettings, header: VideoHeader | None = None):
    """(frames_TCHW uint8 of the sampled frames, resized; their ``VideoMetadata``). Frames are
    decoded in order up to the last sampled one; only sampled frames are converted and resized.
    ``header``: ``video_header(path, settings)`` when the caller has read it already."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as tvF

    header, name = header or video_header(path, settings), _name(path)
    meta = header.metadata
    wanted, frames, decoded = meta.frames_indices, [], 0
    with _container(path) as container:
        for index, frame in enumerate(container.decode(video=0)):
            decoded = index + 1
            if index < wanted[len(frames)]:  # indices rise strictly: n <= total frames
                continue
            # one swscale thread: PyAV keeps its scaler, and a scaler with a slice-thread pool made
            # before a DataLoader forks leaves the worker waiting forever on threads it never had
            rgb_CHW = torch.from_numpy(frame.to_ndarray(format="rgb24", threads=1)).permute(2, 0, 1)
            if tuple(rgb_CHW.shape[1:]) != (meta.height, meta.width):
                raise BadSample(
                    "bad_video",
                    f"{name}: frame {index} is {rgb_CHW.shape[2]}x{rgb_CHW.shape[1]}, "
                    f"the stream {meta.width}x{meta.height}",
                )
            # fetch_video's resize of uint8 frames (its .float() afterwards changes no value)
            frame_CHW = tvF.resize(rgb_CHW, list(header.size), interpolation=InterpolationMode.BICUBIC, antialias=True)
            frames.append(frame_CHW)
            if len(frames) == len(wanted):
                return torch.stack(frames), meta
    raise BadSample("bad_video", f"{name}: {decoded} frames decoded, the container gives {meta.total_num_frames}")
