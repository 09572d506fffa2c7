"""The images and videos a record names: where a reference points, opening an image (decoded, for
the sample) or reading only its header (for ``describe``), and an image's patch grid.

A reference is a path relative to the JSONL file's folder (or to ``media_root`` when given), an
absolute or ``file://`` path, a ``data:`` URI, or an http(s) URL. A dataset is data, so what it
may reach is bounded (``MediaAccess``): a path must lie inside that folder, as written (``..``
resolved) and where its symlinks lead (a Hugging Face snapshot's links into its repository's
``blobs`` are followed; a link out of the folder is refused, as ``..`` is) unless
``anywhere`` (``--allow-media-anywhere``), and a URL is refused unless ``allow_remote``
(``--allow-remote-media``): a run should not depend on hosts it cannot see.

Sizing follows Qwen's two resizes, as ``cord_v2`` does: qwen_vl_utils' ``fetch_image`` with the
part's own ``min_pixels`` / ``max_pixels`` / ``resized_height`` + ``resized_width`` (else
``--min-pixels`` / ``--max-pixels``), then the image processor's resize to its own budget (the
same flags), so the tighter of the two bounds an image. Videos are sampled and sized by
``video.py`` (``VideoOptions``: the ``--video-*`` flags, a part's own keys laid over them).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import io
import os
from typing import TYPE_CHECKING

from .sample import BadSample, DataError

if TYPE_CHECKING:  # video.py imports PyAV: read where a video is
    from .video import VideoSettings

REMOTE_SCHEMES = ("http://", "https://")
FETCH_TIMEOUT_S = 30


@dataclasses.dataclass(frozen=True)
class MediaAccess:
    """Where a record's media may come from (the ``--media-root`` / ``--allow-*-media`` flags)."""

    media_root: str | None = None
    allow_remote: bool = False
    anywhere: bool = False

    def locate(self, ref: str, base_dir: str) -> str:
        """The location of ``ref`` for a record read from ``base_dir``; ``BadSample`` where it may not go."""
        if ref.startswith(REMOTE_SCHEMES):
            if not self.allow_remote:
                raise BadSample("remote_media", f"{ref!r} is a URL; pass --allow-remote-media to fetch remote media")
            return ref
        if ref.startswith("data:"):
            return ref
        root = os.path.abspath(self.media_root or base_dir)
        path = os.path.normpath(os.path.join(root, os.path.expanduser(ref.removeprefix("file://"))))
        if self.anywhere:
            return path
        fix = "(set --media-root to the folder holding it, or pass --allow-media-anywhere)"
        if not _inside(path, root):
            raise BadSample(
                "media_outside_root", f"{_short(ref)} lies outside {root!r}, the folder media may come from {fix}"
            )
        # as written it is inside; a symlink on the way may still lead out (images/x.png -> ~/.ssh/id_rsa)
        real = os.path.realpath(path)
        if not any(_inside(real, area) for area in _media_areas(root)):
            raise BadSample(
                "media_outside_root",
                f"{_short(ref)} is a symlink to {real!r}, outside {root!r}, the folder media may come from {fix}",
            )
        return path


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


@functools.lru_cache(maxsize=64)
def _media_areas(root: str) -> tuple[str, ...]:
    """The real folders a path under ``root`` may resolve into: ``root`` itself and, where ``root``
    lies in a Hugging Face cache repository (``REPO/snapshots/REV/...``, its files links to
    ``REPO/blobs/HASH``), that repository's folder, where its snapshot links point."""
    real = os.path.realpath(root)
    parts = real.split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        repo = os.sep.join(parts[:i]) or os.sep
        if parts[i] == "snapshots" and os.path.isdir(os.path.join(repo, "blobs")):
            return real, repo
    return (real,)


