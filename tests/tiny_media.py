"""Tiny video files written with PyAV for tests (no downloads, no system FFmpeg).

Every frame differs from its neighbours (a red level rising with the frame index and a bright
column moving across), so a frame sampled at the wrong index changes the pixels."""

from __future__ import annotations

import numpy as np

# extension -> (container format, encoders in order of preference, pixel format)
FORMATS = {
    "mp4": ("mp4", ("libx264", "mpeg4"), "yuv420p"),
    "webm": ("webm", ("libvpx", "libvpx-vp9"), "yuv420p"),
    "mkv": ("matroska", ("libx264", "mpeg4"), "yuv420p"),
    "gif": ("gif", ("gif",), "rgb8"),
}


def frame_rgb(index: int, n_frames: int, width: int, height: int) -> np.ndarray:
    rgb = np.zeros((height, width, 3), np.uint8)
    rgb[..., 0] = 40 + index * 200 // max(n_frames - 1, 1)
    rgb[..., 1] = (np.arange(height) * 255 // height)[:, None]
    rgb[..., 2] = (np.arange(width) * 255 // width)[None, :]
    rgb[:, (index * 5) % width] = 255
    return rgb


def _encoder(names) -> str:
    import av

    for name in names:
        try:
            av.codec.Codec(name, "w")
            return name
        except Exception:  # this FFmpeg build lacks the encoder
            continue
    raise RuntimeError(f"none of the encoders {names} is available in PyAV's FFmpeg")


def write_video(path: str, n_frames: int, width: int, height: int, fps: int = 10, codec: str | None = None) -> str:
    """A video at ``path`` whose container follows the extension (mp4, webm, mkv, gif)."""
    import av

    fmt, encoders, pix_fmt = FORMATS[str(path).rsplit(".", 1)[-1]]
    with av.open(str(path), "w", format=fmt) as container:
        stream = container.add_stream(codec or _encoder(encoders), rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        for i in range(n_frames):
            frame = av.VideoFrame.from_ndarray(frame_rgb(i, n_frames, width, height), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())  # flush the encoder's delayed frames
    return str(path)


def decode_all_tchw(path: str):
    """(all frames as torchvision's removed ``read_video`` returned them: a [T, C, H, W] uint8
    view of stacked [T, H, W, C] RGB frames, the stream's average rate)."""
    import av
    import torch

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2), float(stream.average_rate)


def write_example_media(folder: str) -> None:
    """The pictures and the video the README's example JSONL files name, drawn at their relative
    paths (nothing binary is committed)."""
    import os

    from PIL import Image, ImageDraw

    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    os.makedirs(os.path.join(folder, "videos"), exist_ok=True)
    drawings = {"red_circle": lambda d: d.ellipse([16, 16, 80, 80], fill=(220, 20, 20)),
                "blue_square": lambda d: d.rectangle([24, 24, 72, 72], fill=(20, 40, 220)),
                "green_triangle": lambda d: d.polygon([(48, 12), (86, 84), (10, 84)], fill=(20, 180, 40)),
                "stripes": lambda d: [d.rectangle([x, 0, x + 11, 95], fill=(0, 0, 0)) for x in (0, 24, 48, 72)]}
    for name, draw in drawings.items():
        image = Image.new("RGB", (96, 96), (255, 255, 255))
        draw(ImageDraw.Draw(image))
        image.save(os.path.join(folder, "images", f"{name}.png"))
    write_video(os.path.join(folder, "videos", "moving_bar.mp4"), 8, 64, 48, fps=4)