def fetch(location: str, kind: str):
    """A local path, or the bytes behind a URL or data: URI; ``missing_<kind>`` / ``bad_<kind>``."""
    if location.startswith(REMOTE_SCHEMES):
        import urllib.request

        try:
            with urllib.request.urlopen(location, timeout=FETCH_TIMEOUT_S) as response:
                return io.BytesIO(response.read())
        except Exception as err:  # urllib raises URLError, HTTPError, timeouts, ...
            raise BadSample(f"missing_{kind}", f"cannot fetch {location!r}: {err}") from err
    if location.startswith("data:"):
        try:
            return io.BytesIO(base64.b64decode(location.partition("base64,")[2], validate=True))
        except ValueError as err:
            raise BadSample(f"bad_{kind}", f"a data: URI that is not base64: {err}") from err
    if not os.path.isfile(location):
        if os.path.exists(location):  # a device, a fifo, a folder: nothing a record may name
            raise BadSample(f"bad_{kind}", f"{location!r} is not a regular file")
        raise BadSample(f"missing_{kind}", f"no such {kind} file {location!r}")
    return location


def check_decodes(data: bytes, kind: str, name: str) -> None:
    """``bad_<kind>`` unless ``data`` decodes as the kind it claims (an image's pixels, a video's first
    frame): a converter packs nothing else, so a record cannot smuggle the host's files into shards."""
    if kind == "image":
        from PIL import Image

        with _unreadable_is_bad_image(name), Image.open(io.BytesIO(data)) as image:
            image.load()
    else:
        from .video import check_video

        check_video(io.BytesIO(data), name)


@contextlib.contextmanager
def _unreadable_is_bad_image(location: str):
    try:
        yield
    except BadSample:
        raise
    except Exception as err:  # PIL raises many types for truncated / unreadable files
        raise BadSample("bad_image", f"cannot read image {_short(location)}: {type(err).__name__}: {err}") from err


def open_image(location: str):
    """The image, decoded (colour conversion is qwen_vl_utils'): a bad file is a skip here."""
    from PIL import Image

    source = fetch(location, "image")
    with _unreadable_is_bad_image(location):
        image = Image.open(source)
        image.load()
        return image


def image_size(location: str) -> tuple[int, int]:
    """(width, height) from the image's header: no pixels are decoded."""
    from PIL import Image

    source = fetch(location, "image")
    with _unreadable_is_bad_image(location), Image.open(source) as image:
        return image.size


@contextlib.contextmanager
def _sizing_errors():
    """qwen_vl_utils refuses an aspect ratio over 200 with a ValueError and impossible settings
    with an AssertionError, and a budget below one merged patch ends in a zero size; all are the
    record's fault, so skips."""
    try:
        yield
    except ValueError as err:
        if "aspect ratio" in str(err):
            raise BadSample("aspect_ratio", f"image aspect ratio over 200 ({err})") from err
        raise BadSample("bad_record", f"image settings: {err}") from err
    except (AssertionError, TypeError, ZeroDivisionError) as err:  # e.g. max_pixels below one merged patch
        raise BadSample("bad_record", f"image settings cannot be met: {err or type(err).__name__}") from err


class ImageSizing:
    """Both resizes of an image, performed (``resize``) or computed from its size (``grid``)."""

    def __init__(self, processor, patch_size: int, min_pixels: int | None, max_pixels: int | None):
        self.image_processor, self.patch_size = processor.image_processor, patch_size
        self.budget = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v}

    def resize(self, image, options: dict, location: str = "image"):
        from qwen_vl_utils import fetch_image
        from qwen_vl_utils.vision_process import to_rgb

        with _unreadable_is_bad_image(location):  # e.g. a mode PIL cannot turn into RGB
            image = to_rgb(image)
        with _sizing_errors():
            return fetch_image({"image": image, **self.budget, **options}, image_patch_size=self.patch_size)

    def grid(self, width: int, height: int, options: dict) -> tuple[int, int, int]:
        from qwen_vl_utils import vision_process as qvu
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        settings = {**self.budget, **options}
        factor = self.patch_size * qvu.SPATIAL_MERGE_SIZE
        with _sizing_errors():
            if "resized_height" in settings and "resized_width" in settings:
                height, width = qvu.smart_resize(settings["resized_height"], settings["resized_width"], factor=factor)
            else:
                height, width = qvu.smart_resize(
                    height,
                    width,
                    factor=factor,
                    min_pixels=settings.get("min_pixels"),
                    max_pixels=settings.get("max_pixels"),
                )
            processor = self.image_processor
            height, width = smart_resize(
                height,
                width,
                factor=processor.patch_size * processor.merge_size,
                min_pixels=processor.size["shortest_edge"],
                max_pixels=processor.size["longest_edge"],
            )
        return (1, height // processor.patch_size, width // processor.patch_size)


class VideoOptions:
    """Video settings (``video.py``, read only when a record holds a video) and the processor call's
    ``videos_kwargs`` for the frames ``load`` gives. The template's
    ``<|vision_start|><|video_pad|><|vision_end|>`` reaches the processor as written, so a sample's
    ids are the installed processor's: transformers 5.x expands only ``<|video_pad|>`` (each temporal
    patch into ``<t seconds><|vision_start|>...<|vision_end|>``) and keeps the template's pair around
    the frames; 4.57 replaced the whole triple. ``validate_sample`` accepts both layouts."""

    def __init__(self, processor, **settings):
        from .video import OVERRIDE_LIMITS

        self.processor = processor
        self._base: VideoSettings | None = None
        self.settings = {k: v for k, v in settings.items() if v is not None}
        for key, value in self.settings.items():  # the --video-* flags (the run script's VIDEO_*)
            if key in OVERRIDE_LIMITS and not 0 < value <= OVERRIDE_LIMITS[key]:
                raise DataError(
                    f"--video-{key.replace('_', '-')} {value}: must be a positive number up to {OVERRIDE_LIMITS[key]}"
                )
        if "nframes" in self.settings:
            self.settings.setdefault("fps", None)  # a frame count instead of the default rate
        if self.settings:  # flags given: a bad value stops the run before the first step
            self.base()

    @functools.cached_property
    def call_kwargs(self) -> dict:
        return processor_video_kwargs(self.processor)

    def base(self) -> VideoSettings:
        if self._base is None:
            from .video import VideoSettings

            try:
                self._base = VideoSettings.from_processor(self.processor, **self.settings)
            except (TypeError, ValueError) as err:
                raise DataError(f"video settings {self.settings}: {err}") from None
        return self._base

    def of(self, media) -> VideoSettings:
        return self.base().with_overrides(media.options) if media.options else self.base()

    def opened(self, media, location):
        """(the video's file, or its fetched bytes, and its header): a URL is fetched once for both."""
        from .video import video_header

        source = fetch(location, "video")
        return source, video_header(source, self.of(media))

    def load(self, media, source, header):
        from .video import load_video

        return load_video(source, self.of(media), header)

    def header(self, media, location):
        return self.opened(media, location)[1]


def processor_video_kwargs(processor) -> dict:
    """``PROCESSOR_VIDEO_KWARGS``, plus ``cap_pixels_per_frame=False`` where the video processor has
    that setting: left unset, transformers 5.x logs a notice on the first video of every process
    (each data worker). With ``do_resize=False`` the cap resizes nothing, so the value changes no
    id or pixel; a processor without the setting refuses the key, hence the check."""
    from .video import PROCESSOR_VIDEO_KWARGS

    kwargs = dict(PROCESSOR_VIDEO_KWARGS)
    if hasattr(getattr(processor, "video_processor", None), "cap_pixels_per_frame"):
        kwargs["cap_pixels_per_frame"] = False
    return kwargs


def _short(location: str) -> str:
    return repr(location if len(location) < 200 else location[:60] + "...")


def media_settings(
    processor, info, min_pixels: int | None, max_pixels: int | None, options: dict
) -> tuple[ImageSizing, VideoOptions]:
    """How a provider sizes images and samples videos: ``options`` are its ``video_*`` keyword
    arguments (``--video-fps`` arrives as ``video_fps``; None keeps the reference's default)."""
    video = {name[len("video_") :]: value for name, value in options.items() if name.startswith("video_")}
    return ImageSizing(processor, info.patch_size, min_pixels, max_pixels), VideoOptions(processor, **video)
